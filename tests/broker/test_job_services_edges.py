"""The words and fields of refused job operations, as a user or the scheduler reads them (issue 9).

Each refusal is checked whole: the HTTP status and body a user gets, or the exception's message,
field and code (what broker.api.errors turns into that body and the scheduler logs as a conflict).
"""
from __future__ import annotations

import pytest
from django.utils import timezone

from broker.inventory.models import Gpu, GpuHealth, Node, NodeState
from broker.jobs import services
from broker.jobs.models import Allocation, AllocationSlice, Job, JobEvent
from broker.jobs.services import (DoubleBooking, GpuRequest, JobError, StaleState, allocation_commit,
                                  job_cancel, job_set_pending_reason, job_transition)
from broker.jobs.states import JobState

from .test_api_tenancy import submit

JOBS = "/api/v1/jobs"


def _force(job: Job, state: str) -> Job:
    Job.objects.filter(pk=job.pk).update(state=state)
    job.refresh_from_db()
    return job


# -- cancel ----------------------------------------------------------------------------------------
def test_cancelling_a_finished_job_is_a_409_naming_both_states(acme):
    job = _force(submit(acme), JobState.SUCCEEDED)
    resp = acme.client.post(f"{JOBS}/{job.pk}/cancel/")
    assert resp.status_code == 409
    assert resp.json() == {"state": ["A job cannot go from SUCCEEDED to CANCELLED."],
                           "code": "illegal_transition"}
    job.refresh_from_db()
    assert job.state == JobState.SUCCEEDED


def test_a_cancel_records_who_cancelled(acme):
    job = submit(acme)
    resp = acme.client.post(f"{JOBS}/{job.pk}/cancel/")
    assert resp.status_code == 200 and resp.json()["state"] == JobState.CANCELLED
    event = JobEvent.objects.filter(job=job, kind="state").latest("id")
    assert (event.reason_code, event.message) == ("USER_CANCELLED", f"Cancelled by {acme.admin}.")


def test_a_cancel_without_a_person_says_cancelled(acme):
    job = job_cancel(job=submit(acme))
    assert job.state == JobState.CANCELLED
    event = JobEvent.objects.filter(job=job, kind="state").latest("id")
    assert (event.reason_code, event.message) == ("USER_CANCELLED", "Cancelled.")


def test_a_cancel_gives_up_after_five_races_with_a_conflict(acme, monkeypatch):
    """Another writer changes the job before each of the cancel's attempts: five tries, then the
    user is told to try again (a 409), and the job is left as the other writer made it."""
    job = submit(acme)
    real = services.job_transition
    attempts = []

    def racing(**kwargs):
        attempts.append(kwargs["job"].state)
        if len(attempts) <= 5:  # the other writer wins this round
            other = JobState.PLACED if kwargs["job"].state == JobState.PENDING else JobState.PENDING
            Job.objects.filter(pk=kwargs["job"].pk).update(state=other)
        return real(**kwargs)

    monkeypatch.setattr(services, "job_transition", racing)
    with pytest.raises(JobError) as caught:
        job_cancel(job=job)
    err = caught.value
    assert (str(err), err.field, err.code) == ("The job kept changing state; try again.", "non_field_errors",
                                               "conflict")
    assert len(attempts) == 5
    job.refresh_from_db()
    assert job.state != JobState.CANCELLED


def test_a_job_in_a_state_this_version_does_not_know_is_refused_as_a_409(acme):
    """A row in a state outside the table (written by a newer release, or by hand) cannot be moved:
    the user gets the same 409 as for any refused transition, not a server error, and the row stays."""
    job = _force(submit(acme), "ARCHIVED")
    resp = acme.client.post(f"{JOBS}/{job.pk}/cancel/")
    assert resp.status_code == 409
    assert resp.json() == {"state": ["A job cannot go from ARCHIVED to CANCELLED."],
                           "code": "illegal_transition"}
    job.refresh_from_db()
    assert job.state == "ARCHIVED"


# -- other refusals ----------------------------------------------------------------------------------
def test_a_job_over_the_gpu_quota_is_a_400_on_resources(acme):
    acme.tenant.quota.max_gpus = 1
    acme.tenant.quota.save()
    resp = acme.client.post(f"{JOBS}/", {"name": "big", "command": ["python", "train.py"],
                                          "resources": {"gpus": 2}}, format="json")
    assert resp.status_code == 400
    assert resp.json() == {"resources": ["The job asks for 2 GPUs; your tenant's quota allows 1 at once."],
                           "code": "invalid"}


def test_a_stale_caller_is_told_the_state_the_job_is_in(acme):
    job = submit(acme)
    with pytest.raises(StaleState) as caught:
        job_transition(job=job, to=JobState.CANCELLED, expected=JobState.PLACED)
    err = caught.value
    assert (str(err), err.field, err.code) == ("The job is PENDING, not PLACED any more.", "state",
                                               "conflict")
    assert (err.expected, err.actual) == (JobState.PLACED, JobState.PENDING)


def test_a_gpu_share_already_taken_is_a_double_booking_on_gpus(acme):
    node = acme.nodes[0]
    first, second = submit(acme, name="a"), submit(acme, name="b")
    allocation_commit(job=first, requests=[GpuRequest(node=node, gpu_indices=(0,))])
    with pytest.raises(DoubleBooking) as caught:
        allocation_commit(job=second, requests=[GpuRequest(node=node, gpu_indices=(0,))])
    err = caught.value
    assert (str(err), err.field, err.code) == (
        f"GPU 0 on {node.name} does not have the share requested free.", "gpus", "double_booking")


def test_losing_the_race_for_a_slot_at_insert_is_a_double_booking_on_gpus(acme, monkeypatch):
    """Another transaction takes the slot between the free-slot check and the insert: the unique
    index refuses it, and the caller gets the generic double-booking error, not an IntegrityError."""
    node = acme.nodes[0]
    rival, job = submit(acme, name="rival"), submit(acme, name="late")
    (rival_alloc,) = allocation_commit(job=rival, requests=[GpuRequest(node=node, gpu_indices=(1,))])
    manager = AllocationSlice.objects
    real_bulk_create = manager.bulk_create

    def racing_bulk_create(objs, *args, **kwargs):
        objs = list(objs)
        manager.create(allocation=rival_alloc, gpu=objs[0].gpu, mask=objs[0].mask, slots=objs[0].slots)  # the rival's
        return real_bulk_create(objs, *args, **kwargs)

    monkeypatch.setattr(manager, "bulk_create", racing_bulk_create)
    with pytest.raises(DoubleBooking) as caught:
        allocation_commit(job=job, requests=[GpuRequest(node=node, gpu_indices=(0,))])
    err = caught.value
    assert (str(err), err.field, err.code) == ("One of these GPUs is already allocated.", "gpus",
                                               "double_booking")
    job.refresh_from_db()
    assert job.state == JobState.PENDING


def test_nothing_to_allocate_is_an_invalid_request_on_gpus(acme):
    with pytest.raises(JobError) as caught:
        allocation_commit(job=submit(acme), requests=[])
    err = caught.value
    assert (str(err), err.field, err.code) == ("Nothing to allocate.", "gpus", "invalid")


def test_the_gpu_quota_message_counts_gpus_not_slots(acme):
    acme.tenant.quota.max_gpus = 1
    acme.tenant.quota.save()
    node = acme.nodes[0]
    first = submit(acme, name="h1", resources={"gpu_fraction": 0.5})
    allocation_commit(job=first, requests=[GpuRequest(node=node, gpu_indices=(0,), milli=500)])
    with pytest.raises(JobError) as caught:
        allocation_commit(job=submit(acme, name="w"), requests=[GpuRequest(node=node, gpu_indices=(1,))])
    err = caught.value
    assert (str(err), err.field, err.code) == ("GPU quota exceeded: 0.5 in use + 1 > 1.", "resources",
                                               "quota")


# -- why a pending job waits -----------------------------------------------------------------------
def test_a_pending_reason_is_recorded_on_that_job_only_and_logged_when_it_changes(acme):
    job, other = submit(acme, name="waits"), submit(acme, name="other")
    data = {"pool": "onprem", "max_instances": 2}
    job_set_pending_reason(job=job, code="OFFER_QUOTA", message="The pool is at its instance cap.", data=data)
    job.refresh_from_db()
    other.refresh_from_db()
    assert (job.pending_reason_code, job.pending_reason, job.pending_reason_data) == (
        "OFFER_QUOTA", "The pool is at its instance cap.", data)
    assert (other.pending_reason_code, other.pending_reason) == ("NOT_YET_SCHEDULED",
                                                                  "Waiting for the next scheduling cycle.")
    (event,) = JobEvent.objects.filter(job=job, kind="pending_reason")
    assert (event.reason_code, event.message, event.data) == (
        "OFFER_QUOTA", "The pool is at its instance cap.", data)
    assert not JobEvent.objects.filter(job=other, kind="pending_reason").exists()
    # The same reason again (next cycle, new words): recorded, but no second event.
    job_set_pending_reason(job=job, code="OFFER_QUOTA", message="Still at the cap.")
    job.refresh_from_db()
    assert (job.pending_reason, job.pending_reason_data) == ("Still at the cap.", {})
    assert JobEvent.objects.filter(job=job, kind="pending_reason").count() == 1


def test_a_reason_for_a_job_placed_meanwhile_is_dropped(acme):
    """The cycle planned `job` as waiting, but it was placed before the reason was written: a placed
    job says nothing about waiting, and its history gets no pending-reason event."""
    job = submit(acme)
    allocation_commit(job=job, requests=[GpuRequest(node=acme.nodes[0], gpu_indices=(0,))])
    job_set_pending_reason(job=job, code="NO_CAPACITY", message="No node has a free GPU.")
    job.refresh_from_db()
    assert (job.state, job.pending_reason_code, job.pending_reason) == (JobState.PLACED, "", "")
    assert not JobEvent.objects.filter(job=job, kind="pending_reason").exists()
    shown = acme.client.get(f"{JOBS}/{job.pk}/").json()
    assert shown["state"] == JobState.PLACED


# -- placing a job -----------------------------------------------------------------------------------
def test_a_placement_is_logged_with_where_it_went_and_moves_the_nodes_epoch_on(acme):
    node = acme.nodes[0]
    epoch = node.epoch
    job = submit(acme, resources={"gpus": 2})
    (alloc,) = allocation_commit(job=job, requests=[GpuRequest(node=node, gpu_indices=(0, 1))])
    node.refresh_from_db()
    assert node.epoch == epoch + 1 and alloc.epoch == node.epoch
    held = list(AllocationSlice.objects.filter(allocation=alloc).values_list("gpu__index", "mask", "slots"))
    assert sorted(held) == [(0, 2 ** Gpu.SLOTS - 1, Gpu.SLOTS), (1, 2 ** Gpu.SLOTS - 1, Gpu.SLOTS)], \
        "every slot of GPUs 0 and 1"
    event = JobEvent.objects.filter(job=job, kind="state").latest("id")
    assert (event.reason_code, event.message) == ("PLACED", f"Placed on {node.name}[0,1]")
    assert event.data == {"from": "PENDING", "to": "PLACED",
                          "placements": [{"node": node.name, "gpus": [0, 1], "milli": 1000}]}


def test_a_placement_on_two_nodes_names_both(acme):
    first, second = acme.nodes[:2]
    job = submit(acme, resources={"gpus": 2})
    allocation_commit(job=job, requests=[GpuRequest(node=first, gpu_indices=(0,)),
                                         GpuRequest(node=second, gpu_indices=(3,))])
    event = JobEvent.objects.filter(job=job, kind="state").latest("id")
    assert event.message == f"Placed on {first.name}[0], {second.name}[3]"


def test_a_placement_planned_for_a_pending_job_does_not_land_on_it_once_it_moved_on(acme):
    """The commit's compare-and-set is on the state the caller planned from (PENDING by default), not
    on whatever the job object says now: a job that meanwhile went to MIGRATING keeps what it has."""
    job = _force(submit(acme), JobState.MIGRATING)
    with pytest.raises(StaleState) as caught:
        allocation_commit(job=job, requests=[GpuRequest(node=acme.nodes[0], gpu_indices=(0,))])
    assert (caught.value.expected, caught.value.actual) == (JobState.PENDING, JobState.MIGRATING)
    job.refresh_from_db()
    assert job.state == JobState.MIGRATING
    assert not AllocationSlice.objects.filter(allocation__job=job).exists(), "nothing half-written"


def _refused_placement(acme, job, request) -> JobError:
    with pytest.raises(JobError) as caught:
        allocation_commit(job=job, requests=[request])
    job.refresh_from_db()
    assert job.state == JobState.PENDING
    assert not AllocationSlice.objects.filter(allocation__job=job).exists(), "nothing half-written"
    return caught.value


def test_a_gpu_index_the_node_does_not_have_is_refused_on_gpus(acme):
    node = acme.nodes[0]
    err = _refused_placement(acme, submit(acme, resources={"gpus": 2}), GpuRequest(node=node, gpu_indices=(0, 99)))
    assert (str(err), err.field, err.code) == (f"Node {node.name} has no GPU index among [0, 99].", "gpus",
                                               "invalid")


def test_a_failed_gpu_is_refused_on_gpus(acme):
    node = acme.nodes[0]
    node.gpus.filter(index=1).update(health=GpuHealth.FAILED)
    err = _refused_placement(acme, submit(acme, resources={"gpus": 2}), GpuRequest(node=node, gpu_indices=(0, 1)))
    assert (str(err), err.field, err.code) == (f"A requested GPU on {node.name} has failed.", "gpus", "invalid")


def test_a_draining_node_is_refused_on_node(acme):
    node = acme.nodes[0]
    Node.objects.filter(pk=node.pk).update(state=NodeState.DRAINING)
    err = _refused_placement(acme, submit(acme), GpuRequest(node=node, gpu_indices=(0,)))
    assert (str(err), err.field, err.code) == (f"Node {node.name} is DRAINING.", "node", "invalid")


def test_another_teams_node_is_refused_as_no_pool_access(acme, globex):
    node = globex.nodes[0]
    err = _refused_placement(acme, submit(acme), GpuRequest(node=node, gpu_indices=(0,)))
    assert (str(err), err.field, err.code) == (f"Node {node.name} is in a pool this team may not use.", "node",
                                               "no_pool_access")


# -- moving a job between states ---------------------------------------------------------------------
def test_a_job_sent_back_to_the_queue_without_words_says_requeued(acme):
    job = submit(acme)
    allocation_commit(job=job, requests=[GpuRequest(node=acme.nodes[0], gpu_indices=(0,))])
    Job.objects.filter(pk=job.pk).update(next_attempt_at=None)
    before = timezone.now()
    job = job_transition(job=job, to=JobState.PENDING)
    assert (job.pending_reason_code, job.pending_reason, job.pending_reason_data) == ("REQUEUED",
                                                                                      "Back in the queue.", {})
    assert job.next_attempt_at is not None and job.next_attempt_at >= before, "the next cycle may try it at once"
    assert not AllocationSlice.objects.filter(allocation__job=job, active=True).exists(), "its GPUs are free"
    released = Allocation.objects.get(job=job)
    assert released.stop_unconfirmed is False, "a normal release makes the next start wait for nothing"
    event = JobEvent.objects.filter(job=job, kind="state").latest("id")
    assert (event.reason_code, event.message, event.data) == ("", "PLACED → PENDING",
                                                              {"from": "PLACED", "to": "PENDING"})


def test_a_job_leaving_the_queue_forgets_why_it_waited_and_records_when_it_ran_and_ended(acme):
    job = submit(acme)
    job_set_pending_reason(job=job, code="INSUFFICIENT_GPUS", message="0/2 nodes fit", data={"nodes_fit": 0})
    allocation_commit(job=job, requests=[GpuRequest(node=acme.nodes[0], gpu_indices=(0,))])
    job.refresh_from_db()
    assert (job.pending_reason_code, job.pending_reason, job.pending_reason_data) == ("", "", {})
    assert job.started_at is None and job.finished_at is None
    job = job_transition(job=job, to=JobState.STARTING)
    job = job_transition(job=job, to=JobState.RUNNING)
    assert job.started_at is not None and job.finished_at is None
    job = job_transition(job=job, to=JobState.SUCCEEDED)
    assert job.finished_at is not None and job.finished_at >= job.started_at
    assert not AllocationSlice.objects.filter(allocation__job=job, active=True).exists(), "its GPUs are free"


def test_a_preempted_job_hands_its_gpus_over(acme):
    job = submit(acme)
    allocation_commit(job=job, requests=[GpuRequest(node=acme.nodes[0], gpu_indices=(0,))])
    for state in (JobState.STARTING, JobState.RUNNING, JobState.PREEMPTED):
        job = job_transition(job=job, to=state)
    assert not AllocationSlice.objects.filter(allocation__job=job, active=True).exists()
    assert Allocation.objects.get(job=job).active is False


def test_a_caller_of_a_deleted_job_is_told_it_was_deleted(acme):
    job = submit(acme)
    Job.objects.filter(pk=job.pk).delete()
    with pytest.raises(StaleState) as caught:
        job_transition(job=job, to=JobState.CANCELLED)
    assert (caught.value.expected, caught.value.actual) == (JobState.PENDING, "deleted")
