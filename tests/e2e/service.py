"""Helpers for the end-to-end tests: start the service as real processes, talk HTTP to it, and find
every process that belongs to one test's var dir (to prove nothing outlives a stop)."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from bench.procs import live_processes
from bench.procs import free_port

ROOT = Path(__file__).resolve().parents[2]


def service_env(var_dir: Path, **extra: str) -> dict[str, str]:
    """The embedded defaults (SQLite, file-system queue) in a var dir of the test's own."""
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL")}
    env.update(WHALEZEN_VAR_DIR=str(var_dir), WHALEZEN_CYCLE_SECONDS="1", PYTHONUNBUFFERED="1", **extra)
    return env


@contextmanager
def backends(var_dir: Path, **extra: str) -> Iterator[dict[str, str]]:
    """The service's environment: PostgreSQL and Redis when the suite runs with them (a fresh
    database and queue of this test's own, dropped afterwards), else the embedded defaults. CI runs
    the suite both ways, so the faults are exercised on both."""
    database_url, redis_url = os.environ.get("DATABASE_URL"), os.environ.get("REDIS_URL")
    if not (database_url and redis_url):
        yield service_env(var_dir, **extra)
        return
    import psycopg

    parts = urllib.parse.urlsplit(database_url)
    name = f"wz_e2e_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    server = urllib.parse.urlunsplit(parts._replace(path="/postgres"))
    with psycopg.connect(server, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield service_env(var_dir, DATABASE_URL=urllib.parse.urlunsplit(parts._replace(path=f"/{name}")),
                          REDIS_URL=redis_url, WHALEZEN_QUEUE=name, **extra)
    finally:
        with psycopg.connect(server, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def call(url: str, token: str, body: dict | None = None) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode() if body is not None else None,
                                     headers={"Authorization": f"Bearer {token}",
                                              "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as resp:
        return json.loads(resp.read())


def health(base: str) -> tuple[int, dict] | None:
    """(status, body) of /healthz, or None while nothing answers."""
    try:
        with urllib.request.urlopen(f"{base}/healthz", timeout=3) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")
    except OSError:
        return None


def wait_for(predicate, timeout: float, what: str, interval: float = 0.5):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = predicate()
        except OSError as exc:  # the service is restarting a part: ask again
            last = exc
        else:
            if last:
                return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what}; last: {last}")


def processes_of(var_dir: Path, *markers: str) -> list[str]:
    """Live processes started for this var dir (its path in their environment or command line), or
    whose command line holds one of `markers` (jobs run with a clean environment)."""
    needles = [str(var_dir).encode(), *(m.encode() for m in markers)]
    return [f"{pid}: {' '.join(argv)[:200]}" for pid, argv, environ in live_processes()
            if any(n in " ".join(argv).encode() or n in environ for n in needles)]


def kill_leftovers(var_dir: Path, *markers: str) -> None:
    """Safety net after a failed test: SIGKILL the process groups of whatever `processes_of` finds,
    so one failure does not leave agents running into the next test."""
    for entry in processes_of(var_dir, *markers):
        try:
            pgid = os.getpgid(int(entry.split(":", 1)[0]))
            if pgid != os.getpgrp():
                os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            continue


def commands_with(marker: str) -> list[list[str]]:
    """argv of every live process whose command line holds `marker`."""
    return [argv for _, argv, _ in live_processes() if any(marker in arg for arg in argv)]


def shared_tmp_dir() -> Path:
    """A directory jobs can write to: they run as an unprivileged user, and pytest's tmp dirs are 0700."""
    path = Path(tempfile.mkdtemp(prefix="wz-e2e-", dir="/tmp"))
    path.chmod(0o1777)
    return path


class Service:
    """One `make run` (or `manage.py serve`) in its own process group, output in a file."""

    def __init__(self, var_dir: Path, port: int, env: dict[str, str], argv: list[str] | None = None):
        self.var_dir, self.port, self.env = var_dir, port, env
        self.base = f"http://127.0.0.1:{port}"
        self.argv = argv or ["make", "-o", ".venv/.installed-dev", "run", f"PORT={port}", "HOST=127.0.0.1",
                             f"PY={sys.executable}"]
        self.output = var_dir.parent / f"service-{port}-{time.monotonic_ns()}.out"
        self.process: subprocess.Popen | None = None

    def start(self) -> "Service":
        self.started_at = time.time()
        with self.output.open("wb") as out:
            # Its own session, as a terminal or systemd gives it: the group is what a stop signals.
            self.process = subprocess.Popen(self.argv, cwd=ROOT, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, start_new_session=True)
        wait_for(lambda: "WhaleZen is up" in self.log() or self.process.poll() is not None, 240, "the service to start")
        assert self.process.poll() is None, self.log()
        return self

    def log(self) -> str:
        return self.output.read_text(errors="replace")

    def token(self, slug: str) -> str:
        return next(line.split()[2] for line in self.log().splitlines() if line.startswith(f"TOKEN {slug} "))

    def children(self) -> dict[str, int]:
        """name -> pid of web, worker and beat, from serve's own state file."""
        rows = json.loads((self.var_dir / "serve-children.json").read_text())
        return {row["name"]: row["pid"] for row in rows}

    def serve_pid(self) -> int:
        out = subprocess.run(["ps", "-o", "pid=,args=", "-g", str(self.process.pid)], capture_output=True,
                             text=True).stdout
        return next(int(line.split()[0]) for line in out.splitlines() if "manage.py serve" in line)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 90, group: bool = True) -> int:
        """Signal the whole group (like Ctrl-C in a terminal or systemd's stop), or only its first
        process (`kill <pid of make>`), and wait for that one."""
        assert self.process is not None
        try:
            if group:
                os.killpg(self.process.pid, sig)
            else:
                self.process.send_signal(sig)
        except ProcessLookupError:
            pass
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            raise AssertionError(f"the service did not stop within {timeout:g} s:\n{self.log()[-3000:]}")


class Partition:
    """A TCP relay between one agent and the web server that can be cut: while cut, every open
    connection is closed and new ones are refused, as a broken network between them looks to both."""

    def __init__(self, upstream_port: int):
        import threading

        self.upstream_port, self.port = upstream_port, free_port()
        self._lock, self._open, self._listener = threading.Lock(), set(), None
        self._threading = threading
        self.heal()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def heal(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self._listener = listener
        self._threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def cut(self) -> None:
        with self._lock:
            listener, self._listener = self._listener, None
            doomed, self._open = self._open, set()
        for sock in [listener, *doomed]:
            if sock is not None:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                sock.close()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # cut
            try:
                upstream = socket.create_connection(("127.0.0.1", self.upstream_port), timeout=5)
            except OSError:
                client.close()
                continue
            with self._lock:
                if self._listener is not listener:
                    client.close(), upstream.close()
                    return
                self._open.update((client, upstream))
            for src, dst in ((client, upstream), (upstream, client)):
                self._threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while chunk := src.recv(65536):
                dst.sendall(chunk)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            src.close()  # each socket is read by one pump: that one closes it
