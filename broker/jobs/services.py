"""Writes for jobs: submit, state changes (compare-and-set), cancel, allocate and release GPUs.

Every state change goes through `job_transition`, which refuses illegal edges, changes the row only if
it is still in the state the caller saw, and appends a JobEvent in the same transaction.
"""
from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from django.contrib.auth.models import AbstractBaseUser
from django.db import IntegrityError, transaction
from django.db.models import Count, F, OuterRef, Subquery
from django.utils import timezone

from broker.inventory.models import Gpu, GpuHealth, Node, NodeState
from broker.inventory.selectors import usable_pool_ids
from broker.jobs.models import Allocation, AllocationSlice, Job, JobEvent
from broker.jobs.quota import QuotaRoom
from broker.jobs.selectors import held_slots
from broker.jobs.spec import Demand, spec_to_json
from broker.jobs.states import TERMINAL_STATES, JobState, is_legal
from broker.rows import CompiledRead, instance_with_child_insert
from broker.tenancy.models import Quota, Tenant
from broker.tenancy.services import tenants_lock


class JobError(Exception):
    """A refused job operation. `field` names what was wrong, for a 400 body."""

    def __init__(self, message: str, *, field: str = "non_field_errors", code: str = "invalid"):
        super().__init__(message)
        self.field = field
        self.code = code


class IllegalTransition(JobError):
    def __init__(self, old: str, new: str):
        super().__init__(f"A job cannot go from {old} to {new}.", field="state", code="illegal_transition")
        self.old, self.new = old, new


class StaleState(JobError):
    """The row changed under us: someone else won the race."""

    def __init__(self, expected: str, actual: str):
        super().__init__(f"The job is {actual}, not {expected} any more.", field="state", code="conflict")
        self.expected, self.actual = expected, actual


class DoubleBooking(JobError):
    def __init__(self, message: str = "One of these GPUs is already allocated."):
        super().__init__(message, field="gpus", code="double_booking")


def event_append(*, job: Job, kind: str, message: str = "", reason_code: str = "",
                 data: dict[str, Any] | None = None) -> JobEvent:
    return JobEvent.objects.create(job=job, kind=kind, message=message, reason_code=reason_code, data=data or {})


def job_columns(validated: dict[str, Any]) -> dict[str, Any]:
    """A validated spec (`JobSpecSerializer`) as Job columns: the stored spec, its secrets and demand."""
    demand: Demand = validated["_demand"]
    return dict(
        name=validated["name"],
        spec=spec_to_json(validated),
        secret_env=dict(validated.get("secrets") or {}),
        priority=validated.get("priority", 50),
        preemptible=validated.get("preemptible", False),
        gpu_count=demand.gpus_per_node,
        gpu_milli=demand.gpu_milli,
        compute_units=Decimal(str(demand.compute_units)) if demand.compute_units is not None else None,
        gpu_models=demand.gpu_models,
        gpu_alternatives=demand.gpu_alternatives,
        min_gpu_memory_gb=demand.min_gpu_memory_gb,
        interconnect=demand.interconnect,
        node_count=demand.nodes,
        cpu_milli=demand.cpu_milli,
        memory_mb=demand.memory_mb,
        spot=demand.spot,
        max_price_per_hour=(Decimal(str(demand.max_price_per_hour))
                            if demand.max_price_per_hour is not None else None),
        expected_duration_hours=validated.get("expected_duration_hours"),
        deadline=validated.get("deadline"),
    )


# Read on every submission, their SQL written once per database (broker/rows.py), in one round trip: the
# tenant's three limits as one plain row, and two index probes that bound its pending jobs from above
# without counting them: every pending job's id lies between the tenant's oldest pending job's and the
# newest job's, so there are at most newest - oldest + 1 of them. Counting visits every pending job (on
# PostgreSQL the heap too, for rows written since the last vacuum: a submission's database CPU rose by half
# with 2,400 of one tenant's jobs pending; bench.service), so it runs only when the bound reaches the limit.
_QUOTA_OF_TENANT = CompiledRead(
    lambda tenant_id: Quota.objects.filter(tenant_id=tenant_id).annotate(
        oldest_pending=Subquery(Job.objects.filter(tenant_id=OuterRef("tenant_id"), state=JobState.PENDING)
                                .order_by("id").values("id")[:1]),
        newest=Subquery(Job.objects.order_by("-id").values("id")[:1]))
    .values_list("max_gpus", "max_compute_units", "max_pending_jobs", "oldest_pending", "newest")[:1],
    marker=CompiledRead.INT_MARKER)
_PENDING_OF_TENANT = CompiledRead(lambda tenant_id: Job.objects.filter(tenant_id=tenant_id, state=JobState.PENDING)
                                  .order_by().values("tenant_id").annotate(n=Count("id")).values_list("n"),
                                  marker=CompiledRead.INT_MARKER)


def _pending_at_limit(tenant: Tenant, limit: int, oldest_pending: int | None, newest: int | None) -> int | None:
    """The tenant's pending jobs when they may have reached `limit`, else None (counted only then)."""
    if limit > 0 and (oldest_pending is None or newest - oldest_pending + 1 < limit):
        return None
    pending = next(iter(_PENDING_OF_TENANT.rows(tenant.pk)), [0])[0]
    return pending if pending >= limit else None


def job_submit(*, tenant: Tenant, owner: AbstractBaseUser, validated: dict[str, Any]) -> Job:
    """Create a PENDING job from a validated spec (see `JobSpecSerializer`), all or nothing."""
    demand: Demand = validated["_demand"]
    quota = next(iter(_QUOTA_OF_TENANT.rows(tenant.pk)), None)
    if quota is not None:
        max_gpus, max_compute_units, max_pending_jobs, oldest_pending, newest = quota
        if max_gpus and demand.total_gpus > max_gpus:
            raise JobError(
                f"The job asks for {demand.total_gpus} GPUs; your tenant's quota allows {max_gpus} at once.",
                field="resources",
            )
        if max_compute_units and demand.compute_units and Decimal(str(demand.compute_units)) > max_compute_units:
            raise JobError(
                f"The job asks for {demand.compute_units} compute units; your quota allows {max_compute_units}.",
                field="resources",
            )
        # Counted without a lock, as before: two submissions racing at the limit may both pass it by one.
        pending = _pending_at_limit(tenant, max_pending_jobs, oldest_pending, newest)
        if pending is not None:
            raise JobError(
                f"Your tenant already has {pending} pending jobs (limit {max_pending_jobs}).",
                field="non_field_errors", code="throttled",
            )
    job = Job(
        tenant=tenant,
        owner=owner,
        **job_columns(validated),
        pending_reason_code="NOT_YET_SCHEDULED",
        pending_reason="Waiting for the next scheduling cycle.",
        next_attempt_at=timezone.now(),
    )
    submitted = JobEvent(job=job, kind="submitted", message=f"Submitted by {owner}.",
                         data={"demand": demand.as_dict()})
    instance_with_child_insert(job, submitted, "job")  # both or neither
    return job


def job_transition(*, job: Job, to: str, expected: str | None = None, reason_code: str = "",
                   message: str = "", data: dict[str, Any] | None = None, stop_unconfirmed: bool = False) -> Job:
    """Move `job` from `expected` (default: its state as loaded) to `to`, or raise.

    Compare-and-set: the UPDATE only matches while the row is still in `expected`, so of two
    concurrent callers exactly one wins and the other gets StaleState. `stop_unconfirmed`: the
    allocations it releases may still have a running process (their node is LOST), and the job's
    next start waits for them (broker.agents.fencing).
    """
    old = expected or job.state
    if not is_legal(old, to):
        raise IllegalTransition(old, to)
    now = timezone.now()
    changes: dict[str, Any] = {"state": to, "updated_at": now}
    if to == JobState.RUNNING:
        changes["started_at"] = now
    if to in TERMINAL_STATES:
        changes["finished_at"] = now
    if to != JobState.PENDING:
        changes.update(pending_reason_code="", pending_reason="", pending_reason_data={})
    else:
        # A pending job always says why it waits; the next cycle refines the reason.
        changes.update(next_attempt_at=now, pending_reason_code=reason_code or "REQUEUED",
                       pending_reason=message or "Back in the queue.", pending_reason_data=data or {})
    with transaction.atomic():
        updated = Job.objects.filter(pk=job.pk, state=old).update(**changes)
        if updated != 1:
            actual = Job.objects.filter(pk=job.pk).values_list("state", flat=True).first() or "deleted"
            raise StaleState(old, actual)
        if to in TERMINAL_STATES or to in (JobState.PENDING, JobState.PREEMPTED):
            _release_allocations(job=job, stop_unconfirmed=stop_unconfirmed)
        event_append(job=job, kind="state", reason_code=reason_code,
                     message=message or f"{old} → {to}", data={"from": old, "to": to, **(data or {})})
    job.refresh_from_db()
    return job


def job_cancel(*, job: Job, by: AbstractBaseUser | None = None) -> Job:
    """Cancel from any live state. Cancelling a finished job is refused; a race retries on the new state."""
    for _ in range(5):
        if job.state in TERMINAL_STATES:
            raise IllegalTransition(job.state, JobState.CANCELLED)
        try:
            return job_transition(job=job, to=JobState.CANCELLED, reason_code="USER_CANCELLED",
                                  message=f"Cancelled by {by}." if by else "Cancelled.")
        except StaleState:
            job.refresh_from_db()
    raise JobError("The job kept changing state; try again.", code="conflict")


def job_set_pending_reason(*, job: Job, code: str, message: str, data: dict[str, Any] | None = None) -> None:
    """Record why a pending job waits; logs an event only when the reason code changes."""
    with transaction.atomic():
        changed = (Job.objects.filter(pk=job.pk, state=JobState.PENDING)
                   .exclude(pending_reason_code=code).exists())
        Job.objects.filter(pk=job.pk, state=JobState.PENDING).update(
            pending_reason_code=code, pending_reason=message, pending_reason_data=data or {})
        if changed:
            event_append(job=job, kind="pending_reason", reason_code=code, message=message, data=data or {})


@dataclass(frozen=True)
class GpuRequest:
    """GPUs wanted on one node: GPU indices and the share of each (1000 = whole GPU)."""

    node: Node
    gpu_indices: tuple[int, ...]
    milli: int = 1000


def allocation_commit(*, job: Job, requests: list[GpuRequest], expected_state: str = JobState.PENDING,
                      to_state: str = JobState.PLACED) -> list[Allocation]:
    """Give `job` the requested GPUs and move it to `to_state` (PLACED), or change nothing.

    Locks the nodes in id order (a fixed order, so two commits cannot deadlock), checks health and the
    tenant's GPU quota, then inserts slot rows; the partial unique index refuses any slot already held,
    so a GPU can never be booked twice even by two transactions that both passed the checks.
    """
    if not requests:
        raise JobError("Nothing to allocate.", field="gpus")
    try:
        with transaction.atomic():
            node_ids = sorted({r.node.pk for r in requests})
            nodes = {n.pk: n for n in Node.objects.select_for_update().filter(pk__in=node_ids).order_by("pk")}
            tenants_lock([job.tenant_id])  # serialises quota checks
            # A team may run on its own pools' nodes and on those of pools shared with it (PoolGrant).
            usable = usable_pool_ids(tenant_id=job.tenant_id, pool_ids={n.pool_id for n in nodes.values()})
            for node_id, node in nodes.items():
                if node.pool_id not in usable:
                    raise JobError(f"Node {node.name} is in a pool this team may not use.", field="node",
                                   code="no_pool_access")
                if node.state != NodeState.ONLINE:
                    raise JobError(f"Node {node.name} is {node.state}.", field="node")
            wanted: list[tuple[GpuRequest, list[Gpu]]] = []
            for req in requests:
                gpus = list(Gpu.objects.filter(node_id=req.node.pk, index__in=req.gpu_indices)
                            .select_related("model"))
                if len(gpus) != len(set(req.gpu_indices)):
                    raise JobError(f"Node {req.node.name} has no GPU index among {list(req.gpu_indices)}.",
                                   field="gpus")
                if any(g.health == GpuHealth.FAILED for g in gpus):
                    raise JobError(f"A requested GPU on {req.node.name} has failed.", field="gpus")
                wanted.append((req, gpus))
            _check_quota(job=job, adding=[(gpu, Gpu.slots_for(req.milli)) for req, gpus in wanted for gpu in gpus])
            allocations = []
            for req, gpus in wanted:
                node = nodes[req.node.pk]
                Node.objects.filter(pk=node.pk).update(epoch=F("epoch") + 1)
                alloc = Allocation.objects.create(job=job, node=node, epoch=node.epoch + 1)
                slot_count = Gpu.slots_for(req.milli)
                slices = []
                held = held_slots([gpu.pk for gpu in gpus])  # one read for the node's GPUs, not one per GPU
                for gpu in gpus:
                    free = [s for s in range(Gpu.SLOTS) if s not in held[gpu.pk]]
                    if len(free) < slot_count:
                        raise DoubleBooking(f"GPU {gpu.index} on {node.name} does not have the share requested free.")
                    slices.append(AllocationSlice(allocation=alloc, gpu=gpu, mask=AllocationSlice.mask_of(
                        free[:slot_count]), slots=slot_count))
                AllocationSlice.objects.bulk_create(slices)
                allocations.append(alloc)
            job_transition(job=job, to=to_state, expected=expected_state, reason_code="PLACED",
                           message="Placed on " + ", ".join(
                               f"{r.node.name}[{','.join(map(str, r.gpu_indices))}]" for r in requests),
                           data={"placements": [{"node": r.node.name, "gpus": list(r.gpu_indices),
                                                 "milli": r.milli} for r in requests]})
            return allocations
    except IntegrityError as exc:
        raise DoubleBooking() from exc


def _check_quota(*, job: Job, adding: list[tuple[Gpu, int]]) -> None:
    """Refuse what would take the tenant past its GPU or compute-unit quota (broker/jobs/quota.py)."""
    refused = QuotaRoom(job.tenant_id).take([(gpu.model.compute_units if gpu.model else Decimal(0), slots)
                                             for gpu, slots in adding])
    if refused is not None:
        raise JobError(refused, field="resources", code="quota")


def job_allocations_release(*, job: Job) -> int:
    """Release the job's GPUs without changing its state: a moved job's source, once its agent
    confirmed the stop (broker.jobs.migration)."""
    with transaction.atomic():
        return _release_allocations(job=job)


def _release_allocations(*, job: Job, stop_unconfirmed: bool = False) -> int:
    now = timezone.now()
    alloc_ids = list(Allocation.objects.filter(job=job, active=True).values_list("pk", flat=True))
    if not alloc_ids:
        return 0
    AllocationSlice.objects.filter(allocation_id__in=alloc_ids, active=True).update(active=False)
    Allocation.objects.filter(pk__in=alloc_ids).update(active=False, released_at=now,
                                                       stop_unconfirmed=stop_unconfirmed)
    node_ids = Allocation.objects.filter(pk__in=alloc_ids).values_list("node_id", flat=True)
    Node.objects.filter(pk__in=list(node_ids)).update(epoch=F("epoch") + 1)
    return len(alloc_ids)


def job_requeue(*, job: Job, reason_code: str, message: str, stop_unconfirmed: bool = False) -> bool:
    """Back to PENDING (which releases its GPUs); a CHECKPOINTING job goes through PREEMPTED.

    False when the job has already finished or was cancelled meanwhile. `stop_unconfirmed`: see
    `job_transition`.
    """
    for _ in range(3):
        try:
            if job.state == JobState.CHECKPOINTING:
                job = job_transition(job=job, to=JobState.PREEMPTED, reason_code=reason_code, message=message,
                                     stop_unconfirmed=stop_unconfirmed)
            return bool(job_transition(job=job, to=JobState.PENDING, reason_code=reason_code, message=message,
                                       stop_unconfirmed=stop_unconfirmed))
        except StaleState:
            job.refresh_from_db()
        except IllegalTransition:
            return False
    return False


def jobs_requeue_on_node(*, node_id: int, reason_code: str, message: str,
                         stop_unconfirmed: bool = False) -> list[int]:
    """Requeue every job holding GPUs on a node that is gone (lost, terminated, taken over).

    `stop_unconfirmed` when nobody knows the node's processes ended (a LOST node): see `job_transition`.
    """
    jobs = Job.objects.filter(allocations__node_id=node_id, allocations__active=True).distinct()
    return [job.pk for job in jobs
            if job_requeue(job=job, reason_code=reason_code, message=message, stop_unconfirmed=stop_unconfirmed)]
