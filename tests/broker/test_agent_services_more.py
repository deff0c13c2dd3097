"""The rest of the agent services under mutation testing (issue 9): a live cloud instance's node,
status reports moving a job or a gang, checkpoints, the timings an agent is told and the sweep reads,
the node's address, what registration stores of each GPU, join tokens and GPUs another node holds.

Checked as an operator or an agent sees it: the answers of the agent API, the node and GPU records,
the job's state, its pending reason and its events.
"""
from __future__ import annotations

import logging
from datetime import timedelta

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from broker.agents.models import NodeAgent
from broker.agents.services import nodes_mark_lost
from broker.inventory.models import Gpu, GpuHealth, Node, NodeState, Pool, PoolKind
from broker.inventory.services import pool_join_token_issue
from broker.jobs.models import Job, JobEvent
from broker.jobs.services import GpuRequest, allocation_commit, job_requeue, job_transition
from broker.jobs.states import JobState
from broker.scheduler import outage

from .test_agent_api import (API, agent_client, cloud_instance, join_token, place, register_body,  # noqa: F401
                             registered, report)
from .test_gang import gang_nodes, place_gang, register  # noqa: F401 (fixture)
from .test_migration import commit_checkpoint, only_assignment, second  # noqa: F401 (fixture)
from .test_api_tenancy import submit
from .test_checkpoints import report_checkpoint, root, running_job, verify_queue, write  # noqa: F401 (fixtures)


# -- a cloud instance's node the broker has not given up on ----------------------------------------
def test_a_live_cloud_instances_agent_registering_again_through_the_pool_keeps_its_node(acme, gpu_models):
    """The instance is live and its node ONLINE: nothing was given up, so its own agent (its first
    answer lost, its one-time token used) gets its node back through the pool's join token."""
    instance, instance_token = cloud_instance(acme)
    first = APIClient().post(f"{API}/register", register_body(instance_token, agent_key="key-instance-1"),
                             format="json")
    assert first.status_code == 201, first.content
    body = register_body(pool_join_token_issue(pool=instance.pool), name=instance.node_name,
                         agent_key="key-instance-1")
    again = APIClient().post(f"{API}/register", body, format="json")
    assert again.status_code == 200, again.content
    assert again.json()["node_id"] == first.json()["node_id"]
    node = Node.objects.get(pk=first.json()["node_id"])
    assert node.state == NodeState.ONLINE
    assert NodeAgent.objects.get(node=node).agent_key == "key-instance-1"


# -- a report moves the job ----------------------------------------------------------------------
def _steps(job: Job) -> list[tuple[str, str, str]]:
    """The job's state changes as its timeline shows them: (to, reason code, message)."""
    return [(e.data["to"], e.reason_code, e.message)
            for e in JobEvent.objects.filter(job=job, kind="state").order_by("id")]


def _started(job: Job) -> Job:
    return job_transition(job=job_transition(job=job, to=JobState.STARTING), to=JobState.RUNNING)


def test_a_running_report_starts_a_placed_job_in_two_steps_each_told_once(acme, registered):
    node, token = registered
    job, allocation = place(acme, node)
    assert report(token, allocation, "running", reason="started").status_code == 200
    job.refresh_from_db()
    assert job.state == JobState.RUNNING
    assert _steps(job)[-2:] == [
        (JobState.STARTING, "AGENT_STARTED", f"{node.name} started the job's process."),
        (JobState.RUNNING, "AGENT_RUNNING", f"Running on {node.name}."),
    ]
    report(token, allocation, "running", reason="started")  # the outbox sends it again: nothing moves
    assert len(_steps(job)) == 3


@pytest.mark.parametrize("already_running", [True, False])
def test_an_exit_with_code_0_succeeds_the_job_even_before_it_was_seen_running(acme, registered, already_running):
    """A job so short that its "running" report was never sent still passes STARTING on its way."""
    node, token = registered
    job, allocation = place(acme, node)
    if already_running:
        job = _started(job)
    report(token, allocation, "exited", reason="exit", exit_code=0)
    job.refresh_from_db()
    assert job.state == JobState.SUCCEEDED
    expected = [(JobState.SUCCEEDED, "JOB_EXITED", f"Exited with code 0 on {node.name}.")]
    if not already_running:
        expected.insert(0, (JobState.STARTING, "JOB_EXITED", f"Exited with code 0 on {node.name}."))
    assert _steps(job)[-len(expected):] == expected
    assert [to for to, _, _ in _steps(job)].count(JobState.STARTING) == 1


def test_an_exit_succeeds_a_restarted_job_while_other_jobs_still_run(acme, registered):
    """Only this job's live parts are waited for: not its run before the restart (requeued off
    another node, never "exited"), not another job running beside it."""
    node, token = registered
    job = submit(acme, name="restarted")
    allocation_commit(job=job, requests=[GpuRequest(node=acme.nodes[0], gpu_indices=(0,))])
    assert job_requeue(job=Job.objects.get(pk=job.pk), reason_code="NODE_LOST", message="gone")
    (allocation,) = allocation_commit(job=Job.objects.get(pk=job.pk),
                                      requests=[GpuRequest(node=node, gpu_indices=(0,))])
    neighbour, _ = place(acme, node, indices=(2,))
    _started(neighbour)
    report(token, allocation, "running", reason="started")
    report(token, allocation, "exited", reason="exit", exit_code=0)
    job.refresh_from_db()
    assert job.state == JobState.SUCCEEDED

@pytest.mark.parametrize("report_state, reason, pending_code, pending_reason", [
    ("failed", "agent_crashed", "AGENT_RESTARTED", "{node}: the agent crashed. Restarting the job."),
    ("failed", "not_running", "AGENT_RESTARTED", "{node}: the agent crashed. Restarting the job."),
    ("stopped", "signal", "AGENT_STOPPED_JOB", "{node}: the agent crashed."),
    ("refused", "gpu_busy", "ASSIGNMENT_REFUSED", "{node} refused the job: the agent crashed."),
])
def test_a_report_the_job_is_not_to_blame_for_sends_it_back_to_the_queue_saying_why(
        acme, registered, report_state, reason, pending_code, pending_reason):
    node, token = registered
    job, allocation = place(acme, node)
    job = _started(job)
    report(token, allocation, report_state, reason=reason, message="the agent crashed")
    job.refresh_from_db()
    assert (job.state, job.pending_reason_code) == (JobState.PENDING, pending_code)
    assert job.pending_reason == pending_reason.format(node=node.name)


@pytest.mark.parametrize("report_state, reason, code, message", [
    ("failed", "exit_code", "JOB_FAILED", "{node}: exited with code 3."),
    ("refused", "invalid", "ASSIGNMENT_INVALID", "{node} cannot run this job: exited with code 3."),
])
def test_a_report_the_job_is_to_blame_for_fails_it_saying_why(acme, registered, report_state, reason, code, message):
    node, token = registered
    job, allocation = place(acme, node)
    report(token, allocation, report_state, reason=reason, message="exited with code 3")
    job.refresh_from_db()
    assert job.state == JobState.FAILED
    (to, reason_code, said), = [step for step in _steps(job) if step[0] == JobState.FAILED]
    assert (reason_code, said) == (code, message.format(node=node.name))
    event = JobEvent.objects.get(job=job, kind="state", reason_code=code)
    assert event.data == {"from": JobState.PLACED, "to": JobState.FAILED}, "a single node's job has no rank to name"


def test_a_moved_jobs_source_process_dying_on_its_way_out_still_lets_the_move_go_on(acme, registered, second,
                                                                                   root, verify_queue):
    """The checkpoint is committed and the source is told to stop; its process fails instead of
    stopping cleanly. Either way it is down: the job is placed on the target, not failed."""
    (source, source_token), _ = registered, second
    job, allocation = running_job(acme, source, root)
    assert acme.client.post(f"/api/v1/jobs/{job.pk}/migrate/", {"node": "gpu-node-2"},
                            format="json").status_code == 202
    commit_checkpoint(source_token, allocation, root, job, 40, only_assignment(source_token)["checkpoint_request_id"])
    job.refresh_from_db()
    assert job.state == JobState.MIGRATING
    report(source_token, allocation, "failed", reason="exit_code", message="killed by signal 9")
    job.refresh_from_db()
    assert job.state == JobState.PLACED
    assert not JobEvent.objects.filter(job=job, reason_code="JOB_FAILED").exists()

# -- a gang's parts ------------------------------------------------------------------------------
def _ranked(parts: dict) -> list[str]:
    return sorted(parts, key=lambda name: parts[name].pk)


def test_a_gang_waits_for_every_part_naming_the_ones_not_started(acme, gang_nodes):
    job, parts = place_gang(acme, gang_nodes)
    first, second = _ranked(parts)
    report(gang_nodes[first][1], parts[first], "running", reason="started")
    job.refresh_from_db()
    assert job.state == JobState.STARTING
    assert _steps(job)[-1] == (JobState.STARTING, "GANG_STARTING",
                               f"rank 0 of 2 on {first} is running; waiting for rank 1 ({second}) to start.")
    report(gang_nodes[second][1], parts[second], "running", reason="started")
    job.refresh_from_db()
    assert job.state == JobState.RUNNING
    assert _steps(job)[-1] == (JobState.RUNNING, "AGENT_RUNNING", "Running on all 2 nodes.")


def _gang_of_three(acme, join_token):
    """A 3-node gang placed on three freshly registered nodes: (job, {name: (node, token)},
    {name: allocation}, the node names by rank)."""
    nodes = {}
    for name in ("trio-a", "trio-b", "trio-c"):
        resp = register(join_token, name)
        nodes[name] = (Node.objects.get(pk=resp.json()["node_id"]), resp.json()["node_token"])
    job = submit(acme, resources={"gpus": 2, "nodes": 3})
    parts = {a.node.name: a for a in allocation_commit(
        job=job, requests=[GpuRequest(node=node, gpu_indices=(0, 1)) for node, _ in nodes.values()])}
    return job, nodes, parts, _ranked(parts)


def test_a_gang_of_three_names_both_parts_it_still_waits_for(acme, join_token):
    job, nodes, parts, (first, second, third) = _gang_of_three(acme, join_token)
    report(nodes[first][1], parts[first], "running", reason="started")
    assert _steps(job)[-1][2] == (f"rank 0 of 3 on {first} is running; waiting for rank 1 ({second}), "
                                  f"rank 2 ({third}) to start.")


def test_a_gangs_last_rank_starting_first_names_the_ranks_before_it(acme, join_token):
    """The parts still awaited are found by their allocation, not by the report's own id (mutant
    `_parts_not_started` 7 read the report ids and named the wrong ranks)."""
    job, nodes, parts, (first, second, third) = _gang_of_three(acme, join_token)
    report(nodes[third][1], parts[third], "running", reason="started")
    assert _steps(job)[-1][2] == (f"rank 2 of 3 on {third} is running; waiting for rank 0 ({first}), "
                                  f"rank 1 ({second}) to start.")


def test_a_gang_part_whose_agent_crashed_restarts_the_gang(acme, gang_nodes):
    job, parts = place_gang(acme, gang_nodes)
    first, second = _ranked(parts)
    report(gang_nodes[second][1], parts[second], "failed", reason="agent_crashed", message="the agent restarted")
    job.refresh_from_db()
    assert (job.state, job.pending_reason_code) == (JobState.PENDING, "AGENT_RESTARTED")
    assert job.pending_reason == f"rank 1 of 2 on {second}: the agent restarted. Restarting the job."


def test_a_gang_part_failing_names_its_rank_and_reason_in_the_jobs_failure(acme, gang_nodes):
    job, parts = place_gang(acme, gang_nodes)
    first, second = _ranked(parts)
    report(gang_nodes[second][1], parts[second], "failed", reason="exit_code", message="exited with code 3")
    event = JobEvent.objects.get(job=job, kind="state", reason_code="JOB_FAILED")
    assert event.message == f"rank 1 of 2 on {second} failed: exited with code 3. The other ranks are stopped."
    assert event.data == {"from": JobState.PLACED, "to": JobState.FAILED, "node": second, "reason": "exit_code",
                          "rank": 1, "num_nodes": 2}


def test_a_gang_part_refusing_an_unusable_assignment_fails_the_gang_naming_its_rank(acme, gang_nodes):
    job, parts = place_gang(acme, gang_nodes)
    first, _ = _ranked(parts)
    report(gang_nodes[first][1], parts[first], "refused", reason="invalid", message="no command")
    job.refresh_from_db()
    assert job.state == JobState.FAILED
    event = JobEvent.objects.get(job=job, kind="state", reason_code="ASSIGNMENT_INVALID")
    assert event.message == f"rank 0 of 2 on {first} cannot run this job: no command."
    assert event.data == {"from": JobState.PLACED, "to": JobState.FAILED, "rank": 0, "num_nodes": 2}


# -- checkpoints ---------------------------------------------------------------------------------
def test_a_checkpoint_answering_a_request_is_listed_with_that_requests_id(acme, registered, root, verify_queue):
    """The job's checkpoint list and its timeline say which request a checkpoint answered: the
    operator who asked for one sees it was this one, not one the job wrote on its own schedule."""
    node, token = registered
    job, allocation = running_job(acme, node, root)
    assert acme.client.post(f"/api/v1/jobs/{job.pk}/checkpoint/").status_code == 202
    (assignment,) = agent_client(token).get(f"{API}/assignments").json()["assignments"]
    request_id = assignment["checkpoint_request_id"]
    assert request_id
    resp = report_checkpoint(token, allocation, write(root, 12), request_id=request_id)
    assert resp.status_code == 200, resp.content
    listed = acme.client.get(f"/api/v1/jobs/{job.pk}/checkpoints/").json()["results"]
    assert [(c["step"], c["request_id"]) for c in listed] == [(12, request_id)]
    written = JobEvent.objects.get(job=job, reason_code="CHECKPOINT_WRITTEN")
    assert written.data["request_id"] == request_id



def test_a_checkpoint_outside_the_jobs_checkpoint_uri_is_refused_in_words(acme, registered, root, tmp_path):
    """The agent is told why, by field, and drops the report: nothing is recorded for the job."""
    node, token = registered
    job, allocation = running_job(acme, node, root)
    saved = write(root, 5)
    resp = report_checkpoint(token, allocation, saved, uri=str(tmp_path / "elsewhere" / "step-000000000005"))
    said = "The checkpoint is not under this job's checkpoint.uri."
    assert (resp.status_code, resp.json()) == (400, {"checkpoint.uri": [said], "detail": said})
    assert not JobEvent.objects.filter(job=job, reason_code="CHECKPOINT_WRITTEN").exists()

# -- the timings agents are told and the sweep keeps -----------------------------------------------
def _sweep_one_silent_node(acme, silent_for: int, which: int = 0) -> Job:
    """One job on node `which`, last heard `silent_for` seconds ago; the sweep runs now. The job, after it."""
    node = acme.nodes[which]
    job = submit(acme, name=f"on-silent-{which}")
    allocation_commit(job=job, requests=[GpuRequest(node=node, gpu_indices=(0,))])
    now = timezone.now()
    Node.objects.filter(pk=node.pk).update(last_heartbeat_at=now - timedelta(seconds=silent_for))
    nodes_mark_lost(now=now)
    job.refresh_from_db()
    return job


@pytest.fixture
def broker_up(monkeypatch) -> None:
    """The agents' way in answers: a silent node is the node's silence, not the broker's outage."""
    monkeypatch.setattr(outage, "agents_way_in_answers", lambda: True)


def test_agents_beat_every_5_s_and_a_node_is_lost_after_30_s_of_silence(acme, join_token, broker_up):
    """The shipped settings (broker/settings.py)."""
    resp = APIClient().post(f"{API}/register", register_body(join_token), format="json")
    assert resp.json()["heartbeat_seconds"] == 5
    assert _sweep_one_silent_node(acme, 29).state == "PLACED", "29 s of silence is within six beats"
    job = _sweep_one_silent_node(acme, 31, which=1)
    assert job.pending_reason_code == "NODE_LOST"
    assert job.pending_reason.startswith(f"Node {acme.nodes[1].name} sent no heartbeat for 31 s (limit 30 s);")


def test_the_settings_set_what_agents_are_told_and_how_long_a_silence_is_lost(acme, join_token, settings,
                                                                              broker_up):
    settings.WHALEZEN_AGENT_HEARTBEAT_SECONDS = 2
    settings.WHALEZEN_NODE_LOST_AFTER_SECONDS = 100
    resp = APIClient().post(f"{API}/register", register_body(join_token), format="json")
    assert resp.json()["heartbeat_seconds"] == 2
    token = resp.json()["node_token"]
    assert agent_client(token).post(f"{API}/heartbeat", {}, format="json").json()["heartbeat_seconds"] == 2
    assert _sweep_one_silent_node(acme, 99).state == "PLACED"
    assert "(limit 100 s)" in _sweep_one_silent_node(acme, 101, which=1).pending_reason


def test_a_settings_module_without_the_timings_falls_back_to_5_s_beats_and_six_of_them(acme, join_token, settings,
                                                                                       broker_up):
    """A deployment's own settings module may leave them out: the broker's defaults, and a LOST
    limit that follows the heartbeat it sets."""
    del settings.WHALEZEN_AGENT_HEARTBEAT_SECONDS
    del settings.WHALEZEN_NODE_LOST_AFTER_SECONDS
    resp = APIClient().post(f"{API}/register", register_body(join_token), format="json")
    assert resp.json()["heartbeat_seconds"] == 5
    settings.WHALEZEN_AGENT_HEARTBEAT_SECONDS = 2
    assert _sweep_one_silent_node(acme, 11).state == "PLACED"
    assert "(limit 12 s)" in _sweep_one_silent_node(acme, 13, which=1).pending_reason


# -- the node's address --------------------------------------------------------------------------
def test_a_registration_from_something_not_an_ip_address_leaves_the_nodes_address_empty(acme, join_token):
    """A proxy in front may put anything in REMOTE_ADDR: not an address peers could connect to."""
    resp = APIClient(REMOTE_ADDR="proxy.internal").post(f"{API}/register", register_body(join_token),
                                                        format="json")
    assert resp.status_code == 201, resp.content
    assert Node.objects.get(pk=resp.json()["node_id"]).address == ""
    resp = APIClient(REMOTE_ADDR="10.1.2.3").post(f"{API}/register",
                                                    register_body(join_token, name="n2", agent_key="key-n2-xxxxx"),
                                                    format="json")
    assert Node.objects.get(pk=resp.json()["node_id"]).address == "10.1.2.3"


# -- what registration stores of each GPU ----------------------------------------------------------
def _gpu_rows(node_id: str) -> dict[int, tuple]:
    """What the GPU records say, by index: as the admin's node page and the scheduler read them."""
    return {g.index: (g.uuid, g.model.name if g.model else None, g.model_name, g.memory_mb, g.nvlink_island,
                      g.numa_node, g.pci_bus_id, g.mig_mode, g.health)
            for g in Gpu.objects.filter(node_id=node_id).select_related("model")}


def test_registration_stores_each_gpu_as_reported_and_what_it_could_not_tell_as_unknown(acme, join_token):
    body = register_body(join_token, name="gpu-rec")
    known = dict(body["gpus"][0])
    body["gpus"][0]["numa_node"] = 0  # NUMA node 0 is a node, not "none"
    body["gpus"][1].update(numa_node=-1, mig_mode="enabled", model="Mystery Accelerator 9000")  # sysfs: "none"
    body["gpus"][2].update(numa_node=None, uuid=None, model=None, memory_mb=None, pci_bus_id=None,
                           nvlink_island=None, mig_mode="unsupported")
    body["gpus"][3].update(numa_node=1, nvlink_island=1)
    before = timezone.now()
    resp = APIClient().post(f"{API}/register", body, format="json")
    assert resp.status_code == 201, resp.content
    rows = _gpu_rows(resp.json()["node_id"])
    sent = body["gpus"]
    assert rows == {
        0: (known["uuid"], "A100-80GB", known["model"], known["memory_mb"], 0, 0, known["pci_bus_id"], False,
            GpuHealth.HEALTHY),
        # A model the catalogue does not know: kept by name, never guessed (jobs asking for a model skip it).
        1: (sent[1]["uuid"], None, "Mystery Accelerator 9000", known["memory_mb"], sent[1]["nvlink_island"], None,
            sent[1]["pci_bus_id"], True, GpuHealth.HEALTHY),
        2: ("", None, "", 0, None, None, "", False, GpuHealth.HEALTHY),
        3: (sent[3]["uuid"], "A100-80GB", known["model"], known["memory_mb"], 1, 1, sent[3]["pci_bus_id"], False,
            GpuHealth.HEALTHY),
    }
    assert all(g.last_seen_at >= before for g in Gpu.objects.filter(node_id=resp.json()["node_id"]))


def test_gpus_renumbered_between_registrations_keep_their_uuids_and_a_missing_one_is_failed(acme, join_token):
    """The driver numbered the GPUs differently after a reboot (index 0 now has index 1's UUID) and
    one fell off the bus: the records follow the UUIDs, the missing index is never scheduled on."""
    body = register_body(join_token, name="gpu-renumbered")
    first = APIClient().post(f"{API}/register", body, format="json")
    node_id = first.json()["node_id"]
    uuids = [g["uuid"] for g in body["gpus"]]
    body["gpus"][0]["uuid"], body["gpus"][1]["uuid"] = uuids[1], uuids[0]
    body["gpus"][0]["mig_mode"] = "enabled"
    del body["gpus"][3]
    again = APIClient().post(f"{API}/register", body, format="json")
    assert again.status_code == 200, again.content
    rows = _gpu_rows(node_id)
    assert {i: (r[0], r[7], r[8]) for i, r in rows.items()} == {
        0: (uuids[1], True, GpuHealth.HEALTHY), 1: (uuids[0], False, GpuHealth.HEALTHY),
        2: (uuids[2], False, GpuHealth.HEALTHY), 3: ("", False, GpuHealth.FAILED)}
    assert Gpu.objects.filter(node_id=node_id).count() == 4, "the missing GPU's record stays: allocations point at it"


# -- join tokens and GPUs another node holds -------------------------------------------------------
def test_a_cloud_instances_token_is_refused_while_its_pool_is_disabled(acme, gpu_models):
    instance, instance_token = cloud_instance(acme)
    Pool.objects.filter(pk=instance.pool_id).update(enabled=False)
    resp = APIClient().post(f"{API}/register", register_body(instance_token), format="json")
    assert (resp.status_code, resp.json()) == (401, {"detail": "Invalid join token."})
    assert not Node.objects.filter(name=instance.node_name).exists()


@pytest.mark.parametrize("where", ["another node of this pool", "a node of the same name in another pool"])
def test_a_gpu_uuid_another_node_holds_is_refused_naming_the_gpu(acme, join_token, where):
    """Checked before anything is written, in words that name the GPU (not the node that has it)."""
    holder = register_body(join_token, name="holder", agent_key="key-holder-xx")
    assert APIClient().post(f"{API}/register", holder, format="json").status_code == 201
    if where == "another node of this pool":
        name, token = "newcomer", join_token
    else:
        other = Pool.objects.create(tenant=acme.tenant, name="onprem-2", kind=PoolKind.ONPREM, region="dc2")
        name, token = "holder", pool_join_token_issue(pool=other)
    body = register_body(token, name=name, agent_key="key-newcomer")
    for i, gpu in enumerate(body["gpus"]):  # its own GPUs, as a machine of the same name would have
        gpu["uuid"] = f"GPU-00000000-0000-0000-0000-00000000000{i}"
    taken = holder["gpus"][2]["uuid"]
    body["gpus"][1]["uuid"] = taken
    resp = APIClient().post(f"{API}/register", body, format="json")
    said = (f"GPU 1 ({taken}) is already registered to another node; remove that node before registering the "
            "GPU here.")
    assert (resp.status_code, resp.json()) == (409, {"gpus": [said], "detail": said})
    assert Node.objects.filter(name=name).count() == (1 if name == "holder" else 0)


def test_each_live_cloud_instances_agent_gets_in_with_its_own_token(acme, gpu_models):
    """Two instances launched into the pool, both waiting for their agents: each one-time token admits
    its own instance's node, whichever agent comes up first (mutant `_join_target` 9 looked up any live
    instance and refused every token but that one's)."""
    launched = [cloud_instance(acme, key="k" * 36 + suffix) for suffix in ("0001", "0002")]
    for instance, token in reversed(launched):
        body = register_body(token, name=instance.node_name, agent_key=f"key-{instance.node_name}")
        resp = APIClient().post(f"{API}/register", body, format="json")
        assert resp.status_code == 201, resp.content
        assert Node.objects.get(pk=resp.json()["node_id"]).name == instance.node_name


# -- GPUs as reported, not guessed -----------------------------------------------------------------
def test_a_gpu_the_driver_could_not_name_is_never_given_a_catalogue_model(acme, join_token, gpu_models):
    """Not even a model with a blank spelling among its aliases (an admin's stray "-"): jobs asking
    for that model must not land on GPUs nobody named."""
    a100 = gpu_models["A100-80GB"]
    a100.aliases = [*(a100.aliases or []), "-"]
    a100.save()
    body = register_body(join_token, name="gpu-unnamed")
    body["gpus"][2]["model"] = None
    body["gpus"][3]["model"] = ""
    resp = APIClient().post(f"{API}/register", body, format="json")
    assert resp.status_code == 201, resp.content
    rows = _gpu_rows(resp.json()["node_id"])
    named = body["gpus"][0]["model"]
    assert [rows[i][1:3] for i in range(4)] == [("A100-80GB", named), ("A100-80GB", named),
                                                (None, ""), (None, "")]


def test_gpu_uuids_of_any_shape_follow_their_gpus_when_renumbered(acme, join_token):
    """The broker keeps the UUID strings the agent sends as they are (a backend other than NVML need
    not write `GPU-...`): renumbered between two registrations, the records follow them and the
    re-registration is not taken for a GPU of another node."""
    body = register_body(join_token, name="gpu-odd-uuids")
    body["gpus"][0]["uuid"], body["gpus"][1]["uuid"] = "YYYY", "XXXX"
    first = APIClient().post(f"{API}/register", body, format="json")
    assert first.status_code == 201, first.content
    body["gpus"][0]["uuid"], body["gpus"][1]["uuid"] = "XXXX", "YYYY"
    again = APIClient().post(f"{API}/register", body, format="json")
    assert again.status_code == 200, again.content
    rows = _gpu_rows(first.json()["node_id"])
    assert (rows[0][0], rows[1][0]) == ("XXXX", "YYYY")


def test_an_unknown_gpu_model_is_logged_once_by_name_and_a_known_or_unnamed_one_not(acme, join_token, caplog):
    """The operator's cue to add the model or an alias (test_kubernetes_bridge.py reads it too)."""
    body = register_body(join_token, name="gpu-warned")
    body["gpus"][1]["model"] = body["gpus"][3]["model"] = "Mystery Accelerator 9000"
    body["gpus"][2]["model"] = None
    with caplog.at_level(logging.WARNING, logger="broker.agents.services"):
        resp = APIClient().post(f"{API}/register", body, format="json")
    assert resp.status_code == 201, resp.content
    warned = [r.getMessage() for r in caplog.records
              if r.name == "broker.agents.services" and r.levelno >= logging.WARNING]
    assert warned == ["node gpu-warned: GPU model 'Mystery Accelerator 9000' is not in the catalogue; "
                      "jobs that ask for a GPU model will not be placed on it until an admin adds the model "
                      "or an alias (admin: GPU models)"]
