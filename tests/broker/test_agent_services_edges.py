"""What a heartbeat records, what retiring a node and confirming it powered off change (issue 9).

Checked as an operator sees it: the node and GPU records (and the node API), the job's state and
pending reason, its events, and which allocations still hold a job's next start.
"""
from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from broker.agents.fencing import fence_wait_seconds
from broker.agents.models import NodeAgent
from broker.agents.services import (ConfirmForbidden, agent_heartbeat, lost_after_seconds,
                                    node_confirm_powered_off, node_give_up, nodes_mark_lost)
from broker.inventory.models import Gpu, Node, NodeState
from broker.inventory.services import node_create_simulated, pool_join_token_issue
from broker.jobs.models import Allocation, JobEvent
from broker.jobs.services import GpuRequest, allocation_commit, job_requeue, jobs_requeue_on_node
from broker.jobs.states import JobState
from broker.ops.models import PeriodicRun
from broker.scheduler import outage

from .test_agent_api import API, agent_client, cloud_instance, reading, register_body
from .test_api_tenancy import submit


def _register(join_token: str, name: str) -> tuple[Node, str]:
    body = register_body(join_token, name=name, agent_key=f"key-{name}-xx")
    resp = APIClient().post(f"{API}/register", body, format="json")
    assert resp.status_code == 201, resp.content
    return Node.objects.get(pk=resp.json()["node_id"]), resp.json()["node_token"]


@pytest.fixture
def join_token(acme) -> str:
    return pool_join_token_issue(pool=acme.pool)


# -- heartbeats ----------------------------------------------------------------------------------
def test_a_heartbeat_records_version_mig_mode_ecc_and_the_agents_error(acme, join_token):
    node, token = _register(join_token, "hb-node")
    Gpu.objects.filter(node=node, index__in=[1, 2]).update(mig_mode=True)
    NodeAgent.objects.filter(node=node).update(missed_heartbeats=4)
    telemetry = [
        reading(9),  # not a GPU of this node, and first: the readings after it still count
        reading(0, mig_mode="enabled", ecc_uncorrected=None),  # NVML could not read the ECC counter
        reading(1, mig_mode="disabled"),
        reading(2, mig_mode="unsupported"),  # says nothing about the mode: it stays as it was
        reading(3),
    ]
    del telemetry[4]["mig_mode"]
    body = {"agent_version": "9.9.9", "telemetry": telemetry, "last_error": "nvml: driver not loaded"}
    resp = agent_client(token).post(f"{API}/heartbeat", body, format="json")
    assert resp.status_code == 200, resp.content
    shown = acme.client.get(f"/api/v1/nodes/{node.pk}/").json()
    assert shown["agent_version"] == "9.9.9"
    mig = [g["mig_mode"] for g in sorted(shown["gpus"], key=lambda g: g["index"])]
    assert mig == [True, False, True, False]
    gpus = {g.index: g for g in Gpu.objects.filter(node=node)}
    assert [gpus[i].utilization_pct for i in range(4)] == [40, 41, 42, 43]
    assert gpus[0].ecc_errors == 0
    agent = NodeAgent.objects.get(node=node)
    assert (agent.last_error, agent.missed_heartbeats) == ("nvml: driver not loaded", 0)

    # A heartbeat with nothing in it (every field is optional): the last error and telemetry clear,
    # the version the node reported stays.
    resp = agent_client(token).post(f"{API}/heartbeat", {}, format="json")
    assert resp.status_code == 200, resp.content
    agent.refresh_from_db()
    assert (agent.last_error, agent.last_telemetry, agent.missed_heartbeats) == ("", [], 0)
    node.refresh_from_db()
    assert node.agent_version == "9.9.9"


def test_a_lost_node_coming_back_brings_back_only_itself_with_its_new_version(acme, join_token):
    back, token = _register(join_token, "hb-back")
    silent, _ = _register(join_token, "hb-silent")
    Node.objects.filter(pk__in=[back.pk, silent.pk]).update(state=NodeState.LOST)
    resp = agent_client(token).post(f"{API}/heartbeat", {"agent_version": "2.0.0"}, format="json")
    assert resp.status_code == 200 and resp.json()["lost"] is True
    back.refresh_from_db()
    silent.refresh_from_db()
    assert (back.state, back.agent_version) == (NodeState.ONLINE, "2.0.0")
    assert silent.state == NodeState.LOST


def test_a_cloud_instances_node_marked_lost_under_its_heartbeat_stays_lost(acme, gpu_models):
    """The sweep marks the node LOST after its token was checked but before its heartbeat is stored
    (the race the service's second lock is for): it does not come back, its jobs have moved on."""
    _, instance_token = cloud_instance(acme)
    resp = APIClient().post(f"{API}/register", register_body(instance_token), format="json")
    node = Node.objects.get(pk=resp.json()["node_id"])
    Node.objects.filter(pk=node.pk).update(state=NodeState.LOST)
    answer = agent_heartbeat(node=node, data={})
    assert answer["lost"] is False
    node.refresh_from_db()
    assert node.state == NodeState.LOST


# -- retiring a cloud instance's node ------------------------------------------------------------
def test_retiring_a_node_revokes_its_token_once_and_requeues_its_job_fenced(acme, gpu_models):
    _, instance_token = cloud_instance(acme)
    resp = APIClient().post(f"{API}/register", register_body(instance_token), format="json")
    node = Node.objects.get(pk=resp.json()["node_id"])
    job = submit(acme)
    (allocation,) = allocation_commit(job=job, requests=[GpuRequest(node=node, gpu_indices=(0,))])
    node.refresh_from_db()
    epoch = node.epoch

    assert node_give_up(node=node, reason="idle") is True
    node.refresh_from_db()
    assert (node.state, node.token_prefix, node.token_hash) == (NodeState.OFFLINE, "", "")
    assert node.epoch == epoch + 2  # one for going OFFLINE, one for releasing the job's GPUs
    job.refresh_from_db()
    assert (job.state, job.pending_reason_code) == (JobState.PENDING, "NODE_RETIRED")
    assert job.pending_reason == (
        f"Node {node.name} was retired (idle); the job restarts elsewhere once the provider confirms the "
        f"instance terminated (at most {fence_wait_seconds()} s).")
    allocation.refresh_from_db()
    assert (allocation.active, allocation.stop_unconfirmed) == (False, True)

    assert node_give_up(node=node, reason="idle") is False  # safe to call twice: nothing more to revoke
    node.refresh_from_db()
    assert node.epoch == epoch + 2


def test_retiring_a_node_without_jobs_moves_its_epoch_on_by_one(acme, gpu_models):
    _, instance_token = cloud_instance(acme)
    resp = APIClient().post(f"{API}/register", register_body(instance_token), format="json")
    node = Node.objects.get(pk=resp.json()["node_id"])
    epoch = node.epoch
    assert node_give_up(node=node, reason="idle") is True
    node.refresh_from_db()
    assert node.epoch == epoch + 1


# -- confirming a node powered off ---------------------------------------------------------------
def _held_on(node: Node, job) -> Allocation:
    """`job` requeued off a LOST `node`, its stop there unconfirmed."""
    (allocation,) = allocation_commit(job=job, requests=[GpuRequest(node=node, gpu_indices=(0,))])
    Node.objects.filter(pk=node.pk).update(state=NodeState.LOST)
    jobs_requeue_on_node(node_id=node.pk, reason_code="NODE_LOST", message="silent", stop_unconfirmed=True)
    allocation.refresh_from_db()
    assert allocation.stop_unconfirmed and not allocation.active
    return allocation


def test_confirming_a_node_off_releases_only_its_own_unconfirmed_copies(acme):
    node, other = acme.nodes
    ordinary = submit(acme, name="ordinary")  # ran on `node` earlier and was requeued normally
    allocation_commit(job=ordinary, requests=[GpuRequest(node=node, gpu_indices=(3,))])
    ordinary.refresh_from_db()
    assert job_requeue(job=ordinary, reason_code="REQUEUED", message="moved")
    held = _held_on(node, submit(acme, name="held"))
    elsewhere = _held_on(other, submit(acme, name="elsewhere"))

    assert node_confirm_powered_off(node=node, by=acme.admin) == [held.job_id]
    held.refresh_from_db()
    elsewhere.refresh_from_db()
    assert held.stop_unconfirmed is False
    assert elsewhere.stop_unconfirmed is True, "another LOST node's copies still wait"
    (event,) = JobEvent.objects.filter(job_id=held.job_id, reason_code="NODE_CONFIRMED_OFF")
    assert event.kind == "operator"
    assert event.message == (f"{acme.admin} confirmed that node {node.name} is powered off: the job's copy "
                             "there counts as stopped and it may start elsewhere at once.")
    assert event.data == {"node": node.name, "by": str(acme.admin)}
    events = acme.client.get(f"/api/v1/jobs/{held.job_id}/events/").json()["results"]
    assert [e["kind"] for e in events if e["reason_code"] == "NODE_CONFIRMED_OFF"] == ["operator"]
    others = [ordinary.pk, elsewhere.job_id]
    assert not JobEvent.objects.filter(job__in=others, reason_code="NODE_CONFIRMED_OFF").exists()


def test_a_member_is_told_who_may_confirm_a_node_off(acme):
    node = acme.nodes[0]
    held = _held_on(node, submit(acme))
    with pytest.raises(ConfirmForbidden) as caught:
        node_confirm_powered_off(node=node, by=acme.member)
    assert str(caught.value) == ("Only a platform operator or an admin of the node's tenant may confirm that "
                                 "a node is powered off.")
    held.refresh_from_db()
    assert held.stop_unconfirmed is True


# -- the lost-node sweep ---------------------------------------------------------------------------
def _agent_nodes(acme, gpu_models, count: int) -> list[Node]:
    """`count` nodes that heartbeat (their last one is set by each test), named in sweep order."""
    nodes = list(acme.nodes)
    for i in range(len(nodes), count):
        nodes.append(node_create_simulated(pool=acme.pool, name=f"acme-a100-{i}", gpu_count=8,
                                           gpu_model=gpu_models["A100-80GB"], nvlink_island_size=4,
                                           cpu_milli=96000, memory_mb=1024 * 1024))
    return nodes[:count]


def _sweep_clock():
    return PeriodicRun.objects.get(name=outage.LOST_SWEEP)


def test_nodes_that_never_heartbeated_do_not_make_the_sweep_record_an_outage(acme, monkeypatch):
    monkeypatch.setattr(outage, "agents_way_in_answers", lambda: False)  # the web server is down too
    assert nodes_mark_lost() == []
    assert _sweep_clock().resumed_at is None, "no agent is silent: nothing says the broker was down"


def test_a_retired_node_heard_recently_does_not_prove_the_broker_is_up(acme, gpu_models, monkeypatch):
    """Every live agent node silent at once and the way in down: the broker is down in front of them,
    whatever an OFFLINE node said before it was retired."""
    silent, retired = _agent_nodes(acme, gpu_models, 2)
    now = timezone.now()
    long_ago = now - timedelta(seconds=lost_after_seconds() + 5)
    Node.objects.filter(pk=silent.pk).update(last_heartbeat_at=long_ago)
    Node.objects.filter(pk=retired.pk).update(state=NodeState.OFFLINE, last_heartbeat_at=now)
    monkeypatch.setattr(outage, "agents_way_in_answers", lambda: False)
    assert nodes_mark_lost(now=now) == []
    silent.refresh_from_db()
    assert silent.state == NodeState.ONLINE
    assert _sweep_clock().resumed_at == now


def test_every_silent_node_is_marked_lost_with_its_job_told_why(acme, gpu_models, monkeypatch):
    nodes = _agent_nodes(acme, gpu_models, 2)
    now, limit = timezone.now(), lost_after_seconds()
    jobs, epochs = [], []
    for node in nodes:
        job = submit(acme, name=f"on-{node.name}")
        allocation_commit(job=job, requests=[GpuRequest(node=node, gpu_indices=(0,))])
        Node.objects.filter(pk=node.pk).update(last_heartbeat_at=now - timedelta(seconds=limit + 7))
        node.refresh_from_db()
        jobs.append(job)
        epochs.append(node.epoch)
    monkeypatch.setattr(outage, "agents_way_in_answers", lambda: True)
    lost = nodes_mark_lost(now=now)
    assert [n.pk for n in lost] == [n.pk for n in nodes]
    for node, job, epoch in zip(nodes, jobs, epochs):
        node.refresh_from_db()
        assert node.state == NodeState.LOST
        assert node.epoch == epoch + 2  # one for LOST, one for releasing the job's GPUs
        job.refresh_from_db()
        assert (job.state, job.pending_reason_code) == (JobState.PENDING, "NODE_LOST")
        assert job.pending_reason == (
            f"Node {node.name} sent no heartbeat for {limit + 7} s (limit {limit} s); the job restarts "
            "elsewhere from its last committed checkpoint, once its copy there is confirmed stopped "
            f"(at most {fence_wait_seconds()} s).")


def test_a_silent_node_without_jobs_moves_its_epoch_on_by_one(acme, gpu_models, monkeypatch):
    (node,) = _agent_nodes(acme, gpu_models, 1)
    now = timezone.now()
    long_ago = now - timedelta(seconds=lost_after_seconds() + 1)
    Node.objects.filter(pk=node.pk).update(last_heartbeat_at=long_ago)
    node.refresh_from_db()
    epoch = node.epoch
    monkeypatch.setattr(outage, "agents_way_in_answers", lambda: True)
    assert [n.pk for n in nodes_mark_lost(now=now)] == [node.pk]
    node.refresh_from_db()
    assert (node.state, node.epoch) == (NodeState.LOST, epoch + 1)


def test_a_node_that_changed_during_the_sweep_is_left_alone_and_the_rest_still_swept(acme, gpu_models,
                                                                                      monkeypatch):
    """Between the sweep reading the silent nodes and marking them: the first heartbeats again, the
    second is retired (OFFLINE). Neither is marked LOST; the third, still silent, is."""
    first, second, third = _agent_nodes(acme, gpu_models, 3)
    now = timezone.now()
    Node.objects.filter(pk__in=[first.pk, second.pk, third.pk]).update(
        last_heartbeat_at=now - timedelta(seconds=lost_after_seconds() + 5))

    def meanwhile() -> bool:
        Node.objects.filter(pk=first.pk).update(last_heartbeat_at=now)
        Node.objects.filter(pk=second.pk).update(state=NodeState.OFFLINE)
        return True

    monkeypatch.setattr(outage, "agents_way_in_answers", meanwhile)
    assert [n.pk for n in nodes_mark_lost(now=now)] == [third.pk]
    states = dict(Node.objects.filter(pk__in=[first.pk, second.pk, third.pk]).values_list("pk", "state"))
    assert states == {first.pk: NodeState.ONLINE, second.pk: NodeState.OFFLINE, third.pk: NodeState.LOST}
