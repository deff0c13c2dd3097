"""Jobs cannot read the agent's secrets, and no job process outlives its agent (issue 8, items 3, 7).

Real agent processes (`python -m agent`) against the in-test broker, real jobs. The tests run as
root, as agents do on GPU nodes, so jobs run as the default job user (`nobody`, or `whalezen-job`
where it exists). State and work dirs live in a folder every user can traverse (`open_dir`):
only the agent's own permissions may keep a job out, not pytest's 0700 temporary root.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agent import cli
from agent.isolation import resolve_job_user
from agent.procs import group_members, kill_orphan, process_start_ticks
from tests.agent.fake_broker import FakeBroker

REPO = Path(__file__).resolve().parents[2]
JOIN_TOKEN = "join-secret"  # what the in-test broker accepts


def agent_process(broker: FakeBroker, state_dir: Path, *args: str, env: dict[str, str] | None = None,
                  stdin: int | None = subprocess.DEVNULL) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "agent", "--server", broker.url, "--fake-gpus", "2xL4", "--name", "iso-node",
         "--state-dir", str(state_dir), *args],
        cwd=REPO, env={**os.environ, **(env or {})}, stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True)


def wait_for(condition, what: str, limit_s: float = 30.0):
    """Poll until `condition()` is truthy; the limit only stops a broken test from hanging."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"gave up waiting for {what}")


def stop(proc: subprocess.Popen[str]) -> str:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        _, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
    return err


def kill_group(pgid: int | None) -> None:
    """Cleanup when a test failed: never leave a job behind for the next test."""
    if pgid and group_members(pgid):
        os.killpg(pgid, signal.SIGKILL)


def alive(pid: int) -> bool:
    """Running (a zombie waiting for a parent that never reaps is not running)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return False
    return fields[0] not in ("Z", "X")


def running_record(state_dir: Path, assignment_id: str) -> dict | None:
    """The agent's record of a running job (its process group), once it has saved it."""
    try:
        record = json.loads((state_dir / "state.json").read_text())["jobs"].get(assignment_id)
    except (OSError, ValueError, KeyError):
        return None
    return record if record and record.get("state") == "running" and record.get("pid") else None


def start(command: str, *, job_id: str = "j1") -> dict:
    return {"id": "a1", "job_id": job_id, "epoch": 1, "action": "start", "gpu_indices": [0],
            "command": command, "env": {}}


# Each line: a name and a path the job tries to read. `cat` must fail on every one.
def secret_reads(state_dir: Path, agent_pid: int, token_file: Path | None) -> list[tuple[str, str]]:
    reads = [
        ("parent-environ", "/proc/$PPID/environ"),
        ("agent-environ", f"/proc/{agent_pid}/environ"),
        ("identity-relative", f"../../{state_dir.name}/identity.json"),
        ("state-relative", f"../../{state_dir.name}/state.json"),
        ("identity-absolute", str(state_dir / "identity.json")),
        ("state-absolute", str(state_dir / "state.json")),
        ("old-layout-identity", "../../identity.json"),
        ("through-agent-root-link", f"/proc/{agent_pid}/root{state_dir}/identity.json"),
    ]
    if token_file is not None:
        reads.append(("join-token-file", str(token_file)))
    return reads


def prober(reads: list[tuple[str, str]], agent_pid: int) -> str:
    lines = [f'if cat "{path}" >/dev/null 2>&1; then echo "READ {name}"; cat "{path}"; echo; '
             f'else echo "DENIED {name}"; fi' for name, path in reads]
    lines.append('ls .. >/dev/null 2>&1 && echo "LISTED work root" || echo "DENIED work root listing"')
    lines.append(f'tr "\\0" "\\n" < /proc/{agent_pid}/cmdline; echo "id: $(id -u) HOME=$HOME USER=$USER"')
    return "\n".join(lines)


@pytest.mark.parametrize("how", ["environment", "file"])
def test_a_job_cannot_read_the_agents_secrets(open_dir, broker, how):
    state_dir = open_dir / "state"
    token_file = None
    args: list[str] = []
    env = {}
    if how == "environment":  # as the issue found it: the token in the agent's initial environment
        env["WHALEZEN_JOIN_TOKEN"] = JOIN_TOKEN
    else:
        token_file = open_dir / "join-token"  # its folder is open: only the file's mode protects it
        token_file.write_text(JOIN_TOKEN + "\n")
        token_file.chmod(0o600)
        args = ["--join-token-file", str(token_file)]
    broker.state.heartbeat_seconds = 1
    proc = agent_process(broker, state_dir, *args, env=env)
    try:
        wait_for(lambda: broker.state.heartbeats, "the agent to register and heartbeat")
        # The agent re-executed itself without the token: same pid, environment and argv clean.
        assert JOIN_TOKEN.encode() not in Path(f"/proc/{proc.pid}/environ").read_bytes()
        assert JOIN_TOKEN.encode() not in Path(f"/proc/{proc.pid}/cmdline").read_bytes()
        node_token = json.loads((state_dir / "identity.json").read_text())["node_token"]
        agent_key = json.loads((state_dir / "state.json").read_text())["agent_key"]
        broker.state.assignments = [start(prober(secret_reads(state_dir, proc.pid, token_file), proc.pid))]
        report = wait_for(lambda: [s for s in broker.statuses_for("a1") if s["state"] in ("exited", "failed")],
                          "the job's exit report")[0]
    finally:
        err = stop(proc)
    assert "Traceback" not in err
    output = report["output_tail"]
    expected = [f"DENIED {name}" for name, _ in secret_reads(state_dir, proc.pid, token_file)]
    expected.append("DENIED work root listing")  # other jobs' dirs cannot even be named
    assert [line for line in output.splitlines() if line.startswith(("DENIED", "READ", "LISTED"))] == expected, output
    for secret in (JOIN_TOKEN, node_token, agent_key):
        assert secret not in output
    job_user = resolve_job_user(None)
    assert f"id: {job_user.uid} " in output and f"USER={job_user.name}" in output
    assert broker.state.registrations[0]["job_isolation"] == "separate-user"
    assert oct(state_dir.stat().st_mode & 0o777) == "0o700"
    assert token_file is None or token_file.exists()  # kept: --delete-join-token-file was not given


def test_the_join_token_file_can_be_deleted_once_registered(open_dir, broker):
    token_file = open_dir / "join-token"
    token_file.write_text(JOIN_TOKEN)
    token_file.chmod(0o600)
    proc = agent_process(broker, open_dir / "state", "--join-token-file", str(token_file),
                         "--delete-join-token-file")
    try:
        wait_for(lambda: broker.state.registrations and not token_file.exists(), "registration, then deletion")
    finally:
        stop(proc)
    assert broker.state.registrations[0]["join_token"] == JOIN_TOKEN


def test_the_join_token_can_come_on_stdin(open_dir, broker):
    read_end, write_end = os.pipe()
    os.write(write_end, f"{JOIN_TOKEN}\n".encode())
    os.close(write_end)
    proc = agent_process(broker, open_dir / "state", "--join-token", "-", stdin=read_end)
    os.close(read_end)
    try:
        wait_for(lambda: broker.state.registrations, "registration")
    finally:
        stop(proc)
    assert broker.state.registrations[0]["join_token"] == JOIN_TOKEN


def test_an_agent_running_jobs_as_itself_says_so(open_dir, broker):
    proc = agent_process(broker, open_dir / "state", "--job-user", "self", env={"WHALEZEN_JOIN_TOKEN": JOIN_TOKEN})
    try:
        wait_for(lambda: broker.state.registrations, "registration")
    finally:
        err = stop(proc)
    assert broker.state.registrations[0]["job_isolation"] == "shared-user"
    assert "jobs run as this agent's own user" in err and "can read its state dir" in err


@pytest.mark.parametrize(("args", "message"), [
    (["--work-dir", "{state}/jobs"], "lies inside the state dir"),
    (["--job-user", "root"], "would give jobs the agent's secrets"),
    (["--job-user", "no-such-user-here"], "no such user"),
    (["--delete-join-token-file"], "needs --join-token-file"),
    (["--work-dir", "/tmp"], "must be a folder of the agent's own, not world-writable"),
])
def test_unsafe_or_impossible_settings_are_usage_errors(open_dir, capsys, args, message):
    state = open_dir / "state"
    argv = ["--server", "http://127.0.0.1:9", "--join-token", "t", "--fake-gpus", "1xT4", "--state-dir", str(state)]
    assert cli.main(argv + [a.replace("{state}", str(state)) for a in args]) == cli.EXIT_USAGE
    assert message in capsys.readouterr().err


def test_jobs_die_with_their_agent(open_dir, broker):
    """SIGKILL the agent while its job (which spawned a child) runs: every job process is gone."""
    state_dir = open_dir / "state"
    broker.state.heartbeat_seconds = 1
    broker.state.assignments = [start('echo $$ > main.pid; sleep 300 & echo $! > child.pid; wait')]
    proc = agent_process(broker, state_dir, env={"WHALEZEN_JOIN_TOKEN": JOIN_TOKEN})
    workdir = open_dir / "state-jobs" / "a1"
    shim = None
    try:
        wait_for(lambda: (workdir / "child.pid").exists() and (workdir / "child.pid").read_text().strip(),
                 "the job and its child")
        record = wait_for(lambda: running_record(state_dir, "a1"), "the agent to record the running job")
        shim, main, child = record["pid"], int((workdir / "main.pid").read_text()), int((workdir / "child.pid").read_text())
        assert all(alive(pid) for pid in (shim, main, child))
        proc.kill()
        proc.wait(timeout=10)
        # A coarse bound: the shim's SIGTERM ends `sh` and `sleep` at once.
        wait_for(lambda: not any(alive(pid) for pid in (shim, main, child)) and not group_members(shim),
                 "every job process to end", limit_s=10)
    finally:
        stop(proc)
        kill_group(shim)


def test_a_restarted_agent_stops_what_its_predecessor_left_before_calling_the_broker(open_dir, broker):
    """A job that ignores SIGTERM outlives a SIGKILLed agent for the shim's grace period (60 s
    here); the next agent must stop it before it talks to the broker."""
    state_dir = open_dir / "state"
    broker.state.heartbeat_seconds = 1
    broker.state.assignments = [start("trap '' TERM; echo $$ > main.pid; sleep 300 & echo $! > child.pid; wait")]
    first = agent_process(broker, state_dir, "--stop-grace-seconds", "60", env={"WHALEZEN_JOIN_TOKEN": JOIN_TOKEN})
    workdir = open_dir / "state-jobs" / "a1"
    shim = None
    try:
        wait_for(lambda: (workdir / "child.pid").exists() and (workdir / "child.pid").read_text().strip(),
                 "the job and its child")
        record = wait_for(lambda: running_record(state_dir, "a1"), "the agent to record the running job")
        shim, child = record["pid"], int((workdir / "child.pid").read_text())
        first.kill()
        first.wait(timeout=10)
        time.sleep(0.5)
        assert alive(child) and group_members(shim), "the job ignores SIGTERM: it outlives its agent for a while"

        seen_at_first_request: list[list[int]] = []
        broker.state.on_request = lambda method, path: seen_at_first_request.append(group_members(shim))
        broker.state.assignments = []
        second = agent_process(broker, state_dir, "--stop-grace-seconds", "1")
        try:
            wait_for(lambda: broker.statuses_for("a1")[1:], "the leftover's report")
        finally:
            stop(second)
        assert seen_at_first_request[0] == [], "the leftover group was still running when the broker was called"
        assert not alive(child)
    finally:
        stop(first)
        kill_group(shim)
    report = broker.statuses_for("a1")[-1]
    assert report["state"] == "failed" and report["reason"] == "agent_crashed"
    assert "its process was stopped" in report["message"]


def test_a_leftover_group_whose_leader_died_is_stopped():
    # The group's leader (a shell) exits and leaves its child behind in the group.
    leader = subprocess.Popen(["/bin/sh", "-c", "sleep 300 & echo $!; read _"], start_new_session=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert leader.stdout is not None and leader.stdin is not None
    child = int(leader.stdout.readline())
    ticks = process_start_ticks(leader.pid)
    leader.stdin.close()
    leader.wait(timeout=10)
    try:
        assert alive(child) and group_members(leader.pid) == [child]
        assert kill_orphan(leader.pid, ticks, grace_s=5) is True
        wait_for(lambda: not alive(child), "the child to end", limit_s=10)
        assert kill_orphan(leader.pid, ticks, grace_s=5) is False  # nothing left: nothing to do
    finally:
        if alive(child):
            os.kill(child, signal.SIGKILL)
