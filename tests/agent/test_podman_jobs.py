"""Image jobs through a real podman (tests/podman.py: a busybox image built here, no registry).

tests/agent/test_image_jobs.py proves the agent's side against a recording stand-in for every
runtime; these prove that the command line it writes is one podman accepts and that a container
does what the agent promises: the job runs in the image (not on the host) as the job user, sees
its own GPU numbering and its secrets only through the environment, reports its exit code, and
leaves no container behind when it is stopped, when the image cannot run, or when its agent died.
"""
from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from agent.jobs import Assignment, JobRunner
from agent.runtimes import detect
from agent.state import StateStore
from tests.agent.test_cli import running_agent, sigterm, wait_for as wait_until
from tests.agent.test_jobs import wait_for
from tests.agent.test_loop import make_agent, pump, states
from tests.podman import Podman, podman_or_skip

SECRET = "s3cr3t-podman-value"
SHOW = ("env > env.txt; cat /proc/1/cmdline | tr '\\0' ' ' > pid1.txt; id -u > uid.txt; "
        "ls / > root.txt; exit ${EXIT_CODE:-0}")
STUBBORN = "trap '' TERM; touch ready; while true; do sleep 1; done"


@pytest.fixture(scope="module")
def podman() -> Podman:
    return podman_or_skip()


def assignment(podman: Podman, assignment_id: str, script: str, **overrides) -> Assignment:
    data = {"id": assignment_id, "job_id": f"job-{assignment_id}", "epoch": 1, "action": "start",
            "gpu_indices": [2, 5], "image": podman.image, "command": ["/bin/sh", "-c", script],
            "env": {"HF_TOKEN": SECRET}}
    data.update(overrides)
    return Assignment.from_json(data)


def runner_for(open_dir: Path, podman: Podman, **kwargs) -> JobRunner:
    # --fake-gpus nodes: podman without the NVIDIA toolkit, given only CUDA_VISIBLE_DEVICES.
    return JobRunner(open_dir / "work", base_env={"PATH": os.environ["PATH"], **podman.env},
                     runtimes=detect("podman", simulated_gpus=True), stop_grace_s=1.0, **kwargs)


def env_file(path: Path) -> dict[str, str]:
    return dict(line.split("=", 1) for line in path.read_text().splitlines() if "=" in line)


def command_lines() -> list[str]:
    lines = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            lines.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
        except OSError:
            continue
    return lines


def test_an_image_job_runs_inside_the_container_as_the_job_user_with_its_own_gpu_numbers(open_dir, podman):
    runner = runner_for(open_dir, podman)
    job = runner.start(assignment(podman, "pm1", SHOW), node_id="n1")
    (exit_,) = wait_for(runner.poll, what="job exit", limit_s=60)
    assert (exit_.state, exit_.exit_code) == ("exited", 0), exit_.output_tail
    inside = env_file(job.workdir / "env.txt")
    assert inside["HF_TOKEN"] == SECRET and inside["WHALEZEN_JOB_ID"] == "job-pm1"
    assert inside["CUDA_VISIBLE_DEVICES"] == "0,1"  # the job's two GPUs, numbered from 0 in the container
    assert inside["HOME"] == str(job.workdir) and inside["PATH"] == "/bin"  # the image's PATH, not the host's
    assert (job.workdir / "pid1.txt").read_text().startswith("/run/podman-init")  # --init reaps and forwards
    assert "usr" not in (job.workdir / "root.txt").read_text().split()  # the image's filesystem: no host /usr
    assert int((job.workdir / "uid.txt").read_text()) == runner.job_user.uid
    assert os.stat(job.workdir / "env.txt").st_uid == runner.job_user.uid
    assert podman.containers("whalezen-pm1") == []  # --rm


def test_a_secret_reaches_the_container_through_the_environment_never_a_command_line(open_dir, podman):
    runner = runner_for(open_dir, podman)
    job = runner.start(assignment(podman, "pm2", STUBBORN), node_id=None)
    wait_for(lambda: (job.workdir / "ready").exists(), what="container ready", limit_s=60)
    assert not any(SECRET in line for line in command_lines())
    inspect = podman.run("inspect", "--format", "{{.Config.Env}}", "whalezen-pm2", check=True).stdout
    assert f"HF_TOKEN={SECRET}" in inspect  # the container has it all the same
    runner.stop("pm2", reason="stop requested by the broker")
    wait_for(runner.poll, what="job stopped", limit_s=60)


def test_a_failing_image_job_reports_its_exit_code_and_output(open_dir, podman):
    runner = runner_for(open_dir, podman)
    runner.start(assignment(podman, "pm3", "echo loss went to nan >&2; exit 3"), node_id=None)
    (exit_,) = wait_for(runner.poll, what="job exit", limit_s=60)
    assert (exit_.state, exit_.exit_code, exit_.reason) == ("failed", 3, "exit_code")
    assert "loss went to nan" in exit_.output_tail


def test_stopping_an_image_job_that_ignores_sigterm_ends_and_removes_its_container(open_dir, podman):
    runner = runner_for(open_dir, podman)
    job = runner.start(assignment(podman, "pm4", STUBBORN), node_id=None)
    wait_for(lambda: (job.workdir / "ready").exists(), what="container ready", limit_s=60)
    assert podman.containers("whalezen-pm4") == ["whalezen-pm4"]
    runner.stop("pm4", reason="stop requested by the broker")
    (exit_,) = wait_for(runner.poll, what="job stopped", limit_s=60)
    assert exit_.state == "stopped" and exit_.reason == "requested"
    wait_for(lambda: podman.containers("whalezen-pm4") == [], what="container removed", limit_s=60)


def test_an_image_that_cannot_be_pulled_fails_the_job_and_nothing_runs_on_the_host(open_dir, podman):
    runner = runner_for(open_dir, podman)
    job = runner.start(assignment(podman, "pm5", "touch ran-on-the-host", image="localhost:1/whalezen/none:1"),
                       node_id=None)
    (exit_,) = wait_for(runner.poll, what="job exit", limit_s=90)
    assert (exit_.state, exit_.exit_code) == ("failed", 125)
    assert "could not run image localhost:1/whalezen/none:1" in exit_.message
    assert not (job.workdir / "ran-on-the-host").exists()


def test_a_restarted_agent_removes_the_container_its_killed_predecessor_left(open_dir, broker, clock, podman):
    broker.state.assignments = [{"id": "pm6", "job_id": "j6", "epoch": 1, "action": "start", "gpu_indices": [0],
                                 "image": podman.image, "command": ["/bin/sh", "-c", STUBBORN]}]
    first = make_agent(open_dir, broker, clock, spec="2xL4", container_runtimes="podman",
                       extra_env=podman.env)
    first.step()
    job = first.runner.running["pm6"]
    wait_for(lambda: (job.workdir / "ready").exists(), what="container ready", limit_s=60)
    os.killpg(job.process.pid, signal.SIGKILL)  # the agent's side dies; conmon keeps the container
    job.process.wait()
    assert podman.containers("whalezen-pm6") == ["whalezen-pm6"]
    assert StateStore(open_dir / "state").load_state().jobs["pm6"].state == "running"
    broker.state.assignments = []
    second = make_agent(open_dir, broker, clock, spec="2xL4", container_runtimes="podman",
                        extra_env=podman.env)
    second.start()
    pump(second, clock, lambda: podman.containers("whalezen-pm6") == [], what="orphaned container removed",
         limit_s=60)
    assert states(broker, "pm6")[-1] in ("failed", "stopped")


def test_a_real_agent_process_finds_podman_and_runs_an_image_job(broker, open_dir, podman):
    broker.state.heartbeat_seconds = 1
    broker.state.assignments = [{"id": "pm7", "job_id": "j7", "epoch": 1, "action": "start", "gpu_indices": [1],
                                 "image": podman.image, "command": ["/bin/sh", "-c", "echo $CUDA_VISIBLE_DEVICES"]}]
    with running_agent("--server", broker.url, "--fake-gpus", "2xL4", "--name", "edge-p", "--state-dir",
                       str(open_dir / "s"), env={"WHALEZEN_JOIN_TOKEN": "join-secret", **podman.env}) as proc:
        wait_until(lambda: len(broker.statuses_for("pm7")) >= 2, "the image job's exit", limit_s=90)
        assert "podman" in broker.state.registrations[0]["container_runtimes"]
        assert [s["state"] for s in broker.statuses_for("pm7")] == ["running", "exited"]
        err = sigterm(proc)
    assert proc.returncode == 0 and "Traceback" not in err
