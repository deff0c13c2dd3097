"""How the web server is started, in one place: `serve` (what `make run` starts), the benchmarks and
the tests that need a real server all run this same command, so what they measure is what users meet.

gunicorn (the production WSGI server, already a dependency), `WEB_WORKERS` processes of `WEB_THREADS`
threads each:
- several processes, because one Python process runs its threads one at a time (the GIL): at 32
  concurrent submitters one process was the bottleneck at about a core (4-5 ms of CPU per submission)
  while the machine's second core had room; on the embedded default two served 377-398 submissions/s
  where one served 202-230 (bench/README.md §10). What they must count once is shared through files
  (broker/ops/gunicorn_conf.py): rate limits and /metrics' request counts. The embedded SQLite's
  writers queue on a lock within a process and on a lock file between processes (broker/sqlite/);
- threads, so slow requests don't block each other (Django's `runserver` is threaded too);
- a listen backlog of 2048: `runserver` keeps Python's default of 10, and at 32 concurrent
  submitters it reset connections before the application ever saw them (issue 8 item 10).
"""
from __future__ import annotations

import os
import sys

WEB_WORKERS = int(os.environ.get("WHALEZEN_WEB_WORKERS", 2))
WEB_THREADS = int(os.environ.get("WHALEZEN_WEB_THREADS", 16))
WEB_BACKLOG = 2048


def web_command(*, host: str, port: int, python: str = sys.executable) -> list[str]:
    """The argv that serves the broker's WSGI app on host:port (run from the project root)."""
    return [python, "-m", "gunicorn", "broker.wsgi:application", "--config", "python:broker.ops.gunicorn_conf",
            "--bind", f"{host}:{port}", "--worker-class", "gthread", "--workers", str(WEB_WORKERS),
            "--threads", str(WEB_THREADS), "--backlog", str(WEB_BACKLOG), "--timeout", "120",
            "--graceful-timeout", "10", "--access-logfile", "-", "--error-logfile", "-", "--no-control-socket"]
