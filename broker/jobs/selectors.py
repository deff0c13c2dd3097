"""Reads for jobs and the GPU catalogue."""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from decimal import Decimal
from typing import Any, Iterable

from django.db.models import DecimalField, F, QuerySet, Sum

from broker.inventory.models import GpuModel
from broker.jobs.models import AllocationSlice, Job
from broker.jobs.spec import GpuCatalog
from broker.jobs.states import ACTIVE_STATES, JobState
from broker.rows import CompiledRead
from broker.tenancy.models import Tenant


@dataclass(frozen=True)
class HeldShare:
    """What active allocation slots hold: `slots` (Gpu.SLOTS per whole GPU) and `cu_slots`, the slots
    weighted by their GPU model's compute units (divide either by Gpu.SLOTS for GPUs or CU)."""

    slots: int
    cu_slots: Decimal


def held_share(**filters: Any) -> HeldShare:
    """The share held by the active slots matching `filters` (e.g. `allocation__job=job`)."""
    usage = AllocationSlice.objects.filter(active=True, **filters).aggregate(
        held=Sum("slots"), cu=Sum(F("slots") * F("gpu__model__compute_units"), output_field=DecimalField()))
    return HeldShare(slots=usage["held"] or 0, cu_slots=usage["cu"] or Decimal(0))


def held_slots(gpu_ids: Iterable[int]) -> dict[int, set[int]]:
    """GPU id -> the slots active allocations hold on it, for these GPUs (a GPU nothing holds: empty)."""
    taken: dict[int, set[int]] = defaultdict(set)
    for gpu_id, mask in AllocationSlice.objects.filter(gpu_id__in=gpu_ids, active=True).values_list("gpu_id", "mask"):
        taken[gpu_id].update(AllocationSlice.slots_of(mask))
    return taken


def tenant_held_share(*, tenant_id: int) -> HeldShare:
    """What a tenant's placed and running jobs hold: what its GPU and CU quotas count."""
    return held_share(allocation__job__tenant_id=tenant_id, allocation__job__state__in=ACTIVE_STATES)


# Every submission reads the catalogue: plain rows (model instances of it were 6% of a submission's CPU),
# and SQL the ORM writes once per database (compiling it was another 6%; broker/rows.py).
_CATALOG = CompiledRead(lambda _: GpuModel.objects.values_list("name", "memory_gb", "aliases"), varying=False)


def gpu_catalog() -> GpuCatalog:
    """The catalogue, read when first asked (a spec that names no model never reads it)."""
    return GpuCatalog(lambda: [(name, memory_gb, list(aliases or [])) for name, memory_gb, aliases in _CATALOG.rows()])


def jobs_for_tenant(*, tenant: Tenant) -> QuerySet[Job]:
    return Job.objects.filter(tenant=tenant).select_related("owner")


def tenant_gpu_usage(*, tenant: Tenant) -> dict[str, Any]:
    """GPUs held now (whole GPUs touched by an active allocation) and pending job count."""
    gpus = (AllocationSlice.objects.filter(active=True, allocation__job__tenant=tenant)
            .values("gpu").distinct().count())
    cu = (Job.objects.filter(tenant=tenant, state__in=ACTIVE_STATES).aggregate(total=Sum("compute_units"))["total"]
          or Decimal("0"))
    return {
        "gpus_in_use": gpus,
        "compute_units_in_use": float(cu),
        "pending_jobs": Job.objects.filter(tenant=tenant, state=JobState.PENDING).count(),
        "running_jobs": Job.objects.filter(tenant=tenant, state=JobState.RUNNING).count(),
    }
