"""Issue 8 item 6: a broker outage marks no live node LOST, and a requeued job never runs twice.

Unit tests of the lost-node sweep across outage gaps (sweeps are called with explicit times, as the
beat would call them) and of the start gating in the agents' assignment list. The fault test with
real processes is tests/broker/test_outage_processes.py.
"""
from __future__ import annotations

import socket
from datetime import datetime, timedelta

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from broker.agents.fencing import fence_wait_seconds
from broker.agents.services import lost_after_seconds, nodes_mark_lost
from broker.inventory.models import Node, NodeState
from broker.jobs.models import Allocation, Job
from broker.jobs.services import GpuRequest, allocation_commit, job_requeue
from broker.jobs.states import JobState
from broker.scheduler.outage import agent_retry_cap_seconds

from .test_agent_api import API, agent_client, join_token, place, register_body, registered, report  # noqa: F401 (fixtures)

SWEEP_S = 10  # the beat's period for agents.mark_lost


@pytest.fixture
def web_up(settings):
    settings.WHALEZEN_BROKER_PROBE_URL = ""  # these tests are about the worker side: no probe


def register(join_token: str, name: str, key: str) -> tuple[Node, str]:
    resp = APIClient().post(f"{API}/register", register_body(join_token, name=name, agent_key=key), format="json")
    assert resp.status_code == 201, resp.content
    return Node.objects.get(pk=resp.json()["node_id"]), resp.json()["node_token"]


def heartbeat(token: str, running: tuple[Allocation, ...] = ()) -> None:
    """A heartbeat as the agent sends it, listing the processes it runs."""
    processes = [{"assignment_id": str(a.pk), "job_id": str(a.job_id), "epoch": a.epoch, "pid": 4242,
                  "gpu_indices": [1, 3], "state": "running"} for a in running]
    resp = agent_client(token).post(f"{API}/heartbeat", {"telemetry": [], "processes": processes}, format="json")
    assert resp.status_code == 200, resp.content


def sweep_through(start: datetime, end: datetime) -> list[Node]:
    """Run the sweep every SWEEP_S seconds of simulated time from `start` to `end`; everything marked."""
    lost, t = [], start
    while t <= end:
        lost += nodes_mark_lost(now=t)
        t += timedelta(seconds=SWEEP_S)
    return lost


def backdate_heartbeat(node: Node, at: datetime) -> None:
    Node.objects.filter(pk=node.pk).update(last_heartbeat_at=at)


def starts(token: str) -> list[str]:
    body = agent_client(token).get(f"{API}/assignments").json()
    return [a["job_id"] for a in body["assignments"] if a["action"] == "start"]


# -- the sweep across outages ---------------------------------------------------------------------
def test_after_a_worker_outage_a_node_gets_a_full_period_from_the_brokers_return(acme, registered, web_up):
    node, token = registered
    job, allocation = place(acme, node)
    report(token, allocation, "running", reason="started")
    t0 = timezone.now()
    assert sweep_through(t0, t0 + timedelta(seconds=20)) == []
    # Broker down 120 s (no sweep ran); the agent kept running but could not heartbeat.
    back = t0 + timedelta(seconds=140)
    grace = lost_after_seconds() + agent_retry_cap_seconds()
    assert sweep_through(back, back + timedelta(seconds=grace - 1)) == []
    node.refresh_from_db()
    job.refresh_from_db()
    assert node.state == NodeState.ONLINE and job.state == JobState.RUNNING
    # Still silent a full period (plus the agents' retry cap) after the return: now it is LOST.
    (lost,) = sweep_through(back + timedelta(seconds=grace + 1), back + timedelta(seconds=grace + SWEEP_S))
    assert lost.pk == node.pk
    job.refresh_from_db()
    assert job.state == JobState.PENDING and "confirmed stopped" in job.pending_reason


def test_a_ten_minute_outage_restarts_no_job(acme, registered, web_up):
    node, token = registered
    job, allocation = place(acme, node)
    report(token, allocation, "running", reason="started")
    t0 = timezone.now()
    sweep_through(t0, t0 + timedelta(seconds=10))
    back = t0 + timedelta(seconds=610)
    backdate_heartbeat(node, t0)
    assert sweep_through(back, back + timedelta(seconds=50)) == []
    # The agent's backoff (at most its retry cap) brings it back: from then on it heartbeats.
    t = back + timedelta(seconds=55)
    while t < back + timedelta(seconds=300):
        backdate_heartbeat(node, t - timedelta(seconds=5))
        assert nodes_mark_lost(now=t) == []
        t += timedelta(seconds=SWEEP_S)
    job.refresh_from_db()
    assert job.state == JobState.RUNNING
    assert list(job.allocations.values_list("pk", "active")) == [(allocation.pk, True)]


def test_a_node_silent_while_the_broker_was_up_is_still_marked_lost(acme, registered, web_up):
    node, token = registered
    t0 = timezone.now()
    assert sweep_through(t0, t0 + timedelta(seconds=lost_after_seconds() - 1)) == []
    lost = sweep_through(t0 + timedelta(seconds=lost_after_seconds()), t0 + timedelta(seconds=lost_after_seconds() + 20))
    assert [n.pk for n in lost] == [node.pk]


def closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/healthz"  # nothing listens there once the socket is closed


def test_web_server_down_while_the_worker_sweeps_blames_no_node(acme, registered, settings, live_server):
    node, token = registered
    job, allocation = place(acme, node)
    report(token, allocation, "running", reason="started")
    t0 = timezone.now()
    settings.WHALEZEN_BROKER_PROBE_URL = closed_port_url()  # the agents' way in does not answer
    assert sweep_through(t0 + timedelta(seconds=SWEEP_S), t0 + timedelta(seconds=300)) == []
    node.refresh_from_db()
    assert node.state == NodeState.ONLINE
    # The web server answers again (any status counts); the agent is still silent: a full
    # period plus the retry cap after the last time it was seen down, the node is LOST.
    settings.WHALEZEN_BROKER_PROBE_URL = f"{live_server.url}/healthz"
    grace = lost_after_seconds() + agent_retry_cap_seconds()
    assert sweep_through(t0 + timedelta(seconds=310), t0 + timedelta(seconds=300 + grace - 1)) == []
    lost = sweep_through(t0 + timedelta(seconds=300 + grace + 1), t0 + timedelta(seconds=300 + grace + SWEEP_S))
    assert [n.pk for n in lost] == [node.pk]


def test_one_silent_node_among_live_ones_needs_no_probe(acme, join_token, settings):
    settings.WHALEZEN_BROKER_PROBE_URL = closed_port_url()  # would say "down" if it were asked
    quiet, _ = register(join_token, "quiet", "key-quiet-000")
    _, live_token = register(join_token, "live", "key-live-0000")
    t0 = timezone.now()
    backdate_heartbeat(quiet, t0 - timedelta(seconds=lost_after_seconds() + 5))
    heartbeat(live_token)
    assert [n.pk for n in nodes_mark_lost(now=t0)] == [quiet.pk]


# -- start gating --------------------------------------------------------------------------------
@pytest.fixture
def lost_job(acme, join_token, web_up):
    """A job that ran on node `old` (now LOST) and is placed again on node `new`, not yet started."""
    old, old_token = register(join_token, "old", "key-old-00000")
    new, new_token = register(join_token, "new", "key-new-00000")
    job, allocation = place(acme, old)
    report(old_token, allocation, "running", reason="started")
    t0 = timezone.now()
    backdate_heartbeat(old, t0 - timedelta(seconds=lost_after_seconds() + 5))
    assert [n.pk for n in nodes_mark_lost(now=t0)] == [old.pk]
    job.refresh_from_db()
    assert job.state == JobState.PENDING
    old_allocation = Allocation.objects.get(pk=allocation.pk)
    assert not old_allocation.active and old_allocation.stop_unconfirmed
    allocation_commit(job=job, requests=[GpuRequest(node=new, gpu_indices=(0,))])
    return job, (old, old_token, old_allocation), (new, new_token)


def test_a_requeued_job_does_not_start_while_its_old_copy_may_run(lost_job):
    job, _, (_, new_token) = lost_job
    assert starts(new_token) == []
    job.refresh_from_db()
    assert job.state == JobState.PLACED  # placed (GPUs reserved), only the start waits


def test_the_old_agent_reporting_the_stop_releases_the_start(lost_job):
    job, (_, old_token, old_allocation), (_, new_token) = lost_job
    # The old agent comes back: ONLINE again, its list no longer has the job, it stops it and says so.
    heartbeat(old_token, (old_allocation,))
    assert starts(new_token) == []  # it still runs there
    assert agent_client(old_token).get(f"{API}/assignments").json()["assignments"] == []
    assert report(old_token, old_allocation, "stopped", reason="withdrawn").status_code == 200
    assert starts(new_token) == [str(job.pk)]


def test_a_heartbeat_without_the_old_process_releases_the_start(lost_job):
    job, (_, old_token, _), (_, new_token) = lost_job
    heartbeat(old_token)
    assert starts(new_token) == [str(job.pk)]


def test_the_old_node_registering_again_releases_the_start(lost_job, join_token):
    job, _, (_, new_token) = lost_job
    # A restarted agent kills what its predecessor left before it registers.
    resp = APIClient().post(f"{API}/register", register_body(join_token, name="old", agent_key="key-old-00000"),
                            format="json")
    assert resp.status_code == 200
    assert starts(new_token) == [str(job.pk)]


def test_the_wait_for_an_old_copy_is_bounded(lost_job):
    job, (_, _, old_allocation), (_, new_token) = lost_job
    assert fence_wait_seconds() == 2 * lost_after_seconds()
    Allocation.objects.filter(pk=old_allocation.pk).update(
        released_at=timezone.now() - timedelta(seconds=fence_wait_seconds() + 1))
    assert starts(new_token) == [str(job.pk)]


def test_an_ordinary_requeue_does_not_hold_the_next_start(acme, join_token, web_up):
    first, first_token = register(join_token, "first", "key-first-000")
    second, second_token = register(join_token, "second", "key-second-00")
    job, allocation = place(acme, first)
    report(first_token, allocation, "running", reason="started")
    job.refresh_from_db()
    assert job_requeue(job=job, reason_code="PREEMPTED", message="for a bigger job")
    assert not Allocation.objects.get(pk=allocation.pk).stop_unconfirmed
    job.refresh_from_db()
    allocation_commit(job=job, requests=[GpuRequest(node=second, gpu_indices=(0,))])
    assert starts(second_token) == [str(job.pk)]


def test_after_a_start_timeout_the_next_start_waits_for_the_first_nodes_word(acme, join_token, web_up, settings):
    from broker.scheduler.timeouts import stalled_starts_requeue

    slow, slow_token = register(join_token, "slow", "key-slow-0000")
    other, other_token = register(join_token, "other", "key-other-000")
    job, allocation = place(acme, slow)
    Job.objects.filter(pk=job.pk).update(
        updated_at=timezone.now() - timedelta(seconds=settings.WHALEZEN_START_TIMEOUT_SECONDS + 1))
    assert stalled_starts_requeue() == [job.pk]
    job.refresh_from_db()
    allocation_commit(job=job, requests=[GpuRequest(node=other, gpu_indices=(0,))])
    assert starts(other_token) == []
    heartbeat(slow_token)  # the slow node says what it runs: not this job
    assert starts(other_token) == [str(job.pk)]
