"""Month-to-date spend of a tenant, from its allocations and the pools' internal GPU-hour rates.

This is the figure budgets are checked against; the billing issue turns the same allocations into
invoices per GPU-second.
"""
from __future__ import annotations

from datetime import datetime

from django.db.models import Q

from broker.inventory.models import Gpu
from broker.jobs.models import Allocation
from broker.tenancy.models import Tenant


def month_start(now: datetime) -> datetime:
    return now.replace(day=1, hour=0, minute=0, second=0, microsecond=0)


def month_to_date_spend(*, tenant: Tenant, now: datetime) -> float:
    return sum(month_to_date_spend_by_provider(now=now, tenant=tenant).values())


def month_to_date_spend_by_provider(*, now: datetime, tenant: Tenant | None = None) -> dict[tuple[str, str], float]:
    """(tenant slug, pool kind) -> dollars this month, for one tenant or all (the /metrics gauge)."""
    start = month_start(now)
    totals: dict[tuple[str, str], float] = {}
    allocations = Allocation.objects.filter(Q(active=True) | Q(released_at__gte=start))
    if tenant is not None:
        allocations = allocations.filter(job__tenant=tenant)
    for alloc in allocations.select_related("node__pool", "job__tenant").prefetch_related("slices"):
        begin = max(alloc.created_at, start)
        end = alloc.released_at or now
        hours = max(0.0, (end - begin).total_seconds() / 3600)
        gpu_equivalents = len(alloc.slices.all()) / Gpu.SLOTS
        key = (alloc.job.tenant.slug, alloc.node.pool.kind)
        totals[key] = totals.get(key, 0.0) + hours * gpu_equivalents * float(alloc.node.pool.gpu_hour_rate_usd)
    return totals
