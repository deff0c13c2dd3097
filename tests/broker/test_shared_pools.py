"""Shared pools (issue 11): a platform-owned pool granted to teams. Grants let a team's jobs run there,
a team without one is never placed there, one cycle decides for every team sharing the capacity."""
from __future__ import annotations

from dataclasses import dataclass

import pytest

from broker.inventory.models import Node, Pool, PoolGrant, PoolKind
from broker.inventory.selectors import (nodes_usable_by, pools_usable_by, scheduling_component,
                                        scheduling_components)
from broker.inventory.services import node_create_simulated, pool_share
from broker.jobs.models import Job
from broker.jobs.services import GpuRequest, JobError, allocation_commit
from broker.jobs.states import JobState
from broker.scheduler.models import CycleLease, CycleRecord
from broker.scheduler.services import lease_holder_name, _lease_acquire, plan_commit, scheduling_cycle_run, \
    tenants_to_schedule
from broker.scheduler.snapshot import tenant_snapshot
from broker.tenancy.models import Tenant
from broker.tenancy.services import tenant_create
from scheduling import model as sm

from .test_api_tenancy import submit

H100 = {"gpus": 4, "gpu_models": ["H100-80GB"]}


@dataclass
class Platform:
    tenant: Tenant
    pool: Pool  # shared-h100: one 8-GPU H100 node
    node: Node


def make_platform(gpu_models, *, name: str = "shared-h100", model: str = "H100-80GB", gpus: int = 8,
                  tenant: Tenant | None = None) -> Platform:
    tenant = tenant or Tenant.objects.filter(slug="platform").first() or tenant_create(slug="platform",
                                                                                       name="Platform")
    pool = Pool.objects.create(tenant=tenant, name=name, kind=PoolKind.ONPREM, region="dc1")
    node = node_create_simulated(pool=pool, name=f"{name}-0", gpu_model=gpu_models[model], gpu_count=gpus,
                                 nvlink_island_size=8, cpu_milli=96000, memory_mb=1024 * 1024)
    return Platform(tenant=tenant, pool=pool, node=node)


@pytest.fixture
def platform(gpu_models, acme, globex) -> Platform:
    """Created after acme and globex, so acme has the lowest id of the three (the component's lease)."""
    return make_platform(gpu_models)


def on_node(job: Job) -> Node:
    return job.allocations.get(active=True).node


def test_a_grant_lets_a_teams_job_run_on_the_shared_node(acme, platform):
    pool_share(pool=platform.pool, tenant=acme.tenant)
    job = submit(acme, resources=H100)
    outcome = scheduling_cycle_run(tenant=acme.tenant)
    assert outcome.placed == [job.pk], outcome.conflicts
    job.refresh_from_db()
    assert job.state == JobState.PLACED and on_node(job) == platform.node
    # The node stays the platform's: the grant shares it, it does not hand it over.
    assert Node.objects.get(pk=platform.node.pk).tenant == platform.tenant


def test_without_a_grant_a_team_is_never_placed_on_the_shared_pool(acme, globex, platform):
    pool_share(pool=platform.pool, tenant=acme.tenant)
    job = submit(globex, resources=H100)
    for tenant in (globex.tenant, acme.tenant, platform.tenant):
        scheduling_cycle_run(tenant=tenant)
    job.refresh_from_db()
    assert job.state == JobState.PENDING
    assert not job.allocations.exists()
    assert platform.node not in nodes_usable_by(globex.tenant)


def test_a_team_in_the_component_without_access_to_a_pool_waits_with_no_pool_access(acme, globex, gpu_models,
                                                                                      platform):
    """globex shares a platform pool with acme (so they are one component) but not the H100 pool: its H100
    job sees that capacity in the cycle and is told it may not use it. (globex has no cluster of its own
    here, so pool access is the only thing that rejects a node.)"""
    pool_share(pool=platform.pool, tenant=acme.tenant)
    other = Pool.objects.create(tenant=platform.tenant, name="shared-other", kind=PoolKind.ONPREM)
    pool_share(pool=other, tenant=globex.tenant)
    globex.pool.delete()
    assert [t.slug for t in scheduling_component(globex.tenant)] == ["acme", "globex", "platform"]
    job = submit(globex, resources=H100)
    scheduling_cycle_run(tenant=globex.tenant)
    job.refresh_from_db()
    assert job.state == JobState.PENDING and job.pending_reason_code == "NO_POOL_ACCESS", job.pending_reason
    (h100,) = [n for n in tenant_snapshot(tenant=globex.tenant).nodes if n.id == str(platform.node.pk)]
    assert h100.tenants == ("acme", "platform")


def test_allocation_commit_refuses_a_node_of_a_pool_the_team_may_not_use(acme, globex, platform):
    job = submit(globex, resources=H100)
    request = [GpuRequest(node=platform.node, gpu_indices=(0, 1, 2, 3))]
    with pytest.raises(JobError) as refused:
        allocation_commit(job=job, requests=request)
    assert refused.value.code == "no_pool_access" and refused.value.field == "node"
    job.refresh_from_db()
    assert job.state == JobState.PENDING and not job.allocations.exists()
    pool_share(pool=platform.pool, tenant=globex.tenant)
    allocation_commit(job=job, requests=request)
    assert on_node(job) == platform.node


def test_plan_commit_refuses_a_plan_that_places_a_team_on_a_pool_it_may_not_use(acme, globex, gpu_models, platform):
    """A stale or wrong plan (the grant was revoked after the snapshot): nothing is booked, the job waits."""
    a100 = make_platform(gpu_models, name="shared-a100", model="A100-80GB", tenant=platform.tenant)
    pool_share(pool=a100.pool, tenant=globex.tenant)  # globex is in the platform's component, not in its H100 pool
    job = submit(globex, resources=H100)
    plan = sm.Plan(placements=(sm.Placement(job_id=str(job.pk), parts=(
        sm.PlacementPart(node_id=str(platform.node.pk), gpu_indices=(0, 1, 2, 3)),)),))
    outcome = plan_commit(tenant=platform.tenant, plan=plan)
    assert outcome.placed == [] and "may not use the pool" in outcome.conflicts[0]
    job.refresh_from_db()
    assert job.state == JobState.PENDING and not job.allocations.exists()


def test_one_cycle_places_the_jobs_of_two_teams_on_one_shared_pool(acme, globex, platform):
    for team in (acme, globex):
        pool_share(pool=platform.pool, tenant=team.tenant)
    acme_job, globex_job = submit(acme, resources=H100), submit(globex, resources=H100)
    outcome = scheduling_cycle_run(tenant=globex.tenant)  # either team's cycle decides for both
    assert sorted(outcome.placed) == sorted([acme_job.pk, globex_job.pk]), outcome.conflicts
    gpus = [set(Job.objects.get(pk=j.pk).allocations.get(active=True).slices.values_list("gpu__index", flat=True))
            for j in (acme_job, globex_job)]
    assert all(on_node(Job.objects.get(pk=j.pk)) == platform.node for j in (acme_job, globex_job))
    assert not gpus[0] & gpus[1] and len(gpus[0] | gpus[1]) == 8
    # One cycle, recorded once, on the component's lease team (the lowest id: acme).
    (record,) = CycleRecord.objects.all()
    assert record.tenant == acme.tenant and record.placed_jobs == 2 and "globex" in record.note


def test_a_component_has_one_lease_and_is_enqueued_once(acme, globex, platform):
    submit(acme, resources=H100)
    submit(globex, resources=H100)
    assert tenants_to_schedule() == [acme.tenant, globex.tenant]  # not sharing: two components
    pool_share(pool=platform.pool, tenant=acme.tenant)
    pool_share(pool=platform.pool, tenant=globex.tenant)
    assert scheduling_components() == [sorted([acme.tenant.pk, globex.tenant.pk, platform.tenant.pk])]
    assert tenants_to_schedule() == [acme.tenant]  # one cycle for the three
    holder = lease_holder_name()
    assert _lease_acquire(acme.tenant, holder) is not None
    assert scheduling_cycle_run(tenant=globex.tenant).ran is False, "acme's lease is the component's"
    assert scheduling_cycle_run(tenant=platform.tenant).ran is False
    CycleLease.objects.filter(tenant=acme.tenant).update(holder="", expires_at=None)
    assert scheduling_cycle_run(tenant=platform.tenant).ran is True


def test_a_pool_without_grants_is_its_owners_alone(acme, globex):
    assert set(pools_usable_by(acme.tenant)) == {acme.pool}
    assert set(nodes_usable_by(acme.tenant)) == set(acme.nodes)
    assert scheduling_component(acme.tenant) == [acme.tenant]
    nodes = tenant_snapshot(tenant=acme.tenant).nodes
    assert {n.tenants for n in nodes} == {("acme",)} and {n.pool for n in nodes} == {"onprem"}


def test_a_revoked_grant_stops_new_placements(acme, platform):
    from broker.inventory.services import pool_unshare

    pool_share(pool=platform.pool, tenant=acme.tenant)
    pool_unshare(pool=platform.pool, tenant=acme.tenant)
    assert not PoolGrant.objects.exists()
    job = submit(acme, resources=H100)
    scheduling_cycle_run(tenant=acme.tenant)
    job.refresh_from_db()
    assert job.state == JobState.PENDING


def test_a_cloud_pool_shared_with_a_team_rents_for_its_job_in_the_owners_name(acme, gpu_models, platform):
    from broker.inventory.management.commands.seed_demo import SIM_CLOUD_CONFIG
    from broker.inventory.models import CloudInstance

    cloud = Pool.objects.create(tenant=platform.tenant, name="cloud-sim", kind=PoolKind.LOCAL,
                                region="sim-east-1", max_instances=1, provider_config=SIM_CLOUD_CONFIG)
    for node in acme.nodes:
        node.state = "OFFLINE"
        node.save()
    job = submit(acme, resources={"gpus": 1, "gpu_models": ["L4"]})
    scheduling_cycle_run(tenant=acme.tenant)
    job.refresh_from_db()
    assert job.state == JobState.PENDING and not CloudInstance.objects.exists()  # not shared yet
    pool_share(pool=cloud, tenant=acme.tenant)
    outcome = scheduling_cycle_run(tenant=acme.tenant)
    (instance,) = CloudInstance.objects.all()
    assert outcome.launched == [instance.pk] and instance.pool == cloud
    assert instance.tenant == platform.tenant  # the platform's account pays and owns it
    assert [p["job_id"] for p in instance.placements] == [job.pk]
    job.refresh_from_db()
    assert job.state == JobState.PROVISIONING


def test_a_move_may_target_a_shared_node_but_not_another_teams_own(acme, globex, platform, tmp_path, settings):
    from broker.jobs.services import job_transition

    settings.WHALEZEN_CHECKPOINT_ROOTS = [str(tmp_path)]
    pool_share(pool=platform.pool, tenant=acme.tenant)
    job = submit(acme, resources={"gpus": 1}, checkpoint={"uri": str(tmp_path / "m")})
    allocation_commit(job=job, requests=[GpuRequest(node=acme.nodes[0], gpu_indices=(0,))])
    for to in (JobState.STARTING, JobState.RUNNING):
        job = job_transition(job=job, to=to)
    theirs = acme.client.post(f"/api/v1/jobs/{job.pk}/migrate/", {"node": globex.nodes[0].name}, format="json")
    unknown = acme.client.post(f"/api/v1/jobs/{job.pk}/migrate/", {"node": "no-such-node"}, format="json")
    assert theirs.status_code == unknown.status_code == 409
    assert theirs.json()["node"] == unknown.json()["node"], "another team's node answers like a missing one"
    shared = acme.client.post(f"/api/v1/jobs/{job.pk}/migrate/", {"node": platform.node.name}, format="json")
    assert shared.status_code == 202, shared.json()
    assert shared.json()["target"] == platform.node.name


def test_plan_commit_refuses_a_priority_preemption_across_teams(acme, globex, platform):
    from broker.jobs.services import job_transition

    for team in (acme, globex):
        pool_share(pool=platform.pool, tenant=team.tenant)
    victim = submit(globex, resources=H100, preemptible=True)
    allocation_commit(job=victim, requests=[GpuRequest(node=platform.node, gpu_indices=(0, 1, 2, 3))])
    for to in (JobState.STARTING, JobState.RUNNING):
        victim = job_transition(job=victim, to=to)
    mine = submit(acme, resources=H100, priority="critical")
    plan = sm.Plan(preemptions=(sm.Preemption(victim_job_id=str(victim.pk), for_job_id=str(mine.pk),
                                              node_id=str(platform.node.pk), lost_work_s=0.0),),
                   pending={str(mine.pk): sm.Reason(sm.ReasonCode.WAITING_FOR_PREEMPTION, "waiting")})
    outcome = plan_commit(tenant=acme.tenant, plan=plan)
    assert outcome.preempted == [] and "across teams" in outcome.conflicts[0]
    victim.refresh_from_db()
    assert victim.state == JobState.RUNNING
