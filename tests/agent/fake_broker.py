"""A tiny in-test broker speaking the agent protocol (docs/agent.md), with switches for outages."""
from __future__ import annotations

import json
import secrets
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable


@dataclass
class FakeBrokerState:
    join_token: str = "join-secret"
    heartbeat_seconds: int = 5
    epoch: int = 1
    assignments_epoch: int | None = None  # answer assignments from an older view (a lagging replica)
    lost: bool = False
    fail_with: int | None = None  # answer every request with this status (e.g. 503)
    nodes: dict[str, dict[str, Any]] = field(default_factory=dict)  # node_token -> registration
    registrations: list[dict[str, Any]] = field(default_factory=list)
    heartbeats: list[dict[str, Any]] = field(default_factory=list)
    assignments: list[dict[str, Any]] = field(default_factory=list)
    statuses: list[dict[str, Any]] = field(default_factory=list)
    requests: list[tuple[str, str]] = field(default_factory=list)
    reject_status_for: set[str] = field(default_factory=set)  # assignment ids answered 409
    revoked_tokens: set[str] = field(default_factory=set)
    unknown_heartbeat_fields: set[str] = field(default_factory=set)  # answered 400, as a strict older broker does
    on_request: Callable[[str, str], None] | None = None  # called with (method, path) before answering


class FakeBroker:
    def __init__(self) -> None:
        self.state = FakeBrokerState()
        self.lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self.port = 0
        self.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        """Listen (again, on the same port after `stop`)."""
        broker = self

        class Handler(_Handler):
            fake = broker

        server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        server.daemon_threads = True
        self.port = server.server_address[1]
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Close the listening socket: the agent now gets "connection refused"."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def statuses_for(self, assignment_id: str) -> list[dict[str, Any]]:
        with self.lock:
            return [s for s in self.state.statuses if s["assignment_id"] == assignment_id]


class _Handler(BaseHTTPRequestHandler):
    fake: FakeBroker

    def log_message(self, *args: Any) -> None:  # keep test output quiet
        pass

    def _send(self, status: int, body: dict[str, Any]) -> None:
        raw = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def _body(self) -> dict[str, Any]:
        length = int(self.headers.get("Content-Length") or 0)
        return json.loads(self.rfile.read(length) or b"{}")

    def _node(self) -> dict[str, Any] | None:
        auth = self.headers.get("Authorization", "")
        token = auth.removeprefix("Bearer ").strip()
        state = self.fake.state
        if not auth.startswith("Bearer ") or token in state.revoked_tokens:
            return None
        return state.nodes.get(token)

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def _dispatch(self, method: str) -> None:
        fake, state = self.fake, self.fake.state
        body = self._body() if method == "POST" else {}
        with fake.lock:
            if state.on_request is not None:
                state.on_request(method, self.path)
            state.requests.append((method, self.path))
            if state.fail_with:
                return self._send(state.fail_with, {"detail": "simulated outage"})
            if method == "POST" and self.path == "/api/v1/agent/register":
                if body.get("join_token") != state.join_token:
                    return self._send(401, {"detail": "invalid join token"})
                token = "node-" + secrets.token_hex(8)
                node_id = f"n{len(state.nodes) + 1}"
                state.nodes[token] = {"node_id": node_id, **body}
                state.registrations.append(body)
                return self._send(201, {"node_id": node_id, "node_token": token,
                                        "heartbeat_seconds": state.heartbeat_seconds, "epoch": state.epoch})
            node = self._node()
            if node is None:
                return self._send(401, {"detail": "invalid node token"})
            if method == "POST" and self.path == "/api/v1/agent/heartbeat":
                if state.unknown_heartbeat_fields & set(body):
                    return self._send(400, {"detail": "unknown field"})
                state.heartbeats.append({"node_id": node["node_id"], **body})
                return self._send(200, {"epoch": state.epoch, "lost": state.lost,
                                        "heartbeat_seconds": state.heartbeat_seconds})
            if method == "GET" and self.path == "/api/v1/agent/assignments":
                epoch = state.epoch if state.assignments_epoch is None else state.assignments_epoch
                return self._send(200, {"epoch": epoch, "assignments": list(state.assignments)})
            prefix, suffix = "/api/v1/agent/assignments/", "/status"
            if method == "POST" and self.path.startswith(prefix) and self.path.endswith(suffix):
                assignment_id = self.path[len(prefix) : -len(suffix)]
                if assignment_id in state.reject_status_for:
                    return self._send(409, {"detail": "invalid transition"})
                state.statuses.append({"assignment_id": assignment_id, **body})
                return self._send(200, {"ok": True})
            return self._send(404, {"detail": "not found"})
