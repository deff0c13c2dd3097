"""Checkpointed moves end to end, as a user meets them: `make run`, real agents running the real toy
training job (examples/train_toy.py, checkpointing through agent/checkpoint), the HTTP API.

1. The job runs and its checkpoints are committed; a move by request brings it to another node,
   restored from the committed step (its log there says so), while the Celery worker is SIGKILLed
   once in each step of the move (serve restarts it): the move completes, and the job never runs
   twice.
2. The agent of the node it then runs on is SIGKILLed (the job dies with it): the node is LOST and the
   job restarts elsewhere from its last committed checkpoint, losing at most about one checkpoint
   interval of steps.
3. A torn checkpoint (a flipped byte in its data file) is refused and never restored; then a move
   whose source node is cut off from the broker as it begins (a real agent behind a TCP relay
   that is cut): the node is LOST, the target does not start until the source is fenced (the agent
   stops its job itself, the broker waits out the fence), the job never runs on both, the move
   completes from the last checkpoint committed before the cut, and the source coming back starts
   nothing.
4. A spot notice on a `cloud-sim` instance: the job checkpoints and runs on another instance from a
   checkpoint written after the notice.
5. Preemption of jobs that write no checkpoints: not before their minimum run time; then one is
   stopped, told it restarts from the beginning, and the critical job runs.
One service for the module (the CI budget is tight). On SQLite and the file queue, or PostgreSQL and
Redis when the suite has them (CI runs both).
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest

from .service import (ROOT, Partition, Service, backends, call, commands_with, free_port, kill_leftovers, live_processes,
                      processes_of, shared_tmp_dir, wait_for)
from .test_serve import demo_nodes_online, wait_state

STEP_S, CHECKPOINT_EVERY_S = 0.1, 2.0


def toy_spec(checkpoints: Path, name: str = "toy", args: tuple[str, ...] = (), **resources) -> dict:
    return {"name": name, "preemptible": True,
            "resources": {"gpus": 1, "gpu_models": ["A100-80GB"], **resources},
            "command": ["/usr/bin/python3", str(ROOT / "examples" / "train_toy.py"), "--steps", "100000",
                        "--step-seconds", str(STEP_S), "--checkpoint-every-seconds", str(CHECKPOINT_EVERY_S),
                        *args],
            "checkpoint": {"uri": str(checkpoints / name)}}


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


def toy_copies(checkpoints: Path, name: str = "toy") -> list[int]:
    """Pids of one toy job's training processes: the job itself (python3 running train_toy.py, its
    checkpoint path in its environment), not the shim that started it."""
    uri = f"WHALEZEN_CHECKPOINT_URI={checkpoints / name}".encode()
    return [pid for pid, argv, environ in live_processes()
            if argv[:1] == ["/usr/bin/python3"] and argv[1:2] and argv[1].endswith("train_toy.py")
            and uri in environ.split(b"\0")]


class WorkerKills:
    """SIGKILLs serve's Celery worker once in each step a move is seen in, and checks on every look
    that the job runs at most once."""

    def __init__(self, service: Service):
        self.service, self.steps, self.killed = service, [], []

    def during(self, move: dict, checkpoints: Path) -> dict | None:
        copies = toy_copies(checkpoints)
        assert len(copies) <= 1, f"the job runs twice during its move ({move['state']}): {copies}"
        if move["state"] not in ("CHECKPOINTING", "STOPPING", "PLACING"):
            return move
        if move["state"] not in self.steps:
            worker = self.service.children()["worker"]
            if worker not in self.killed:  # else the last one killed is still down: down in this step too
                try:
                    os.kill(worker, signal.SIGKILL)
                    self.killed.append(worker)
                except ProcessLookupError:
                    pass
            self.steps.append(move["state"])
        return None


pytestmark = pytest.mark.slow
MOVE_STOP_TIMEOUT_S, FENCE_WAIT_S, EDGE_FENCE_AFTER_S, MIN_RUN_BEFORE_PREEMPT_S = 6, 10, 3, 15
SLEEP_MARK = 861_000  # the low-priority jobs' `sleep` arguments: how their processes are found


@pytest.fixture(scope="module")
def served():
    """One `make run` for the module (the CI budget is tight): (service, var dir, checkpoint root)."""
    # Both where jobs reach: they run as an unprivileged user, and pytest's tmp dirs are 0700.
    var_dir, checkpoints = shared_tmp_dir() / "var", shared_tmp_dir()
    with backends(var_dir, WHALEZEN_CHECKPOINT_ROOTS=str(checkpoints), WHALEZEN_NODE_LOST_AFTER_SECONDS="8",
                  WHALEZEN_LOST_SWEEP_SECONDS="2", WHALEZEN_FENCE_WAIT_SECONDS=str(FENCE_WAIT_S),
                  WHALEZEN_MIGRATION_STOP_TIMEOUT_SECONDS=str(MOVE_STOP_TIMEOUT_S),
                  WHALEZEN_MIN_RUN_BEFORE_PREEMPT_SECONDS=str(MIN_RUN_BEFORE_PREEMPT_S)) as env:
        service = Service(var_dir, free_port(), env)
        try:
            service.start()
            yield service, var_dir, checkpoints
        finally:
            if service.process is not None and service.process.poll() is None:
                service.stop(signal.SIGTERM)
            kill_leftovers(var_dir, str(checkpoints))


def test_a_running_job_moves_and_survives_its_agent_being_killed(served):
    _move_then_kill(*served)


def _move_then_kill(service: Service, var_dir: Path, checkpoints: Path) -> None:
    token = service.token("acme")
    jobs = f"{service.base}/api/v1/jobs/"
    demo_nodes_online(service, token)
    job = call(jobs, token, toy_spec(checkpoints))
    url = f"{jobs}{job['id']}/"
    first = wait_state(service, token, job["id"], {"RUNNING"})
    wait_for(lambda: [c for c in call(f"{url}checkpoints/", token)["results"] if c["state"] == "COMMITTED"],
             90, "a committed checkpoint")
    assert len(toy_copies(checkpoints)) == 1  # what the checks during the move count

    # 1. Move by request, the worker SIGKILLed in each step of it.
    moved = call(f"{url}migrate/", token, {})
    assert moved["state"] == "CHECKPOINTING" and moved["source"] == current_allocation(first)["node"]
    worker_kills = WorkerKills(service)
    done = wait_for(lambda: worker_kills.during(call(f"{url}migrations/", token)["results"][0], checkpoints),
                    180, "the move to complete with its worker killed in each step")
    assert done["state"] == "COMPLETED", done
    assert done["to"] != done["source"] and done["downtime_s"] is not None
    assert worker_kills.steps == ["CHECKPOINTING", "STOPPING", "PLACING"][:len(worker_kills.steps)], worker_kills.steps
    assert worker_kills.killed, "the worker was killed at least once"
    for pid in worker_kills.killed:
        assert f"worker (pid {pid}) killed by SIGKILL" in service.log()
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


def test_a_move_whose_source_is_cut_off_waits_for_the_fence(served):
    service, var_dir, checkpoints = served
    token = service.token("acme")
    jobs = f"{service.base}/api/v1/jobs/"
    join = subprocess.run([sys.executable, "manage.py", "issue_join_token", "--tenant", "acme", "--pool", "edge",
                           "--create"], cwd=ROOT, env=service.env, check=True, capture_output=True, text=True,
                          timeout=60).stdout.strip().splitlines()[-1]
    token_file = var_dir / "edge-join-token"
    token_file.write_text(join)
    partition = Partition(service.port)
    agents = []
    try:
        # Two L4 nodes of their own (the demo has none on-prem): the job starts behind the relay.
        agents.append(edge_agent(var_dir, "edge-src", partition.url, token_file))
        wait_for(lambda: node_state(service, token, "edge-src") == "ONLINE", 60, "edge-src to register")
        # Its second checkpoint is torn (a flipped byte in its data file, as a crash mid-write leaves it).
        spec = toy_spec(checkpoints, "edge", ("--tear-checkpoint-at-step", str(int(1.5 * CHECKPOINT_EVERY_S / STEP_S))),
                        gpu_models=["L4"])
        job = call(jobs, token, spec | {"placement": {"providers": ["onprem"]}})
        url = f"{jobs}{job['id']}/"
        first = wait_state(service, token, job["id"], {"RUNNING"})
        assert current_allocation(first)["node"] == "edge-src"
        torn = wait_for(lambda: next((c for c in call(f"{url}checkpoints/", token)["results"]
                                      if c["state"] == "INVALID"), None), 90, "the torn checkpoint to be refused")
        assert "sha256" in torn["problem"] or "size" in torn["problem"], torn
        agents.append(edge_agent(var_dir, "edge-dst", service.base, token_file))
        wait_for(lambda: node_state(service, token, "edge-dst") == "ONLINE", 60, "edge-dst to register")

        # Cut off as soon as the move is asked for: whatever the source does now (the checkpoint it is
        # asked for, its stop), the broker hears none of it.
        call(f"{url}migrate/", token, {})
        partition.cut()
        cut_at = time.time()

        def moved():
            copies = toy_copies(checkpoints, "edge")
            assert len(copies) <= 1, f"the job runs on both nodes: {copies}"
            j = call(url, token)
            return j["state"] == "RUNNING" and current_allocation(j)["node"] == "edge-dst" and j

        wait_for(moved, 120, "the job to run on edge-dst", interval=0.2)
        started_after = time.time() - cut_at
        move = call(f"{url}migrations/", token)["results"][0]
        assert (move["state"], move["to"]) == ("COMPLETED", "edge-dst"), move
        codes = [e["reason_code"] for e in call(f"{url}events/?page_size=200", token)["results"]]
        assert "NODE_LOST" in codes and "PLACED" in codes[codes.index("NODE_LOST"):], codes
        # Not before the node was given up on and the fence wait had passed.
        assert started_after >= FENCE_WAIT_S, started_after
        # From the newest checkpoint committed before the cut, never the torn one.
        listed = {c["step"]: c["state"] for c in call(f"{url}checkpoints/?page_size=200", token)["results"]}
        assert move["restored_step"] is not None and move["restored_step"] != torn["step"], (move, torn)
        assert listed.get(torn["step"]) != "COMMITTED", listed
        target_log = job_log(var_dir, current_allocation(call(url, token))["id"])
        assert f"restored from step {move['restored_step']}" in target_log, target_log[:500]

        # The source comes back: it learns its copy is withdrawn, and the job still runs once.
        partition.heal()
        wait_for(lambda: node_state(service, token, "edge-src") == "ONLINE", 60, "edge-src to come back")
        for _ in range(10):
            assert len(toy_copies(checkpoints, "edge")) == 1
            time.sleep(0.3)
        assert call(url, token)["state"] == "RUNNING"
    finally:
        partition.cut()
        for agent in agents:
            agent.kill()
            agent.wait(timeout=30)


def edge_agent(var_dir: Path, name: str, server: str, token_file: Path) -> subprocess.Popen:
    """A real node agent with one fake L4, fencing its jobs itself after EDGE_FENCE_AFTER_S without
    the broker (well inside the broker's fence wait)."""
    state = var_dir / "edge-agents" / name
    state.parent.mkdir(parents=True, exist_ok=True)
    jobs_dir = state.parent / f"{name}-jobs"  # where job_log() finds the job's output, as for the demo's agents
    log = (var_dir / f"{name}.log").open("wb")
    return subprocess.Popen(
        [sys.executable, "-m", "agent", "--server", server, "--join-token-file", str(token_file), "--name", name,
         "--fake-gpus", "1xL4", "--state-dir", str(state), "--work-dir", str(jobs_dir), "--heartbeat-seconds", "1",
         "--fence-after-seconds", str(EDGE_FENCE_AFTER_S), "--stop-grace-seconds", "2"],
        cwd=ROOT, env=service_agent_env(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        start_new_session=True)


def service_agent_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("DATABASE_URL", "REDIS_URL", "DJANGO"))}


def node_state(service: Service, token: str, name: str) -> str | None:
    nodes = call(f"{service.base}/api/v1/nodes/?page_size=200", token)["results"]
    return next((n["state"] for n in nodes if n["name"] == name), None)


def test_a_spot_notice_moves_the_job_before_its_instance_dies(served):
    """A job on a `cloud-sim` instance (the `local` provider: real agent processes behind a simulated
    metadata service) gets a spot notice: it checkpoints, and runs on elsewhere from a checkpoint
    written after the notice, so it loses at most the work since the notice."""
    service, var_dir, checkpoints = served
    token = service.token("acme")
    jobs = f"{service.base}/api/v1/jobs/"
    spec = toy_spec(checkpoints, "spot", gpu_models=["L4"]) | {"placement": {"providers": ["local"]}}
    job = call(jobs, token, spec)
    url = f"{jobs}{job['id']}/"
    first = wait_state(service, token, job["id"], {"RUNNING"}, timeout=180)
    source = current_allocation(first)
    wait_for(lambda: [c for c in call(f"{url}checkpoints/", token)["results"] if c["state"] == "COMMITTED"],
             90, "a committed checkpoint")

    step_at_notice = max(int(s) for s in re.findall(r"^step (\d+) ", job_log(var_dir, source["id"]), re.MULTILINE))
    subprocess.run([sys.executable, "manage.py", "spot_interrupt", source["node"], "--in", "30"], cwd=ROOT,
                   env=service.env, check=True, capture_output=True, timeout=60)

    def elsewhere():
        assert len(toy_copies(checkpoints, "spot")) <= 1, "the job runs twice"
        j = call(url, token)
        return j["state"] == "RUNNING" and j["allocations"] and current_allocation(j)["node"] != source["node"] and j

    again = wait_for(elsewhere, 180, "the job to run on another instance", interval=0.3)
    restored = wait_for(lambda: re.search(r"^restored from step (\d+)", job_log(var_dir, current_allocation(again)["id"]),
                                          re.MULTILINE), 60, "the job to restore a checkpoint")
    assert int(restored.group(1)) >= step_at_notice  # written after the notice: no work before it is lost
    codes = [e["reason_code"] for e in call(f"{url}events/?page_size=200", token)["results"]]
    assert "SPOT_NOTICE" in codes and "SPOT_INTERRUPTION" in codes, codes
    (move,) = [m for m in call(f"{url}migrations/", token)["results"] if m["cause"] == "SPOT"]
    assert move["state"] == "COMPLETED" and move["to"] == current_allocation(again)["node"], move


def test_preemption_waits_for_the_minimum_run_time_and_a_job_without_checkpoints_restarts(served):
    """Both demo T4 nodes full with low-priority jobs that write no checkpoints; a critical job wants
    one of them. It waits until the victims have run WHALEZEN_MIN_RUN_BEFORE_PREEMPT_SECONDS, then one
    is stopped (its process gone), told it restarts from the beginning, and the critical job runs."""
    service, _, _ = served
    token = service.token("acme")
    jobs = f"{service.base}/api/v1/jobs/"
    t4_onprem = {"resources": {"gpus": 4, "gpu_models": ["T4"]}, "placement": {"providers": ["onprem"]}}
    low = [call(jobs, token, {"name": f"low-{i}", "priority": "low", "preemptible": True,
                              "command": ["/bin/sleep", f"{SLEEP_MARK + i}"], **t4_onprem}) for i in range(2)]
    running = [wait_state(service, token, j["id"], {"RUNNING"}) for j in low]
    # The broker counts a victim's run time from the job's started_at, so the test does too: the time a
    # poll saw RUNNING can lag that by seconds on a loaded machine, and the wait would end early.
    first_running = min(datetime.fromisoformat(j["started_at"]).timestamp() for j in running)
    high = call(jobs, token, {"name": "urgent", "priority": "critical", "command": ["/bin/sleep", "3600"],
                              **t4_onprem})
    # Below their minimum run time the victims are left alone: the critical job waits.
    assert time.time() < first_running + MIN_RUN_BEFORE_PREEMPT_S - 6, "too slow to see the wait"
    while time.time() < first_running + MIN_RUN_BEFORE_PREEMPT_S - 2:
        assert all(call(f"{jobs}{j['id']}/", token)["state"] == "RUNNING" for j in low)
        assert call(f"{jobs}{high['id']}/", token)["state"] == "PENDING"
        time.sleep(0.5)
    wait_state(service, token, high["id"], {"RUNNING"}, timeout=120)

    states = {j["id"]: call(f"{jobs}{j['id']}/", token)["state"] for j in low}
    (victim,) = [i for i, s in states.items() if s != "RUNNING"]
    preempted = [e for e in call(f"{jobs}{victim}/events/?page_size=200", token)["results"]
                 if e["reason_code"] == "PREEMPTED"]
    assert preempted and "restarts from the beginning" in preempted[0]["message"], preempted
    mark = str(SLEEP_MARK + [j["id"] for j in low].index(victim))
    wait_for(lambda: not commands_with(mark), 30, "the victim's process to be stopped")
    assert call(f"{jobs}{victim}/", token)["state"] == "PENDING"
    for j in (*low, high):
        call(f"{jobs}{j['id']}/cancel/", token, {})
