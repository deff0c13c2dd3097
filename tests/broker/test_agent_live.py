"""The real node agent against a live broker (pytest-django `live_server`), over real HTTP.

In-process tests drive the agent loop step by step with a fake clock; the test thread touches the
database only between steps, never while the agent waits for an answer. The last test runs the
agent as a separate process, the way `make run` and the local provider do.
"""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
from django.utils import timezone

from agent.backends.fake import FakeBackend
from agent.isolation import default_work_dir
from agent.loop import Agent, AgentConfig, RegistrationRefused
from broker.agents.services import lost_after_seconds, nodes_mark_lost
from broker.inventory.models import Gpu, GpuHealth, Node, NodeState
from broker.inventory.services import pool_join_token_issue
from broker.jobs.models import Allocation
from broker.jobs.services import GpuRequest, allocation_commit
from broker.jobs.states import JobState
from tests.agent import jobscripts
from tests.agent.clock import FakeClock

from .test_api_tenancy import submit

REPO = Path(__file__).resolve().parents[2]


def make_agent(url: str, join_token: str, tmp_path: Path, clock: FakeClock, *, name: str = "live-node",
               spec: str = "8xH100-80GB-SXM,nvlink=2x4", **config_extra) -> Agent:
    config = AgentConfig(server_url=url, join_token=join_token, name=name, state_dir=tmp_path / name,
                         stop_grace_s=2.0, http_timeout_s=10.0, **config_extra)
    backend = FakeBackend(spec, clock=clock, hostname=name)
    return Agent(config, backend, clock=clock, rng=random.Random(1), base_env={"PATH": os.environ["PATH"]})


def pump(agent: Agent, clock: FakeClock, until, *, what: str, limit_s: float = 30.0):
    """Step the agent (moving its clock 1 s a step) until `until()` holds; the real-time limit only
    stops a broken test from hanging."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        agent.step()
        value = until()
        if value:
            return value
        clock.advance(1.0)
        time.sleep(0.02)
    raise AssertionError(f"gave up waiting for {what}")


def job_state(job) -> str:
    job.refresh_from_db()
    return job.state


@pytest.fixture
def join_token(acme) -> str:
    return pool_join_token_issue(pool=acme.pool)


def test_agent_registers_heartbeats_and_runs_a_job_with_its_gpus(live_server, acme, join_token, tmp_path):
    clock = FakeClock()
    agent = make_agent(live_server.url, join_token, tmp_path, clock)
    agent.step()

    node = Node.objects.get(pool=acme.pool, name="live-node")
    assert str(node.pk) == agent.identity.node_id and node.state == NodeState.ONLINE
    gpus = list(node.gpus.order_by("index"))
    # NVLink islands and NUMA nodes as the agent measured them.
    assert [g.nvlink_island for g in gpus] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [g.numa_node for g in gpus] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert {g.model.name for g in gpus} == {"H100-80GB"}
    # Telemetry stored per GPU by the first heartbeat.
    for gpu in gpus:
        assert gpu.utilization_pct is not None and gpu.temperature_c is not None and gpu.power_w is not None
        assert gpu.memory_used_mb is not None and gpu.last_seen_at is not None and gpu.health == GpuHealth.HEALTHY
    assert node.last_heartbeat_at is not None

    job = submit(acme, name="envdump", command=jobscripts.WRITE_ENV, resources={"gpus": 2},
                 env={"LR": "0.1"}, checkpoint={"uri": "s3://ckpt-bucket/envdump"})
    (allocation,) = allocation_commit(job=job, requests=[GpuRequest(node=node, gpu_indices=(5, 7))])
    clock.advance(5)  # the next heartbeat pulls the assignment
    pump(agent, clock, lambda: job_state(job) == JobState.SUCCEEDED, what="job to succeed")

    env = json.loads((agent.runner.jobs_dir / str(allocation.pk) / "env.json").read_text())
    assert env["CUDA_VISIBLE_DEVICES"] == "5,7"
    assert env["WHALEZEN_JOB_ID"] == str(job.pk) and env["WHALEZEN_CHECKPOINT_URI"] == "s3://ckpt-bucket/envdump"
    assert env["LR"] == "0.1" and env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert not Allocation.objects.get(pk=allocation.pk).active
    kinds = list(job.events.filter(kind="agent").values_list("reason_code", flat=True))
    assert kinds == ["AGENT_RUNNING", "AGENT_EXITED"]


def test_telemetry_follows_a_failing_gpu(live_server, acme, join_token, tmp_path):
    clock = FakeClock()
    agent = make_agent(live_server.url, join_token, tmp_path, clock, spec="4xA100-80GB-SXM")
    agent.step()
    agent.backend.inject_xid(2, 48)
    clock.advance(5)
    agent.step()
    gpu = Gpu.objects.get(node__name="live-node", index=2)
    assert gpu.health == GpuHealth.FAILED and gpu.ecc_errors == 1
    assert Gpu.objects.get(node__name="live-node", index=1).health == GpuHealth.HEALTHY


def test_node_is_marked_lost_after_missed_heartbeats_and_its_job_fenced(live_server, acme, join_token, tmp_path,
                                                                         settings):
    settings.WHALEZEN_BROKER_PROBE_URL = f"{live_server.url}/healthz"  # the web server is up; the agent is not
    clock = FakeClock()
    agent = make_agent(live_server.url, join_token, tmp_path, clock, spec="2xA100-80GB-SXM")
    agent.step()
    node = Node.objects.get(name="live-node")
    job = submit(acme, name="sleeper", command=jobscripts.SLEEPER, resources={"gpus": 1})
    (allocation,) = allocation_commit(job=job, requests=[GpuRequest(node=node, gpu_indices=(1,))])
    clock.advance(5)
    pump(agent, clock, lambda: job_state(job) == JobState.RUNNING, what="job to run")
    pid = agent.runner.running[str(allocation.pk)].pid

    # The agent goes quiet (partitioned); the sweep runs after the limit, counted from the last
    # heartbeat the broker recorded (not from now: a loaded machine may be seconds past it).
    node.refresh_from_db()
    heard_at = node.last_heartbeat_at
    assert nodes_mark_lost(now=heard_at + timedelta(seconds=lost_after_seconds() - 1)) == []
    (lost,) = nodes_mark_lost(now=heard_at + timedelta(seconds=lost_after_seconds() + 1))
    assert lost.pk == node.pk and lost.state == NodeState.LOST
    assert job_state(job) == JobState.PENDING and job.pending_reason_code == "NODE_LOST"

    # The node comes back: ONLINE again, and the job it can no longer own is stopped.
    pump(agent, clock, lambda: not agent.runner.running, what="fenced job to stop")
    assert agent.broker_says_lost
    node.refresh_from_db()
    assert node.state == NodeState.ONLINE
    pump(agent, clock, lambda: not agent.state.outbox, what="stop report delivered")
    assert allocation.agent_report.state == "stopped" and allocation.agent_report.reason == "withdrawn"
    assert job_state(job) == JobState.PENDING  # the report about the old allocation moved nothing
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_a_reused_instance_token_gets_no_real_agent_back_in(live_server, acme, gpu_models, tmp_path, settings):
    """Issue 8's attack with real agents: the instance's agent goes silent (SIGKILLed), its node is
    marked LOST; a new agent with the stolen one-time token, and the old agent coming back, are
    both refused for good."""
    from .test_agent_api import cloud_instance

    settings.WHALEZEN_BROKER_PROBE_URL = f"{live_server.url}/healthz"  # the web server is up; the agent is not
    instance, token = cloud_instance(acme)
    clock = FakeClock()
    victim = make_agent(live_server.url, token, tmp_path, clock, name="victim", spec="2xA100-80GB-SXM")
    victim.step()
    node = Node.objects.get(pk=victim.identity.node_id)
    assert node.name == instance.node_name and node.state == NodeState.ONLINE
    (lost,) = nodes_mark_lost(now=timezone.now() + timedelta(seconds=lost_after_seconds() + 1))
    assert lost.pk == node.pk

    attacker = make_agent(live_server.url, token, tmp_path, FakeClock(), name="attacker", spec="2xA100-80GB-SXM")
    with pytest.raises(RegistrationRefused, match="HTTP 401"):
        attacker.step()
    # The old agent's next heartbeat is refused; it tries its join token, which is spent: it gives up.
    clock.advance(5)
    with pytest.raises(RegistrationRefused, match="HTTP 401"):
        pump(victim, clock, lambda: False, what="the old agent to give up")
    node.refresh_from_db()
    assert node.state == NodeState.LOST and node.token_hash == ""
    assert Node.objects.filter(pool=instance.pool).count() == 1


def test_bad_join_token_is_refused(live_server, acme, join_token, tmp_path):
    agent = make_agent(live_server.url, "wzj_00000000_not-the-token", tmp_path, FakeClock())
    with pytest.raises(RegistrationRefused, match="HTTP 401: Invalid join token"):
        agent.step()
    assert not Node.objects.filter(name="live-node").exists()


def test_agent_process_takes_over_a_seeded_node_and_runs_its_job(live_server, acme, join_token, tmp_path):
    node = acme.nodes[0]  # seeded simulated node (8xA100-80GB), as `make run` creates them
    job = submit(acme, name="envdump", command=jobscripts.WRITE_ENV, resources={"gpus": 1})
    (allocation,) = allocation_commit(job=job, requests=[GpuRequest(node=node, gpu_indices=(6,))])
    state_dir = tmp_path / "agent"
    proc = subprocess.Popen(
        [sys.executable, "-m", "agent", "--server", live_server.url, "--fake-gpus", "8xA100-80GB-SXM",
         "--name", node.name, "--state-dir", str(state_dir)],
        cwd=REPO, env={**os.environ, "WHALEZEN_JOIN_TOKEN": join_token},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # Wait on the agent's own files, not the database (the server threads use it meanwhile).
        def delivered() -> bool:
            try:
                state = json.loads((state_dir / "state.json").read_text())
            except (OSError, ValueError):
                return False
            record = state["jobs"].get(str(allocation.pk), {})
            return record.get("state") == "exited" and not state["outbox"]

        deadline = time.monotonic() + 60
        while not delivered():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "gave up waiting for the job's exit to be delivered"
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0 and "Traceback" not in err
    assert job_state(job) == JobState.SUCCEEDED
    # Job work dirs live beside the agent's state dir, never inside it (agent/isolation.py).
    env = json.loads((default_work_dir(state_dir) / str(allocation.pk) / "env.json").read_text())
    assert env["CUDA_VISIBLE_DEVICES"] == "6"
    node.refresh_from_db()
    assert "simulated" not in node.labels and node.last_heartbeat_at is not None
    assert all(g.last_seen_at is not None for g in node.gpus.all())
