"""GPU allocation: the database refuses to book a GPU slot twice, even under concurrency."""
from __future__ import annotations

import threading

import pytest
from django.db import close_old_connections, connection

from broker.jobs.models import AllocationSlice, Job
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
