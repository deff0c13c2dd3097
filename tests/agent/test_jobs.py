"""Job processes: environment, GPUs, exit status, stop with grace, checkpoint relay."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from agent.jobs import (
    CHECKPOINT_REQUEST_FILE,
    Assignment,
    AssignmentInvalid,
    JobRunner,
    JobStartError,
    job_environment,
)
from tests.agent import jobscripts


def assignment(**overrides) -> Assignment:
    data = {"id": "a1", "job_id": "j1", "epoch": 3, "action": "start", "gpu_indices": [2, 5],
            "command": jobscripts.WRITE_ENV, "env": {"EPOCHS": "10"}, "checkpoint_uri": "s3://ckpt/j1"}
    data.update(overrides)
    return Assignment.from_json(data)


def wait_for(condition, *, what: str, runner: JobRunner | None = None, limit_s: float = 20.0):
    """Poll until `condition()` is truthy; the limit only stops a broken test from hanging."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"gave up waiting for {what}")


def test_environment_has_exactly_the_assigned_gpus_and_job_identity(open_dir):
    base = {"PATH": "/usr/bin", "HOME": "/root", "WHALEZEN_JOIN_TOKEN": "secret", "CUDA_VISIBLE_DEVICES": "0,1,2,3"}
    env = job_environment(assignment(), workdir=open_dir, node_id="n7", base_env=base)
    assert env["CUDA_VISIBLE_DEVICES"] == "2,5"
    assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert env["WHALEZEN_JOB_ID"] == "j1" and env["WHALEZEN_ASSIGNMENT_ID"] == "a1"
    assert env["WHALEZEN_EPOCH"] == "3" and env["WHALEZEN_NODE_ID"] == "n7"
    assert env["WHALEZEN_CHECKPOINT_URI"] == "s3://ckpt/j1"
    assert env["WHALEZEN_CHECKPOINT_REQUEST_FILE"] == str(open_dir / CHECKPOINT_REQUEST_FILE)
    assert env["EPOCHS"] == "10" and env["PATH"] == "/usr/bin"
    assert "WHALEZEN_JOIN_TOKEN" not in env  # the agent's secrets never reach jobs


def test_assignment_env_cannot_override_what_the_agent_sets(open_dir):
    a = assignment(env={"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7", "WHALEZEN_JOB_ID": "other", "OK": "1"})
    env = job_environment(a, workdir=open_dir, node_id=None, base_env={})
    assert env["CUDA_VISIBLE_DEVICES"] == "2,5" and env["WHALEZEN_JOB_ID"] == "j1" and env["OK"] == "1"
    assert "WHALEZEN_NODE_ID" not in env


def test_job_runs_with_its_environment_and_exit_code_zero(open_dir):
    runner = JobRunner(open_dir, base_env={"PATH": "/usr/bin:/bin"})
    job = runner.start(assignment(), node_id="n1")
    assert runner.busy_gpus() == {2, 5}
    exits = wait_for(runner.poll, what="job exit")
    assert [(e.assignment_id, e.state, e.exit_code) for e in exits] == [("a1", "exited", 0)]
    env = json.loads((job.workdir / "env.json").read_text())
    assert env["CUDA_VISIBLE_DEVICES"] == "2,5" and env["WHALEZEN_JOB_ID"] == "j1"
    assert Path(env["WHALEZEN_WORK_DIR"]) == job.workdir == open_dir / "a1"
    assert runner.running == {} and runner.busy_gpus() == set()


def test_non_zero_exit_is_a_failure(open_dir):
    runner = JobRunner(open_dir, base_env={})
    runner.start(assignment(env={"EXIT_CODE": "7"}), node_id=None)
    (exit_,) = wait_for(runner.poll, what="job exit")
    assert (exit_.state, exit_.exit_code, exit_.message) == ("failed", 7, "exited with code 7")


def test_shell_string_command_and_log_file(open_dir):
    runner = JobRunner(open_dir, base_env={"PATH": "/usr/bin:/bin"})
    job = runner.start(assignment(command="echo hello from $WHALEZEN_JOB_ID; exit 4"), node_id=None)
    (exit_,) = wait_for(runner.poll, what="job exit")
    assert exit_.exit_code == 4
    assert (job.workdir / "job.log").read_text() == "hello from j1\n"


def test_a_bare_command_name_is_found_on_path_as_the_job_user(open_dir):
    """`python train.py`, not `/usr/bin/python3 train.py`: the lookup runs after the drop to the job user,
    who may not read the agent's Python (under /root, 0700, on the test machines)."""
    runner = JobRunner(open_dir, base_env={"PATH": "/usr/bin:/bin"})
    job = runner.start(assignment(command=["sh", "-c", "echo ran as $(id -u)"]), node_id=None)
    (exit_,) = wait_for(runner.poll, what="job exit")
    assert (exit_.state, exit_.exit_code) == ("exited", 0), exit_.message
    assert (job.workdir / "job.log").read_text() == f"ran as {runner.job_user.uid}\n"
    with pytest.raises(JobStartError, match="cannot start 'no-such-program': No such file or directory"):
        runner.start(assignment(id="a2", command=["no-such-program"]), node_id=None)


def test_missing_program_cannot_start(open_dir):
    runner = JobRunner(open_dir, base_env={})
    with pytest.raises(JobStartError, match="cannot start '/no/such/program'"):
        runner.start(assignment(command=["/no/such/program"]), node_id=None)
    assert runner.running == {}


def test_stop_sends_sigterm_and_reports_stopped(open_dir):
    runner = JobRunner(open_dir, base_env={})
    job = runner.start(assignment(command=jobscripts.SLEEPER), node_id=None)
    wait_for(lambda: (job.workdir / "ready").exists(), what="job ready")
    runner.stop("a1", reason="stop requested by the broker")
    (exit_,) = wait_for(runner.poll, what="job exit")
    assert exit_.state == "stopped" and exit_.exit_code == 0
    assert exit_.message == "stop requested by the broker (exit code 0)"


def test_job_ignoring_sigterm_is_killed_after_the_grace_period(open_dir, clock):
    runner = JobRunner(open_dir, base_env={}, stop_grace_s=30, clock=clock)
    job = runner.start(assignment(command=jobscripts.STUBBORN), node_id=None)
    wait_for(lambda: (job.workdir / "ready").exists(), what="job ready")
    runner.stop("a1", reason="fenced")
    time.sleep(0.2)
    assert runner.poll() == [] and job.process.poll() is None  # still within its grace period
    clock.advance(31)
    (exit_,) = wait_for(runner.poll, what="job killed")
    assert exit_.state == "stopped" and exit_.exit_code == -9 and "SIGKILL" in exit_.message


def test_checkpoint_request_writes_the_file_and_signals_the_job(open_dir):
    runner = JobRunner(open_dir, base_env={})
    job = runner.start(assignment(command=jobscripts.CHECKPOINTABLE), node_id=None)
    wait_for(lambda: (job.workdir / "ready").exists(), what="job ready")
    assert runner.request_checkpoint("a1", request_id="c1", checkpoint_uri=None) == "signalled"
    assert runner.request_checkpoint("a1", request_id="c1", checkpoint_uri=None) is None  # once only
    (exit_,) = wait_for(runner.poll, what="job exit after checkpoint")
    assert exit_.state == "exited"
    done = json.loads((job.workdir / "checkpoint-done.json").read_text())
    assert done["request_id"] == "c1" and done["job_id"] == "j1" and done["checkpoint_uri"] == "s3://ckpt/j1"


def test_checkpoint_request_never_kills_a_job_without_a_handler(open_dir):
    runner = JobRunner(open_dir, base_env={}, stop_grace_s=0.2)
    job = runner.start(assignment(command=jobscripts.STUBBORN), node_id=None)
    wait_for(lambda: (job.workdir / "ready").exists(), what="job ready")
    assert runner.request_checkpoint("a1", request_id="c1", checkpoint_uri="s3://other") == "file_only"
    request = json.loads((job.workdir / CHECKPOINT_REQUEST_FILE).read_text())
    assert request["checkpoint_uri"] == "s3://other"
    time.sleep(0.2)
    assert runner.poll() == [] and job.process.poll() is None
    runner.stop_all(reason="test over")


def test_stop_all_ends_every_job(open_dir):
    runner = JobRunner(open_dir, base_env={}, stop_grace_s=0.5)
    runner.start(assignment(id="a1", command=jobscripts.SLEEPER), node_id=None)
    runner.start(assignment(id="a2", gpu_indices=[0], command=jobscripts.STUBBORN), node_id=None)
    exits = runner.stop_all(reason="agent shutting down")
    assert sorted((e.assignment_id, e.state) for e in exits) == [("a1", "stopped"), ("a2", "stopped")]
    assert runner.running == {}


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        ({"id": None}, "missing or bad field"),
        ({"epoch": "x"}, "missing or bad field"),
        ({"action": "explode"}, "unknown action"),
        ({"gpu_indices": [1, 1]}, "twice"),
        ({"gpu_indices": [-1]}, "list of GPU indices"),
        ({"gpu_uuids": ["GPU-1"]}, "one UUID per entry"),
        ({"command": []}, "non-empty"),
        ({"env": {"A": 1}}, "string values"),
        ({"gpu_milli": 0}, "gpu_milli"),
        ({"gpu_milli": 1500}, "gpu_milli"),
    ],
)
def test_invalid_assignments_are_explained(change, fragment):
    data = {"id": "a1", "job_id": "j1", "epoch": 1, "gpu_indices": [0, 1], "command": ["true"]}
    data.update(change)
    if data["id"] is None:
        del data["id"]
    with pytest.raises(AssignmentInvalid) as err:
        Assignment.from_json(data)
    assert fragment in str(err.value)


def test_exit_report_carries_the_end_of_the_jobs_output(open_dir):
    runner = JobRunner(open_dir, base_env={"PATH": "/usr/bin:/bin"})
    script = "for i in $(seq 1 2000); do echo line $i; done; echo 'Traceback: boom' >&2; exit 3"
    runner.start(assignment(command=script), node_id=None)
    (exit_,) = wait_for(runner.poll, what="job exit")
    assert exit_.state == "failed" and exit_.output_tail.endswith("Traceback: boom\n")
    assert "line 2000" in exit_.output_tail and "line 1\n" not in exit_.output_tail
    assert len(exit_.output_tail.encode()) <= 4000


def test_a_job_cannot_make_the_agent_read_a_file_for_it(open_dir):
    # The job owns its folder: it replaces job.log with a link to a file only the agent (root)
    # may read. Its exit report must not carry that file's contents to the job's owner.
    secret = open_dir / "root-only"
    secret.write_text("the agent's secret\n")
    secret.chmod(0o600)
    runner = JobRunner(open_dir / "jobs", base_env={"PATH": "/usr/bin:/bin"})
    runner.start(assignment(command=f"rm -f job.log; ln -s {secret} job.log"), node_id=None)
    (exit_,) = wait_for(runner.poll, what="job exit")
    assert exit_.state == "exited" and "secret" not in exit_.output_tail


def test_a_job_cannot_make_the_agent_write_a_file_for_it(open_dir):
    # Links planted at the request file's names: the agent must neither follow them nor fail.
    target = open_dir / "root-owned"
    target.write_text("untouched")
    runner = JobRunner(open_dir / "jobs", base_env={"PATH": "/usr/bin:/bin"})
    plant = (f"for n in {CHECKPOINT_REQUEST_FILE} {CHECKPOINT_REQUEST_FILE}.tmp; do ln -s {target} $n; done; "
             "touch ready; sleep 30")
    job = runner.start(assignment(command=plant), node_id=None)
    wait_for(lambda: (job.workdir / "ready").exists(), what="links planted")
    assert runner.request_checkpoint("a1", request_id="c1", checkpoint_uri=None) == "file_only"
    assert target.read_text() == "untouched"
    request = job.workdir / CHECKPOINT_REQUEST_FILE
    assert not request.is_symlink() and json.loads(request.read_text())["request_id"] == "c1"
    assert request.stat().st_uid == runner.job_user.uid  # the job can read and delete its request
    runner.stop_all(reason="test over")


# -- what the broker committed: WHALEZEN_RESTORE_FROM ------------------------------------------------


def test_the_committed_checkpoint_reaches_the_job_and_cannot_be_overridden(open_dir):
    committed = "s3://ckpt/j1/step-000000000120"
    a = assignment(restore_from=committed, env={"WHALEZEN_RESTORE_FROM": "s3://ckpt/j1/step-000000000999"})
    env = job_environment(a, workdir=open_dir, node_id=None, base_env={"WHALEZEN_RESTORE_FROM": "/agent/own"})
    assert env["WHALEZEN_RESTORE_FROM"] == committed


def test_nothing_committed_is_passed_as_empty_and_an_old_broker_passes_nothing(open_dir):
    scratch = job_environment(assignment(restore_from=""), workdir=open_dir, node_id=None, base_env={})
    assert scratch["WHALEZEN_RESTORE_FROM"] == ""
    old = job_environment(assignment(), workdir=open_dir, node_id=None, base_env={})
    assert "WHALEZEN_RESTORE_FROM" not in old
    null = job_environment(assignment(restore_from=None), workdir=open_dir, node_id=None, base_env={})
    assert "WHALEZEN_RESTORE_FROM" not in null


@pytest.mark.parametrize("bad", [120, ["s3://x/step-1"], "s3://x/\x00step-1"])
def test_a_restore_from_that_is_not_a_string_makes_the_assignment_invalid(bad):
    with pytest.raises(AssignmentInvalid, match="restore_from"):
        assignment(restore_from=bad)
