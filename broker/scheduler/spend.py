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
    start = month_start(now)
    total = 0.0
    allocations = (Allocation.objects.filter(job__tenant=tenant)
                   .filter(Q(active=True) | Q(released_at__gte=start))
                   .select_related("node__pool").prefetch_related("slices"))
    for alloc in allocations:
        begin = max(alloc.created_at, start)
        end = alloc.released_at or now
        hours = max(0.0, (end - begin).total_seconds() / 3600)
        gpu_equivalents = len(alloc.slices.all()) / Gpu.SLOTS
        total += hours * gpu_equivalents * float(alloc.node.pool.gpu_hour_rate_usd)
    return total
