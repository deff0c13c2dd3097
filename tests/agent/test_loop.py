"""The agent loop against a small in-test broker: registration, heartbeats, assignments, outages.

The loop is driven step by step with a fake clock, so schedules (heartbeat interval, backoff) are
checked from the agent's own decisions, never from how long anything took. Jobs are real
processes (tests/agent/jobscripts.py).
"""
from __future__ import annotations

import json
import os
import random
import stat
import subprocess
import sys
import time

import pytest

from agent.backends.fake import FakeBackend
from agent.loop import Agent, AgentConfig, RegistrationRefused
from agent.procs import process_start_ticks
from agent.state import JobRecord, StateStore
from tests.agent import jobscripts


def make_agent(open_dir, broker, clock, *, spec: str = "4xA100-80GB-SXM", **config) -> Agent:
    base_env = {"PATH": os.environ["PATH"], **config.pop("extra_env", {})}  # the agent's own environment
    cfg = AgentConfig(
        server_url=broker.url,
        join_token=config.pop("join_token", "join-secret"),
        name="node-a",
        state_dir=open_dir / "state",
        stop_grace_s=config.pop("stop_grace_s", 1.0),
        http_timeout_s=5.0,
        **config,
    )
    backend = FakeBackend(spec, clock=clock, hostname="node-a")
    return Agent(cfg, backend, clock=clock, rng=random.Random(7), base_env=base_env)


def pump(agent: Agent, clock, until, *, advance: float = 1.0, what: str = "condition", limit_s: float = 20.0):
    """Step the agent (moving the fake clock) until `until()` holds. The real-time limit only
    stops a broken test from hanging; nothing is asserted about durations."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        agent.step()
        value = until()
        if value:
            return value
        clock.advance(advance)
        time.sleep(0.01)
    raise AssertionError(f"gave up waiting for {what}")


def start_assignment(**overrides):
    data = {"id": "a1", "job_id": "j1", "epoch": 1, "action": "start", "gpu_indices": [1, 3],
            "command": jobscripts.WRITE_ENV, "env": {}, "checkpoint_uri": "file:///ckpt/j1"}
    data.update(overrides)
    return data


def states(broker, assignment_id: str) -> list[str]:
    return [s["state"] for s in broker.statuses_for(assignment_id)]


# -- registration and heartbeats -----------------------------------------------------------------
def test_registers_with_inventory_and_topology_then_heartbeats(open_dir, broker, clock):
    agent = make_agent(open_dir, broker, clock)
    agent.step()
    (reg,) = broker.state.registrations
    assert reg["join_token"] == "join-secret" and reg["name"] == "node-a"
    assert reg["cpu_milli"] == 4 * 32 * 1000 and reg["memory_mb"] == 4 * 256 * 1024
    assert [g["index"] for g in reg["gpus"]] == [0, 1, 2, 3]
    gpu = reg["gpus"][2]
    assert gpu["model"] == "NVIDIA A100-SXM4-80GB" and gpu["memory_mb"] == 81920
    assert gpu["nvlink_island"] == 0 and gpu["nvlink_peers"] == [0, 1, 3]
    assert gpu["numa_node"] == 1 and gpu["mig_mode"] == "disabled" and gpu["uuid"].startswith("GPU-")
    assert reg["topology"]["pcie_common_ancestor"][0] == ["X", "PIX", "SYS", "SYS"]
    assert len(reg["topology"]["gpus"][0]["nvlinks"]) == 12
    # Registered, then heartbeat with one reading per GPU, then the assignments pull.
    assert [p for _, p in broker.state.requests] == [
        "/api/v1/agent/register", "/api/v1/agent/heartbeat", "/api/v1/agent/assignments"]
    (beat,) = broker.state.heartbeats
    assert [t["index"] for t in beat["telemetry"]] == [0, 1, 2, 3]
    reading = beat["telemetry"][0]
    for key in ("utilization_pct", "memory_used_mb", "memory_total_mb", "temperature_c", "power_w",
                "ecc_corrected", "ecc_uncorrected", "health", "mig_mode", "xid_errors"):
        assert key in reading
    assert reading["health"] == "HEALTHY" and beat["processes"] == []


def test_an_idle_agent_sleeps_between_steps(open_dir, broker, clock):
    """With nothing to deliver, the loop waits a full tick (or until the heartbeat) after each step:
    an earlier version returned 0 whenever the broker answered, so an idle agent woke at once,
    forever, and used up to a whole core (issue 12 measured a quarter of a core per demo agent)."""
    agent = make_agent(open_dir, broker, clock)
    assert agent.step() == pytest.approx(agent.config.tick_seconds)  # registered, heartbeat sent
    for _ in range(20):
        clock.advance(0.1)
        assert agent.step() > 0, "an idle agent must not spin"
    calls = len(broker.state.requests)
    clock.advance(agent.heartbeat_s - 2.5)  # still before the next heartbeat (2 s have passed)
    agent.step()
    assert len(broker.state.requests) == calls  # no broker call between heartbeats


def test_node_token_is_kept_private_and_a_restart_does_not_register_again(open_dir, broker, clock):
    agent = make_agent(open_dir, broker, clock)
    agent.step()
    identity_file = open_dir / "state" / "identity.json"
    assert stat.S_IMODE(identity_file.stat().st_mode) == 0o600
    token = json.loads(identity_file.read_text())["node_token"]
    assert token in broker.state.nodes

    again = make_agent(open_dir, broker, clock)
    again.step()
    assert len(broker.state.registrations) == 1
    assert [h["node_id"] for h in broker.state.heartbeats] == ["n1", "n1"]


def test_heartbeats_follow_the_interval_the_broker_gives(open_dir, broker, clock):
    broker.state.heartbeat_seconds = 3
    agent = make_agent(open_dir, broker, clock)
    agent.step()
    for _ in range(9):
        clock.advance(1.0)
        agent.step()
    assert len(broker.state.heartbeats) == 4  # at t = 0, 3, 6, 9


def test_telemetry_shows_a_gpu_that_failed_meanwhile(open_dir, broker, clock):
    agent = make_agent(open_dir, broker, clock)
    agent.step()
    agent.backend.inject_xid(3, 79)
    clock.advance(5)
    agent.step()
    last = broker.state.heartbeats[-1]["telemetry"][3]
    assert last["health"] == "FAILED" and last["lost"] is True and 79 in last["xid_errors"]


def test_bad_join_token_is_refused_without_retrying(open_dir, broker, clock):
    agent = make_agent(open_dir, broker, clock, join_token="wrong")
    with pytest.raises(RegistrationRefused, match="invalid join token"):
        agent.step()
    assert len(broker.state.requests) == 1
    assert not (open_dir / "state" / "identity.json").exists()


def test_missing_join_token_on_a_new_node_is_refused(open_dir, broker, clock):
    agent = make_agent(open_dir, broker, clock, join_token=None)
    with pytest.raises(RegistrationRefused, match="no join token"):
        agent.step()
    assert broker.state.requests == []


def test_revoked_node_token_makes_the_agent_join_again(open_dir, broker, clock):
    agent = make_agent(open_dir, broker, clock)
    agent.step()
    broker.state.revoked_tokens.add(agent.identity.node_token)
    clock.advance(5)
    agent.step()  # heartbeat refused: identity dropped, backoff
    assert agent.identity is None
    pump(agent, clock, lambda: len(broker.state.registrations) == 2 and agent.identity, what="second registration")
    assert broker.state.registrations[1]["agent_key"] == broker.state.registrations[0]["agent_key"]


# -- the broker is down ----------------------------------------------------------------------------
def test_backoff_grows_with_jitter_while_the_broker_is_down(open_dir, broker, clock):
    broker.stop()
    agent = make_agent(open_dir, broker, clock)
    delays = []
    for _ in range(6):
        agent.step()
        delay = agent._next_network_at - clock.now
        delays.append(delay)
        clock.advance(delay)
    for attempt, delay in enumerate(delays):
        ceiling = min(60.0, 2.0**attempt)
        assert ceiling / 2 <= delay <= ceiling
    assert delays == sorted(delays)
    assert agent.identity is None and agent.last_error and "unreachable" in agent.last_error


def test_no_request_is_made_before_the_backoff_delay_ends(open_dir, broker, clock):
    broker.state.fail_with = 503
    agent = make_agent(open_dir, broker, clock)
    agent.step()
    for _ in range(2):
        clock.advance(agent._next_network_at - clock.now)
        agent.step()
    assert len(broker.state.requests) == 3
    delay = agent._next_network_at - clock.now
    clock.advance(delay / 2)
    agent.step()
    assert len(broker.state.requests) == 3  # still waiting
    broker.state.fail_with = None
    clock.advance(delay)
    agent.step()
    assert agent.identity is not None and agent.backoff.failures == 0


def test_exit_during_an_outage_is_buffered_on_disk_and_sent_when_the_broker_returns(open_dir, broker, clock):
    broker.state.assignments = [start_assignment()]
    agent = make_agent(open_dir, broker, clock)
    agent.step()
    assert states(broker, "a1") == ["running"]
    broker.stop()
    # The job ends while the broker is unreachable; the agent keeps retrying with backoff.
    pump(agent, clock, lambda: agent.state.outbox, what="exit queued")
    saved = json.loads((open_dir / "state" / "state.json").read_text())
    assert [r["state"] for r in saved["outbox"]] == ["exited"]
    for _ in range(4):
        clock.advance(agent._next_network_at - clock.now)
        agent.step()
    assert agent.missed_heartbeats >= 1
    before = len(broker.state.requests)
    broker.start()
    clock.advance(agent._next_network_at - clock.now)
    agent.step()
    assert states(broker, "a1") == ["running", "exited"]
    assert broker.statuses_for("a1")[1]["exit_code"] == 0
    paths = [p for _, p in broker.state.requests[before:]]
    assert paths[0] == "/api/v1/agent/assignments/a1/status"  # the exit first, then the heartbeat
    assert paths[1] == "/api/v1/agent/heartbeat"
    beat = broker.state.heartbeats[-1]
    assert beat["missed_heartbeats"] >= 1 and len(beat["telemetry"]) == 4
    assert agent.state.outbox == []


def test_buffered_reports_survive_an_agent_restart(open_dir, broker, clock):
    broker.state.assignments = [start_assignment()]
    agent = make_agent(open_dir, broker, clock)
    agent.step()
    broker.stop()
    pump(agent, clock, lambda: agent.state.outbox, what="exit queued")
    agent.shutdown()
    broker.start()
    fresh = make_agent(open_dir, broker, clock)
    fresh.step()
    assert states(broker, "a1") == ["running", "exited"]


# -- assignments -----------------------------------------------------------------------------------
def test_job_starts_with_exactly_its_gpus_and_its_exit_is_reported(open_dir, broker, clock):
    broker.state.assignments = [start_assignment(env={"EXIT_CODE": "0", "LR": "0.1"})]
    agent = make_agent(open_dir, broker, clock)
    agent.step()
    (running,) = broker.statuses_for("a1")
    assert running["state"] == "running" and running["epoch"] == 1 and running["pid"] > 0
    pump(agent, clock, lambda: len(broker.statuses_for("a1")) == 2, what="exit report")
    exited = broker.statuses_for("a1")[1]
    assert (exited["state"], exited["exit_code"], exited["job_id"], exited["reason"]) == ("exited", 0, "j1", "exit")
    assert running["reason"] == "started"
    env = json.loads((open_dir / "state-jobs" / "a1" / "env.json").read_text())
    assert env["CUDA_VISIBLE_DEVICES"] == "1,3"
    assert env["WHALEZEN_JOB_ID"] == "j1" and env["WHALEZEN_CHECKPOINT_URI"] == "file:///ckpt/j1"
    assert env["WHALEZEN_NODE_ID"] == "n1" and env["LR"] == "0.1"


def test_failed_job_reports_its_exit_code(open_dir, broker, clock):
    broker.state.assignments = [start_assignment(env={"EXIT_CODE": "3"})]
    agent = make_agent(open_dir, broker, clock)
    pump(agent, clock, lambda: "failed" in states(broker, "a1"), what="failure report")
    assert broker.statuses_for("a1")[-1]["exit_code"] == 3


def test_running_job_is_listed_in_heartbeats_and_marks_its_gpus_busy(open_dir, broker, clock):
    broker.state.assignments = [start_assignment(command=jobscripts.SLEEPER)]
    agent = make_agent(open_dir, broker, clock)
    agent.step()
    clock.advance(5)
    agent.step()
    (proc,) = broker.state.heartbeats[-1]["processes"]
    assert proc["assignment_id"] == "a1" and proc["gpu_indices"] == [1, 3] and proc["state"] == "running"
    telemetry = broker.state.heartbeats[-1]["telemetry"]
    assert telemetry[1]["utilization_pct"] >= 55 and telemetry[0]["utilization_pct"] < 5
    agent.shutdown()


def test_a_job_that_dies_with_its_gpu_says_so_in_its_exit_report(open_dir, broker, clock):
    broker.state.assignments = [start_assignment(command=jobscripts.SLEEPER)]
    agent = make_agent(open_dir, broker, clock)
    agent.step()
    job = agent.runner.running["a1"]
    pump(agent, clock, lambda: (job.workdir / "ready").exists(), what="job ready")
    agent.backend.fall_off_bus(3)
    os.kill(job.pid, 9)  # the CUDA context died with the GPU
    pump(agent, clock, lambda: "failed" in states(broker, "a1"), what="failure report")
    failure = broker.statuses_for("a1")[-1]
    assert failure["reason"] == "signal" and failure["exit_code"] == -9
    assert list(failure["failed_gpus"]) == ["3"]
    assert "fell off the bus" in failure["failed_gpus"]["3"][0]


def test_an_ordinary_failure_names_no_gpu(open_dir, broker, clock):
    broker.state.assignments = [start_assignment(env={"EXIT_CODE": "2"})]
    agent = make_agent(open_dir, broker, clock)
    pump(agent, clock, lambda: "failed" in states(broker, "a1"), what="failure report")
    assert "failed_gpus" not in broker.statuses_for("a1")[-1]


def test_an_assignment_is_never_started_twice(open_dir, broker, clock):
    broker.state.assignments = [start_assignment()]
    agent = make_agent(open_dir, broker, clock)
    pump(agent, clock, lambda: "exited" in states(broker, "a1"), what="exit")
    for _ in range(12):  # the broker keeps listing it; the agent must not run it again
        clock.advance(1)
        agent.step()
    assert states(broker, "a1") == ["running", "exited"]


def test_stale_epoch_is_refused_and_the_job_never_starts(open_dir, broker, clock):
    broker.state.epoch = 5  # the heartbeat answer says 5 ...
    broker.state.assignments_epoch = 3  # ... then a lagging replica answers with its view at 3
    broker.state.assignments = [start_assignment(epoch=3)]
    agent = make_agent(open_dir, broker, clock)
    agent.step()
    (refusal,) = broker.statuses_for("a1")
    assert refusal["state"] == "refused"
    assert refusal["message"] == "stale epoch 3: this node has seen epoch 5" and refusal["reason"] == "stale_epoch"
    assert not (open_dir / "state-jobs" / "a1").exists()
    broker.state.assignments_epoch = None
    clock.advance(5)
    agent.step()
    assert states(broker, "a1") == ["refused"]  # refused once, and never started afterwards


def test_stale_epoch_is_remembered_across_restarts(open_dir, broker, clock):
    broker.state.epoch = 9
    make_agent(open_dir, broker, clock).step()
    broker.state.epoch = 1  # e.g. an old replica answering, or a replayed response
    broker.state.assignments = [start_assignment(epoch=1)]
    make_agent(open_dir, broker, clock).step()
    assert states(broker, "a1") == ["refused"]


def test_a_stale_view_stops_nothing(open_dir, broker, clock):
    broker.state.assignments = [start_assignment(command=jobscripts.SLEEPER)]
    agent = make_agent(open_dir, broker, clock)
    agent.step()
    broker.state.epoch, broker.state.assignments_epoch = 3, 2
    broker.state.assignments = []  # an old view in which a1 did not exist yet
    for _ in range(6):
        clock.advance(1)
        agent.step()
    assert states(broker, "a1") == ["running"] and "a1" in agent.runner.running
    broker.state.assignments_epoch = None  # the current view: a1 really was released
    pump(agent, clock, lambda: "stopped" in states(broker, "a1"), what="stop")


def test_a_newer_epoch_alone_does_not_stop_a_listed_job(open_dir, broker, clock):
    # The broker bumps the node epoch on every assignment change, e.g. when another job is placed.
    broker.state.assignments = [start_assignment(command=jobscripts.SLEEPER)]
    agent = make_agent(open_dir, broker, clock)
    agent.step()
    broker.state.epoch = 2
    broker.state.assignments = [start_assignment(command=jobscripts.SLEEPER),
                                start_assignment(id="a2", job_id="j2", epoch=2, gpu_indices=[0])]
    for _ in range(6):
        clock.advance(1)
        agent.step()
    assert states(broker, "a1") == ["running"] and states(broker, "a2")[0] == "running"
    agent.shutdown()


def test_an_older_assignment_first_seen_in_a_newer_list_starts(open_dir, broker, clock):
    broker.state.epoch = 7  # other allocations came and went while this agent was away
    broker.state.assignments = [start_assignment(epoch=3)]
    make_agent(open_dir, broker, clock).step()
    assert states(broker, "a1")[0] == "running"


def test_an_assignment_newer_than_its_list_is_refused(open_dir, broker, clock):
    broker.state.assignments = [start_assignment(epoch=2)]
    make_agent(open_dir, broker, clock).step()
    (refusal,) = broker.statuses_for("a1")
    assert refusal["message"] == "invalid assignment: its epoch 2 is newer than the list's epoch 1"


def test_node_marked_lost_gets_its_jobs_withdrawn_and_stopped(open_dir, broker, clock):
    broker.state.assignments = [start_assignment(command=jobscripts.SLEEPER)]
    agent = make_agent(open_dir, broker, clock)
    agent.step()
    pump(agent, clock, lambda: (open_dir / "state-jobs" / "a1" / "ready").exists(), what="job ready")
    broker.state.epoch, broker.state.lost = 2, True  # released while the node was unreachable
    broker.state.assignments = []
    pump(agent, clock, lambda: "stopped" in states(broker, "a1"), what="fence")
    assert "withdrawn" in broker.statuses_for("a1")[-1]["message"]
    assert broker.statuses_for("a1")[-1]["reason"] == "withdrawn"
    assert agent.broker_says_lost


def test_fractional_jobs_share_a_gpu_up_to_a_whole_one(open_dir, broker, clock):
    half = {"gpu_indices": [2], "gpu_milli": 500, "command": jobscripts.SLEEPER}
    broker.state.assignments = [start_assignment(id=f"a{i}", job_id=f"j{i}", **half) for i in (1, 2, 3)]
    agent = make_agent(open_dir, broker, clock)
    agent.step()
    assert states(broker, "a1") == ["running"] and states(broker, "a2") == ["running"]
    assert broker.statuses_for("a3")[0]["message"] == "GPU 2 is already in use by another assignment on this node"
    agent.shutdown()


def test_a_start_waits_for_the_gpu_its_previous_job_is_leaving(open_dir, broker, clock):
    broker.state.assignments = [start_assignment(command=jobscripts.STUBBORN, gpu_indices=[1])]
    agent = make_agent(open_dir, broker, clock, stop_grace_s=10.0)
    agent.step()
    pump(agent, clock, lambda: (open_dir / "state-jobs" / "a1" / "ready").exists(), what="job ready",
         advance=0.1)
    broker.state.epoch = 3  # a1 released, a2 placed on the same GPU
    broker.state.assignments = [start_assignment(id="a2", job_id="j2", epoch=3, gpu_indices=[1])]
    clock.advance(5)
    agent.step()
    assert states(broker, "a2") == []  # neither started nor refused: GPU 1 is still being freed
    assert agent.runner.running["a1"].stop_reason
    pump(agent, clock, lambda: "running" in states(broker, "a2"), what="a2 start")
    assert states(broker, "a1")[-1] == "stopped"


def test_registering_as_a_new_node_starts_a_new_epoch_space(open_dir, broker, clock):
    broker.state.epoch = 9
    agent = make_agent(open_dir, broker, clock)
    agent.step()
    broker.state.revoked_tokens.add(agent.identity.node_token)  # the node was deleted on the broker
    broker.state.epoch = 1
    broker.state.assignments = [start_assignment(epoch=1)]
    pump(agent, clock, lambda: states(broker, "a1"), what="a1 handled by the new node")
    assert agent.identity.node_id == "n2" and states(broker, "a1")[0] == "running"


def test_withdrawn_assignment_is_stopped(open_dir, broker, clock):
    broker.state.assignments = [start_assignment(command=jobscripts.SLEEPER)]
    agent = make_agent(open_dir, broker, clock)
    agent.step()
    broker.state.assignments = []
    pump(agent, clock, lambda: "stopped" in states(broker, "a1"), what="stop")
    assert "withdrawn" in broker.statuses_for("a1")[-1]["message"]


def test_stop_action_stops_a_running_job_and_an_unstarted_one(open_dir, broker, clock):
    broker.state.assignments = [start_assignment(command=jobscripts.SLEEPER),
                                start_assignment(id="a2", job_id="j2", gpu_indices=[0], action="stop")]
    agent = make_agent(open_dir, broker, clock)
    agent.step()
    assert states(broker, "a2") == ["stopped"]
    broker.state.assignments = [start_assignment(action="stop", command=jobscripts.SLEEPER)]
    pump(agent, clock, lambda: "stopped" in states(broker, "a1"), what="stop")
    assert "stop requested by the broker" in broker.statuses_for("a1")[-1]["message"]


def test_checkpoint_request_is_relayed_to_the_job(open_dir, broker, clock):
    broker.state.assignments = [start_assignment(command=jobscripts.CHECKPOINTABLE)]
    agent = make_agent(open_dir, broker, clock)
    agent.step()
    workdir = open_dir / "state-jobs" / "a1"
    pump(agent, clock, lambda: (workdir / "ready").exists(), what="job ready")
    broker.state.assignments = [start_assignment(command=jobscripts.CHECKPOINTABLE, action="checkpoint",
                                                 checkpoint_request_id="ck-1")]
    pump(agent, clock, lambda: "exited" in states(broker, "a1"), what="checkpoint then exit")
    assert states(broker, "a1") == ["running", "checkpoint_requested", "exited"]
    assert "SIGUSR1 sent" in broker.statuses_for("a1")[1]["message"]
    done = json.loads((workdir / "checkpoint-done.json").read_text())
    assert done["request_id"] == "ck-1" and done["checkpoint_uri"] == "file:///ckpt/j1"


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        ({"gpu_indices": [4]}, "GPU 4 does not exist on this node (4 GPUs)"),
        ({"gpu_uuids": ["GPU-elsewhere", "GPU-other"]}, "GPU numbering changed?"),
        ({"command": []}, "invalid assignment: command must be"),
    ],
)
def test_impossible_assignments_are_refused(open_dir, broker, clock, overrides, fragment):
    broker.state.assignments = [start_assignment(**overrides)]
    agent = make_agent(open_dir, broker, clock)
    agent.step()
    (refusal,) = broker.statuses_for("a1")
    assert refusal["state"] == "refused" and fragment in refusal["message"]


def test_matching_gpu_uuids_are_accepted(open_dir, broker, clock):
    agent = make_agent(open_dir, broker, clock)
    uuids = [agent.backend.inventory().gpus[i].uuid for i in (1, 3)]
    broker.state.assignments = [start_assignment(gpu_uuids=uuids)]
    agent.step()
    assert states(broker, "a1")[0] == "running"


def test_a_gpu_is_never_given_to_two_jobs(open_dir, broker, clock):
    broker.state.assignments = [start_assignment(command=jobscripts.SLEEPER),
                                start_assignment(id="a2", job_id="j2", gpu_indices=[3, 0])]
    agent = make_agent(open_dir, broker, clock)
    agent.step()
    assert states(broker, "a1") == ["running"]
    assert broker.statuses_for("a2")[0]["message"] == "GPU 3 is already in use by another assignment on this node"
    agent.shutdown()


def test_a_failed_gpu_gets_no_new_work(open_dir, broker, clock):
    agent = make_agent(open_dir, broker, clock, spec="4xA100-80GB-SXM,xid=1:48")
    broker.state.assignments = [start_assignment()]
    agent.step()
    (refusal,) = broker.statuses_for("a1")
    assert refusal["state"] == "refused" and refusal["message"].startswith("GPU 1 is FAILED: ")
    assert refusal["reason"] == "gpu_failed"


def test_a_status_the_broker_rejects_is_dropped_and_the_rest_still_go(open_dir, broker, clock):
    broker.state.reject_status_for = {"a1"}
    broker.state.assignments = [start_assignment(command=["/no/such/program"]),
                                start_assignment(id="a2", job_id="j2", gpu_indices=[0])]
    agent = make_agent(open_dir, broker, clock)
    agent.step()
    assert states(broker, "a1") == [] and states(broker, "a2") == ["running"]
    assert all(r["assignment_id"] != "a1" for r in agent.state.outbox)


def test_missing_program_is_reported_failed(open_dir, broker, clock):
    broker.state.assignments = [start_assignment(command=["/no/such/program"])]
    make_agent(open_dir, broker, clock).step()
    (failure,) = broker.statuses_for("a1")
    assert failure["state"] == "failed" and "cannot start '/no/such/program'" in failure["message"]


# -- stopping and crashing ----------------------------------------------------------------------
def test_shutdown_stops_jobs_and_reports_them(open_dir, broker, clock):
    broker.state.assignments = [start_assignment(command=jobscripts.SLEEPER)]
    agent = make_agent(open_dir, broker, clock)
    agent.step()
    pid = agent.runner.running["a1"].pid
    agent.request_stop()
    agent.shutdown()
    assert states(broker, "a1") == ["running", "stopped"]
    assert broker.statuses_for("a1")[-1]["reason"] == "agent_shutdown"
    assert process_start_ticks(pid) is None  # the process is gone


def test_orphans_of_a_crashed_agent_are_stopped_and_reported(open_dir, broker, clock):
    orphan = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        store = StateStore(open_dir / "state")
        state = store.load_state()
        state.jobs["a9"] = JobRecord("a9", "j9", 1, "running", pid=orphan.pid,
                                     pid_start_ticks=process_start_ticks(orphan.pid), gpu_indices=[0])
        store.save_state(state)
        agent = make_agent(open_dir, broker, clock)
        agent.step()
        assert orphan.wait(timeout=10) != 0
        (report,) = broker.statuses_for("a9")
        assert report["state"] == "failed" and "its process was stopped" in report["message"]
        assert report["reason"] == "agent_crashed"
    finally:
        orphan.kill()
        orphan.wait()


def test_a_reused_pid_is_not_killed(open_dir, broker, clock):
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        store = StateStore(open_dir / "state")
        state = store.load_state()
        state.jobs["a9"] = JobRecord("a9", "j9", 1, "running", pid=bystander.pid, pid_start_ticks=1, gpu_indices=[0])
        store.save_state(state)
        make_agent(open_dir, broker, clock).step()
        assert bystander.poll() is None
        assert "already gone" in broker.statuses_for("a9")[0]["message"]
    finally:
        bystander.kill()
        bystander.wait()
