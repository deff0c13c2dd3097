"""How the web server is started, in one place: `serve` (what `make run` starts), the benchmarks and
the tests that need a real server all run this same command, so what they measure is what users meet.

gunicorn (the production WSGI server, already a dependency) with one process and a thread pool:
- one process, because the embedded SQLite's fair write queue (broker/sqlite/) works between the
  threads of a process; PostgreSQL would take more processes, but one keeps both defaults alike;
- threads, so slow requests don't block each other (Django's `runserver` is threaded too);
- a listen backlog of 2048: `runserver` keeps Python's default of 10, and at 32 concurrent
  submitters it reset connections before the application ever saw them (issue 8 item 10).
"""
from __future__ import annotations

import os
import sys

WEB_THREADS = int(os.environ.get("WHALEZEN_WEB_THREADS", 16))
WEB_BACKLOG = 2048


def web_command(*, host: str, port: int, python: str = sys.executable) -> list[str]:
    """The argv that serves the broker's WSGI app on host:port (run from the project root)."""
    return [python, "-m", "gunicorn", "broker.wsgi:application", "--bind", f"{host}:{port}",
            "--worker-class", "gthread", "--workers", "1", "--threads", str(WEB_THREADS),
            "--backlog", str(WEB_BACKLOG), "--timeout", "120", "--graceful-timeout", "10",
            "--access-logfile", "-", "--error-logfile", "-", "--no-control-socket"]
