"""One simulated cloud instance of the local provider: its metadata service and its agent.

    python instance.py --listen-fd FD --secret S --notice-file F [--grace N] [--nice N] -- python -m agent ...

The provider starts this as the instance's first process, in a session of its own; the agent is
its child in the same process group, so the provider's terminate (SIGTERM, then SIGKILL to the
group) ends both, as a cloud ending a VM ends everything on it. It serves, on the listening socket
the provider bound (127.0.0.1, so the agent's --metadata-url is known before anything starts),
the two IMDSv2 calls an agent makes with `--spot-notice local`, under an unguessable path prefix:

    PUT <prefix>/latest/api/token               (X-aws-ec2-metadata-token-ttl-seconds) -> a token
    GET <prefix>/latest/meta-data/spot/instance-action   (X-aws-ec2-metadata-token)
        -> 404 until the provider posts a notice, then 200 {"action": "terminate", "time": "...Z"}

The provider posts a notice by writing `--notice-file` (in its own 0700 state folder); nothing
can be changed over HTTP. When the notice's time passes this process ends the instance itself,
like the cloud would, whether or not anyone asks the provider: SIGTERM to the agent, SIGKILL after
`--grace`, then it exits. It also exits when the agent does (the instance is then gone).

Standard library only, and run as a file (not `-m`): it must start wherever the provider runs.
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

POLL_S = 0.1
MAX_TOKENS = 1000  # an agent asks once per 6 h; the bound only stops a loop from growing memory


def read_notice(path: Path) -> dict[str, Any] | None:
    """The posted notice, or None (none posted, or a half-written one: the provider renames a
    complete file into place, so that is only ever a file being replaced)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and "time" in data and "action" in data else None


def notice_deadline(notice: dict[str, Any]) -> float:
    return datetime.fromisoformat(str(notice["time"]).replace("Z", "+00:00")).timestamp()


class MetadataServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, sock: socket.socket, secret: str, notice_file: Path) -> None:
        super().__init__(sock.getsockname(), _Handler, bind_and_activate=False)
        self.socket.close()  # the one the base class made; serve on the provider's instead
        self.socket = sock
        self.prefix = f"/{secret}"
        self.notice_file = notice_file
        self.tokens: set[str] = set()
        self.lock = threading.Lock()

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that went away mid-answer; nothing to log on the instance's console


class _Handler(BaseHTTPRequestHandler):
    server: MetadataServer

    def log_message(self, *args: Any) -> None:
        pass

    def _send(self, status: int, body: bytes = b"", content_type: str = "text/plain") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _path(self) -> str | None:
        prefix = self.server.prefix
        return self.path[len(prefix):] if self.path.startswith(prefix + "/") else None

    def do_PUT(self) -> None:
        if self._path() != "/latest/api/token":
            return self._send(404)
        if not (self.headers.get("X-aws-ec2-metadata-token-ttl-seconds") or "").isdigit():
            return self._send(400)  # IMDSv2 refuses a token request without its TTL
        token = secrets.token_urlsafe(32)
        with self.server.lock:
            if len(self.server.tokens) >= MAX_TOKENS:
                self.server.tokens.pop()
            self.server.tokens.add(token)
        self._send(200, token.encode())

    def do_GET(self) -> None:
        if self._path() != "/latest/meta-data/spot/instance-action":
            return self._send(404)
        with self.server.lock:
            known = self.headers.get("X-aws-ec2-metadata-token") in self.server.tokens
        if not known:
            return self._send(401)
        notice = read_notice(self.server.notice_file)
        if notice is None:
            return self._send(404)
        body = json.dumps({"action": notice["action"], "time": notice["time"]}).encode()
        self._send(200, body, "application/json")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="local-instance")
    parser.add_argument("--listen-fd", type=int, required=True)
    parser.add_argument("--secret", required=True)
    parser.add_argument("--notice-file", type=Path, required=True)
    parser.add_argument("--grace", type=float, default=10.0)
    # A simulated instance stands for a machine of its own: on the machine it shares with the broker
    # it (with its agent and the jobs they run, which inherit it) yields the CPU to the service.
    parser.add_argument("--nice", type=int, default=0, help="raise this process's niceness by N first")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command to run")

    # SIGTERM comes to the whole group from the provider's terminate: the agent got it too. Stay
    # until the agent has stopped its jobs, so "this process is gone" keeps meaning "all is gone".
    signal.signal(signal.SIGTERM, lambda *_: None)
    if args.nice > 0:
        os.nice(args.nice)
    # The agent first: the socket already listens (the provider bound it), so a request that
    # comes before the server below runs waits in the backlog instead of failing.
    child = subprocess.Popen(command)  # inherits stdin (the join token), stdout and the process group
    server = MetadataServer(socket.socket(fileno=args.listen_fd), args.secret, args.notice_file)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True).start()
    kill_at: float | None = None
    while child.poll() is None:
        notice = read_notice(args.notice_file) if kill_at is None else None
        if notice is not None:
            try:
                if time.time() >= notice_deadline(notice):
                    child.terminate()  # the cloud takes the instance back now
                    kill_at = time.monotonic() + args.grace
            except ValueError:
                pass  # the provider writes the time; a bad one cannot come from anywhere else
        if kill_at is not None and time.monotonic() >= kill_at:
            child.kill()
        time.sleep(POLL_S)
    server.shutdown()
    code = child.returncode
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main())
