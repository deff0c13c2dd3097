"""Billing reads: usage lines of a window (stored records plus the live remainder), cost reports grouped by
any combination of keys, and month-to-date spend (what budgets are checked against).

Live: the lines not stored yet (an open day of a held allocation, a running instance's idle time today,
anything metering has not reached) are computed on the fly by the same functions that make records, and
a stored key is never counted twice. Both reads happen in one snapshot (REPEATABLE READ on PostgreSQL,
SQLite's transactions are serialised), so a metering run committing between them neither hides nor
doubles a line.
"""
from __future__ import annotations

import contextlib
from collections import defaultdict
from datetime import date, datetime
from decimal import Decimal
from typing import Iterator, Sequence

from django.db import connection, transaction
from django.db.models import DecimalField, F, FloatField, Q, Sum
from django.utils import timezone

from broker.billing.metering import CENT, Line, allocation_lines, instance_idle_lines, month_of
from broker.billing.models import IDLE, UsageKind, UsageRecord, UserBudget
from broker.tenancy.models import Tenant

# group_by key -> UsageRecord field.
GROUP_FIELDS = {"team": "tenant__slug", "user": "user", "job": "job_id", "gpu_model": "gpu_model",
                "provider": "provider", "pool": "pool", "region": "region", "day": "day"}
ZERO = Decimal("0.00")


@contextlib.contextmanager
def consistent_read() -> Iterator[None]:
    """One snapshot for several queries: REPEATABLE READ on PostgreSQL (when not already inside a
    transaction, which has its own level), a plain transaction elsewhere."""
    outer = connection.in_atomic_block
    with transaction.atomic():
        if connection.vendor == "postgresql" and not outer:
            with connection.cursor() as cursor:
                cursor.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        yield


def live_lines(*, tenant: Tenant, start: date, end: date, now: datetime, user: str | None = None,
               job_id: int | None = None) -> list[Line]:
    """Lines of days [start, end) not stored yet, charged to `tenant` (of `user` only, of one job only,
    when given: a job has no idle lines)."""
    from broker.billing.services import open_allocations, open_instances

    lines: list[Line] = []
    for alloc in open_allocations(tenant_id=tenant.pk, until=now, job_id=job_id):
        if alloc.released_at is not None and alloc.released_at.date() < start:
            continue
        lines += allocation_lines(alloc, getattr(alloc, "meter", None), until=now)
    if user is None and job_id is None:
        for instance in open_instances(until=now):
            if instance.terminated_at is not None and instance.terminated_at.date() < start:
                continue
            lines += [ln for ln in instance_idle_lines(instance, until=now) if ln.tenant_id == tenant.pk]
    lines = [ln for ln in lines if start <= ln.day < end and (user is None or ln.user == user)]
    if not lines:
        return []
    stored = set(UsageRecord.objects.filter(key__in=[ln.key for ln in lines]).values_list("key", flat=True))
    return [ln for ln in lines if ln.key not in stored]


def _stored(*, tenants: Sequence[Tenant], start: date, end: date, user: str | None, job_id: int | None = None):
    """Stored records of days [start, end) of `tenants`."""
    qs = UsageRecord.objects.filter(tenant__in=list(tenants), day__gte=start, day__lt=end)
    if user is not None:
        qs = qs.filter(user=user)
    if job_id is not None:
        qs = qs.filter(job_id=job_id)
    return qs


def _row_key(values: dict, group_by: list[str], tenant_slug: str) -> tuple:
    return tuple(values[g] for g in group_by)


def cost_report(*, tenant: Tenant | None = None, start: date, end: date, group_by: list[str],
                user: str | None = None, now: datetime | None = None, job_id: int | None = None,
                tenants: Sequence[Tenant] | None = None) -> list[dict]:
    """Rows of {keys..., gpu_hours, cost, idle_gpu_hours, idle_cost, cpu_cost, memory_cost,
    avg_gpu_utilisation} for days [start, end), of `tenant`, or of `tenants` together (a platform admin's
    report: rows that group by no team add the teams up). `cost` is the total paid: idle, CPU and memory
    included (`cpu_cost`, `memory_cost`: the parts owned pools charge for the jobs' requested CPU and
    memory); `gpu_hours` are GPU-hours held by jobs; the utilisation is the GPU-hour-weighted mean of the
    lines that have readings (null when none has)."""
    teams = list(tenants) if tenants is not None else [tenant]
    now = now or timezone.now()
    fields = [GROUP_FIELDS[g] for g in group_by]
    usage = Q(kind=UsageKind.USAGE)
    idle = Q(kind=UsageKind.IDLE)
    with_util = Q(avg_gpu_utilisation__isnull=False)
    money = DecimalField(max_digits=18, decimal_places=2)
    rows: dict[tuple, dict] = {}
    with consistent_read():
        stored = (_stored(tenants=teams, start=start, end=end, user=user, job_id=job_id).values(*fields)
                  .annotate(gs=Sum("gpu_seconds", filter=usage), cost=Sum("amount_usd", output_field=money),
                            idle_gs=Sum("gpu_seconds", filter=idle),
                            idle_cost=Sum("amount_usd", filter=idle, output_field=money),
                            cpu_cost=Sum("cpu_amount_usd", output_field=money),
                            memory_cost=Sum("memory_amount_usd", output_field=money),
                            util_w=Sum(F("avg_gpu_utilisation") * F("gpu_seconds"), filter=with_util,
                                       output_field=FloatField()),
                            util_gs=Sum("gpu_seconds", filter=with_util))
                  .order_by(*fields))
        for values in stored:
            key = tuple(values[f] for f in fields)
            rows[key] = {"gs": values["gs"] or Decimal(0), "cost": values["cost"] or ZERO,
                         "idle_gs": values["idle_gs"] or Decimal(0), "idle_cost": values["idle_cost"] or ZERO,
                         "cpu_cost": values["cpu_cost"] or ZERO, "memory_cost": values["memory_cost"] or ZERO,
                         "util_w": values["util_w"] or 0.0, "util_gs": float(values["util_gs"] or 0)}
        live = [(team.slug, ln) for team in teams
                for ln in live_lines(tenant=team, start=start, end=end, now=now, user=user, job_id=job_id)]
    for slug, ln in live:
        attrs = {"tenant__slug": slug, **{f: getattr(ln, f) for f in fields if f != "tenant__slug"}}
        key = tuple(attrs[f] for f in fields)
        row = rows.setdefault(key, {"gs": Decimal(0), "cost": ZERO, "idle_gs": Decimal(0), "idle_cost": ZERO,
                                    "cpu_cost": ZERO, "memory_cost": ZERO, "util_w": 0.0, "util_gs": 0.0})
        row["cost"] += ln.amount_usd
        row["cpu_cost"] += ln.cpu_amount_usd
        row["memory_cost"] += ln.memory_amount_usd
        if ln.kind == UsageKind.IDLE:
            row["idle_gs"] += ln.gpu_seconds
            row["idle_cost"] += ln.amount_usd
        else:
            row["gs"] += ln.gpu_seconds
            if ln.avg_gpu_utilisation is not None:
                row["util_w"] += ln.avg_gpu_utilisation * float(ln.gpu_seconds)
                row["util_gs"] += float(ln.gpu_seconds)
    out = []
    for key in sorted(rows, key=lambda k: tuple("" if v is None else str(v) for v in k)):
        row = rows[key]
        item = {}
        for name, value in zip(group_by, key):
            if name == "job":
                value = IDLE if value is None else value
            elif name == "day":
                value = value.isoformat()
            item[name] = value
        item.update(
            gpu_hours=float(round(row["gs"] / Decimal(3600), 4)),
            cost=str(Decimal(row["cost"]).quantize(CENT)),
            idle_gpu_hours=float(round(row["idle_gs"] / Decimal(3600), 4)),
            idle_cost=str(Decimal(row["idle_cost"]).quantize(CENT)),
            cpu_cost=str(Decimal(row["cpu_cost"]).quantize(CENT)),
            memory_cost=str(Decimal(row["memory_cost"]).quantize(CENT)),
            avg_gpu_utilisation=round(row["util_w"] / row["util_gs"], 1) if row["util_gs"] else None)
        out.append(item)
    return out


def month_to_date_spend(*, tenant: Tenant, now: datetime) -> Decimal:
    """What `tenant` is charged this UTC month so far, idle lines included: the billing figure budgets
    are checked against (broker.scheduler.spend)."""
    month = month_of(now.date())
    start = now.date().replace(day=1)
    with consistent_read():
        stored = UsageRecord.objects.filter(tenant=tenant, month=month).aggregate(total=Sum("amount_usd"))["total"]
        live = live_lines(tenant=tenant, start=start, end=date.max, now=now)
    return (Decimal(stored or ZERO) + sum((ln.amount_usd for ln in live), ZERO)).quantize(CENT)


def month_to_date_spend_by_user(*, tenant: Tenant, now: datetime,
                                users: list[str] | None = None) -> dict[str, Decimal]:
    """username -> what the jobs `tenant`'s member owns cost this UTC month so far (the figure their budget is
    checked against); `users` limits it to those. Idle lines are the team's and count for no user. Every
    user asked for has an entry (0.00 when they spent nothing)."""
    month = month_of(now.date())
    start = now.date().replace(day=1)
    totals: dict[str, Decimal] = defaultdict(lambda: ZERO)
    with consistent_read():
        # Any kind but idle: a job's lines (whatever they price) are its owner's.
        stored = UsageRecord.objects.filter(tenant=tenant, month=month).exclude(kind=UsageKind.IDLE)
        if users is not None:
            stored = stored.filter(user__in=users)
        for user, total in stored.values_list("user").annotate(total=Sum("amount_usd")).order_by():
            totals[user] += Decimal(total)
        # One pass over the team's open lines for all users (not one per user): the scheduler asks each cycle.
        for ln in live_lines(tenant=tenant, start=start, end=date.max, now=now):
            if ln.kind != UsageKind.IDLE and (users is None or ln.user in users):
                totals[ln.user] += ln.amount_usd
    out = {user: total.quantize(CENT) for user, total in totals.items() if user != IDLE}
    return {**{user: ZERO for user in users or ()}, **out}


def user_budgets_spent(*, tenant: Tenant, now: datetime,
                       username: str | None = None) -> list[tuple[str, Decimal, Decimal]]:
    """(username, monthly budget, spent this month) of `tenant`'s members with a budget of their own, by
    username (of `username` only, when given): one query for the budgets and, when there are any, one spend
    read for all of them. The API, the console and the scheduler's snapshot all read them here."""
    rows = UserBudget.objects.filter(tenant=tenant)
    if username is not None:
        rows = rows.filter(user__username=username)
    budgets = dict(rows.values_list("user__username", "monthly_budget_usd"))
    if not budgets:
        return []
    spent = month_to_date_spend_by_user(tenant=tenant, now=now, users=list(budgets))
    return [(user, Decimal(budgets[user]), spent[user]) for user in sorted(budgets)]


def month_to_date_spend_by_provider(*, now: datetime, tenant: Tenant | None = None) -> dict[tuple[str, str], Decimal]:
    """(tenant slug, provider) -> dollars this month (the /metrics gauge)."""
    month = month_of(now.date())
    start = now.date().replace(day=1)
    tenants = [tenant] if tenant is not None else list(Tenant.objects.all())
    totals: dict[tuple[str, str], Decimal] = defaultdict(lambda: ZERO)
    with consistent_read():
        stored = UsageRecord.objects.filter(month=month)
        if tenant is not None:
            stored = stored.filter(tenant=tenant)
        for slug, provider, total in (stored.values_list("tenant__slug", "provider")
                                      .annotate(total=Sum("amount_usd")).order_by()):
            totals[(slug, provider)] += Decimal(total).quantize(CENT)
        for team in tenants:
            for ln in live_lines(tenant=team, start=start, end=date.max, now=now):
                totals[(team.slug, ln.provider)] += ln.amount_usd
    return dict(totals)
