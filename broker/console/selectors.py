"""Reads the console's pages need beyond the API's own selectors: each scoped to one team."""
from __future__ import annotations

from collections import Counter, defaultdict
from datetime import datetime

from django.db.models import Count, Sum
from django.utils import timezone

from broker.billing.selectors import month_to_date_spend
from broker.billing.statements import budget_status
from broker.inventory.models import Gpu, NodeState
from broker.inventory.selectors import nodes_usable_by
from broker.jobs.models import AllocationSlice, Job
from broker.jobs.states import JobState
from broker.tenancy.models import Tenant


def gpus_in_use(*, tenant: Tenant) -> list[dict]:
    """The team's GPUs in use now, by GPU model and pool: whole-GPU equivalents held by its jobs."""
    rows = (AllocationSlice.objects.filter(active=True, allocation__job__tenant=tenant)
            .values("gpu__model_name", "gpu__node__pool__name").annotate(held=Sum("slots"))
            .order_by("gpu__node__pool__name", "gpu__model_name"))
    return [{"model": r["gpu__model_name"], "pool": r["gpu__node__pool__name"],
             "gpus": round(r["held"] / Gpu.SLOTS, 2)} for r in rows]


def pending_by_reason(*, tenant: Tenant) -> list[dict]:
    """Pending jobs counted by the engine's reason code, most common first."""
    rows = (Job.objects.filter(tenant=tenant, state=JobState.PENDING).values("pending_reason_code")
            .annotate(jobs=Count("id")).order_by("-jobs", "pending_reason_code"))
    return [{"code": r["pending_reason_code"] or "NOT_YET_CONSIDERED", "jobs": r["jobs"]} for r in rows]


def jobs_by_state(*, tenant: Tenant) -> dict[str, int]:
    counts = Counter(dict(Job.objects.filter(tenant=tenant).values_list("state").annotate(n=Count("id"))
                          .order_by()))
    return {state: counts.get(state, 0) for state in JobState.values}


def capacity_summary(*, tenant: Tenant) -> dict:
    """Nodes the team may use by state, and their GPUs (total, and held by anyone: occupancy)."""
    nodes = nodes_usable_by(tenant)
    by_state = Counter(dict(nodes.values_list("state").annotate(n=Count("id")).order_by()))
    gpus = Gpu.objects.filter(node__in=nodes)
    held = (AllocationSlice.objects.filter(active=True, gpu__node__in=nodes).values("gpu").distinct().count())
    lost = list(nodes.filter(state=NodeState.LOST).order_by("name").values_list("name", flat=True)[:20])
    return {"nodes": dict(by_state), "gpus": gpus.count(), "gpus_occupied": held, "lost_nodes": lost}


def spend_summary(*, tenant: Tenant, now: datetime | None = None) -> dict:
    """This month's spend against the budget (the billing figure; budget_status's shape)."""
    spent = month_to_date_spend(tenant=tenant, now=now or timezone.now())
    return budget_status(tenant=tenant, spent=spent)


def warnings(*, spend: dict, capacity: dict) -> list[str]:
    """What the dashboard warns about: the budget at 80% or over, nodes lost."""
    out = []
    if spend.get("exceeded"):
        out.append(f"This month's spend (${spend['spent_usd']}) is over the budget of ${spend['monthly_budget_usd']}: "
                   "jobs that need paid capacity wait (BUDGET_EXCEEDED) until next month or a higher budget.")
    elif spend.get("warning"):
        out.append(f"This month's spend is at {spend['used_pct']}% of the budget "
                   f"(${spend['spent_usd']} of ${spend['monthly_budget_usd']}).")
    lost = capacity.get("lost_nodes") or []
    if lost:
        out.append(f"{len(lost)} node{'s' if len(lost) != 1 else ''} lost: {', '.join(lost)}. "
                   "Their jobs restart elsewhere from their last checkpoint.")
    return out


# A job checkpointing or being moved is still running its code: the dashboard counts it as running.
RUNNING_STATES = (JobState.RUNNING, JobState.CHECKPOINTING, JobState.MIGRATING)


def running_jobs(*, tenant: Tenant, limit: int = 10) -> list[Job]:
    return list(Job.objects.filter(tenant=tenant, state__in=RUNNING_STATES).select_related("owner")
                .order_by("-started_at", "-id")[:limit])


def dashboard(*, tenant: Tenant) -> dict:
    spend = spend_summary(tenant=tenant)
    capacity = capacity_summary(tenant=tenant)
    states = jobs_by_state(tenant=tenant)
    in_use = gpus_in_use(tenant=tenant)
    by_model: dict[str, float] = defaultdict(float)
    for row in in_use:
        by_model[row["model"]] += row["gpus"]
    return {"spend": spend, "capacity": capacity, "states": states, "gpus_in_use": in_use,
            "gpus_in_use_total": round(sum(by_model.values()), 2), "gpus_by_model": dict(by_model),
            "pending": pending_by_reason(tenant=tenant), "queue_length": states.get(JobState.PENDING, 0),
            "running": running_jobs(tenant=tenant), "running_count": sum(states.get(s, 0) for s in RUNNING_STATES),
            "warnings": warnings(spend=spend, capacity=capacity)}
