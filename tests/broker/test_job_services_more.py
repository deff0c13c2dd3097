"""Submissions, quotas, requeues and releases as a user or an operator sees them (issue 9, second pass).

Written for the mutants of `broker/jobs/services.py` the first runs did not reach: what lands in the
job's row from its spec, where a quota refuses a submission and where it does not, and what a requeue
or a release leaves behind (states, events, GPU slots, node epochs).
"""
from __future__ import annotations

from datetime import timedelta
from decimal import Decimal

import pytest
from django.utils import timezone

from broker.inventory.models import Gpu, Node
from broker.jobs import services
from broker.jobs.models import Allocation, AllocationSlice, Job, JobEvent
from broker.jobs.services import (GpuRequest, JobError, allocation_commit, event_append, job_allocations_release,
                                  job_requeue, job_transition, jobs_requeue_on_node)
from broker.jobs.states import JobState
from broker.tenancy.models import Quota

from .test_api_tenancy import submit

JOBS = "/api/v1/jobs/"


def _set_quota(world, **limits) -> None:
    Quota.objects.filter(tenant=world.tenant).update(**limits)


def _epoch(node: Node) -> int:
    return Node.objects.get(pk=node.pk).epoch


def _held_slots(job: Job) -> int:
    return sum(AllocationSlice.objects.filter(allocation__job=job, active=True).values_list("slots", flat=True))


def _start(job: Job) -> Job:
    """PLACED to RUNNING, as the agent reports it."""
    job.refresh_from_db()
    return job_transition(job=job_transition(job=job, to=JobState.STARTING), to=JobState.RUNNING)


# -- what a submission stores ------------------------------------------------------------------------
def test_every_part_of_a_full_spec_lands_in_its_job_column(acme):
    """The scheduler, the billing and the console read these columns, not the spec: each must hold
    what the user asked for."""
    deadline = timezone.now() + timedelta(days=2)
    job = submit(acme, name="full", priority=700, preemptible=True, secrets={"HF_TOKEN": "s3cret"},
                 expected_duration_hours=2.5, deadline=deadline.isoformat(),
                 resources={"gpus": 2, "gpu_models": ["a100-80gb"], "interconnect": "nvlink", "cpu": 8,
                            "memory_gb": 64, "min_gpu_memory_gb": 40},
                 placement={"spot": "allowed", "max_price_per_hour": 12.5})
    job.refresh_from_db()
    assert job.name == "full"
    assert job.secret_env == {"HF_TOKEN": "s3cret"}
    assert "s3cret" not in str(job.spec), "a secret must stay out of the stored spec"
    assert job.spec["name"] == "full" and job.spec["resources"]["gpus"] == 2
    assert (job.priority, job.preemptible) == (700, True)
    assert (job.gpu_count, job.gpu_milli, job.node_count, job.compute_units) == (2, 1000, 1, None)
    assert (job.gpu_models, job.gpu_alternatives, job.min_gpu_memory_gb) == (["A100-80GB"], {}, 40)
    assert (job.interconnect, job.cpu_milli, job.memory_mb) == ("nvlink", 8000, 65536)
    assert (job.spot, job.max_price_per_hour) == ("allowed", Decimal("12.5"))
    assert job.expected_duration_hours == 2.5
    assert abs((job.deadline - deadline).total_seconds()) < 1


def test_a_minimal_spec_gets_normal_priority_no_secrets_and_no_limits(acme):
    job = submit(acme)
    job.refresh_from_db()
    assert (job.priority, job.preemptible, job.secret_env) == (50, False, {})
    assert (job.max_price_per_hour, job.expected_duration_hours, job.deadline) == (None, None, None)
    assert (job.spot, job.interconnect, job.gpu_count, job.node_count) == ("never", "any", 1, 1)


def test_a_compute_unit_job_and_a_multi_node_fraction_free_job_store_their_shapes(acme):
    cu = submit(acme, name="cu", resources={"compute_units": 2.5})
    cu.refresh_from_db()
    assert (cu.compute_units, cu.gpu_count) == (Decimal("2.5"), 0)
    half = submit(acme, name="half", resources={"gpu_fraction": 0.5})
    half.refresh_from_db()
    assert (half.gpu_milli, half.gpu_count) == (500, 1)
    wide = submit(acme, name="wide", resources={"gpus": 4, "nodes": 2})
    wide.refresh_from_db()
    assert (wide.gpu_count, wide.node_count) == (4, 2)


def test_a_submission_says_it_waits_for_the_next_cycle_and_logs_who_submitted_what(acme):
    before = timezone.now()
    job = submit(acme, resources={"gpus": 2})
    job.refresh_from_db()
    assert (job.state, job.pending_reason_code, job.pending_reason) == (
        JobState.PENDING, "NOT_YET_SCHEDULED", "Waiting for the next scheduling cycle.")
    assert before <= job.next_attempt_at <= timezone.now(), "the next cycle must look at it at once"
    assert (job.tenant, job.owner) == (acme.tenant, acme.admin)
    events = list(JobEvent.objects.filter(job=job))
    assert len(events) == 1
    event = events[0]
    assert (event.kind, event.message, event.reason_code) == ("submitted", f"Submitted by {acme.admin}.", "")
    assert event.data["demand"]["gpus_per_node"] == 2 and event.data["demand"]["total_gpus"] == 2


# -- quotas at submission ----------------------------------------------------------------------------
def test_a_job_asking_for_exactly_the_gpu_quota_is_accepted(acme):
    _set_quota(acme, max_gpus=2)
    resp = acme.client.post(JOBS, {"name": "fits", "command": ["true"], "resources": {"gpus": 2}}, format="json")
    assert resp.status_code == 201, resp.content


def test_a_job_over_the_compute_unit_quota_is_a_400_on_resources(acme):
    _set_quota(acme, max_compute_units=Decimal("3"))
    resp = acme.client.post(JOBS, {"name": "big", "command": ["true"], "resources": {"compute_units": 3.5}},
                            format="json")
    assert resp.status_code == 400
    assert resp.json() == {"resources": ["The job asks for 3.5 compute units; your quota allows 3.000."],
                           "code": "invalid"}
    assert not Job.objects.filter(tenant=acme.tenant).exists()


def test_a_job_asking_for_exactly_the_compute_unit_quota_is_accepted(acme):
    _set_quota(acme, max_compute_units=Decimal("3"))
    resp = acme.client.post(JOBS, {"name": "fits", "command": ["true"], "resources": {"compute_units": 3}},
                            format="json")
    assert resp.status_code == 201, resp.content


def test_zero_quotas_mean_no_limit_at_submission(acme):
    _set_quota(acme, max_gpus=0, max_compute_units=Decimal("0"))
    for resources in ({"gpus": 8, "nodes": 4}, {"compute_units": 5000}):
        resp = acme.client.post(JOBS, {"name": "big", "command": ["true"], "resources": resources}, format="json")
        assert resp.status_code == 201, resp.content


def test_a_gpu_quota_does_not_refuse_a_compute_unit_job_and_the_reverse(acme):
    """Each limit reads only its own ask: a compute-unit job asks for no GPUs, a GPU job for no compute
    units, so neither is refused by the other's quota."""
    _set_quota(acme, max_gpus=1, max_compute_units=Decimal("1"))
    cu = acme.client.post(JOBS, {"name": "cu", "command": ["true"], "resources": {"compute_units": 1}},
                          format="json")
    gpus = acme.client.post(JOBS, {"name": "g", "command": ["true"], "resources": {"gpus": 1}}, format="json")
    assert (cu.status_code, gpus.status_code) == (201, 201), (cu.content, gpus.content)


def test_the_last_pending_slot_is_given_and_the_next_is_a_429_saying_throttled(acme):
    _set_quota(acme, max_pending_jobs=2)
    spec = {"name": "q", "command": ["true"], "resources": {"gpus": 1}}
    assert acme.client.post(JOBS, spec, format="json").status_code == 201
    assert acme.client.post(JOBS, spec, format="json").status_code == 201
    refused = acme.client.post(JOBS, spec, format="json")
    assert refused.status_code == 429
    assert refused.json() == {"non_field_errors": ["Your tenant already has 2 pending jobs (limit 2)."],
                              "code": "throttled"}


def test_a_limit_of_one_pending_job_lets_the_first_in(acme):
    """With no pending job yet the count reads no row at all: that is zero, not one."""
    _set_quota(acme, max_pending_jobs=1)
    spec = {"name": "q", "command": ["true"], "resources": {"gpus": 1}}
    assert acme.client.post(JOBS, spec, format="json").status_code == 201
    assert acme.client.post(JOBS, spec, format="json").status_code == 429


def test_a_team_without_a_quota_row_may_submit_anything(acme):
    Quota.objects.filter(tenant=acme.tenant).delete()
    job = submit(acme, resources={"gpus": 8, "nodes": 8})
    assert job.state == JobState.PENDING


# -- quotas at allocation ----------------------------------------------------------------------------
def test_a_placement_over_the_gpu_quota_is_refused_as_quota_on_resources(acme):
    _set_quota(acme, max_gpus=1)
    job = submit(acme)
    allocation_commit(job=job, requests=[GpuRequest(node=acme.nodes[0], gpu_indices=(0,))])
    second = submit(acme, name="b")
    with pytest.raises(JobError) as caught:
        allocation_commit(job=second, requests=[GpuRequest(node=acme.nodes[1], gpu_indices=(0,))])
    err = caught.value
    assert (str(err), err.field, err.code) == ("GPU quota exceeded: 1 in use + 1 > 1.", "resources", "quota")
    second.refresh_from_db()
    assert second.state == JobState.PENDING and _held_slots(second) == 0


def test_a_gpu_without_a_known_model_counts_no_compute_units(acme):
    """A GPU the catalogue does not know (model unset) has no compute units: a job placed on it uses
    none of the team's compute-unit quota."""
    _set_quota(acme, max_compute_units=Decimal("0.5"))
    Gpu.objects.filter(node=acme.nodes[0], index__in=(0, 1)).update(model=None)
    job = submit(acme, resources={"gpus": 2})
    allocation_commit(job=job, requests=[GpuRequest(node=acme.nodes[0], gpu_indices=(0, 1))])
    job.refresh_from_db()
    assert job.state == JobState.PLACED and _held_slots(job) == 2 * Gpu.SLOTS


def test_a_placement_over_the_compute_unit_quota_names_the_units(acme):
    one = Gpu.objects.select_related("model").get(node=acme.nodes[0], index=0).model.compute_units
    _set_quota(acme, max_compute_units=one)
    job = submit(acme, resources={"gpus": 2})
    with pytest.raises(JobError) as caught:
        allocation_commit(job=job, requests=[GpuRequest(node=acme.nodes[0], gpu_indices=(0, 1))])
    err = caught.value
    assert (str(err), err.field, err.code) == (
        f"Compute-unit quota exceeded: 0 in use + {one * 2:g} > {one:g}.", "resources", "quota")


# -- releases ----------------------------------------------------------------------------------------
def test_releasing_a_moved_jobs_source_frees_its_gpus_and_keeps_its_state(acme):
    """`job_allocations_release` (a migration's source, stopped): the GPUs are free for the next job,
    the allocation records when, the node's epoch moves on, and the job stays where it is."""
    node = acme.nodes[0]
    job = submit(acme, resources={"gpus": 2})
    allocation_commit(job=job, requests=[GpuRequest(node=node, gpu_indices=(0, 1))])
    job = _start(job)
    epoch = _epoch(node)
    before = timezone.now()
    assert job_allocations_release(job=job) == 1
    job.refresh_from_db()
    assert job.state == JobState.RUNNING
    alloc = Allocation.objects.get(job=job)
    assert (alloc.active, alloc.stop_unconfirmed) == (False, False)
    assert before <= alloc.released_at <= timezone.now()
    released = AllocationSlice.objects.filter(allocation=alloc).values_list("slots", "active")
    assert _held_slots(job) == 0 and sorted(released) == [(Gpu.SLOTS, False)] * 2
    assert _epoch(node) == epoch + 1
    assert job_allocations_release(job=job) == 0, "nothing left to release"
    assert _epoch(node) == epoch + 1, "a release of nothing does not move the node on"
    other = submit(acme, name="next", resources={"gpus": 2})
    allocation_commit(job=other, requests=[GpuRequest(node=node, gpu_indices=(0, 1))])


def test_a_release_touches_only_that_jobs_allocations_and_their_nodes(acme):
    mine, theirs = submit(acme, name="mine"), submit(acme, name="theirs")
    allocation_commit(job=mine, requests=[GpuRequest(node=acme.nodes[0], gpu_indices=(0,))])
    allocation_commit(job=theirs, requests=[GpuRequest(node=acme.nodes[1], gpu_indices=(0,))])
    epochs = (_epoch(acme.nodes[0]), _epoch(acme.nodes[1]))
    assert job_allocations_release(job=mine) == 1
    assert _held_slots(mine) == 0 and _held_slots(theirs) == Gpu.SLOTS
    assert Allocation.objects.get(job=theirs).released_at is None
    assert (_epoch(acme.nodes[0]), _epoch(acme.nodes[1])) == (epochs[0] + 1, epochs[1])


def test_a_job_on_two_nodes_releases_both_and_moves_both_epochs_on(acme):
    job = submit(acme, resources={"gpus": 1, "nodes": 2})
    allocation_commit(job=job, requests=[GpuRequest(node=acme.nodes[0], gpu_indices=(0,)),
                                         GpuRequest(node=acme.nodes[1], gpu_indices=(0,))])
    epochs = (_epoch(acme.nodes[0]), _epoch(acme.nodes[1]))
    assert job_allocations_release(job=job) == 2
    assert (_epoch(acme.nodes[0]), _epoch(acme.nodes[1])) == (epochs[0] + 1, epochs[1] + 1)
    assert not Allocation.objects.filter(job=job, active=True).exists()


# -- requeues ----------------------------------------------------------------------------------------
def _running(world, name: str, node: Node, index: int = 0) -> Job:
    job = submit(world, name=name)
    allocation_commit(job=job, requests=[GpuRequest(node=node, gpu_indices=(index,))])
    return _start(job)


def test_a_requeued_running_job_waits_with_the_given_reason_and_frees_its_gpu(acme):
    job = _running(acme, "r", acme.nodes[0])
    assert job_requeue(job=job, reason_code="NODE_LOST", message="The node went silent.") is True
    job.refresh_from_db()
    assert (job.state, job.pending_reason_code, job.pending_reason) == (
        JobState.PENDING, "NODE_LOST", "The node went silent.")
    event = JobEvent.objects.filter(job=job, kind="state").latest("id")
    assert (event.reason_code, event.message, event.data) == (
        "NODE_LOST", "The node went silent.", {"from": JobState.RUNNING, "to": JobState.PENDING})
    alloc = Allocation.objects.get(job=job)
    assert (alloc.active, alloc.stop_unconfirmed) == (False, False)


def test_a_checkpointing_job_is_requeued_through_preempted_with_its_processes_unconfirmed(acme):
    job = _running(acme, "c", acme.nodes[0])
    job = job_transition(job=job, to=JobState.CHECKPOINTING)
    assert job_requeue(job=job, reason_code="NODE_LOST", message="lost", stop_unconfirmed=True) is True
    job.refresh_from_db()
    assert job.state == JobState.PENDING
    moves = [(e.data["from"], e.data["to"], e.reason_code, e.message)
             for e in JobEvent.objects.filter(job=job, kind="state").order_by("id")][-2:]
    assert moves == [(JobState.CHECKPOINTING, JobState.PREEMPTED, "NODE_LOST", "lost"),
                     (JobState.PREEMPTED, JobState.PENDING, "NODE_LOST", "lost")]
    assert Allocation.objects.get(job=job).stop_unconfirmed is True


def test_requeueing_a_finished_job_is_refused_quietly(acme):
    job = _running(acme, "f", acme.nodes[0])
    job = job_transition(job=job, to=JobState.SUCCEEDED)
    events = JobEvent.objects.filter(job=job).count()
    assert job_requeue(job=job, reason_code="NODE_LOST", message="lost") is False
    job.refresh_from_db()
    assert job.state == JobState.SUCCEEDED and JobEvent.objects.filter(job=job).count() == events


def test_a_requeue_that_loses_a_race_retries_on_the_new_state(acme):
    """The job moved on under the caller (RUNNING to CHECKPOINTING): the requeue reads it again and
    goes through PREEMPTED, as for any checkpointing job."""
    job = _running(acme, "race", acme.nodes[0])
    Job.objects.filter(pk=job.pk).update(state=JobState.CHECKPOINTING)  # job still says RUNNING
    assert job_requeue(job=job, reason_code="NODE_LOST", message="lost") is True
    job.refresh_from_db()
    assert job.state == JobState.PENDING
    assert JobEvent.objects.filter(job=job, kind="state", data__to=JobState.PREEMPTED).exists()


def test_a_requeue_gives_up_after_three_lost_races(acme, monkeypatch):
    job = _running(acme, "busy", acme.nodes[0])
    real = services.job_transition
    attempts: list[str] = []

    def racing(**kwargs):
        attempts.append(kwargs["job"].state)
        if len(attempts) <= 3:  # another writer moves it RUNNING <-> CHECKPOINTING first
            other = JobState.CHECKPOINTING if kwargs["job"].state == JobState.RUNNING else JobState.RUNNING
            Job.objects.filter(pk=kwargs["job"].pk).update(state=other)
        return real(**kwargs)

    monkeypatch.setattr(services, "job_transition", racing)
    assert job_requeue(job=job, reason_code="NODE_LOST", message="lost") is False
    assert len(attempts) == 3
    job.refresh_from_db()
    assert job.state != JobState.PENDING


def test_a_lost_node_requeues_exactly_the_jobs_holding_its_gpus(acme):
    node, other = acme.nodes
    first, second = _running(acme, "a", node, 0), _running(acme, "b", node, 1)
    elsewhere = _running(acme, "c", other, 0)
    gone = _running(acme, "d", node, 2)
    job_allocations_release(job=gone)  # its allocation on the node is no longer active
    finished = submit(acme, name="e")
    requeued = jobs_requeue_on_node(node_id=node.pk, reason_code="NODE_LOST", message="silent",
                                    stop_unconfirmed=True)
    assert sorted(requeued) == sorted([first.pk, second.pk])
    states = dict(Job.objects.filter(pk__in=[first.pk, second.pk, elsewhere.pk, gone.pk, finished.pk])
                  .values_list("pk", "state"))
    assert states == {first.pk: JobState.PENDING, second.pk: JobState.PENDING, elsewhere.pk: JobState.RUNNING,
                      gone.pk: JobState.RUNNING, finished.pk: JobState.PENDING}
    assert (Job.objects.get(pk=first.pk).pending_reason_code, Job.objects.get(pk=first.pk).pending_reason) == (
        "NODE_LOST", "silent")
    assert set(Allocation.objects.filter(job__in=[first, second]).values_list("stop_unconfirmed", flat=True)) == {True}


def test_a_job_with_two_allocations_on_the_lost_node_is_requeued_once(acme):
    node = acme.nodes[0]
    job = submit(acme, resources={"gpus": 2})
    allocation_commit(job=job, requests=[GpuRequest(node=node, gpu_indices=(0,)),
                                         GpuRequest(node=node, gpu_indices=(1,))])
    job = _start(job)
    assert jobs_requeue_on_node(node_id=node.pk, reason_code="NODE_LOST", message="silent") == [job.pk]
    assert JobEvent.objects.filter(job=job, kind="state", data__to=JobState.PENDING).count() == 1


def test_a_node_whose_jobs_already_finished_requeues_nothing(acme):
    node = acme.nodes[0]
    job = _running(acme, "done", node)
    Job.objects.filter(pk=job.pk).update(state=JobState.SUCCEEDED)  # its release not yet written
    assert jobs_requeue_on_node(node_id=node.pk, reason_code="NODE_LOST", message="silent") == []


# -- events ------------------------------------------------------------------------------------------
def test_an_event_keeps_its_kind_words_reason_and_data(acme):
    job = submit(acme)
    event = event_append(job=job, kind="checkpoint", message="Saved step 10.", reason_code="CKPT",
                         data={"step": 10})
    event.refresh_from_db()
    assert (event.job_id, event.kind, event.message, event.reason_code, event.data) == (
        job.pk, "checkpoint", "Saved step 10.", "CKPT", {"step": 10})
    bare = event_append(job=job, kind="note")
    bare.refresh_from_db()
    assert (bare.message, bare.reason_code, bare.data) == ("", "", {})


# -- transitions -------------------------------------------------------------------------------------
def test_a_job_sent_back_to_the_queue_with_details_shows_them_in_its_pending_reason(acme):
    """A move waiting for room elsewhere (broker.jobs.migration) sends the job back with the migration's
    id: the user reads it in the job's pending reason, next to the words."""
    job = _running(acme, "moving", acme.nodes[0])
    job_transition(job=job, to=JobState.PENDING, reason_code="MIGRATING",
                   message="Being moved: waiting for room elsewhere.", data={"migration": 7})
    body = acme.client.get(f"{JOBS}{job.pk}/").json()
    assert body["state"] == JobState.PENDING
    assert body["pending_reason"] == {"code": "MIGRATING", "message": "Being moved: waiting for room elsewhere.",
                                      "data": {"migration": 7}}


def test_a_terminated_instances_jobs_are_requeued_without_waiting_for_a_stop_confirmation(acme):
    """A cloud instance that is gone (INSTANCE_TERMINATED) ran nothing any more: its jobs go back to the
    queue with their old allocations settled, so their next start does not wait for a stop report from
    a machine that no longer exists (broker.agents.fencing)."""
    node = acme.nodes[0]
    job = _running(acme, "spot", node)
    assert jobs_requeue_on_node(node_id=node.pk, reason_code="INSTANCE_TERMINATED",
                                message="The instance was terminated.") == [job.pk]
    alloc = Allocation.objects.get(job=job)
    assert (alloc.active, alloc.stop_unconfirmed) == (False, False)
