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
from broker.agents.models import AssignmentReport, NodeAgent
from broker.agents.services import (ConfirmForbidden, agent_heartbeat, lost_after_seconds,
                                    node_confirm_powered_off, node_give_up, nodes_mark_lost)
from broker.inventory.models import Gpu, GpuHealth, Node, NodeState
from broker.inventory.services import node_create_simulated, pool_join_token_issue
from broker.jobs.models import Allocation, Job, JobEvent
from broker.jobs.services import GpuRequest, allocation_commit, job_requeue, jobs_requeue_on_node
from broker.jobs.states import JobState
from broker.ops.models import PeriodicRun
from broker.scheduler import outage

from .test_agent_api import API, agent_client, cloud_instance, place, reading, register_body, registered, report  # noqa: F401
from .test_api_tenancy import submit
from .test_checkpoints import report_checkpoint, root, running_job, verify_queue, write  # noqa: F401 (fixtures)


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


def test_a_lost_node_coming_back_brings_back_only_itself_with_its_new_version(acme, join_token, monkeypatch):
    back, token = _register(join_token, "hb-back")
    silent, _ = _register(join_token, "hb-silent")
    Node.objects.filter(pk__in=[back.pk, silent.pk]).update(state=NodeState.LOST)
    resp = agent_client(token).post(f"{API}/heartbeat", {"agent_version": "2.0.0"}, format="json")
    assert resp.status_code == 200 and resp.json()["lost"] is True
    back.refresh_from_db()
    silent.refresh_from_db()
    assert (back.state, back.agent_version) == (NodeState.ONLINE, "2.0.0")
    assert silent.state == NodeState.LOST
    # Back with the time it was heard: the next sweep does not mark it LOST again at once.
    Node.objects.filter(pk=back.pk).update(last_heartbeat_at=timezone.now() - timedelta(hours=1))
    Node.objects.filter(pk=back.pk).update(state=NodeState.LOST)
    before = timezone.now()
    assert agent_client(token).post(f"{API}/heartbeat", {}, format="json").json()["lost"] is True
    back.refresh_from_db()
    assert back.state == NodeState.ONLINE and back.last_heartbeat_at >= before
    monkeypatch.setattr(outage, "agents_way_in_answers", lambda: True)
    assert back not in nodes_mark_lost()
    back.refresh_from_db()
    assert back.state == NodeState.ONLINE


def test_a_cloud_instances_node_marked_lost_under_its_heartbeat_stays_lost(acme, gpu_models):
    """The sweep marks the node LOST after its token was checked but before its heartbeat is stored
    (the race the service's second lock is for): it does not come back, its jobs have moved on."""
    _, instance_token = cloud_instance(acme)
    resp = APIClient().post(f"{API}/register", register_body(instance_token), format="json")
    node = Node.objects.get(pk=resp.json()["node_id"])
    Node.objects.filter(pk=node.pk).update(state=NodeState.LOST, last_heartbeat_at=timezone.now() - timedelta(hours=1))
    before = timezone.now()
    answer = agent_heartbeat(node=node, data={"agent_version": "3.1.0"})
    assert answer["lost"] is False
    node.refresh_from_db()
    assert node.state == NodeState.LOST
    # Still heard: when and which version, for the operator (and the outage check) to read.
    assert node.last_heartbeat_at >= before and node.agent_version == "3.1.0"


def test_a_lost_node_taken_offline_under_its_heartbeat_does_not_come_back(acme, join_token, monkeypatch):
    """The node is LOST when its heartbeat's stamp is refused, and an admin takes it OFFLINE before the
    heartbeat brings it back (two statements in one transaction; on PostgreSQL another commit may land
    between them): it stays OFFLINE."""
    from broker.agents import services

    node, _ = _register(join_token, "hb-offline")
    Node.objects.filter(pk=node.pk).update(state=NodeState.LOST)
    real = services.row_update

    def retired_meanwhile(model, *args, **kwargs):
        answer = real(model, *args, **kwargs)
        if model is Node and answer is None:
            Node.objects.filter(pk=node.pk).update(state=NodeState.OFFLINE)
        return answer

    monkeypatch.setattr(services, "row_update", retired_meanwhile)
    assert agent_heartbeat(node=node, data={})["lost"] is False
    node.refresh_from_db()
    assert node.state == NodeState.OFFLINE


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


# -- status reports ------------------------------------------------------------------------------
def test_a_report_is_recorded_as_the_agent_sent_it_and_told_in_the_jobs_timeline(acme, registered):
    node, token = registered
    job, allocation = place(acme, node)
    resp = report(token, allocation, "running", reason="started", pid=123, message="train.py started")
    assert resp.json() == {"ok": True, "state": "running", "recorded": True}
    row = AssignmentReport.objects.get(allocation=allocation)
    assert (row.state, row.reason, row.exit_code, row.message, row.pid) == ("running", "started", None,
                                                                           "train.py started", 123)
    event = JobEvent.objects.filter(job=job, kind="agent").latest("id")
    assert (event.reason_code, event.message) == ("AGENT_RUNNING", f"{node.name}: train.py started")
    assert event.data == {"node": node.name, "allocation": allocation.pk, "state": "running", "reason": "started",
                          "exit_code": None, "pid": 123}
    # Only what the agent says: no reason, message or pid.
    assert report(token, allocation, "exited", exit_code=0, message="").status_code == 200
    row.refresh_from_db()
    assert (row.state, row.reason, row.exit_code, row.message, row.pid) == ("exited", "", 0, "", None)
    event = JobEvent.objects.filter(job=job, kind="agent").latest("id")
    assert (event.reason_code, event.message) == ("AGENT_EXITED", f"{node.name}: exited")
    assert event.data == {"node": node.name, "allocation": allocation.pk, "state": "exited", "reason": "",
                          "exit_code": 0, "pid": None}


def test_a_report_for_no_assignment_of_this_node_or_of_an_old_epoch_is_refused_in_words(acme, registered):
    node, token = registered
    _, allocation = place(acme, node)
    _, foreign = place(acme, acme.nodes[1], indices=(0,))
    resp = report(token, foreign, "running")
    assert (resp.status_code, resp.json()) == (404, {"detail": f"No assignment {foreign.pk} on this node."})
    resp = report(token, allocation, "running", epoch=allocation.epoch + 5)
    said = f"Assignment {allocation.pk} is at epoch {allocation.epoch}, not {allocation.epoch + 5}."
    assert (resp.status_code, resp.json()) == (409, {"epoch": [said], "detail": said})


def test_another_finished_job_does_not_silence_the_reports_of_a_live_one(acme, registered):
    node, token = registered
    done = submit(acme, name="done")
    Job.objects.filter(pk=done.pk).update(state=JobState.SUCCEEDED)
    job, allocation = place(acme, node)
    assert report(token, allocation, "running", reason="started").json()["recorded"] is True
    job.refresh_from_db()
    assert job.state == JobState.RUNNING


def test_the_answer_to_a_checkpoint_report_is_the_process_report_it_leaves_as_it_was(acme, registered, root,
                                                                                      verify_queue):
    node, token = registered
    job, allocation = running_job(acme, node, root)
    report(token, allocation, "running", reason="started")
    resp = report_checkpoint(token, allocation, write(root, 5))
    assert (resp.status_code, resp.json()) == (200, {"ok": True, "state": "running", "recorded": True})
    assert AssignmentReport.objects.get(allocation=allocation).state == "running"


def test_a_job_that_died_with_its_gpus_names_each_and_fails_only_those(acme, registered, join_token):
    node, token = registered
    other, _ = _register(join_token, "gpu-other")
    job, allocation = place(acme, node)
    report(token, allocation, "running", reason="started")
    resp = report(token, allocation, "failed", reason="signal", exit_code=-9,
                  failed_gpus={"3": ["Xid 79", "fell off the bus"], "1": []})
    assert resp.status_code == 200
    job.refresh_from_db()
    assert (job.state, job.pending_reason_code) == (JobState.PENDING, "GPU_FAILED")
    assert job.pending_reason == (f"{node.name}: the job died with its GPU (GPU 1: FAILED; GPU 3: Xid 79, fell off "
                                  "the bus); it restarts elsewhere.")
    failed = set(Gpu.objects.filter(health=GpuHealth.FAILED).values_list("node__name", "index"))
    assert failed == {(node.name, 1), (node.name, 3)}, "only the GPUs named, only on this node"
    assert Gpu.objects.filter(node=other, health=GpuHealth.HEALTHY).count() == 4


def test_an_instance_token_used_up_by_a_registration_racing_this_one_is_refused(acme, gpu_models, monkeypatch):
    """Two registrations with one instance token: the other consumed it between this one's check and its
    consumption (broker.provisioning's compare-and-set said no). PostgreSQL runs the real race in
    test_agent_api; this is its answer on any database."""
    _, instance_token = cloud_instance(acme)
    monkeypatch.setattr("broker.provisioning.services.instance_join_token_consume", lambda **kwargs: False)
    resp = APIClient().post(f"{API}/register", register_body(instance_token), format="json")
    assert (resp.status_code, resp.json()) == (401, {"detail": "Invalid join token."})
    assert not Node.objects.filter(name__startswith="aws-east").exists()


# -- registration --------------------------------------------------------------------------------
def test_a_name_another_teams_node_has_is_a_new_node_in_this_teams_pool(acme, globex, join_token):
    theirs = globex.nodes[0]  # seeded, no agent yet: takeable by an agent of *its* pool
    before = (theirs.pool_id, theirs.tenant_id, dict(theirs.labels), theirs.epoch)
    node, _ = _register(join_token, theirs.name)
    assert node.pk != theirs.pk and (node.pool, node.tenant) == (acme.pool, acme.tenant)
    theirs.refresh_from_db()
    assert (theirs.pool_id, theirs.tenant_id, dict(theirs.labels), theirs.epoch) == before
    assert not NodeAgent.objects.filter(node=theirs).exists()


def test_registration_records_what_the_agent_says_of_its_host_and_forgets_what_it_no_longer_says(acme,
                                                                                                   join_token):
    body = {**register_body(join_token, name="host-1"), "hostname": "host-1.dc1", "agent_version": "1.4.2",
            "cpu_milli": 96000, "memory_mb": 512 * 1024, "container_runtimes": ["podman"]}
    resp = APIClient().post(f"{API}/register", body, format="json")
    assert resp.status_code == 201, resp.content
    node = Node.objects.get(pk=resp.json()["node_id"])
    assert (node.hostname, node.agent_version, node.cpu_milli, node.memory_mb, node.container_runtimes) == (
        "host-1.dc1", "1.4.2", 96000, 512 * 1024, ["podman"])
    for key in ("hostname", "agent_version", "cpu_milli", "memory_mb", "container_runtimes"):
        del body[key]
    assert APIClient().post(f"{API}/register", body, format="json").status_code == 200
    node.refresh_from_db()
    assert (node.hostname, node.agent_version, node.cpu_milli, node.memory_mb, node.container_runtimes) == (
        "", "", 0, 0, [])


def test_registration_keeps_a_summary_of_each_gpus_place_in_the_topology(acme, join_token):
    body = register_body(join_token, name="topo-1")
    resp = APIClient().post(f"{API}/register", body, format="json")
    node = Node.objects.get(pk=resp.json()["node_id"])
    keys = ("index", "nvlink_island", "nvlink_peers", "numa_node", "cpu_affinity", "pci_bus_id")
    assert node.topology["gpus_summary"] == [{k: g[k] for k in keys} for g in body["gpus"]]
    assert node.topology["gpus_summary"][2] == {"index": 2, "nvlink_island": 0, "nvlink_peers": [0, 1, 3],
                                                "numa_node": 1, "cpu_affinity": "64-127",
                                                "pci_bus_id": body["gpus"][2]["pci_bus_id"]}


def test_each_registration_moves_the_nodes_epoch_on_by_one_and_stamps_its_gpus(acme, join_token):
    before = timezone.now()
    node, _ = _register(join_token, "epoch-1")
    first = node.epoch
    assert all(g.last_seen_at is not None and g.last_seen_at >= before for g in node.gpus.all())
    again = APIClient().post(f"{API}/register", register_body(join_token, name="epoch-1", agent_key="key-epoch-1-xx"),
                             format="json")
    assert again.status_code == 200 and again.json()["epoch"] == first + 1


def test_a_new_agent_taking_over_a_lost_node_requeues_its_jobs_and_the_same_agent_does_not(acme, join_token):
    node, _ = _register(join_token, "take-1")
    job = submit(acme, name="on-take-1")
    allocation_commit(job=job, requests=[GpuRequest(node=node, gpu_indices=(0,))])
    same = register_body(join_token, name="take-1", agent_key="key-take-1-xx")  # its first answer was lost
    assert APIClient().post(f"{API}/register", same, format="json").status_code == 200
    job.refresh_from_db()
    assert job.state == JobState.PLACED
    Node.objects.filter(pk=node.pk).update(state=NodeState.LOST)
    body = register_body(join_token, name="take-1", agent_key="key-newcomer-1")
    assert APIClient().post(f"{API}/register", body, format="json").status_code == 200
    job.refresh_from_db()
    assert (job.state, job.pending_reason_code) == (JobState.PENDING, "NODE_REREGISTERED")
    assert job.pending_reason == "Node take-1 was taken over by a new agent."


def test_a_given_up_instances_node_name_is_refused_in_words(acme, gpu_models):
    instance, token = cloud_instance(acme)
    node_id = APIClient().post(f"{API}/register", register_body(token), format="json").json()["node_id"]
    Node.objects.filter(pk=node_id).update(state=NodeState.LOST)
    body = register_body(pool_join_token_issue(pool=instance.pool), name=instance.node_name, agent_key="key-takeover-1")
    resp = APIClient().post(f"{API}/register", body, format="json")
    said = (f"Node {instance.node_name} in pool {instance.pool.name} belongs to a cloud instance the broker gave up "
            "on; it cannot be registered again.")
    assert (resp.status_code, resp.json()) == (409, {"name": [said], "detail": said})


def test_a_gpu_uuid_taken_by_a_racing_registration_is_refused_in_words(acme, globex, registered, monkeypatch):
    monkeypatch.setattr("broker.agents.services._refuse_duplicate_gpus", lambda **kwargs: None)
    node, _ = registered
    body = register_body(pool_join_token_issue(pool=globex.pool), name="copycat", agent_key="key-copycat")
    body["gpus"][0]["uuid"] = node.gpus.get(index=3).uuid
    resp = APIClient().post(f"{API}/register", body, format="json")
    said = ("A GPU UUID of this node is already registered to another node; remove that node before registering "
            "the GPU here.")
    assert (resp.status_code, resp.json()) == (409, {"gpus": [said], "detail": said})


def test_the_agent_record_is_what_this_agent_sent_and_starts_without_the_last_ones_troubles(acme, join_token):
    """What the admin's agent page shows: backend, drivers, isolation, metrics URL of the agent that
    registered last, with no missed heartbeats and no error carried over from the agent before it."""
    body = {**register_body(join_token, name="rec-1"), "metrics_url": "http://10.0.0.5:9400/metrics"}
    assert APIClient().post(f"{API}/register", body, format="json").status_code == 201
    agent = NodeAgent.objects.get(node__name="rec-1")
    sent = (body["backend"], body["driver_version"], body["cuda_driver_version"], body["job_isolation"],
            body["metrics_url"])
    assert (agent.backend, agent.driver_version, agent.cuda_driver_version, agent.job_isolation,
            agent.metrics_url) == sent
    NodeAgent.objects.filter(pk=agent.pk).update(missed_heartbeats=7, last_error="nvml: driver not loaded")
    for key in ("backend", "driver_version", "cuda_driver_version", "job_isolation", "metrics_url"):
        del body[key]
    assert APIClient().post(f"{API}/register", body, format="json").status_code == 200
    agent.refresh_from_db()
    assert (agent.backend, agent.driver_version, agent.cuda_driver_version, agent.job_isolation,
            agent.metrics_url, agent.missed_heartbeats, agent.last_error) == ("", "", "", "", "", 0, "")
