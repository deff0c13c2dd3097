"""The cycle reads its jobs, nodes and GPUs as plain rows (broker/scheduler/snapshot.py) and commits
placements from (id, team) rows (broker/jobs/batch.py JobRef): what the engine sees and what a
placement guarantees are the same as from model instances."""
from __future__ import annotations

from collections import defaultdict
from broker.inventory.models import Gpu, GpuHealth
from broker.jobs.batch import JobRef, placements_commit
from broker.jobs.models import AllocationSlice, Job
from broker.jobs.services import GpuRequest, allocation_commit, job_cancel, job_transition
from broker.jobs.states import JobState
from broker.scheduler.services import BROKER_POLICY, plan_commit
from broker.scheduler.snapshot import job_demand, tenant_snapshot
from scheduling.engine import schedule

from .test_api_tenancy import submit


def test_the_snapshot_sees_each_job_as_job_demand_and_each_gpu_as_the_database_holds_it(acme):
    # The cycle's rows and job_demand of an instance (what moves and quotes use) describe a job alike,
    # every constraint a user can write included.
    pending = [
        submit(acme, name="plain"),
        submit(acme, name="picky", image="pytorch:2", env={"JOB_FAMILY": "llm"}, expected_duration_hours=3.5,
               resources={"gpus": 2, "gpu_models": ["A100-80GB"], "min_gpu_memory_gb": 40, "interconnect": "nvlink",
                          "cpu": 4, "memory_gb": 16},
               placement={"providers": ["onprem"], "regions": ["dc1"], "spot": "allowed", "max_price_per_hour": 9.5,
                          "node_selector": {"rack": "r1"}}),
        submit(acme, name="share", resources={"gpu_fraction": 0.25}, priority="high"),
    ]
    running = submit(acme, name="ckpt", preemptible=True, resources={"gpu_fraction": 0.5},
                     checkpoint={"uri": "s3://ckpt/run", "interval_seconds": 60})
    allocation_commit(job=running, requests=[GpuRequest(node=acme.nodes[0], gpu_indices=(3,), milli=500)])
    running = job_transition(job=job_transition(job=running, to=JobState.STARTING), to=JobState.RUNNING)
    Gpu.objects.filter(node=acme.nodes[0], index=5).update(health=GpuHealth.FAILED)

    snapshot = tenant_snapshot(tenant=acme.tenant)
    assert snapshot.pending == tuple(job_demand(Job.objects.get(pk=job.pk)) for job in pending)
    assert snapshot.pending[1].node_selector == (("rack", "r1"),) and snapshot.pending[1].needs_container
    (held,) = snapshot.running
    assert (held.job_id, held.gpu_indices, held.gpu_milli) == (str(running.pk), (3,), 500)
    assert held.demand == job_demand(Job.objects.get(pk=running.pk)), "a checkpointable preemptible job can move"
    node = next(n for n in snapshot.nodes if n.id == str(acme.nodes[0].pk))
    gpus = {g.index: g for g in node.gpus}
    assert [g.index for g in node.gpus] == sorted(gpus)
    assert gpus[3].milli_used == 500 and gpus[3].free_memory_mb == gpus[3].memory_mb // 2
    assert not gpus[5].healthy and gpus[0].healthy and gpus[0].milli_used == 0
    assert gpus[0].model == acme.nodes[0].gpus.get(index=0).model.name
    assert node.free_cpu_milli == node.cpu_milli - running.cpu_milli


def test_a_job_cancelled_after_the_snapshot_is_not_placed_by_the_plan(acme):
    cancelled, kept = submit(acme, name="cancelled"), submit(acme, name="kept")
    plan = schedule(tenant_snapshot(tenant=acme.tenant), BROKER_POLICY)
    assert {p.job_id for p in plan.placements} == {str(cancelled.pk), str(kept.pk)}
    job_cancel(job=Job.objects.get(pk=cancelled.pk))
    outcome = plan_commit(tenant=acme.tenant, plan=plan)
    assert outcome.placed == [kept.pk]
    assert any(f"job {cancelled.pk}:" in c and "CANCELLED" in c for c in outcome.conflicts)
    cancelled.refresh_from_db()
    assert cancelled.state == JobState.CANCELLED and not cancelled.allocations.exists()


def test_plain_rows_are_committed_one_by_one_when_the_constraint_refuses_their_chunk(acme, monkeypatch):
    # As the cycle passes them (JobRef, not instances): the fallback loads the jobs it commits one by one,
    # and a job deleted meanwhile is refused, not an error.
    import broker.jobs.batch as batch

    node = acme.nodes[0]
    holder, clash, fine, gone = (submit(acme, name=n) for n in ("holder", "clash", "fine", "gone"))
    allocation_commit(job=holder, requests=[GpuRequest(node=node, gpu_indices=(0,))])
    monkeypatch.setattr(batch, "held_slots", lambda gpu_ids: defaultdict(set))  # misses the holder
    gone_ref = JobRef(gone.pk, gone.tenant_id)
    Job.objects.filter(pk=gone.pk).delete()
    result = placements_commit(items=[(JobRef(job.pk, job.tenant_id), [GpuRequest(node=node, gpu_indices=(i,))])
                                      for i, job in ((0, clash), (4, fine))]
                               + [(gone_ref, [GpuRequest(node=node, gpu_indices=(6,))])])
    assert result.placed == [fine.pk]
    assert set(result.refused) == {clash.pk, gone.pk} and "deleted" in result.refused[gone.pk]
    clash.refresh_from_db()
    assert clash.state == JobState.PENDING
    assert list(AllocationSlice.objects.filter(gpu__node=node, gpu__index=0, active=True)
                .values_list("allocation__job", "slots")) == [(holder.pk, 10)]
    assert Job.objects.get(pk=fine.pk).state == JobState.PLACED
