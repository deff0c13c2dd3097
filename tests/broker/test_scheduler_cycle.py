"""The broker's scheduling cycle: snapshot of one tenant → engine → allocations, reasons, preemptions."""
from __future__ import annotations

import os
import subprocess
from datetime import timedelta

from django.utils import timezone

from broker.jobs.models import Job, JobEvent
from broker.jobs.services import GpuRequest, allocation_commit, job_transition
from broker.jobs.states import JobState
from broker.scheduler.models import CycleLease, CycleRecord
from broker.scheduler.services import _lease_acquire, lease_holder_name, scheduling_cycle_run
from broker.scheduler.snapshot import tenant_snapshot
from providers.local.processes import process_start_time

from .test_api_tenancy import submit


def test_pending_job_is_placed_inside_one_nvlink_island(acme):
    job = submit(acme, resources={"gpus": 4, "interconnect": "nvlink", "gpu_models": ["A100-80GB"]})
    outcome = scheduling_cycle_run(tenant=acme.tenant)
    assert outcome.ran and outcome.placed == [job.pk]
    job.refresh_from_db()
    assert job.state == JobState.PLACED
    alloc = job.allocations.get(active=True)
    islands = {s.gpu.nvlink_island for s in alloc.slices.all()}
    assert len(islands) == 1 and len({s.gpu.index for s in alloc.slices.all()}) == 4
    assert CycleRecord.objects.filter(tenant=acme.tenant, placed_jobs=1).exists()


def test_job_that_cannot_fit_gets_a_reason_visible_in_the_api(acme):
    job = submit(acme, resources={"gpus": 16})  # nodes have 8 GPUs each
    scheduling_cycle_run(tenant=acme.tenant)
    body = acme.client.get(f"/api/v1/jobs/{job.pk}/").json()
    assert body["state"] == "PENDING"
    reason = body["pending_reason"]
    assert reason["code"] == "INSUFFICIENT_GPUS", reason
    assert "16" in reason["message"] or "nodes" in reason["message"]
    assert JobEvent.objects.filter(job=job, kind="pending_reason", reason_code="INSUFFICIENT_GPUS").count() == 1
    scheduling_cycle_run(tenant=acme.tenant)
    assert JobEvent.objects.filter(job=job, kind="pending_reason").count() == 1, "same reason is not re-logged"


def test_a_tenant_is_only_scheduled_on_its_own_nodes(acme, globex):
    for node in acme.nodes:
        node.state = "OFFLINE"
        node.save()
    job = submit(acme)
    scheduling_cycle_run(tenant=acme.tenant)
    scheduling_cycle_run(tenant=globex.tenant)
    job.refresh_from_db()
    assert job.state == JobState.PENDING
    assert job.pending_reason_code == "NODE_NOT_READY"
    assert all(n.id in {str(x.pk) for x in acme.nodes} for n in tenant_snapshot(tenant=acme.tenant).nodes)


def test_quota_caps_what_one_cycle_places(acme):
    acme.tenant.quota.max_gpus = 4
    acme.tenant.quota.save()
    jobs = [submit(acme, name=f"q{i}", resources={"gpus": 2}) for i in range(3)]
    scheduling_cycle_run(tenant=acme.tenant)
    states = sorted(Job.objects.filter(pk__in=[j.pk for j in jobs]).values_list("state", flat=True))
    assert states == ["PENDING", "PLACED", "PLACED"]
    waiting = Job.objects.get(pk__in=[j.pk for j in jobs], state="PENDING")
    assert waiting.pending_reason_code == "QUOTA_EXCEEDED"


def test_fractional_jobs_count_their_share_against_the_gpu_quota_in_the_cycle(acme):
    """max_gpus=1: two half-GPU jobs fit (0.5 + 0.5), a third waits for quota, across two cycles too."""
    acme.tenant.quota.max_gpus = 1
    acme.tenant.quota.save()
    jobs = [submit(acme, name=f"h{i}", resources={"gpu_fraction": 0.5}) for i in range(2)]
    scheduling_cycle_run(tenant=acme.tenant)
    assert set(Job.objects.filter(pk__in=[j.pk for j in jobs]).values_list("state", flat=True)) == {"PLACED"}
    late = submit(acme, name="h-late", resources={"gpu_fraction": 0.5})
    scheduling_cycle_run(tenant=acme.tenant)
    late.refresh_from_db()
    assert late.state == JobState.PENDING and late.pending_reason_code == "QUOTA_EXCEEDED"
    assert "quota" in late.pending_reason


def test_a_share_is_planned_in_whole_slots_as_it_is_held(acme):
    """Four quarter-GPU jobs hold 3 slots of 10 each: three fit one GPU, the fourth needs another.

    Planned at 250 milli each, the engine would put all four on one GPU and the commit would refuse
    the fourth as a double booking, every cycle.
    """
    jobs = [submit(acme, name=f"q{i}", resources={"gpu_fraction": 0.25}) for i in range(4)]
    outcome = scheduling_cycle_run(tenant=acme.tenant)
    assert sorted(outcome.placed) == sorted(j.pk for j in jobs)
    gpus = {(s.gpu.node_id, s.gpu.index) for j in jobs for s in j.allocations.get(active=True).slices.all()}
    assert len(gpus) == 2
    assert not JobEvent.objects.filter(job__in=jobs, reason_code="DOUBLE_BOOKING").exists()


def test_high_priority_job_preempts_a_long_running_preemptible_one(acme):
    for node in acme.nodes[1:]:
        node.state = "OFFLINE"
        node.save()
    low = submit(acme, name="low", resources={"gpus": 8}, preemptible=True, priority="low")
    allocation_commit(job=low, requests=[GpuRequest(node=acme.nodes[0], gpu_indices=tuple(range(8)))])
    low = job_transition(job=low, to=JobState.STARTING)
    low = job_transition(job=low, to=JobState.RUNNING)
    Job.objects.filter(pk=low.pk).update(started_at=timezone.now() - timedelta(hours=2))
    high = submit(acme, name="high", resources={"gpus": 8}, priority="critical")
    outcome = scheduling_cycle_run(tenant=acme.tenant)
    assert outcome.preempted == [low.pk]
    low.refresh_from_db()
    high.refresh_from_db()
    assert low.state == JobState.PENDING  # re-queued
    assert list(JobEvent.objects.filter(job=low, kind="state").values_list("data__to", flat=True))[-2:] == [
        "PREEMPTED", "PENDING"]
    assert high.pending_reason_code == "WAITING_FOR_PREEMPTION"
    scheduling_cycle_run(tenant=acme.tenant)
    high.refresh_from_db()
    assert high.state == JobState.PLACED


def test_a_cycle_does_not_run_while_another_holds_the_lease(acme):
    submit(acme)
    assert _lease_acquire(acme.tenant, "someone-else") is not None
    assert scheduling_cycle_run(tenant=acme.tenant).ran is False
    CycleLease.objects.filter(tenant=acme.tenant).update(expires_at=timezone.now() - timedelta(seconds=1))
    assert scheduling_cycle_run(tenant=acme.tenant).ran is True, "an expired lease (dead worker) is taken over"


def test_a_lease_held_by_a_dead_process_of_this_machine_is_taken_over_at_once(acme):
    """A worker SIGKILLed mid-cycle leaves its lease held for WHALEZEN_CYCLE_LEASE_SECONDS; its
    restarted successor on the same machine takes it over without waiting, a live holder keeps it."""
    submit(acme)
    child = subprocess.Popen(["sleep", "30"])
    try:
        live = f"{lease_holder_name().split('|')[0]}|{child.pid}|{process_start_time(child.pid)}|x"
        assert _lease_acquire(acme.tenant, live) is not None
        assert scheduling_cycle_run(tenant=acme.tenant).ran is False, "the holder still runs"
    finally:
        child.kill()
        child.wait()
    assert scheduling_cycle_run(tenant=acme.tenant).ran is True, "its holder died: no need to wait for expiry"
    other_host = f"elsewhere|{os.getpid()}|1|x"
    assert _lease_acquire(acme.tenant, other_host) is not None
    assert scheduling_cycle_run(tenant=acme.tenant).ran is False, "another machine's holder may be alive"


def test_a_job_its_node_never_starts_is_placed_again(acme, settings):
    from broker.scheduler.timeouts import stalled_starts_requeue

    settings.WHALEZEN_START_TIMEOUT_SECONDS = 600
    job = submit(acme, resources={"gpus": 1})
    scheduling_cycle_run(tenant=acme.tenant)
    job.refresh_from_db()
    assert job.state == JobState.PLACED
    assert stalled_starts_requeue() == [], "within the time limit nothing happens"
    Job.objects.filter(pk=job.pk).update(updated_at=timezone.now() - timedelta(seconds=601))
    assert stalled_starts_requeue() == [job.pk]
    job.refresh_from_db()
    assert job.state == JobState.PENDING and job.pending_reason_code == "START_TIMEOUT"
    assert not job.allocations.filter(active=True).exists(), "its GPUs were released"
    # ...but not forgotten: the node may have started it after all (broker.agents.fencing).
    assert job.allocations.get().stop_unconfirmed


def test_the_snapshot_marks_cloud_instances_as_rented_and_owned_nodes_not(acme, gpu_models):
    from broker.inventory.models import Pool, PoolKind
    from broker.inventory.services import node_create_simulated

    cloud = Pool.objects.create(tenant=acme.tenant, name="burst", kind=PoolKind.AWS, region="us-east-1")
    instance = node_create_simulated(pool=cloud, name="acme-burst-1", gpu_model=gpu_models["A100-80GB"], gpu_count=8,
                                     nvlink_island_size=8, cpu_milli=96000, memory_mb=1024 * 1024)
    rented = {n.id: n.rented for n in tenant_snapshot(tenant=acme.tenant).nodes}
    assert rented[str(instance.pk)] is True
    assert all(rented[str(n.pk)] is False for n in acme.nodes)


def test_a_queue_nothing_changed_in_is_not_decided_again_until_the_refresh(acme, settings):
    too_big = submit(acme, name="too-big", resources={"gpus": 64})
    first = scheduling_cycle_run(tenant=acme.tenant)
    assert first.ran and not first.unchanged and first.placed == []
    records = CycleRecord.objects.count()
    reason = Job.objects.get(pk=too_big.pk).pending_reason
    again = scheduling_cycle_run(tenant=acme.tenant)
    assert again.ran and again.unchanged and again.plan is None
    assert CycleRecord.objects.count() == records and Job.objects.get(pk=too_big.pk).pending_reason == reason
    # Anything the decision reads changes: decided again (a new job is placed at once).
    fits = submit(acme, name="fits", resources={"gpus": 1})
    decided = scheduling_cycle_run(tenant=acme.tenant)
    assert not decided.unchanged and decided.placed == [fits.pk]
    # A node going away is a change too.
    scheduling_cycle_run(tenant=acme.tenant)
    assert scheduling_cycle_run(tenant=acme.tenant).unchanged
    acme.nodes[1].state = "DRAINING"
    acme.nodes[1].save()
    assert not scheduling_cycle_run(tenant=acme.tenant).unchanged
    # Time alone changes some inputs (run times, budgets): a full decision at least every refresh period.
    settings.WHALEZEN_CYCLE_REFRESH_SECONDS = 0
    assert not scheduling_cycle_run(tenant=acme.tenant).unchanged
