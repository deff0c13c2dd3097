"""Set-based commits of a cycle (broker/jobs/batch.py): the checks and guarantees of allocation_commit,
for many jobs at once, and pending reasons written only when they change."""
from __future__ import annotations

import pytest
from django.db import connection
from django.db.models import ProtectedError

import broker.rows as rows
from broker.jobs.batch import pending_reasons_set, placements_commit
from broker.jobs.models import Allocation, AllocationSlice, Job, JobEvent
from broker.jobs.services import GpuRequest, allocation_commit, job_cancel
from broker.jobs.states import JobState
from broker.rows import rows_update
from broker.tenancy.models import Quota

from .test_api_tenancy import submit


def test_many_jobs_are_placed_with_their_events_and_node_epochs(acme):
    node = acme.nodes[0]
    epoch = node.epoch
    jobs = [submit(acme, name=f"j{i}") for i in range(4)]
    result = placements_commit(items=[(job, [GpuRequest(node=node, gpu_indices=(i,))]) for i, job in enumerate(jobs)])
    assert sorted(result.placed) == sorted(j.pk for j in jobs) and result.refused == {}
    for job in jobs:
        job.refresh_from_db()
        assert job.state == JobState.PLACED and job.pending_reason_code == ""
        assert JobEvent.objects.filter(job=job, kind="state", reason_code="PLACED").count() == 1
    node.refresh_from_db()
    assert node.epoch == epoch + 4
    assert sorted(Allocation.objects.filter(node=node).values_list("epoch", flat=True)) == [epoch + i for i in range(1, 5)]


def test_two_jobs_of_one_batch_never_get_the_same_gpu(acme):
    node = acme.nodes[0]
    first, second = submit(acme, name="a"), submit(acme, name="b")
    result = placements_commit(items=[(first, [GpuRequest(node=node, gpu_indices=(0, 1))]),
                                      (second, [GpuRequest(node=node, gpu_indices=(1, 2))])])
    assert result.placed == [first.pk] and "does not have the share requested free" in result.refused[second.pk]
    second.refresh_from_db()
    assert second.state == JobState.PENDING
    assert AllocationSlice.objects.filter(allocation__job=second).count() == 0, "nothing half-written"


def test_a_gpu_already_held_and_a_job_cancelled_meanwhile_are_refused_the_rest_placed(acme):
    node = acme.nodes[0]
    holder, cancelled, fine = (submit(acme, name=n) for n in ("holder", "cancelled", "fine"))
    allocation_commit(job=holder, requests=[GpuRequest(node=node, gpu_indices=(0,))])
    job_cancel(job=Job.objects.get(pk=cancelled.pk))
    late = submit(acme, name="late")
    result = placements_commit(items=[(late, [GpuRequest(node=node, gpu_indices=(0,))]),
                                      (cancelled, [GpuRequest(node=node, gpu_indices=(1,))]),
                                      (fine, [GpuRequest(node=node, gpu_indices=(2,))])])
    assert result.placed == [fine.pk]
    assert "CANCELLED" in result.refused[cancelled.pk] and late.pk in result.refused


def test_fractions_and_the_teams_gpu_quota_add_up_over_the_batch(acme):
    node = acme.nodes[0]
    Quota.objects.update_or_create(tenant=acme.tenant, defaults={"max_gpus": 1})
    halves = [submit(acme, name=f"h{i}", resources={"gpu_fraction": 0.5}) for i in range(3)]
    result = placements_commit(items=[(job, [GpuRequest(node=node, gpu_indices=(i,), milli=500)])
                                      for i, job in enumerate(halves)])
    assert result.placed == [halves[0].pk, halves[1].pk]
    assert "GPU quota exceeded" in result.refused[halves[2].pk]


def test_the_database_constraint_still_decides_when_the_batch_read_missed_a_holder(acme, monkeypatch):
    # The batch's read of held slots misses a holder (as a writer outside its locks would make it):
    # the partial unique constraint refuses the chunk, and its jobs are committed one by one with their
    # own checks, so the GPU is still booked once.
    import broker.jobs.batch as batch
    from collections import defaultdict

    node = acme.nodes[0]
    holder, job, other = submit(acme, name="holder"), submit(acme, name="job"), submit(acme, name="other")
    allocation_commit(job=holder, requests=[GpuRequest(node=node, gpu_indices=(0,))])
    monkeypatch.setattr(batch, "held_slots", lambda gpu_ids: defaultdict(set))
    result = placements_commit(items=[(job, [GpuRequest(node=node, gpu_indices=(0,))]),
                                      (other, [GpuRequest(node=node, gpu_indices=(5,))])])
    assert result.placed == [other.pk] and job.pk in result.refused
    job.refresh_from_db()
    assert job.state == JobState.PENDING
    assert AllocationSlice.objects.filter(allocation__job=job).count() == 0
    assert list(AllocationSlice.objects.filter(gpu__node=node, gpu__index=0, active=True)
                .values_list("allocation__job", "slots")) == [(holder.pk, 10)], "the holder's slots only"


def test_pending_reasons_are_written_only_when_they_change(acme):
    jobs = [submit(acme, name=f"p{i}") for i in range(3)]
    first = {job.pk: ("INSUFFICIENT_GPUS", "INSUFFICIENT_GPUS: 0/2 nodes fit", {"nodes": 2}) for job in jobs}
    assert pending_reasons_set(reasons=first) == 3
    events = JobEvent.objects.filter(kind="pending_reason").count()
    assert pending_reasons_set(reasons=first) == 0, "a cycle with nothing new writes nothing"
    changed = dict(first)
    changed[jobs[0].pk] = ("INSUFFICIENT_GPUS", "INSUFFICIENT_GPUS: 0/3 nodes fit", {"nodes": 3})
    changed[jobs[1].pk] = ("QUOTA_EXCEEDED", "QUOTA_EXCEEDED: over", {})
    assert pending_reasons_set(reasons=changed) == 2
    # An event only when the code changed.
    assert JobEvent.objects.filter(kind="pending_reason").count() == events + 1
    jobs[0].refresh_from_db()
    assert jobs[0].pending_reason == "INSUFFICIENT_GPUS: 0/3 nodes fit"


def test_each_allocation_placed_by_a_batch_gets_its_price_with_the_placement(acme):
    from decimal import Decimal

    from broker.billing.models import AllocationMeter, ChargebackRate
    from broker.inventory.models import Pool, PoolKind
    from broker.inventory.services import node_create_simulated

    node = acme.nodes[0]
    ChargebackRate.objects.create(pool=node.pool, gpu_model="A100-80GB", rate_usd_per_gpu_hour=Decimal("2.5"))
    cheap = Pool.objects.create(tenant=acme.tenant, name="lab", kind=PoolKind.ONPREM, region="dc2",
                                gpu_hour_rate_usd=Decimal("0.75"))
    other = node_create_simulated(pool=cheap, name="lab-0", gpu_model=node.gpus.first().model, gpu_count=2,
                                  nvlink_island_size=2, cpu_milli=16000, memory_mb=65536)
    jobs = [submit(acme, name=f"priced{i}") for i in range(3)]
    result = placements_commit(items=[(jobs[0], [GpuRequest(node=node, gpu_indices=(0,))]),
                                      (jobs[1], [GpuRequest(node=node, gpu_indices=(1,), milli=500)]),
                                      (jobs[2], [GpuRequest(node=other, gpu_indices=(0,))])])
    assert sorted(result.placed) == sorted(j.pk for j in jobs)
    meters = {m.allocation.job_id: m for m in AllocationMeter.objects.select_related("allocation")}
    assert [(meters[j.pk].rate_usd_per_gpu_hour, meters[j.pk].rate_source) for j in jobs] == [
        (Decimal("2.5"), "pool_model"), (Decimal("2.5"), "pool_model"), (Decimal("0.75"), "pool")]
    event = JobEvent.objects.get(job=jobs[0], kind="state", reason_code="PLACED")
    assert event.data["to"] == JobState.PLACED and event.created_at is not None


def test_a_billing_failure_leaves_the_placements_and_the_metering_run_prices_them(acme, monkeypatch):
    from django.utils import timezone

    from broker.billing import services as billing
    from broker.billing.models import AllocationMeter

    def broken(**kwargs):
        raise RuntimeError("the billing tables are unreadable")

    monkeypatch.setattr(billing, "meters_create", broken)
    jobs = [submit(acme, name=f"unbilled{i}") for i in range(2)]
    result = placements_commit(items=[(job, [GpuRequest(node=acme.nodes[0], gpu_indices=(i,))])
                                      for i, job in enumerate(jobs)])
    assert sorted(result.placed) == sorted(j.pk for j in jobs)
    assert Allocation.objects.filter(job__in=jobs, active=True).count() == 2
    assert not AllocationMeter.objects.filter(allocation__job__in=jobs).exists()
    assert billing.rates_fix(now=timezone.now()) == 2
    assert AllocationMeter.objects.filter(allocation__job__in=jobs).count() == 2


def test_slot_rows_keep_their_gpu_and_allocation_without_database_keys(acme):
    # The slot table's keys are not database constraints (broker/jobs/models.py, AllocationSlice): the ORM
    # still refuses to delete a GPU whose slots a job holds, and deleting an allocation takes its slots.
    node = acme.nodes[0]
    job = submit(acme, name="held")
    result = placements_commit(items=[(job, [GpuRequest(node=node, gpu_indices=(0,), milli=500)])])
    assert result.placed == [job.pk]
    gpu = node.gpus.get(index=0)
    with pytest.raises(ProtectedError):
        gpu.delete()
    assert list(gpu.slices.filter(active=True).values_list("slots", flat=True)) == [5]
    Allocation.objects.filter(job=job).delete()
    assert AllocationSlice.objects.filter(gpu=gpu).count() == 0


def test_rows_update_gives_each_row_its_own_values_across_statements(acme, monkeypatch):
    # Several statements of a few rows each (PostgreSQL joins each to a VALUES list; SQLite runs one
    # statement per row): every job gets its own code, message and JSON, nothing else changes.
    monkeypatch.setattr(rows, "ROWS_PER_UPDATE", 2)
    jobs = [submit(acme, name=f"u{i}") for i in range(5)]
    untouched = submit(acme, name="untouched")
    data = Job._meta.get_field("pending_reason_data")
    rows_update(Job, ("pending_reason_code", "pending_reason", "pending_reason_data"),
                [(f"CODE{i}", f"reason {i}", data.get_db_prep_save({"i": i, "nested": [i]}, connection), job.pk)
                 for i, job in enumerate(jobs)])
    for i, job in enumerate(jobs):
        job.refresh_from_db()
        assert (job.pending_reason_code, job.pending_reason, job.pending_reason_data) == (
            f"CODE{i}", f"reason {i}", {"i": i, "nested": [i]})
    before = untouched.pending_reason
    untouched.refresh_from_db()
    assert untouched.pending_reason == before and untouched.pending_reason_code != "CODE0"
