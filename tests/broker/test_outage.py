"""Issue 8 item 6: a broker outage marks no live node LOST, and a requeued job never runs twice.

Unit tests of the lost-node sweep across outage gaps (sweeps are called with explicit times, as the
beat would call them) and of the start gating in the agents' assignment list. The fault test with
real processes is tests/broker/test_outage_processes.py.
"""
from __future__ import annotations

import socket
from datetime import datetime, timedelta

import pytest
from django.db.models import F
from django.utils import timezone
from rest_framework.test import APIClient

from broker.agents.fencing import fence_wait_seconds
from broker.agents.models import NodeAgent
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


def time_passes(allocation: Allocation, seconds: float) -> None:
    """As if `seconds` had passed since the old copy's release: its release, its node's last
    heartbeat and its agent's registration all move back (the order of events stays the same)."""
    delta = timedelta(seconds=seconds)
    Allocation.objects.filter(pk=allocation.pk).update(released_at=F("released_at") - delta)
    Node.objects.filter(pk=allocation.node_id).update(last_heartbeat_at=F("last_heartbeat_at") - delta)
    NodeAgent.objects.filter(node_id=allocation.node_id).update(registered_at=F("registered_at") - delta)


def test_the_wait_for_an_old_copy_is_bounded(lost_job):
    job, (_, _, old_allocation), (_, new_token) = lost_job
    time_passes(old_allocation, fence_wait_seconds() - 5)
    assert starts(new_token) == []  # nearly there: the old agent may not have fenced itself yet
    time_passes(old_allocation, 6)
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


# -- the wait covers agents that fenced themselves -----------------------------------------------
@pytest.fixture
def default_limits(settings):
    settings.WHALEZEN_AGENT_HEARTBEAT_SECONDS = 5
    settings.WHALEZEN_NODE_LOST_AFTER_SECONDS = 30
    settings.WHALEZEN_AGENT_FENCE_AFTER_SECONDS = 900
    settings.WHALEZEN_FENCE_WAIT_SECONDS = None  # not set: derived
    return settings


def test_the_default_wait_outlasts_the_agents_self_fence(default_limits):
    from agent.selffence import DEFAULT_FENCE_AFTER_S

    # The broker's default for the agents' fence-after is the agents' own default.
    assert default_limits.WHALEZEN_AGENT_FENCE_AFTER_SECONDS == DEFAULT_FENCE_AFTER_S
    assert fence_wait_seconds() == 900 + 30 + 2 * 5
    # A 10-minute broker outage (plus the agents' backoff cap) is shorter than the agents' fence-after.
    assert 600 + agent_retry_cap_seconds() < DEFAULT_FENCE_AFTER_S
    # It follows the other settings, and an explicit value wins.
    default_limits.WHALEZEN_AGENT_FENCE_AFTER_SECONDS = 300
    default_limits.WHALEZEN_NODE_LOST_AFTER_SECONDS = 60
    assert fence_wait_seconds() == 300 + 60 + 10
    default_limits.WHALEZEN_FENCE_WAIT_SECONDS = 45
    assert fence_wait_seconds() == 45
    # Agents that never fence themselves: no wait would be safe; the bound is two LOST periods.
    default_limits.WHALEZEN_FENCE_WAIT_SECONDS = None
    default_limits.WHALEZEN_AGENT_FENCE_AFTER_SECONDS = 0
    assert fence_wait_seconds() == 2 * 60


def test_a_node_lost_for_a_partition_starts_the_job_elsewhere_only_after_the_agent_fenced(lost_job, default_limits):
    """The old agent is cut off: it stops its copy 900 s after its last heartbeat got through (agent/
    selffence.py). The new copy may start no sooner than that, plus the stop grace."""
    job, (old, _, old_allocation), (_, new_token) = lost_job
    old.refresh_from_db()
    old_allocation.refresh_from_db()
    fenced_by = old.last_heartbeat_at + timedelta(seconds=default_limits.WHALEZEN_AGENT_FENCE_AFTER_SECONDS + 10)
    start_at = old_allocation.released_at + timedelta(seconds=fence_wait_seconds())
    assert start_at > fenced_by
    assert "(at most 940 s)" in job.events.filter(reason_code="NODE_LOST").get().message
    time_passes(old_allocation, (fenced_by - old_allocation.released_at).total_seconds())
    assert starts(new_token) == []  # the agent has fenced itself by now, at the latest: still held
    time_passes(old_allocation, (start_at - fenced_by).total_seconds())
    assert starts(new_token) == [str(job.pk)]


# -- a cloud instance's node the broker gives up on ----------------------------------------------
@pytest.fixture
def given_up_job(acme, join_token, gpu_models, web_up):
    """A job that ran on a cloud instance's node, which the broker then gave up on (the instance is
    being terminated); the job is placed again on an on-prem node."""
    from broker.provisioning.services import instance_terminate

    from .test_agent_api import cloud_instance

    instance, token = cloud_instance(acme)
    resp = APIClient().post(f"{API}/register", register_body(token), format="json")
    node_token = resp.json()["node_token"]
    job, allocation = place(acme, Node.objects.get(pk=resp.json()["node_id"]), indices=(0,))
    report(node_token, allocation, "running", reason="started")
    instance.refresh_from_db()
    instance_terminate(instance=instance, reason="consolidation")  # no provider id: stays TERMINATING
    job.refresh_from_db()
    assert job.state == JobState.PENDING and "the provider confirms the instance terminated" in job.pending_reason
    assert Allocation.objects.get(pk=allocation.pk).stop_unconfirmed
    other, other_token = register(join_token, "other", "key-other-000")
    allocation_commit(job=job, requests=[GpuRequest(node=other, gpu_indices=(0,))])
    return job, instance, Allocation.objects.get(pk=allocation.pk), other_token


def test_a_given_up_instance_still_running_holds_the_next_start(given_up_job):
    from broker.inventory.models import CloudInstance

    job, instance, _, other_token = given_up_job
    assert CloudInstance.objects.get(pk=instance.pk).state == "TERMINATING"
    assert starts(other_token) == []
    job.refresh_from_db()
    assert job.state == JobState.PLACED


def test_the_provider_confirming_termination_releases_the_start_at_once(given_up_job):
    from broker.inventory.models import CloudInstance, InstanceState

    job, instance, _, other_token = given_up_job
    CloudInstance.objects.filter(pk=instance.pk).update(state=InstanceState.TERMINATED)  # the reconciler saw it gone
    assert starts(other_token) == [str(job.pk)]


def test_a_given_up_instance_that_never_confirms_holds_the_start_only_for_the_wait(given_up_job):
    job, _, old_allocation, other_token = given_up_job
    time_passes(old_allocation, fence_wait_seconds() - 5)
    assert starts(other_token) == []
    time_passes(old_allocation, 6)
    assert starts(other_token) == [str(job.pk)]


# -- a person confirms a LOST node is powered off ------------------------------------------------
def test_an_operator_confirming_a_lost_node_off_starts_its_jobs_elsewhere_at_once(lost_job):
    from django.contrib.auth import get_user_model

    from broker.agents.services import node_confirm_powered_off

    job, (old, _, _), (_, new_token) = lost_job
    operator = get_user_model().objects.create_superuser("ops", "ops@example.com", "x" * 16)
    assert node_confirm_powered_off(node=old, by=operator) == [job.pk]
    assert starts(new_token) == [str(job.pk)]
    event = job.events.get(reason_code="NODE_CONFIRMED_OFF")
    assert "ops confirmed that node old is powered off" in event.message


def test_a_tenant_admin_may_confirm_a_member_may_not(lost_job, acme):
    from broker.agents.services import ConfirmForbidden, node_confirm_powered_off

    job, (old, _, _), (_, new_token) = lost_job
    for user in (acme.member, acme.viewer):
        with pytest.raises(ConfirmForbidden) as refused:
            node_confirm_powered_off(node=old, by=user)
        assert refused.value.status == 403
    assert starts(new_token) == [] and not job.events.filter(reason_code="NODE_CONFIRMED_OFF").exists()
    assert node_confirm_powered_off(node=old, by=acme.admin) == [job.pk]
    assert starts(new_token) == [str(job.pk)]


def test_an_admin_of_another_tenant_may_not_confirm(lost_job, globex):
    from broker.agents.services import ConfirmForbidden, node_confirm_powered_off

    _, (old, _, _), (_, new_token) = lost_job
    with pytest.raises(ConfirmForbidden):
        node_confirm_powered_off(node=old, by=globex.admin)
    assert starts(new_token) == []


def test_a_node_the_broker_hears_from_cannot_be_confirmed_off(lost_job, acme):
    from broker.agents.services import ConfirmRefused, node_confirm_powered_off

    _, (old, old_token, _), (_, new_token) = lost_job
    heartbeat(old_token, (Allocation.objects.get(node=old),))  # back ONLINE, still running the old copy
    old.refresh_from_db()
    with pytest.raises(ConfirmRefused) as refused:
        node_confirm_powered_off(node=old, by=acme.admin)
    assert refused.value.status == 409 and "is ONLINE" in str(refused.value)
    assert starts(new_token) == []


def test_the_admin_action_confirms_a_lost_node_powered_off(lost_job, acme, client):
    from django.contrib.auth import get_user_model
    from django.urls import reverse

    job, (old, _, _), (new, new_token) = lost_job
    client.force_login(get_user_model().objects.create_superuser("root", "root@example.com", "x" * 16))
    url = reverse("admin:inventory_node_changelist")
    resp = client.post(url, {"action": "confirm_powered_off", "_selected_action": [new.pk]}, follow=True)
    assert [str(m) for m in resp.context["messages"]] == [
        "Node new is ONLINE: its agent reports what it runs. Only a LOST or OFFLINE node can be confirmed "
        "powered off."]
    assert starts(new_token) == []
    resp = client.post(url, {"action": "confirm_powered_off", "_selected_action": [old.pk]}, follow=True)
    assert resp.status_code == 200
    assert [str(m) for m in resp.context["messages"]] == ["Node old confirmed powered off: 1 job(s) no longer wait for it."]
    assert starts(new_token) == [str(job.pk)]


def test_a_lost_cloud_nodes_instance_is_retired_at_once_which_releases_the_start(acme, join_token, gpu_models, web_up):
    """An instance whose agent went silent is given up for good: it is terminated at the next
    provisioning sweep, not kept warm for the idle period, and the provider's confirmation lets its
    job start elsewhere without the fence wait."""
    from broker.inventory.models import CloudInstance, InstanceState
    from broker.provisioning.services import idle_instances

    from .test_agent_api import cloud_instance

    instance, token = cloud_instance(acme, state="RUNNING")
    resp = APIClient().post(f"{API}/register", register_body(token), format="json")
    node = Node.objects.get(pk=resp.json()["node_id"])
    job, allocation = place(acme, node, indices=(0,))
    report(resp.json()["node_token"], allocation, "running", reason="started")
    assert idle_instances(idle_seconds=600) == []
    backdate_heartbeat(node, timezone.now() - timedelta(seconds=lost_after_seconds() + 5))
    assert [n.pk for n in nodes_mark_lost()] == [node.pk]
    # Launched seconds ago and its job released just now, yet retired at once.
    assert [i.pk for i in idle_instances(idle_seconds=600)] == [instance.pk]
    other, other_token = register(join_token, "other", "key-other-000")
    job.refresh_from_db()
    allocation_commit(job=job, requests=[GpuRequest(node=other, gpu_indices=(0,))])
    assert starts(other_token) == []
    CloudInstance.objects.filter(pk=instance.pk).update(state=InstanceState.TERMINATED)  # the provider confirms
    assert starts(other_token) == [str(job.pk)]
