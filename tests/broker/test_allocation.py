"""GPU allocation: the database refuses to book a GPU slot twice, even under concurrency."""
from __future__ import annotations

import threading

import pytest
from django.db import IntegrityError, close_old_connections, connection, transaction

from broker.inventory.models import Gpu
from broker.jobs.models import Allocation, AllocationSlice, Job
from broker.jobs import services
from broker.jobs.services import DoubleBooking, GpuRequest, JobError, allocation_commit, job_cancel
from broker.jobs.states import JobState

from .conftest import requires_postgres
from .test_api_tenancy import submit


def test_allocate_then_double_book_is_refused(acme):
    node = acme.nodes[0]
    first, second = submit(acme, name="a"), submit(acme, name="b")
    allocation_commit(job=first, requests=[GpuRequest(node=node, gpu_indices=(0, 1))])
    first.refresh_from_db()
    assert first.state == JobState.PLACED
    with pytest.raises(DoubleBooking):
        allocation_commit(job=second, requests=[GpuRequest(node=node, gpu_indices=(1, 2))])
    second.refresh_from_db()
    assert second.state == JobState.PENDING
    assert AllocationSlice.objects.filter(allocation__job=second).count() == 0, "nothing half-written"


def test_fractions_share_a_gpu_until_it_is_full(acme):
    node = acme.nodes[0]
    jobs = [submit(acme, name=f"f{i}", resources={"gpu_fraction": 0.5}) for i in range(3)]
    allocation_commit(job=jobs[0], requests=[GpuRequest(node=node, gpu_indices=(3,), milli=500)])
    allocation_commit(job=jobs[1], requests=[GpuRequest(node=node, gpu_indices=(3,), milli=500)])
    with pytest.raises(DoubleBooking):
        allocation_commit(job=jobs[2], requests=[GpuRequest(node=node, gpu_indices=(3,), milli=500)])
    resp = acme.client.get(f"/api/v1/nodes/{node.pk}/").json()
    assert resp["gpus"][3]["in_use"] == 1.0 and resp["gpus"][0]["in_use"] == 0.0


def test_cancel_releases_the_gpus(acme):
    node = acme.nodes[0]
    first, second = submit(acme, name="a"), submit(acme, name="b")
    allocation_commit(job=first, requests=[GpuRequest(node=node, gpu_indices=(0,))])
    job_cancel(job=first)
    allocation_commit(job=second, requests=[GpuRequest(node=node, gpu_indices=(0,))])
    second.refresh_from_db()
    assert second.state == JobState.PLACED
    assert acme.client.get(f"/api/v1/jobs/{second.pk}/").json()["allocations"][0]["gpus"] == [0]


def test_quota_is_enforced_at_allocation(acme):
    acme.tenant.quota.max_gpus = 3
    acme.tenant.quota.save()
    first, second = submit(acme, name="a", resources={"gpus": 2}), submit(acme, name="b", resources={"gpus": 2})
    allocation_commit(job=first, requests=[GpuRequest(node=acme.nodes[0], gpu_indices=(0, 1))])
    with pytest.raises(JobError, match="quota"):
        allocation_commit(job=second, requests=[GpuRequest(node=acme.nodes[1], gpu_indices=(0, 1))])


def test_another_tenants_node_cannot_be_allocated(acme, globex):
    job = submit(acme)
    with pytest.raises(JobError):
        allocation_commit(job=job, requests=[GpuRequest(node=globex.nodes[0], gpu_indices=(0,))])
    job.refresh_from_db()
    assert job.state == JobState.PENDING


@requires_postgres
@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_two_transactions_racing_for_one_gpu_exactly_one_succeeds(acme):
    node = acme.nodes[0]
    for round_ in range(5):
        jobs = [submit(acme, name=f"r{round_}-{i}") for i in range(2)]
        barrier = threading.Barrier(2)
        results: list[str] = []

        def run(job: Job) -> None:
            close_old_connections()
            try:
                barrier.wait()
                allocation_commit(job=job, requests=[GpuRequest(node=node, gpu_indices=(round_,))])
                results.append("ok")
            except DoubleBooking:
                results.append("refused")
            finally:
                connection.close()  # each thread owns its connection; leave none open

        threads = [threading.Thread(target=run, args=(j,)) for j in jobs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(results) == ["ok", "refused"]
        holders = AllocationSlice.objects.filter(gpu__node=node, gpu__index=round_, active=True)
        assert holders.values("allocation__job").distinct().count() == 1


@requires_postgres
@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_two_commits_on_different_nodes_cannot_both_pass_the_gpu_quota(acme, monkeypatch):
    """The tenant's row lock serialises quota checks. Each commit waits, after its own check, for the
    other to have checked too (a barrier with a timeout): with the lock the second is still blocked on
    the tenant, the wait times out and only the first gets its GPU; without it both would pass."""
    acme.tenant.quota.max_gpus = 1
    acme.tenant.quota.save()
    real_check = services._check_quota
    barrier = threading.Barrier(2, timeout=2)

    def check_then_wait(**kwargs):
        real_check(**kwargs)
        try:
            barrier.wait()
        except threading.BrokenBarrierError:
            pass

    monkeypatch.setattr(services, "_check_quota", check_then_wait)
    jobs = [submit(acme, name=f"q{i}") for i in range(2)]
    results: list[str] = []

    def run(job: Job, node) -> None:
        close_old_connections()
        try:
            allocation_commit(job=job, requests=[GpuRequest(node=node, gpu_indices=(0,))])
            results.append("ok")
        except JobError as err:
            results.append(err.code)
        finally:
            connection.close()

    threads = [threading.Thread(target=run, args=(job, node)) for job, node in zip(jobs, acme.nodes[:2])]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == ["ok", "quota"]
    assert AllocationSlice.objects.filter(allocation__job__tenant=acme.tenant, active=True).values(
        "gpu").distinct().count() == 1


def _slice_on(acme, *, gpu_index: int, slots: tuple[int, ...], active: bool = True) -> AllocationSlice:
    """A slot row written straight through the ORM: no service, no lock, no check of ours in the way."""
    node = acme.nodes[0]
    job = submit(acme, name=f"raw-{gpu_index}-{AllocationSlice.mask_of(slots)}-{AllocationSlice.objects.count()}")
    alloc = Allocation.objects.create(job=job, node=node, epoch=node.epoch)
    return AllocationSlice.objects.create(allocation=alloc, gpu=node.gpus.get(index=gpu_index),
                                          mask=AllocationSlice.mask_of(slots), slots=len(slots), active=active)


def _holders(acme, gpu_index: int) -> list[int]:
    return sorted(AllocationSlice.objects.filter(gpu__node=acme.nodes[0], gpu__index=gpu_index, active=True)
                  .values_list("mask", flat=True))


@pytest.mark.parametrize("first, second", [((3,), (3,)), (tuple(range(Gpu.SLOTS)), (3,)),
                                           ((2, 3), tuple(range(Gpu.SLOTS))), ((0, 9), (5, 9))])
def test_the_database_itself_refuses_a_second_active_holder_of_a_slot(acme, first, second):
    """The promise is the database's (one partial unique index per slot), not the service's: bypass the
    service. A whole GPU is one row holding every slot: a share of any slot of it is refused too."""
    _slice_on(acme, gpu_index=0, slots=first)
    with pytest.raises(IntegrityError), transaction.atomic():
        _slice_on(acme, gpu_index=0, slots=second)
    assert _holders(acme, 0) == [AllocationSlice.mask_of(first)]


@pytest.mark.parametrize("mask", [0, 1 << Gpu.SLOTS, (1 << Gpu.SLOTS) | 1])
def test_a_row_holds_some_slot_and_only_slots_the_indexes_guard(acme, mask):
    node = acme.nodes[0]
    alloc = Allocation.objects.create(job=submit(acme, name=f"raw-{mask}"), node=node, epoch=node.epoch)
    with pytest.raises(IntegrityError), transaction.atomic():
        AllocationSlice.objects.create(allocation=alloc, gpu=node.gpus.get(index=0), mask=mask, slots=1)
    assert not AllocationSlice.objects.exists()


def test_the_unique_index_is_partial_released_slots_do_not_block(acme):
    everything = tuple(range(Gpu.SLOTS))
    _slice_on(acme, gpu_index=1, slots=everything, active=False)
    _slice_on(acme, gpu_index=1, slots=(0,), active=False)  # released twice over: history, not holders
    _slice_on(acme, gpu_index=1, slots=(0, 4))  # and the slots can be held again
    _slice_on(acme, gpu_index=1, slots=(1, 2, 3))  # other slots of the same GPU are another holder
    _slice_on(acme, gpu_index=2, slots=everything)  # the same slots of another GPU too
    assert _holders(acme, 1) == [0b1110, 0b10001] and _holders(acme, 2) == [2 ** Gpu.SLOTS - 1]


def _half(acme, name: str) -> Job:
    return submit(acme, name=name, resources={"gpu_fraction": 0.5})


def test_fractional_jobs_count_their_share_against_the_gpu_quota(acme):
    """Documented in docs/job-spec.md: a share of a GPU counts as that share (slots held / slots per GPU)."""
    acme.tenant.quota.max_gpus = 1
    acme.tenant.quota.save()
    node = acme.nodes[0]
    first, second, third = _half(acme, "h1"), _half(acme, "h2"), _half(acme, "h3")
    allocation_commit(job=first, requests=[GpuRequest(node=node, gpu_indices=(0,), milli=500)])
    allocation_commit(job=second, requests=[GpuRequest(node=node, gpu_indices=(1,), milli=500)])  # 1.0 in all
    with pytest.raises(JobError, match="quota") as caught:
        allocation_commit(job=third, requests=[GpuRequest(node=node, gpu_indices=(2,), milli=500)])
    assert caught.value.code == "quota"
    third.refresh_from_db()
    assert third.state == JobState.PENDING
    assert not AllocationSlice.objects.filter(allocation__job=third).exists()


def test_a_fraction_beside_a_whole_gpu_is_over_a_quota_of_one(acme):
    acme.tenant.quota.max_gpus = 1
    acme.tenant.quota.save()
    node = acme.nodes[0]
    whole, half = submit(acme, name="whole"), _half(acme, "half")
    allocation_commit(job=whole, requests=[GpuRequest(node=node, gpu_indices=(0,))])
    with pytest.raises(JobError, match="quota"):
        allocation_commit(job=half, requests=[GpuRequest(node=node, gpu_indices=(1,), milli=500)])


def test_a_whole_gpu_beside_a_fraction_is_over_a_quota_of_one(acme):
    acme.tenant.quota.max_gpus = 1
    acme.tenant.quota.save()
    node = acme.nodes[0]
    half, whole = _half(acme, "half"), submit(acme, name="whole")
    allocation_commit(job=half, requests=[GpuRequest(node=node, gpu_indices=(0,), milli=500)])
    with pytest.raises(JobError, match="quota"):
        allocation_commit(job=whole, requests=[GpuRequest(node=node, gpu_indices=(1,))])


def test_the_compute_unit_quota_is_enforced_at_allocation_too(acme):
    """A commit that did not go through the engine (or raced it) cannot pass a compute-unit quota."""
    rating = acme.nodes[0].gpus.first().model.compute_units
    acme.tenant.quota.max_compute_units = rating * 3 / 2  # one and a half A100s' worth
    acme.tenant.quota.save()
    node = acme.nodes[0]
    whole, half, another = submit(acme, name="w"), _half(acme, "h"), _half(acme, "h2")
    allocation_commit(job=whole, requests=[GpuRequest(node=node, gpu_indices=(0,))])
    allocation_commit(job=half, requests=[GpuRequest(node=node, gpu_indices=(1,), milli=500)])
    with pytest.raises(JobError, match="Compute-unit quota") as caught:
        allocation_commit(job=another, requests=[GpuRequest(node=node, gpu_indices=(2,), milli=500)])
    assert caught.value.field == "resources"
