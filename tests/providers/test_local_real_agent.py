"""The local provider starting the real node agent (`python -m agent`): it must reach the broker
with our join token, name and fake GPUs, and stop when terminated."""
from __future__ import annotations

import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from providers.base import InstanceState
from providers.local import LocalProvider
from providers.local.processes import is_alive
from tests.providers.conftest import BROKER_ID, make_request

REPO = Path(__file__).resolve().parents[2]


class _RefusingBroker(BaseHTTPRequestHandler):
    """Records what agents send and answers 503, so the agent keeps retrying and never starts work."""

    received: list[tuple[str, dict[str, Any]]] = []

    def do_POST(self) -> None:
        raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        try:
            body = json.loads(raw or b"{}")
        except ValueError:
            body = {}
        type(self).received.append((self.path, body))
        self.send_response(503)
        self.send_header("Content-Length", "0")
        self.send_header("Retry-After", "30")
        self.end_headers()

    do_PUT = do_POST

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def broker_url():
    _RefusingBroker.received = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _RefusingBroker)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_real_agent_registers_with_join_token_and_stops_on_terminate(tmp_path: Path, broker_url: str) -> None:
    provider = LocalProvider(broker_id=BROKER_ID, state_dir=tmp_path / "state", python=sys.executable,
                             env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)}, stop_timeout_s=10)
    base = make_request(provider="local", instance_type="local-4xT4", zone="local-a", region="local")
    request = base.__class__(**{**base.__dict__, "agent_server_url": broker_url})
    info = provider.provision(request)
    try:
        deadline = time.monotonic() + 30
        while not _RefusingBroker.received:
            state = provider.describe(info.ref).state
            log = (tmp_path / "state" / "logs" / f"{info.ref.instance_id}.log").read_text()
            assert state is not InstanceState.TERMINATED, f"agent exited early:\n{log}"
            assert time.monotonic() < deadline, f"agent never called the broker:\n{log}"
            time.sleep(0.05)
        path, body = _RefusingBroker.received[0]
        assert path.startswith("/api/v1/agent/")
        assert body.get("join_token") == "join-secret-123"
        assert body.get("name") == request.node_name
        gpus = body.get("gpus", [])
        assert len(gpus) == 4 and all("T4" in g["model"] for g in gpus)  # --fake-gpus 4xT4 reached the agent
        # The token came on stdin: the agent's command line and environment (what /proc shows
        # for as long as it runs, to `ps` and to anything running as its user) never held it.
        pid = json.loads((tmp_path / "state" / "instances" / f"{info.ref.instance_id}.json").read_text())["pid"]
        for view in ("environ", "cmdline"):
            assert b"join-secret-123" not in Path(f"/proc/{pid}/{view}").read_bytes(), view
    finally:
        record = json.loads((tmp_path / "state" / "instances" / f"{info.ref.instance_id}.json").read_text())
        assert provider.terminate(info.ref).state is InstanceState.TERMINATED
        assert not is_alive(record["pid"], record["pid_start"])
