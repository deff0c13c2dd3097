"""Checkpointed moves end to end, as a user meets them: `make run`, real agents running the real toy
training job (examples/train_toy.py, checkpointing through agent/checkpoint), the HTTP API.

1. The job runs and its checkpoints are committed; a move by request brings it to another node,
   restored from the committed step (its log there says so).
2. The agent of the node it then runs on is SIGKILLed (the job dies with it): the node is LOST and the
   job restarts elsewhere from its last committed checkpoint, losing at most about one checkpoint
   interval of steps.
On SQLite and the file queue, or PostgreSQL and Redis when the suite has them (CI runs both).
"""
from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import pytest

from .service import Service, backends, call, free_port, kill_leftovers, processes_of, shared_tmp_dir, wait_for
from .test_serve import demo_nodes_online, wait_state

ROOT = Path(__file__).resolve().parents[2]
STEP_S, CHECKPOINT_EVERY_S = 0.1, 2.0


def toy_spec(checkpoints: Path) -> dict:
    return {"name": "toy", "preemptible": True, "resources": {"gpus": 1, "gpu_models": ["A100-80GB"]},
            "command": ["/usr/bin/python3", str(ROOT / "examples" / "train_toy.py"), "--steps", "100000",
                        "--step-seconds", str(STEP_S), "--checkpoint-every-seconds", str(CHECKPOINT_EVERY_S)],
            "checkpoint": {"uri": str(checkpoints / "toy")}}


def job_log(var_dir: Path, allocation_id: int) -> str:
    """The job's output on its node: <agent state>-jobs/<allocation id>/job.log under the var dir."""
    logs = list(var_dir.glob(f"**/*-jobs/{allocation_id}/job.log"))
    return logs[0].read_text(errors="replace") if logs else ""


def current_allocation(job: dict) -> dict:
    (allocation,) = job["allocations"]
    return allocation


def agent_pid(var_dir: Path, node: str) -> int:
    # processes_of finds every process of the var dir; the agent of `node` is the one named so.
    # (not the local provider's instance wrapper, whose command line holds the agent's after "--").
    entries = [e for e in processes_of(var_dir)
               if " -m agent " in e and f" --name {node} " in e + " " and "instance.py" not in e]
    assert entries, f"no agent process for {node}"
    return int(entries[0].split(":", 1)[0])


@pytest.mark.slow
def test_a_running_job_moves_and_survives_its_agent_being_killed(tmp_path):
    # Both where jobs reach: they run as an unprivileged user, and pytest's tmp dirs are 0700.
    var_dir, checkpoints = shared_tmp_dir() / "var", shared_tmp_dir()
    with backends(var_dir, WHALEZEN_CHECKPOINT_ROOTS=str(checkpoints), WHALEZEN_NODE_LOST_AFTER_SECONDS="8",
                  WHALEZEN_LOST_SWEEP_SECONDS="2", WHALEZEN_FENCE_WAIT_SECONDS="10") as env:
        service = Service(var_dir, free_port(), env)
        try:
            service.start()
            _move_then_kill(service, var_dir, checkpoints)
        finally:
            if service.process is not None and service.process.poll() is None:
                service.stop(signal.SIGTERM)
            kill_leftovers(var_dir, str(checkpoints))


def _move_then_kill(service: Service, var_dir: Path, checkpoints: Path) -> None:
    token = service.token("acme")
    jobs = f"{service.base}/api/v1/jobs/"
    demo_nodes_online(service, token)
    job = call(jobs, token, toy_spec(checkpoints))
    url = f"{jobs}{job['id']}/"
    first = wait_state(service, token, job["id"], {"RUNNING"})
    wait_for(lambda: [c for c in call(f"{url}checkpoints/", token)["results"] if c["state"] == "COMMITTED"],
             90, "a committed checkpoint")

    # 1. Move by request.
    moved = call(f"{url}migrate/", token, {})
    assert moved["state"] == "CHECKPOINTING" and moved["source"] == current_allocation(first)["node"]
    done = wait_for(lambda: (m := call(f"{url}migrations/", token)["results"][0])["state"] == "COMPLETED" and m,
                    120, "the move to complete")
    assert done["to"] != done["source"] and done["downtime_s"] is not None
    after = wait_state(service, token, job["id"], {"RUNNING"})
    target = current_allocation(after)
    assert target["node"] == done["to"]
    wait_for(lambda: f"restored from step {done['restored_step']}" in job_log(var_dir, target["id"]), 60,
             "the job on the target to restore the committed step")

    # 2. Its node's agent is killed: the job restarts elsewhere from its last committed checkpoint.
    wait_for(lambda: any(c["state"] == "COMMITTED" and c["written_on"] == target["node"]
                         for c in call(f"{url}checkpoints/", token)["results"]), 60,
             "a checkpoint committed on the target")
    os.kill(agent_pid(var_dir, target["node"]), signal.SIGKILL)
    last_step = max(int(s) for s in re.findall(r"^step (\d+) ", job_log(var_dir, target["id"]), re.MULTILINE))
    again = wait_for(lambda: (j := call(url, token))["state"] == "RUNNING" and j["allocations"]
                     and current_allocation(j)["id"] != target["id"] and j, 180,
                     "the job to run again after its node was lost")
    restarted = current_allocation(again)
    assert restarted["node"] != target["node"]
    restored = wait_for(lambda: re.search(r"^restored from step (\d+)", job_log(var_dir, restarted["id"]),
                                          re.MULTILINE), 60, "the restart to restore a checkpoint")
    lost_steps = last_step - int(restored.group(1))
    # At most one checkpoint interval of steps, plus the steps the job ran while its last checkpoint
    # was being committed (the broker commits a checkpoint within a second or two of its write).
    assert 0 <= lost_steps <= (CHECKPOINT_EVERY_S + 3.0) / STEP_S, (last_step, restored.group(1))
    events = call(f"{url}events/?page_size=200", token)["results"]
    assert any(e["reason_code"] == "NODE_LOST" for e in events), [e["reason_code"] for e in events]
