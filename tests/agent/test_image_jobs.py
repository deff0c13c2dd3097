"""Image jobs run for real through a recording stand-in for the runtime (tests/agent/runtime_standin.py).

No podman, docker or apptainer can run here (a docker client without a daemon at most), so the
stand-in runs the container's command on the host, with the environment, working directory and
user a container would get, and records how it was called. What these tests prove is the agent's
side: the command line, the env hand-over, exit codes, output, stop and cleanup, refusals.
"""
from __future__ import annotations

import json
import os
import signal
import time

import pytest

from agent.jobs import Assignment, JobRunner, JobStartError
from agent.runtimes import detect
from agent.state import StateStore
from tests.agent import jobscripts, runtime_standin
from tests.agent.test_cli import agent_process, running_agent, sigterm, wait_for as wait_until
from tests.agent.test_jobs import wait_for
from tests.agent.test_loop import make_agent, pump, states

SECRET = "s3cr3t-token-value"


@pytest.fixture
def standin(open_dir):
    return runtime_standin.install(open_dir / "runtime", "docker", "podman", "apptainer")


def image_assignment(**overrides) -> Assignment:
    data = {"id": "a1", "job_id": "j1", "epoch": 1, "action": "start", "gpu_indices": [2, 5],
            "image": "docker:nvcr.io/nvidia/pytorch:24.05-py3", "command": jobscripts.WRITE_ENV,
            "env": {"HF_TOKEN": SECRET, "EXIT_CODE": "0"}}
    data.update(overrides)
    return Assignment.from_json(data)


def runner_for(open_dir, standin, name: str, **kwargs) -> JobRunner:
    return JobRunner(open_dir / "work", base_env={"PATH": os.environ["PATH"]},
                     runtimes=detect(name, path=str(standin.bin_dir)), **kwargs)


def test_an_image_job_runs_in_its_container_with_exactly_its_gpus_and_exits_0(open_dir, standin):
    runner = runner_for(open_dir, standin, "docker")
    job = runner.start(image_assignment(), node_id="n1")
    (exit_,) = wait_for(runner.poll, what="job exit")
    assert (exit_.state, exit_.exit_code) == ("exited", 0)
    (run,) = standin.records("run")
    assert run["image"] == "nvcr.io/nvidia/pytorch:24.05-py3" and run["container"] == "whalezen-a1"
    assert run["argv"][run["argv"].index("--gpus") + 1] == '"device=2,5"'
    assert not any(SECRET in word for word in run["argv"]) and "HF_TOKEN" in run["env_names"]
    inside = json.loads((job.workdir / "env.json").read_text())
    assert inside["HF_TOKEN"] == SECRET and inside["WHALEZEN_JOB_ID"] == "j1" and inside["WHALEZEN_NODE_ID"] == "n1"
    assert inside["CUDA_VISIBLE_DEVICES"] == "0,1"  # the container's two GPUs
    assert inside["HOME"] == str(job.workdir) and inside["PATH"] != os.environ["PATH"]  # the image's, not the host's
    assert os.stat(job.workdir / "env.json").st_uid == runner.job_user.uid  # --user: the job user, not root


def test_a_failing_image_job_reports_its_code_and_output(open_dir, standin):
    runner = runner_for(open_dir, standin, "podman")
    runner.start(image_assignment(command="echo loss went to nan >&2; exit 3"), node_id=None)
    (exit_,) = wait_for(runner.poll, what="job exit")
    assert (exit_.state, exit_.exit_code, exit_.message) == ("failed", 3, "exited with code 3")
    assert "loss went to nan" in exit_.output_tail
    (run,) = standin.records("run")
    assert run["runtime"] == "podman" and run["image"] == "nvcr.io/nvidia/pytorch:24.05-py3"
    assert run["command"] == ["/bin/sh", "-c", "echo loss went to nan >&2; exit 3"]


def test_without_a_command_the_image_entrypoint_runs(open_dir, standin):
    runner = runner_for(open_dir, standin, "docker")
    job = runner.start(image_assignment(command=None, image="ubuntu:22.04"), node_id=None)
    (exit_,) = wait_for(runner.poll, what="job exit")
    assert exit_.exit_code == 0 and (job.workdir / "job.log").read_text() == "entrypoint of ubuntu:22.04\n"


def test_stop_ends_the_container_even_when_it_ignores_sigterm(open_dir, standin, clock):
    runner = runner_for(open_dir, standin, "docker", stop_grace_s=30, clock=clock)
    job = runner.start(image_assignment(command=jobscripts.STUBBORN), node_id=None)
    wait_for(lambda: (job.workdir / "ready").exists(), what="job ready")
    container_pid = int((standin.containers_dir / "whalezen-a1.pid").read_text())
    runner.stop("a1", reason="stop requested by the broker")
    time.sleep(0.2)
    assert runner.poll() == [] and runtime_standin.alive(container_pid)  # within its grace period
    clock.advance(31)
    (exit_,) = wait_for(runner.poll, what="job killed")
    assert exit_.state == "stopped"
    # Killing the client alone would leave the daemon's container running: the agent removed it.
    assert [r["container"] for r in standin.records("remove")][-1] == "whalezen-a1"
    wait_for(lambda: not runtime_standin.alive(container_pid), what="container gone")


def test_apptainer_runs_as_the_job_user_with_the_host_gpu_indices(open_dir, standin):
    runner = runner_for(open_dir, standin, "apptainer")
    job = runner.start(image_assignment(), node_id=None)
    (exit_,) = wait_for(runner.poll, what="job exit")
    assert exit_.exit_code == 0
    (run,) = standin.records("exec")
    assert run["uid"] == runner.job_user.uid and "--nv" in run["argv"]
    assert "APPTAINERENV_HF_TOKEN" in run["env_names"] and not any(SECRET in w for w in run["argv"])
    inside = json.loads((job.workdir / "env.json").read_text())
    assert inside["CUDA_VISIBLE_DEVICES"] == "2,5" and inside["HF_TOKEN"] == SECRET
    assert "PATH" in inside and inside["PATH"] != os.environ["PATH"]  # --cleanenv: the host's env stayed out


def test_an_image_job_never_runs_on_the_host_without_a_runtime(open_dir):
    runner = JobRunner(open_dir / "work", base_env={"PATH": os.environ["PATH"]}, runtimes=())
    with pytest.raises(JobStartError, match="no container runtime"):
        runner.start(image_assignment(), node_id=None)
    assert runner.running == {} and not (open_dir / "work" / "a1" / "env.json").exists()


# -- through the agent loop ----------------------------------------------------------------------
def image_start(**overrides) -> dict:
    data = {"id": "a1", "job_id": "j1", "epoch": 1, "action": "start", "gpu_indices": [1, 3],
            "image": "nvcr.io/nvidia/pytorch:24.05-py3", "command": jobscripts.WRITE_ENV,
            "env": {"EXIT_CODE": "0"}}
    data.update(overrides)
    return data


def test_the_agent_reports_its_runtimes_and_runs_image_jobs_through_them(open_dir, broker, clock, standin,
                                                                          monkeypatch):
    monkeypatch.setenv("PATH", f"{standin.bin_dir}:{os.environ['PATH']}")
    broker.state.assignments = [image_start(),
                                image_start(id="a2", job_id="j2", gpu_indices=[0], env={"EXIT_CODE": "3"})]
    agent = make_agent(open_dir, broker, clock, container_runtimes="docker,apptainer")
    pump(agent, clock, lambda: len(states(broker, "a1")) == 2 and len(states(broker, "a2")) == 2, what="exits")
    assert broker.state.registrations[0]["container_runtimes"] == ["docker", "apptainer"]
    assert states(broker, "a1") == ["running", "exited"]
    failed = broker.statuses_for("a2")[-1]
    assert (failed["state"], failed["exit_code"]) == ("failed", 3)
    assert sorted(r["container"] for r in standin.records("run")) == ["whalezen-a1", "whalezen-a2"]


def test_an_image_job_on_a_node_without_runtimes_is_refused(open_dir, broker, clock, standin, monkeypatch):
    monkeypatch.setenv("PATH", f"{standin.bin_dir}:{os.environ['PATH']}")
    broker.state.assignments = [image_start(), image_start(id="a2", image="--privileged")]
    agent = make_agent(open_dir, broker, clock, container_runtimes="none")
    agent.step()
    assert broker.state.registrations[0]["container_runtimes"] == []
    (refused,) = broker.statuses_for("a1")
    assert (refused["state"], refused["reason"]) == ("refused", "no_container_runtime")
    assert "no container runtime" in refused["message"] and "nvcr.io/nvidia/pytorch" in refused["message"]
    (invalid,) = broker.statuses_for("a2")
    assert (invalid["state"], invalid["reason"]) == ("refused", "invalid") and "image" in invalid["message"]
    assert standin.records("run") == [] and not (open_dir / "state-jobs" / "a1" / "env.json").exists()


def test_a_restarted_agent_removes_the_container_its_predecessor_left(open_dir, broker, clock, standin, monkeypatch):
    monkeypatch.setenv("PATH", f"{standin.bin_dir}:{os.environ['PATH']}")
    broker.state.assignments = [image_start(command=jobscripts.STUBBORN)]
    first = make_agent(open_dir, broker, clock, container_runtimes="docker")
    first.step()
    job = first.runner.running["a1"]
    wait_for(lambda: (job.workdir / "ready").exists(), what="job ready")
    container_pid = int((standin.containers_dir / "whalezen-a1.pid").read_text())
    os.killpg(job.process.pid, signal.SIGKILL)  # the agent's side dies (a crash); the daemon's container lives
    job.process.wait()
    assert runtime_standin.alive(container_pid)
    assert StateStore(open_dir / "state").load_state().jobs["a1"].state == "running"
    broker.state.assignments = []
    second = make_agent(open_dir, broker, clock, container_runtimes="docker")
    second.start()
    wait_for(lambda: not runtime_standin.alive(container_pid), what="orphaned container removed")
    assert "whalezen-a1" in [r["container"] for r in standin.records("remove")]


def test_a_real_agent_process_detects_the_runtime_and_runs_an_image_job(broker, open_dir, standin):
    broker.state.heartbeat_seconds = 1
    broker.state.assignments = [image_start(gpu_indices=[1])]
    with running_agent("--server", broker.url, "--fake-gpus", "2xL4", "--name", "edge-1", "--state-dir",
                       str(open_dir / "s"), env={"WHALEZEN_JOIN_TOKEN": "join-secret",
                                                 "PATH": f"{standin.bin_dir}:{os.environ['PATH']}"}) as proc:
        wait_until(lambda: len(broker.statuses_for("a1")) >= 2, "the image job's exit")
        assert broker.state.registrations[0]["container_runtimes"] == ["podman", "docker", "apptainer"]
        assert [s["state"] for s in broker.statuses_for("a1")] == ["running", "exited"]
        (run,) = standin.records("run")
        assert run["runtime"] == "podman"
        argv = run["argv"]
        gpu_flags = [argv[i + 1] for i, w in enumerate(argv[:-1]) if w in ("--gpus", "--device")]
        assert gpu_flags in (['"device=1"'], ["nvidia.com/gpu=1"])  # --gpus, or CDI where the node has a spec
        err = sigterm(proc)
    assert proc.returncode == 0 and "Traceback" not in err


def test_a_bad_container_runtime_option_is_a_usage_error(broker, open_dir):
    proc = agent_process("--server", broker.url, "--fake-gpus", "1xL4", "--state-dir", str(open_dir / "s"),
                         "--container-runtime", "kubernetes", env={"WHALEZEN_JOIN_TOKEN": "join-secret"})
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 2 and "--container-runtime" in err and "Traceback" not in err
