"""Where a job that is being moved can go: the engine, asked about that one job on the allowed nodes.

A move goes to existing capacity the job's tenant may use (its own pools and those shared with it):
a given node, a given pool, or anywhere but the node it leaves. The engine picks the GPUs (topology, fragmentation) exactly as for a pending job; the
broker commits them (`allocation_commit`) under the same database checks.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from broker.inventory.models import Gpu
from broker.inventory.selectors import nodes_usable_by
from broker.jobs.models import Job
from broker.jobs.selectors import held_share
from broker.jobs.services import GpuRequest
from broker.scheduler.snapshot import job_demand, tenant_snapshot
from scheduling import model as sm
from scheduling.engine import schedule

MOVE_POLICY = sm.Policy(preemption=False, defragmentation=False, consolidation=False, time_limit_s=2.0)


@dataclass(frozen=True)
class MoveTarget:
    node: str = ""  # a node name of the tenant; blank = any
    pool: str = ""  # a pool name of the tenant; blank = any


@dataclass(frozen=True)
class MovePlan:
    requests: list[GpuRequest]
    reason: str = ""  # why there is no room, when `requests` is empty

    @property
    def possible(self) -> bool:
        return bool(self.requests)


def _without_own_share(budget: sm.TenantBudget, job: Job) -> sm.TenantBudget:
    """The tenant's usage without what the job itself holds: a move swaps its GPUs, it adds none."""
    held = held_share(allocation__job=job)
    return dataclasses.replace(
        budget, gpus_in_use=max(0.0, budget.gpus_in_use - held.slots / Gpu.SLOTS),
        cu_in_use=max(0.0, budget.cu_in_use - float(held.cu_slots) / Gpu.SLOTS))


def move_plan(*, job: Job, target: MoveTarget, leaving_node_id: int | None) -> MovePlan:
    """GPUs for `job` on the target (never on the node it leaves), or why there are none."""
    nodes = nodes_usable_by(job.tenant).select_related("pool")  # its own pools and those shared with it
    if target.node:
        nodes = nodes.filter(name=target.node)
    if target.pool:
        nodes = nodes.filter(pool__name=target.pool)
    allowed = {str(n.pk): n for n in nodes if n.pk != leaving_node_id}
    if not allowed:
        return MovePlan([], "No node of this tenant matches the target (other than the one the job is on).")
    snapshot = tenant_snapshot(tenant=job.tenant)
    snapshot = dataclasses.replace(
        snapshot, nodes=tuple(n for n in snapshot.nodes if n.id in allowed), pending=(job_demand(job),),
        running=(), offers=(), tenants=tuple(_without_own_share(b, job) if b.tenant == job.tenant.slug else b
                                             for b in snapshot.tenants))
    plan = schedule(snapshot, MOVE_POLICY)
    placement = plan.placement_for(str(job.pk))
    if placement is None:
        reason = plan.pending.get(str(job.pk))
        return MovePlan([], reason.message if reason is not None else "The target has no room for the job.")
    return MovePlan([GpuRequest(node=allowed[part.node_id], gpu_indices=part.gpu_indices, milli=part.gpu_milli)
                     for part in placement.parts if part.node_id in allowed])
