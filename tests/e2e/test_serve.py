"""`make run`'s service, end to end: web + worker + demo agents as real processes; a job submitted
over HTTP runs on a simulated GPU node with the right CUDA_VISIBLE_DEVICES and succeeds; stopping the
service leaves no process behind."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def call(url: str, token: str, body: dict | None = None) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode() if body is not None else None,
                                     headers={"Authorization": f"Bearer {token}",
                                              "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as resp:
        return json.loads(resp.read())


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}; last: {last}")


def processes_mentioning(text: str) -> list[str]:
    out = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if text in line and "ps -eo" not in line]


@pytest.mark.slow
def test_service_runs_a_job_on_a_demo_node_and_stops_cleanly(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL")}
    env.update(WHALEZEN_VAR_DIR=str(tmp_path), WHALEZEN_CYCLE_SECONDS="1", PYTHONUNBUFFERED="1")
    manage = [sys.executable, "manage.py"]
    subprocess.run(manage + ["migrate", "--noinput", "-v0"], cwd=ROOT, env=env, check=True, timeout=120)
    seeded = subprocess.run(manage + ["seed_demo"], cwd=ROOT, env=env, check=True, timeout=120,
                            capture_output=True, text=True).stdout
    token = next(line.split()[2] for line in seeded.splitlines() if line.startswith("TOKEN acme "))
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    service = subprocess.Popen(manage + ["serve", "--port", str(port)], cwd=ROOT, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        nodes = wait_for(lambda: [n for n in call(f"{base}/api/v1/nodes/", token)["results"]
                                  if n["last_heartbeat_at"]] if _up(base) else None, 120, "agents to heartbeat")
        assert {n["name"] for n in nodes} <= {"acme-a100-0", "acme-a100-1", "acme-t4-0", "acme-t4-1"}
        # Jobs run as an unprivileged user (agent/isolation.py), who can reach neither tmp_path nor
        # this venv's Python: the job prints, and its output comes back in its exit event.
        job = call(f"{base}/api/v1/jobs/", token, {
            "name": "e2e", "resources": {"gpus": 2, "gpu_models": ["T4"]},
            "command": ["/bin/sh", "-c", 'echo "gpus=$CUDA_VISIBLE_DEVICES"']})
        final = wait_for(lambda: (j := call(f"{base}/api/v1/jobs/{job['id']}/", token))["state"]
                         in ("SUCCEEDED", "FAILED") and j, 120, "the job to finish")
        assert final["state"] == "SUCCEEDED", call(f"{base}/api/v1/jobs/{job['id']}/events/", token)
        events = call(f"{base}/api/v1/jobs/{job['id']}/events/", token)["results"]
        placed = next(e for e in events if e["reason_code"] == "PLACED")
        gpus = placed["data"]["placements"][0]["gpus"]
        exited = next(e for e in events if e["reason_code"] == "AGENT_EXITED")
        assert exited["data"]["output_tail"] == f"gpus={','.join(map(str, gpus))}\n", "the job saw exactly its GPUs"
    finally:
        service.send_signal(signal.SIGTERM)
        try:
            service.wait(timeout=60)
        except subprocess.TimeoutExpired:
            service.kill()
            raise
    assert not processes_mentioning(str(tmp_path)), "no agent or worker outlives the service"
    assert not _up(base), "the web server stopped too"


def _up(base: str) -> bool:
    try:
        urllib.request.urlopen(f"{base}/healthz", timeout=2).read()
        return True
    except OSError:
        return False
