"""Monthly statements: one per team and UTC month, with a line item per allocation (one per placement of
a job that moved) and per idle instance, their totals, and the budget. A closed month's statement is the
frozen copy stored by `month_close` (broker.billing.services); an open month's is computed live.

A line item's amount is the sum of its daily usage records' amounts (each already rounded to the cent,
ROUND_HALF_EVEN), and the totals are sums of line items: they add up to the cent.
"""
from __future__ import annotations

from collections import OrderedDict
from datetime import datetime
from decimal import Decimal

from django.db.models import Max, Min, Sum
from django.utils import timezone

from broker.billing.metering import CENT, ROUNDING_RULE, month_of
from broker.billing.models import IDLE, BillingMonth, UsageKind, UsageRecord
from broker.billing.selectors import ZERO, consistent_read, live_lines, user_budgets_spent
from broker.tenancy.models import Quota, Tenant

IDENTITY = ("kind", "allocation_id", "instance_id", "spot")
ITEM_KEYS = ("kind", "allocation_id", "instance_id", "job_id", "job_name", "user", "gpu_model", "provider", "pool",
             "region", "spot", "rate_usd_per_gpu_hour", "cpu_rate_usd_per_core_hour", "memory_rate_usd_per_gib_hour")
# Summed over a line item's daily records (each amount already rounded once to the cent).
SUMMED = ("gpu_seconds", "cpu_core_seconds", "memory_gib_seconds", "cpu_amount_usd", "memory_amount_usd")


def _month_days(month: str):
    from broker.billing.services import month_bounds

    start, end = month_bounds(month)
    return start, end


def budget_status(*, tenant: Tenant, spent: Decimal) -> dict:
    quota = Quota.objects.filter(tenant=tenant).first()
    return budget_figures(budget=quota.monthly_budget_usd if quota is not None else None, spent=spent)


def user_budget_lines(*, tenant: Tenant, now: datetime, username: str | None = None) -> list[dict]:
    """The team's per-user budgets with this month's spend of each ({user, monthly_budget_usd, spent_usd,
    remaining_usd, used_pct, warning, exceeded}), by username; of `username` only when given."""
    return [{"user": user, **budget_figures(budget=budget, spent=spent)}
            for user, budget, spent in user_budgets_spent(tenant=tenant, now=now, username=username)]


def budget_figures(*, budget: Decimal | None, spent: Decimal) -> dict:
    """A budget's figures: spent, remaining, share used, warning at 80%, exceeded at 100%."""
    if budget is None:
        return {"monthly_budget_usd": None, "spent_usd": str(spent), "remaining_usd": None, "used_pct": None,
                "warning": False, "exceeded": False}
    budget = Decimal(budget)
    pct = float(spent * 100 / budget) if budget > 0 else (100.0 if spent > 0 else 0.0)
    return {"monthly_budget_usd": str(budget), "spent_usd": str(spent), "remaining_usd": str(max(ZERO, budget - spent)),
            "used_pct": round(pct, 1), "warning": pct >= 80, "exceeded": pct >= 100}


def statement_build(*, tenant: Tenant, month: str, stored_only: bool = False, now: datetime | None = None) -> dict:
    now = now or timezone.now()
    start, end = _month_days(month)
    items: "OrderedDict[tuple, dict]" = OrderedDict()
    with consistent_read():
        # Grouped by the line's identity only (an allocation, or an idle instance); its other columns are
        # the same on each of its records, so Max() just reads them (a GROUP BY on all twelve was 5x slower).
        rows = (UsageRecord.objects.filter(tenant=tenant, month=month).values(*IDENTITY)
                .annotate(**{k: Max(k) for k in ITEM_KEYS if k not in IDENTITY},
                          **{k: Sum(k) for k in SUMMED}, amount=Sum("amount_usd"), first=Min("start"),
                          last=Max("end"), seconds=Sum("seconds"))
                .order_by())
        for row in rows:
            items[tuple(row[k] for k in ITEM_KEYS)] = row
        live = [] if stored_only else live_lines(tenant=tenant, start=start.date(), end=end.date(), now=now)
    for ln in live:
        key = tuple(getattr(ln, k) for k in ITEM_KEYS)
        item = items.get(key)
        if item is None:
            items[key] = {**{k: getattr(ln, k) for k in ITEM_KEYS + SUMMED},
                          "amount": ln.amount_usd, "first": ln.start, "last": ln.end, "seconds": ln.seconds}
        else:
            for k in SUMMED:
                item[k] += getattr(ln, k)
            item["amount"] += ln.amount_usd
            item["first"] = min(item["first"], ln.start)
            item["last"] = max(item["last"], ln.end)
            item["seconds"] += ln.seconds
    lines = []
    usage_total = idle_total = cpu_total = memory_total = ZERO
    gpu_seconds_total = Decimal(0)
    for item in sorted(items.values(), key=lambda i: (i["kind"] == UsageKind.IDLE, i["first"],
                                                      i["allocation_id"] or 0, i["instance_id"] or 0)):
        amount = Decimal(item["amount"]).quantize(CENT)
        idle = item["kind"] == UsageKind.IDLE
        if idle:
            idle_total += amount
        else:
            usage_total += amount
            gpu_seconds_total += Decimal(item["gpu_seconds"])
        cpu_amount, memory_amount = (Decimal(item[k]).quantize(CENT) for k in ("cpu_amount_usd", "memory_amount_usd"))
        cpu_total += cpu_amount
        memory_total += memory_amount
        lines.append({
            "kind": item["kind"], "job": IDLE if idle else item["job_id"], "job_name": item["job_name"],
            "user": item["user"], "allocation": item["allocation_id"], "instance": item["instance_id"],
            "gpu_model": item["gpu_model"], "provider": item["provider"], "pool": item["pool"],
            "region": item["region"], "spot": item["spot"], "start": item["first"].isoformat(),
            "end": item["last"].isoformat(), "seconds": item["seconds"],
            "gpu_hours": str((Decimal(item["gpu_seconds"]) / 3600).quantize(Decimal("0.0001"))),
            "rate_usd_per_gpu_hour": str(Decimal(item["rate_usd_per_gpu_hour"]).quantize(Decimal("0.0001"))),
            # CPU and memory (owned pools that charge them: the job's request per node); amount_usd is the
            # line's total, GPU + CPU + memory.
            "cpu_core_hours": str((Decimal(item["cpu_core_seconds"]) / 3600).quantize(Decimal("0.0001"))),
            "cpu_rate_usd_per_core_hour": _rate(item["cpu_rate_usd_per_core_hour"]),
            "cpu_amount_usd": str(cpu_amount),
            "memory_gib_hours": str((Decimal(item["memory_gib_seconds"]) / 3600).quantize(Decimal("0.0001"))),
            "memory_rate_usd_per_gib_hour": _rate(item["memory_rate_usd_per_gib_hour"]),
            "memory_amount_usd": str(memory_amount),
            "amount_usd": str(amount),
        })
    total = usage_total + idle_total
    statement = {
        "team": tenant.slug, "month": month, "currency": "USD", "status": "open", "closed_at": None,
        "rounding": ROUNDING_RULE, "lines": lines,
        "totals": {"usage_usd": str(usage_total), "idle_usd": str(idle_total), "total_usd": str(total),
                   "cpu_usd": str(cpu_total), "memory_usd": str(memory_total),
                   "gpu_hours": str((gpu_seconds_total / 3600).quantize(Decimal("0.0001"))),
                   "line_count": len(lines)},
    }
    if month == month_of(now.date()):
        statement["budget"] = budget_status(tenant=tenant, spent=total)
    return statement


def _rate(value) -> str | None:
    return None if value is None else str(Decimal(value).quantize(Decimal("0.000001")))


def statement_get(*, tenant: Tenant, month: str, now: datetime | None = None) -> dict:
    """The frozen statement of a closed month, else the live one."""
    _month_days(month)  # validates
    row = BillingMonth.objects.filter(tenant=tenant, month=month, closed_at__isnull=False).first()
    if row is not None:
        return {**row.statement, "status": "closed", "closed_at": row.closed_at.isoformat()}
    return statement_build(tenant=tenant, month=month, now=now)


def statements_list(*, tenant: Tenant, now: datetime | None = None) -> list[dict]:
    """Every month the team has records or a closed statement for, and the current month, newest first."""
    now = now or timezone.now()
    current = month_of(now.date())
    totals = {m: t for m, t in UsageRecord.objects.filter(tenant=tenant).values_list("month")
              .annotate(total=Sum("amount_usd")).order_by()}
    closed = {row.month: row for row in BillingMonth.objects.filter(tenant=tenant, closed_at__isnull=False)}
    start, end = _month_days(current)
    live = sum((ln.amount_usd for ln in live_lines(tenant=tenant, start=start.date(), end=end.date(), now=now)),
               ZERO)
    out = []
    for month in sorted(set(totals) | set(closed) | {current}, reverse=True):
        if month in closed:
            total, status = closed[month].statement.get("totals", {}).get("total_usd", "0.00"), "closed"
        else:
            total = str((Decimal(totals.get(month) or ZERO) + (live if month == current else ZERO)).quantize(CENT))
            status = "open"
        out.append({"month": month, "status": status, "total_usd": total})
    return out
