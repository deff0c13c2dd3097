"""gunicorn's configuration for the web server `make run` starts (broker/ops/web.py): what its processes share.

The server runs several processes (`--workers`). Two things must count across them:
- rate limits: `WHALEZEN_WEB_SHARED_DIR` makes settings use a disk cache there (broker/ops/cache.py);
- request durations on /metrics: `PROMETHEUS_MULTIPROC_DIR` makes prometheus-client keep each process's
  counts in files there, and /metrics adds them up (broker/ops/request_metrics.py).
Both live in one directory per server, `<var dir>/web/<server pid>`, made empty before the first process
starts (the hooks run in gunicorn's arbiter, before it forks them, so they inherit the environment) and
removed when the server exits; one left by a server that was killed is removed by the next start. An
environment that already names a PROMETHEUS_MULTIPROC_DIR keeps it.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

_SHARED: dict[str, Path] = {}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def on_starting(server: Any) -> None:
    # Not the settings: loaded here, before the environment below is set, the processes forked from this
    # one would inherit them as they are.
    from broker.var_dir import var_dir

    parent = var_dir() / "web"
    parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    for old in parent.iterdir():  # a killed server's: nothing removed it
        if old.name.isdigit() and not _alive(int(old.name)):
            shutil.rmtree(old, ignore_errors=True)
    shared = parent / str(os.getpid())
    shutil.rmtree(shared, ignore_errors=True)
    (shared / "metrics").mkdir(mode=0o700, parents=True)
    _SHARED["dir"] = shared
    os.environ["WHALEZEN_WEB_SHARED_DIR"] = str(shared)
    os.environ.setdefault("PROMETHEUS_MULTIPROC_DIR", str(shared / "metrics"))


def child_exit(server: Any, worker: Any) -> None:
    """A process that exited (restarted after a timeout, or at shutdown): its live gauges go (counters and
    histograms keep its counts, as prometheus-client's multiprocess mode says)."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(worker.pid)


def on_exit(server: Any) -> None:
    shared = _SHARED.pop("dir", None)
    if shared is not None:
        shutil.rmtree(shared, ignore_errors=True)
