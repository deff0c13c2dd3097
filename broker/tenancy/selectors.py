"""Reads for teams' shared-capacity quotas: what a team holds of each flavor, and its fair share."""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Sequence

from django.db.models import DecimalField, F, Sum

from broker.tenancy.models import CU_FLAVOR, FairShareUsage, TeamQuota, Tenant


def owned_holdings(*, tenant_ids: Sequence[int]) -> dict[tuple[int, str], float]:
    """GPUs (per model) and compute units ("CU") the teams' active jobs hold now on owned nodes: what
    fair share counts (rented capacity is paid for, not shared)."""
    from broker.inventory.models import OWNED_POOL_KINDS, Gpu
    from broker.jobs.models import AllocationSlice
    from broker.jobs.states import ACTIVE_STATES

    held: dict[tuple[int, str], float] = defaultdict(float)
    rows = (AllocationSlice.objects.filter(active=True, allocation__job__tenant_id__in=list(tenant_ids),
                                           allocation__job__state__in=ACTIVE_STATES,
                                           gpu__node__pool__kind__in=OWNED_POOL_KINDS)
            .values("allocation__job__tenant_id", "gpu__model__name", "gpu__model_name")
            .annotate(held=Sum("slots"),
                      cu=Sum(F("slots") * F("gpu__model__compute_units"), output_field=DecimalField())))
    for row in rows:
        tenant_id = row["allocation__job__tenant_id"]
        held[tenant_id, row["gpu__model__name"] or row["gpu__model_name"]] += row["held"] / Gpu.SLOTS
        held[tenant_id, CU_FLAVOR] += float(row["cu"] or 0) / Gpu.SLOTS
    return held


@dataclass(frozen=True)
class TeamQuotaUsage:
    quotas: list[dict] = field(default_factory=list)
    fair_share_factor: float | None = None


def _number(value) -> float | None:
    return float(value) if value is not None else None


def team_quota_usage(*, tenant: Tenant) -> TeamQuotaUsage:
    """The team's quota of each managed flavor (its own rows, and nominal 0 for a flavor another team of
    its component has a quota of: it may only borrow there), what it holds on owned nodes, what it
    borrows, its decayed usage, and its fair-share factor among the component's teams."""
    from broker.inventory.selectors import scheduling_component  # inventory imports tenancy models
    from scheduling import model as sm
    from scheduling.quota import QuotaLedger

    component = scheduling_component(tenant)
    ids = [t.pk for t in component]
    rows = list(TeamQuota.objects.filter(tenant_id__in=ids).select_related("tenant").order_by("flavor"))
    managed = sorted({row.flavor for row in rows})
    if not managed:
        return TeamQuotaUsage()
    own = {row.flavor: row for row in rows if row.tenant_id == tenant.pk}
    held = owned_holdings(tenant_ids=[tenant.pk])
    usage_rows = list(FairShareUsage.objects.filter(tenant_id__in=ids).select_related("tenant"))
    decayed = {row.flavor: row.decayed_hours for row in usage_rows if row.tenant_id == tenant.pk}
    quotas = []
    for flavor in managed:
        row = own.get(flavor)
        nominal = float(row.nominal) if row is not None else 0.0
        in_use = round(held.get((tenant.pk, flavor), 0.0), 3)
        quotas.append({
            "flavor": flavor, "nominal": nominal,
            "borrowing_limit": _number(row.borrowing_limit) if row is not None else None,
            # No row: nominal 0, so nothing to lend (scheduling.quota.UNQUOTED).
            "lending_limit": _number(row.lending_limit) if row is not None else 0.0,
            "in_use": in_use, "borrowed": round(max(0.0, in_use - nominal), 3),
            "decayed_usage_hours": round(decayed.get(flavor, 0.0), 3),
        })
    # The engine's own arithmetic (scheduling.quota), from the same quotas and decayed usage the cycle
    # reads; a placeholder demand makes the caller one of the teams even when it has no quota row.
    snapshot = sm.Snapshot(
        now=0.0,
        quotas=tuple(sm.QuotaShare(tenant=r.tenant.slug, flavor=r.flavor, nominal=float(r.nominal),
                                   borrowing_limit=_number(r.borrowing_limit), lending_limit=_number(r.lending_limit))
                     for r in rows),
        usage=tuple(sm.TeamUsage(tenant=u.tenant.slug, flavor=u.flavor, decayed_hours=u.decayed_hours)
                    for u in usage_rows),
        pending=(sm.JobDemand(job_id="", tenant=tenant.slug),))
    factor = QuotaLedger(snapshot).factor.get(tenant.slug)
    return TeamQuotaUsage(quotas=quotas, fair_share_factor=round(factor, 4) if factor is not None else None)
