"""Selector: turn one scheduling component's slice of the database into a `scheduling.Snapshot`.

A component is the set of teams connected through shared pools (broker.inventory.selectors
.scheduling_components); a team that shares nothing is a component of its own. One snapshot holds
every node of the component's pools, each saying which teams may use it (`NodeState.tenants`: the
pool's owner and grantees), the running allocations and pending jobs of all its teams, each team's
budget, its quotas of owned capacity (TeamQuota) and its decayed past usage (FairShareUsage).
"""
from __future__ import annotations

from collections import defaultdict
from datetime import datetime
from decimal import Decimal
from typing import NamedTuple

from django.db.models.functions import Coalesce
from django.utils import timezone

from broker.inventory.models import Gpu, GpuHealth, GpuModel, Node, NodeState, Pool, OWNED_POOL_KINDS
from broker.inventory.selectors import pool_teams, scheduling_component
from broker.jobs.models import Allocation, AllocationSlice, Checkpoint, CheckpointState, Job
from broker.jobs.selectors import tenant_held_share
from broker.jobs.states import ACTIVE_STATES, JobState
from broker.scheduler.spend import month_to_date_spend
from broker.tenancy.models import FairShareUsage, Quota, TeamQuota, Tenant
from providers.base import FAST_FABRICS
from scheduling import model as sm

MILLI_PER_SLOT = 1000 // Gpu.SLOTS
DEFAULT_RESTART_COST_S = 120.0


def _ts(value: datetime | None) -> float:
    return value.timestamp() if value else 0.0


def _price_per_gpu_hour(pool) -> float:
    """What the engine counts for a GPU-hour on a node of `pool`: owned capacity at its marginal cost
    to the platform (the chargeback rate is what teams are billed, not money the platform spends), a
    rented instance at what the pool says (its instances are paid for by the hour, used or not)."""
    if pool.kind in OWNED_POOL_KINDS:
        return float(pool.marginal_cost_usd_per_gpu_hour)
    return float(pool.gpu_hour_rate_usd)


# The Job columns a JobDemand is made of, in `_demand`'s order: the snapshot reads them as plain rows
# (values_list) and `job_demand` takes them from a Job's attributes, so there is one mapping for both.
DEMAND_COLUMNS = ("pk", "gpu_count", "node_count", "compute_units", "gpu_milli", "gpu_models", "gpu_alternatives",
                  "spec", "min_gpu_memory_gb", "interconnect", "cpu_milli", "memory_mb", "spot",
                  "max_price_per_hour", "priority", "preemptible", "expected_duration_hours", "created_at")


def _demand(tenant: str, pk: int, gpu_count: int, node_count: int, compute_units: Decimal | None, gpu_milli: int,
            gpu_models: list[str], gpu_alternatives: dict[str, int] | None, spec: dict | None,
            min_gpu_memory_gb: int, interconnect: str, cpu_milli: int, memory_mb: int, spot: str,
            max_price_per_hour: Decimal | None, priority: int, preemptible: bool,
            expected_duration_hours: float | None, created_at: datetime | None, owner: str = "") -> sm.JobDemand:
    spec = spec or {}
    placement = spec.get("placement", {})
    return sm.JobDemand(
        job_id=str(pk),
        tenant=tenant,
        gpus=gpu_count * node_count,  # with alternatives, the smallest of their counts
        compute_units=float(compute_units) if compute_units is not None else None,
        # A share is held in whole slots (Gpu.slots_for): the engine sees what the commit will take.
        gpu_milli=min(1000, Gpu.slots_for(gpu_milli) * MILLI_PER_SLOT) if gpu_milli > 0 else 0,
        allowed_models=tuple(gpu_models),
        gpus_by_model=tuple(sorted((model, count * node_count)
                                   for model, count in (gpu_alternatives or {}).items())),
        needs_container=bool(spec.get("image")),
        node_selector=tuple(sorted((str(k), str(v)) for k, v in (placement.get("node_selector") or {}).items())),
        min_gpu_memory_mb=min_gpu_memory_gb * 1024,
        interconnect=interconnect,
        nodes=node_count,
        cpu_milli=cpu_milli,
        memory_mb=memory_mb,
        spot=spot,
        max_price_per_hour=float(max_price_per_hour) if max_price_per_hour is not None else None,
        priority=priority,
        preemptible=preemptible,
        expected_duration_hours=expected_duration_hours or 1.0,
        providers=tuple(placement.get("providers", ())),
        regions=tuple(placement.get("regions", ())),
        job_family=str(spec.get("env", {}).get("JOB_FAMILY", "")),
        submitted_at=_ts(created_at),
        owner=owner,
    )


def job_demand(job: Job) -> sm.JobDemand:
    """What the engine sees of `job` (saved or not: a quote's job has no id yet)."""
    return _demand(job.tenant.slug, *(getattr(job, column) for column in DEMAND_COLUMNS))


class GpuRow(NamedTuple):
    """What the snapshot reads of a GPU, in GPU_COLUMNS' order."""
    pk: int
    index: int
    uuid: str
    model: str  # its catalogue model's name, else the name the node reported
    memory_mb: int
    nvlink_island: int | None
    health: str
    held_outside: bool


GPU_COLUMNS = ("pk", "index", "uuid", Coalesce("model__name", "model_name"), "memory_mb", "nvlink_island", "health",
               "held_outside")


def _gpu_state(gpu: GpuRow, slots_used: int) -> sm.GpuState:
    # A GPU that work outside the broker holds is used whole (no slot of the broker's says so).
    milli_used = 1000 if gpu.held_outside else min(1000, slots_used * MILLI_PER_SLOT)
    return sm.GpuState(
        index=gpu.index, uuid=gpu.uuid or f"gpu-{gpu.pk}", model=gpu.model, memory_mb=gpu.memory_mb,
        free_memory_mb=gpu.memory_mb - (gpu.memory_mb * milli_used) // 1000,
        nvlink_island=gpu.nvlink_island, healthy=gpu.health != GpuHealth.FAILED, milli_used=milli_used,
    )


def tenant_snapshot(*, tenant: Tenant, seed: int = 0, now: datetime | None = None,
                    offers: tuple[sm.CloudOffer, ...] = (),
                    launch_limits: tuple[sm.LaunchLimit, ...] = ()) -> sm.Snapshot:
    """The snapshot of `tenant`'s scheduling component (the tenant alone when it shares no pool)."""
    return component_snapshot(tenants=scheduling_component(tenant), seed=seed, now=now, offers=offers,
                              launch_limits=launch_limits)


def component_snapshot(*, tenants: list[Tenant], seed: int = 0, now: datetime | None = None,
                       offers: tuple[sm.CloudOffer, ...] = (),
                       launch_limits: tuple[sm.LaunchLimit, ...] = ()) -> sm.Snapshot:
    now = now or timezone.now()
    tenant_ids = [t.pk for t in tenants]
    slots_by_gpu: dict[int, int] = defaultdict(int)
    # GPU indices and slot counts of every active allocation, as plain tuples in one query: model
    # instances of the slice rows took seconds on a full 1,213-node cluster (bench.service).
    slices_of: dict[int, list[tuple[int, int]]] = defaultdict(list)  # allocation -> (GPU index, slots)
    # Every pool a team of the component may use is owned by a team of the component (the owner is
    # joined to its grantees), so "nodes of the component's tenants" is all the capacity it reaches.
    for allocation_id, gpu_id, index, slots in AllocationSlice.objects.filter(
            active=True, gpu__node__tenant_id__in=tenant_ids).values_list("allocation_id", "gpu_id", "gpu__index",
                                                                          "slots"):
        slots_by_gpu[gpu_id] += slots
        slices_of[allocation_id].append((index, slots))

    # Plain rows throughout (values_list), not model instances: 5,000 pending jobs with their tenants and
    # 6,212 GPUs with their models as instances made the snapshot 0.9-1.6 s; as rows it is 0.4-0.5 s
    # (bench.service, 1,213 nodes, PostgreSQL).
    allocations = list(
        Allocation.objects.filter(active=True, node__tenant_id__in=tenant_ids, job__state__in=ACTIVE_STATES)
        .values_list("pk", "node_id", "created_at", "job__started_at", "job__tenant__slug",
                     *("job_id" if column == "pk" else f"job__{column}" for column in DEMAND_COLUMNS)))
    col = {column: position for position, column in enumerate(DEMAND_COLUMNS)}  # in a row's job part
    used_cpu: dict[int, int] = defaultdict(int)
    used_mem: dict[int, int] = defaultdict(int)
    for _, node_id, _, _, _, *job in allocations:
        used_cpu[node_id] += job[col["cpu_milli"]]
        used_mem[node_id] += job[col["memory_mb"]]

    node_rows = list(Node.objects.filter(tenant_id__in=tenant_ids).values_list(
        "pk", "name", "cpu_milli", "memory_mb", "pool_id", "labels", "state", "container_runtimes"))
    pool_ids = {row[4] for row in node_rows}
    pools = Pool.objects.select_related("tenant").in_bulk(pool_ids)  # a few pools: instances are cheap
    gpus_of: dict[int, list[GpuRow]] = defaultdict(list)
    for node_id, *gpu in Gpu.objects.filter(node__tenant_id__in=tenant_ids).order_by("node_id", "index").values_list(
            "node_id", *GPU_COLUMNS):
        gpus_of[node_id].append(GpuRow(*gpu))
    teams_of_pool = pool_teams(pool_ids)
    nodes = []
    for pk, name, cpu_milli, memory_mb, pool_id, labels, state, container_runtimes in node_rows:
        pool = pools[pool_id]
        labels = labels or {}
        fabric = str(labels.get("fabric", "")).lower()
        nodes.append(sm.NodeState(
            id=str(pk), name=name,
            gpus=tuple(_gpu_state(g, slots_by_gpu[g.pk]) for g in gpus_of.get(pk, ())),
            cpu_milli=cpu_milli, memory_mb=memory_mb,
            free_cpu_milli=max(0, cpu_milli - used_cpu[pk]),
            free_memory_mb=max(0, memory_mb - used_mem[pk]),
            pool=_pool_label(pool, len(tenants)), provider=pool.kind, region=pool.region,
            labels={str(k): str(v) for k, v in labels.items()},
            state="ready" if state == NodeState.ONLINE and pool.enabled else state.lower(),
            price_per_gpu_hour=_price_per_gpu_hour(pool),
            fast_fabric=fabric in FAST_FABRICS,
            rented=pool.kind not in OWNED_POOL_KINDS,
            tenants=teams_of_pool.get(pool_id, (pool.tenant.slug,)),
            container_runtimes=tuple(container_runtimes or ()),
        ))

    latest_checkpoint: dict[int, datetime] = {}
    for job_id, committed_at in (Checkpoint.objects.filter(job__tenant_id__in=tenant_ids,
                                                           state=CheckpointState.COMMITTED)
                                 .order_by("job_id", "committed_at").values_list("job_id", "committed_at")):
        latest_checkpoint[job_id] = committed_at
    running = []
    for allocation_id, node_id, created_at, started_at, slug, *job in allocations:
        job_id, spec, preemptible = job[col["pk"]], job[col["spec"]] or {}, job[col["preemptible"]]
        slices = slices_of.get(allocation_id, [])
        indices = tuple(sorted({index for index, _ in slices}))
        slots_per_gpu = max((slots for _, slots in slices), default=0)  # every GPU of an allocation holds as many
        started = started_at or created_at
        ckpt = latest_checkpoint.get(job_id)
        running.append(sm.RunningAllocation(
            job_id=str(job_id), node_id=str(node_id), gpu_indices=indices,
            gpu_milli=min(1000, slots_per_gpu * MILLI_PER_SLOT), tenant=slug, priority=job[col["priority"]],
            preemptible=preemptible, checkpointable=bool(spec.get("checkpoint")),
            run_seconds=max(0.0, (now - started).total_seconds()),
            checkpoint_age_s=(now - ckpt).total_seconds() if ckpt else None,
            restart_cost_s=DEFAULT_RESTART_COST_S, cpu_milli=job[col["cpu_milli"]], memory_mb=job[col["memory_mb"]],
            demand=_demand(slug, *job) if preemptible and spec.get("checkpoint") else None,
        ))

    slug_of = {t.pk: t.slug for t in tenants}
    budgets = tuple(tenant_budget(tenant=tenant, now=now) for tenant in tenants)
    # A job names its owner only when the owner has a budget of their own (sm.JobDemand.owner).
    budgeted = {(b.tenant, o.owner) for b in budgets for o in b.owners}
    pending = tuple(
        _demand(slug_of[tenant_id], *job, owner=owner if (slug_of[tenant_id], owner) in budgeted else "")
        for tenant_id, owner, *job in Job.objects.filter(
            tenant_id__in=tenant_ids, state=JobState.PENDING).order_by("created_at", "id").values_list(
            "tenant_id", "owner__username", *DEMAND_COLUMNS))
    return sm.Snapshot(
        now=now.timestamp(), nodes=tuple(nodes), pending=pending, running=tuple(running), offers=offers,
        tenants=budgets,
        gpu_models=tuple(sm.GpuModelInfo(m.name, float(m.compute_units), m.memory_gb * 1024)
                         for m in GpuModel.objects.all()),
        seed=seed, launch_limits=launch_limits,
        quotas=component_quotas(tenant_ids=tenant_ids), usage=component_usage(tenant_ids=tenant_ids),
    )


def _pool_label(pool, team_count: int) -> str:
    """The engine's pool name of a node: the pool's own name when one team is scheduled (as before), else
    owner/name, since two teams' pools are often both called "onprem" and the engine groups by it."""
    return pool.name if team_count == 1 else f"{pool.tenant.slug}/{pool.name}"


def component_quotas(*, tenant_ids: list[int]) -> tuple[sm.QuotaShare, ...]:
    return tuple(
        sm.QuotaShare(tenant=q.tenant.slug, flavor=q.flavor, nominal=float(q.nominal),
                      borrowing_limit=float(q.borrowing_limit) if q.borrowing_limit is not None else None,
                      lending_limit=float(q.lending_limit) if q.lending_limit is not None else None)
        for q in TeamQuota.objects.filter(tenant_id__in=tenant_ids).select_related("tenant").order_by("tenant_id",
                                                                                                     "flavor"))


def component_usage(*, tenant_ids: list[int]) -> tuple[sm.TeamUsage, ...]:
    return tuple(
        sm.TeamUsage(tenant=u.tenant.slug, flavor=u.flavor, decayed_hours=u.decayed_hours)
        for u in FairShareUsage.objects.filter(tenant_id__in=tenant_ids).select_related("tenant")
        .order_by("tenant_id", "flavor"))


def tenant_budget(*, tenant: Tenant, now: datetime) -> sm.TenantBudget:
    quota = Quota.objects.filter(tenant=tenant).first()
    held = tenant_held_share(tenant_id=tenant.pk)
    slots, cu_slots = held.slots, float(held.cu_slots)
    remaining = None
    if quota is not None and quota.monthly_budget_usd is not None:
        remaining = max(0.0, float(quota.monthly_budget_usd) - month_to_date_spend(tenant=tenant, now=now))
    return sm.TenantBudget(
        tenant=tenant.slug,
        gpu_quota=float(quota.max_gpus) if quota and quota.max_gpus else None,
        cu_quota=float(quota.max_compute_units) if quota and quota.max_compute_units else None,
        gpus_in_use=slots / Gpu.SLOTS, cu_in_use=cu_slots / Gpu.SLOTS, remaining_budget=remaining,
        owners=owner_budgets(tenant=tenant, now=now),
    )


def owner_budgets(*, tenant: Tenant, now: datetime) -> tuple[sm.OwnerBudget, ...]:
    """Members' own budgets and what is left of them: one query for the budgets and, when there are any,
    one spend read for all of them (not one per job or per member)."""
    # Imported here, as broker.scheduler.spend does: billing imports the scheduler's modules.
    from broker.billing.selectors import user_budgets_spent

    return tuple(sm.OwnerBudget(owner=username, remaining_budget=max(0.0, float(budget - spent)),
                                monthly_budget=float(budget))
                 for username, budget, spent in user_budgets_spent(tenant=tenant, now=now))
