"""A local HTTP server answering as the AWS (IMDSv2) or GCP instance metadata service does.

Only the calls agent/spot.py makes: AWS `PUT /latest/api/token` (needs the TTL header) and
`GET /latest/meta-data/spot/instance-action` (needs a token it issued; 404 until a notice is set);
GCP `GET /computeMetadata/v1/instance/preempted` (needs `Metadata-Flavor: Google`; FALSE/TRUE).
"""
from __future__ import annotations

import json
import secrets
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class _QuietServer(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that timed out on a hanging answer closed its end: expected here


class FakeMetadata:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.tokens: set[str] = set()
        self.instance_action: dict[str, Any] | None = None  # AWS: the notice body, None: 404
        self.preempted = False  # GCP
        self.hang_s = 0.0  # answer this much later (a wedged metadata service)
        self.fail_with: int | None = None
        self.requests: list[tuple[str, str, dict[str, str]]] = []  # headers with lower-case names
        server = _QuietServer(("127.0.0.1", 0), self._handler())
        self._server = server
        self.url = f"http://127.0.0.1:{server.server_address[1]}"
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def paths(self) -> list[str]:
        with self.lock:
            return [f"{method} {path}" for method, path, _ in self.requests]

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _send(self, status: int, body: bytes = b"") -> None:
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_PUT(self) -> None:
                self._answer("PUT")

            def do_GET(self) -> None:
                self._answer("GET")

            def _answer(self, method: str) -> None:
                with fake.lock:
                    fake.requests.append((method, self.path, {k.lower(): v for k, v in self.headers.items()}))
                    hang, fail = fake.hang_s, fake.fail_with
                if hang:
                    time.sleep(hang)
                if fail:
                    return self._send(fail)
                with fake.lock:
                    if method == "PUT" and self.path == "/latest/api/token":
                        if not self.headers.get("X-aws-ec2-metadata-token-ttl-seconds"):
                            return self._send(400)
                        token = secrets.token_urlsafe(16)
                        fake.tokens.add(token)
                        return self._send(200, token.encode())
                    if method == "GET" and self.path == "/latest/meta-data/spot/instance-action":
                        if self.headers.get("X-aws-ec2-metadata-token") not in fake.tokens:
                            return self._send(401)
                        if fake.instance_action is None:
                            return self._send(404)
                        return self._send(200, json.dumps(fake.instance_action).encode())
                    if method == "GET" and self.path == "/computeMetadata/v1/instance/preempted":
                        if self.headers.get("Metadata-Flavor") != "Google":
                            return self._send(403)
                        return self._send(200, b"TRUE" if fake.preempted else b"FALSE")
                return self._send(404)

        return Handler
