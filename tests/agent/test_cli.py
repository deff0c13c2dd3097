"""The command line as a real process: probe JSON, bad input, a running agent stopped by SIGTERM."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from agent import cli
from tests.agent import jobscripts

REPO = Path(__file__).resolve().parents[2]


def agent_process(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "agent", *args],
        cwd=REPO,
        env={**os.environ, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@contextlib.contextmanager
def running_agent(*args: str, env: dict[str, str] | None = None) -> Iterator[subprocess.Popen[str]]:
    """`agent_process`, killed on the way out if the test did not stop it (a failed assertion)."""
    proc = agent_process(*args, env=env)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def sigterm(proc: subprocess.Popen[str]) -> str:
    """Stop the agent as an operator would; its stderr once it has exited."""
    proc.send_signal(signal.SIGTERM)
    return proc.communicate(timeout=30)[1]


def wait_for(condition, what: str, limit_s: float = 30.0):
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.05)
    raise AssertionError(f"gave up waiting for {what}")


def test_probe_with_fake_gpus_prints_inventory_and_one_sample():
    done = subprocess.run([sys.executable, "-m", "agent", "probe", "--fake-gpus", "8xH100-80GB-SXM,nvlink=2x4"],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert len(report["inventory"]["gpus"]) == 8 and len(report["sample"]) == 8
    assert [t["nvlink_island"] for t in report["inventory"]["topology"]] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert report["inventory"]["gpus"][0]["name"] == "NVIDIA H100 80GB HBM3"
    assert report["sample"][0]["health"] == "HEALTHY"


def test_bad_fake_spec_is_a_usage_error(capsys):
    assert cli.main(["probe", "--fake-gpus", "3xB300"]) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith("whalezen-agent: error: --fake-gpus: unknown GPU model 'B300'")


def test_bad_server_url_and_label_are_usage_errors(capsys, tmp_path):
    base = ["--join-token", "t", "--fake-gpus", "1xT4", "--state-dir", str(tmp_path)]
    assert cli.main(["--server", "broker:8000", *base]) == cli.EXIT_USAGE
    assert "must start with http://" in capsys.readouterr().err
    assert cli.main(["--server", "http://x", "--label", "nolabel", *base]) == cli.EXIT_USAGE
    assert "expected KEY=VALUE" in capsys.readouterr().err


def test_bad_join_token_exits_4_with_the_reason(broker, tmp_path):
    proc = agent_process("--server", broker.url, "--join-token", "wrong", "--fake-gpus", "2xT4",
                         "--state-dir", str(tmp_path / "s"))
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == cli.EXIT_REGISTRATION_REFUSED
    assert "registration refused: POST /register: HTTP 401: invalid join token" in err
    assert "Traceback" not in err


def test_agent_process_joins_runs_a_job_and_stops_cleanly_on_sigterm(broker, tmp_path):
    broker.state.heartbeat_seconds = 1
    broker.state.assignments = [{"id": "a1", "job_id": "j1", "epoch": 1, "action": "start", "gpu_indices": [1],
                                 "command": jobscripts.WRITE_ENV, "env": {}}]
    state_dir = tmp_path / "s"
    # The join token comes from the environment (not visible in `ps`).
    with running_agent("--server", broker.url, "--fake-gpus", "2xL4", "--name", "edge-1",
                       "--state-dir", str(state_dir), env={"WHALEZEN_JOIN_TOKEN": "join-secret"}) as proc:
        wait_for(lambda: len(broker.state.heartbeats) >= 2 and len(broker.statuses_for("a1")) >= 2,
                 "two heartbeats and the job's exit")
        assert broker.state.registrations[0]["name"] == "edge-1"
        assert [s["state"] for s in broker.statuses_for("a1")] == ["running", "exited"]
        env = json.loads((tmp_path / "s-jobs" / "a1" / "env.json").read_text())
        assert env["CUDA_VISIBLE_DEVICES"] == "1" and "WHALEZEN_JOIN_TOKEN" not in env
        err = sigterm(proc)
    assert proc.returncode == 0
    assert "Traceback" not in err
    assert json.loads((state_dir / "identity.json").read_text())["node_id"] == "n1"


STOP_WHILE_SPINNING = """
import os, signal, sys, threading
from pathlib import Path
from agent.backends.fake import FakeBackend
from agent.loop import Agent, AgentConfig

agent = Agent(AgentConfig(server_url="http://127.0.0.1:9", join_token="t", name="n", state_dir=Path(sys.argv[1])),
              FakeBackend("1xT4"))
agent.step = lambda: 0.0  # wait between steps as often as possible: the signal lands mid-wait
signal.signal(signal.SIGTERM, agent.request_stop)
threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM)).start()
sys.exit(agent.run())
"""


def test_sigterm_never_deadlocks_the_loop(tmp_path):
    # A signal handler that takes a lock the interrupted code holds (threading.Event.set during
    # Event.wait) deadlocks; this loop waits thousands of times a second to hit that window.
    for attempt in range(5):
        proc = subprocess.run([sys.executable, "-c", STOP_WHILE_SPINNING, str(tmp_path / str(attempt))],
                              cwd=REPO, capture_output=True, text=True, timeout=30)
        assert proc.returncode == 0, proc.stderr


def test_the_agent_needs_neither_django_nor_requests():
    code = (
        "import sys, agent.cli, agent.loop, agent.backends.nvml, agent.backends.fake\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('django', 'rest_framework', 'requests', 'broker'))\n"
        "print(heavy)\n"
        "sys.exit(1 if heavy else 0)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
