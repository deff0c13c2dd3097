"""Loaded with `-p tests.workers` before pytest-django imports the settings: under pytest-xdist each
worker gets a Redis database of its own (base number + 1 + worker index), so one worker's
`cache.clear()` (a FLUSHDB) or cached per-tenant answers never reach the other's tests. The
PostgreSQL test database is already per worker (pytest-django suffixes its name)."""
from __future__ import annotations

import os
import re
import urllib.parse


def _worker_redis_url(url: str, worker: str) -> str:
    index = int(re.sub(r"\D", "", worker) or 0)
    parts = urllib.parse.urlsplit(url)
    base = int(parts.path.strip("/") or 0)
    return urllib.parse.urlunsplit(parts._replace(path=f"/{base + 1 + index}"))


_worker = os.environ.get("PYTEST_XDIST_WORKER")
if _worker and os.environ.get("REDIS_URL"):
    os.environ["REDIS_URL"] = _worker_redis_url(os.environ["REDIS_URL"], _worker)
