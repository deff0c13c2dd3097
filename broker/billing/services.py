"""Billing writes: fix allocation prices, sample utilisation, store final usage lines, close months, raise
budget alerts, rebuild and check. Each is safe to run twice, or twice at the same time:

- a record's `key` is unique and records are inserted with ignore_conflicts, so a line written by two
  runs at once exists once;
- records of one team's month are inserted while holding that month's BillingMonth row lock, and a
  month close takes the same lock, meters the month to its end, then freezes it: a record can never
  land in a month after its statement was frozen, and the close never misses a second;
- an allocation's price is fixed by get-or-create on a one-to-one row: the first writer wins.
"""
from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import date, datetime, timedelta, timezone as dt_timezone
from decimal import Decimal

from django.db import IntegrityError, connection, transaction
from django.db.models import F, Prefetch, Q
from django.db.models.functions import Coalesce
from django.utils import timezone

from broker.billing.metering import (Line, PriceBasis, allocation_lines, current_rates, instance_idle_lines, month_of,
                                     resource_rates)
from broker.billing.models import (AllocationMeter, BillingMonth, BudgetAlert, InstanceMeter, UsageRecord,
                                   UserBudget)
from broker.inventory.models import CloudInstance, Gpu, Pool
from broker.jobs.models import Allocation, AllocationSlice
from broker.jobs.signals import PlacedAllocation
from broker.rows import fields_insert
from broker.tenancy.models import Membership, Quota, Tenant

log = logging.getLogger(__name__)

# A metering run samples an allocation's GPU utilisation at most this often (two runs at once: once).
SAMPLE_MIN_SECONDS = 30
BUDGET_THRESHOLDS = (80, 100)


class BillingError(Exception):
    def __init__(self, message: str, *, field: str = "month") -> None:
        super().__init__(message)
        self.field = field


@dataclass
class MeterOutcome:
    rates_fixed: int = 0
    samples: int = 0
    written: int = 0
    skipped_closed: list[str] = field(default_factory=list)
    alerts: list[str] = field(default_factory=list)


def allocations_for_billing():
    return Allocation.objects.select_related("job__owner", "job__tenant", "node__pool__tenant").prefetch_related(
        Prefetch("slices", queryset=AllocationSlice.objects.select_related("gpu__model").order_by("id")))


def rates_fix(*, now: datetime, allocation_ids: list[int] | None = None) -> int:
    """Give every allocation without a meter its price as it stands now: right after its commit
    (broker.billing.signals), else at the first metering run after its start."""
    # Only what a price depends on, as plain rows: the node's pool and its rate, and the GPU model of the
    # first slice. Model instances of every allocation with its node and pool, and a compiled bulk INSERT,
    # were 3 of a 5,000-placement cycle's 11 s of commit (bench.service, PostgreSQL, profiled).
    pending = Allocation.objects.filter(meter__isnull=True)
    if allocation_ids is not None:
        pending = pending.filter(pk__in=allocation_ids)
    rows = list(pending.values_list("pk", "node_id", "node__pool_id", "node__pool__gpu_hour_rate_usd",
                                    "node__pool__cpu_rate_usd_per_core_hour", "node__pool__memory_rate_usd_per_gib_hour"))
    if not rows:
        return 0
    ids = [row[0] for row in rows]
    first_gpu: dict[int, int] = {}
    slices = AllocationSlice.objects.filter(allocation_id__in=ids).order_by("allocation_id", "id")
    if connection.vendor == "postgresql":
        slices = slices.distinct("allocation_id")  # one row per allocation, not one per GPU it holds
    for allocation_id, gpu_id in slices.values_list("allocation_id", "gpu_id"):
        first_gpu.setdefault(allocation_id, gpu_id)
    gpu_model = dict(Gpu.objects.filter(pk__in=set(first_gpu.values()))
                     .values_list("pk", Coalesce("model__name", "model_name")))
    bases = [PriceBasis(allocation_id=pk, node_id=node_id, pool_id=pool_id, pool_rate=Decimal(pool_rate),
                        gpu_model=gpu_model.get(first_gpu.get(pk), "") or "", cpu_rate=cpu_rate,
                        memory_rate=memory_rate)
             for pk, node_id, pool_id, pool_rate, cpu_rate, memory_rate in rows]
    # One query for the instances and one for the overrides of all of them (per allocation this took
    # 6 ms: 5,000 placements of one cycle paid 30 s for their prices), one insert for the meters.
    before = AllocationMeter.objects.filter(allocation_id__in=ids).count()
    # Another run that fixed one first wins: its price stands (the unique allocation refuses ours).
    fields_insert(AllocationMeter, _priced_meters(bases, now=now), ignore_conflicts=True)
    return AllocationMeter.objects.filter(allocation_id__in=ids).count() - before


def meters_create(*, now: datetime, allocations: list[PlacedAllocation]) -> int:
    """Meters of allocations inserted just now in this transaction (as `allocations_placed` gives them): no
    other run can have fixed them yet, so the rows go in by COPY (broker/rows.py). rates_fix read the
    allocations and their slots back and inserted row by row: 2 s of a 5,000-placement cycle."""
    if not allocations:
        return 0
    pool_rates = {pk: rates for pk, *rates in Pool.objects.filter(pk__in={a.pool_id for a in allocations})
                  .values_list("pk", "gpu_hour_rate_usd", "cpu_rate_usd_per_core_hour", "memory_rate_usd_per_gib_hour")}
    bases = [PriceBasis(allocation_id=a.pk, node_id=a.node_id, pool_id=a.pool_id,
                        pool_rate=Decimal(pool_rates[a.pool_id][0]), gpu_model=a.gpu_model,
                        cpu_rate=pool_rates[a.pool_id][1], memory_rate=pool_rates[a.pool_id][2])
             for a in allocations]
    fields_insert(AllocationMeter, _priced_meters(bases, now=now))
    return len(allocations)


def _priced_meters(bases: list[PriceBasis], *, now: datetime) -> list[dict]:
    """Meter rows (broker/rows.py fields_insert) of `bases` at the prices `current_rates` gives now."""
    rates = current_rates(bases)
    meters = []
    for b in bases:
        rate, source, spot = rates[b.allocation_id]
        # CPU and memory rates are fixed with the GPU rate: a later change never reprices a running job.
        cpu_rate, memory_rate = resource_rates(b.cpu_rate, b.memory_rate, source)
        meters.append({"allocation_id": b.allocation_id, "rate_usd_per_gpu_hour": rate, "rate_source": source,
                       "spot": spot, "cpu_rate_usd_per_core_hour": cpu_rate,
                       "memory_rate_usd_per_gib_hour": memory_rate, "fixed_at": now})
    return meters


def utilisation_sample(*, now: datetime) -> int:
    """Add one utilisation reading (the mean of its GPUs' latest telemetry) to each held allocation."""
    samples = 0
    cutoff = now - timedelta(seconds=SAMPLE_MIN_SECONDS)
    readings: dict[int, list[int]] = defaultdict(list)
    for alloc_id, pct in (AllocationSlice.objects.filter(active=True, allocation__active=True,
                                                         gpu__utilization_pct__isnull=False)
                          .values_list("allocation_id", "gpu__utilization_pct")):
        readings[alloc_id].append(pct)
    for alloc_id, values in readings.items():
        mean = sum(values) / len(values)
        # Compare-and-set on the sampling time: of two runs at once one adds the sample.
        samples += AllocationMeter.objects.filter(allocation_id=alloc_id).filter(
            Q(last_sampled_at__isnull=True) | Q(last_sampled_at__lt=cutoff)).update(
            util_sum=F("util_sum") + mean, util_samples=F("util_samples") + 1, last_sampled_at=now)
    return samples


def _month_row(tenant_id: int, month: str) -> BillingMonth:
    """The team-month row, locked (created first if need be)."""
    try:
        with transaction.atomic():
            BillingMonth.objects.get_or_create(tenant_id=tenant_id, month=month)
    except IntegrityError:
        pass
    return BillingMonth.objects.select_for_update().get(tenant_id=tenant_id, month=month)


def lines_store(lines: list[Line], outcome: MeterOutcome) -> None:
    """Insert final lines, one team-month at a time under its lock, in a fixed order (no deadlocks)."""
    groups: dict[tuple[int, str], list[Line]] = defaultdict(list)
    for line in lines:
        if line.final:
            groups[(line.tenant_id, line.month)].append(line)
    for (tenant_id, month), group in sorted(groups.items()):
        with transaction.atomic():
            row = _month_row(tenant_id, month)
            if row.closed_at is not None:
                # Can only be a line nothing metered before the close (which meters its month first):
                # billing_rebuild --check reports it; a closed statement is never changed.
                missing = [ln.key for ln in group
                           if not UsageRecord.objects.filter(key=ln.key).exists()]
                if missing:
                    log.warning("billing: %d line(s) of closed month %s (tenant %s) not stored: %s",
                                len(missing), month, tenant_id, ", ".join(missing[:5]))
                    outcome.skipped_closed += missing
                continue
            before = UsageRecord.objects.filter(tenant_id=tenant_id, month=month).count()
            UsageRecord.objects.bulk_create([UsageRecord(**ln.record_fields()) for ln in group],
                                            ignore_conflicts=True, batch_size=1000)
            outcome.written += UsageRecord.objects.filter(tenant_id=tenant_id, month=month).count() - before


def open_allocations(*, tenant_id: int | None = None, until: datetime | None = None, job_id: int | None = None):
    """Allocations whose lines are not all stored yet (no meter, or a meter not complete)."""
    qs = allocations_for_billing().filter(Q(meter__isnull=True) | Q(meter__complete=False))
    if tenant_id is not None:
        qs = qs.filter(job__tenant_id=tenant_id)
    if job_id is not None:
        qs = qs.filter(job_id=job_id)
    if until is not None:
        qs = qs.filter(created_at__lt=until)
    return qs.select_related("meter")


def open_instances(*, until: datetime | None = None):
    qs = CloudInstance.objects.filter(Q(meter__isnull=True) | Q(meter__complete=False)).exclude(provider_id="")
    if until is not None:
        qs = qs.filter(created_at__lt=until)
    return qs.select_related("pool__tenant", "node")


def meter(*, now: datetime | None = None, until: datetime | None = None, tenant_id: int | None = None) -> MeterOutcome:
    """One metering run: fix prices, sample utilisation, store every line that became final by `until`
    (default: now), mark what is fully recorded, and raise budget alerts."""
    now = now or timezone.now()
    until = min(until or now, now)
    outcome = MeterOutcome()
    outcome.rates_fixed = rates_fix(now=now)
    outcome.samples = utilisation_sample(now=now)
    complete_allocs: list[int] = []
    lines: list[Line] = []
    for alloc in open_allocations(tenant_id=tenant_id, until=until):
        meter_row = getattr(alloc, "meter", None)
        alloc_lines = allocation_lines(alloc, meter_row, until=until)
        lines += alloc_lines
        if alloc.released_at is not None and alloc.released_at <= until and all(ln.final for ln in alloc_lines):
            complete_allocs.append(alloc.pk)
    complete_instances: list[int] = []
    for instance in open_instances(until=until):
        inst_lines = instance_idle_lines(instance, until=until)
        if tenant_id is not None:
            inst_lines = [ln for ln in inst_lines if ln.tenant_id == tenant_id]
        lines += inst_lines
        if instance.terminated_at is not None and instance.terminated_at <= until and tenant_id is None:
            complete_instances.append(instance.pk)
    lines_store(lines, outcome)
    if not outcome.skipped_closed:
        AllocationMeter.objects.filter(allocation_id__in=complete_allocs).update(complete=True)
        for instance_id in complete_instances:
            InstanceMeter.objects.update_or_create(instance_id=instance_id, defaults={"complete": True})
    outcome.alerts = budget_alerts_raise(now=now)
    return outcome


def month_bounds(month: str) -> tuple[datetime, datetime]:
    try:
        year, mon = (int(part) for part in month.split("-"))
        start = datetime(year, mon, 1, tzinfo=dt_timezone.utc)
        end = datetime(year + (mon == 12), mon % 12 + 1, 1, tzinfo=dt_timezone.utc)
    except (ValueError, TypeError, OverflowError):
        raise BillingError(f"{month[:16]!r} is not a month: use YYYY-MM.") from None
    return start, end


def month_close(*, tenant: Tenant, month: str, now: datetime | None = None) -> BillingMonth:
    """Freeze `tenant`'s statement of `month` (a month that has ended): meter it to its end under the
    month's lock, then store the statement. Closing a closed month changes nothing."""
    from broker.billing.statements import statement_build

    now = now or timezone.now()
    start, end = month_bounds(month)
    if end > now:
        raise BillingError(f"{month} has not ended yet: only past months can be closed.")
    meter(now=now, until=end, tenant_id=tenant.pk)
    with transaction.atomic():
        row = _month_row(tenant.pk, month)
        if row.closed_at is not None:
            return row
        # Meter once more under the lock: a line that became final meanwhile is in before the freeze.
        lines = [ln for alloc in open_allocations(tenant_id=tenant.pk, until=end)
                 for ln in allocation_lines(alloc, getattr(alloc, "meter", None), until=end)
                 if ln.final and ln.month == month]
        lines += [ln for inst in open_instances(until=end) for ln in instance_idle_lines(inst, until=end)
                  if ln.final and ln.month == month and ln.tenant_id == tenant.pk]
        UsageRecord.objects.bulk_create([UsageRecord(**ln.record_fields()) for ln in lines],
                                        ignore_conflicts=True, batch_size=1000)
        statement = statement_build(tenant=tenant, month=month, stored_only=True)
        BillingMonth.objects.filter(pk=row.pk).update(closed_at=now, statement=statement)
    row.refresh_from_db()
    return row


def budget_set(*, tenant: Tenant, monthly_budget_usd: Decimal | None) -> Quota:
    quota, _ = Quota.objects.get_or_create(tenant=tenant)
    Quota.objects.filter(pk=quota.pk).update(monthly_budget_usd=monthly_budget_usd, updated_at=timezone.now())
    quota.refresh_from_db()
    return quota


def user_budgets_set(*, tenant: Tenant, budgets: dict[str, Decimal | None]) -> None:
    """Set members' monthly budgets, by username (None clears one), all or none. A name that is not a member
    of `tenant` raises BillingError (field `users`) in the same words whether or not such a user exists
    elsewhere: another team's people are not revealed."""
    members = {m.user.get_username(): m.user for m in Membership.objects.filter(
        tenant=tenant, user__username__in=list(budgets)).select_related("user")}
    unknown = sorted(set(budgets) - set(members))
    if unknown:
        raise BillingError(f"{unknown[0][:150]!r} is not a member of this team.", field="users")
    with transaction.atomic():
        for username, amount in sorted(budgets.items()):
            if amount is None:
                UserBudget.objects.filter(tenant=tenant, user=members[username]).delete()
            else:
                UserBudget.objects.update_or_create(tenant=tenant, user=members[username],
                                                    defaults={"monthly_budget_usd": amount})


def budget_alerts_raise(*, now: datetime) -> list[str]:
    """An event (BudgetAlert, logged) the first time a team's month-to-date spend reaches 80% and 100%, and
    the first time a member's spend reaches 80% and 100% of their own budget (UserBudget)."""
    from broker.billing.selectors import month_to_date_spend, month_to_date_spend_by_user

    raised = []
    month = month_of(now.date())
    for quota in Quota.objects.filter(monthly_budget_usd__isnull=False).select_related("tenant"):
        budget = Decimal(quota.monthly_budget_usd)
        if budget <= 0:
            continue
        spent = month_to_date_spend(tenant=quota.tenant, now=now)
        raised += _alerts_for(tenant=quota.tenant, user=None, month=month, spent=spent, budget=budget)
    by_team: dict[int, list[UserBudget]] = defaultdict(list)
    for row in UserBudget.objects.filter(monthly_budget_usd__gt=0).select_related("tenant", "user"):
        by_team[row.tenant_id].append(row)
    for rows in by_team.values():  # one spend read per team, not one per member
        spent_by = month_to_date_spend_by_user(tenant=rows[0].tenant, now=now,
                                               users=[row.user.get_username() for row in rows])
        for row in rows:
            raised += _alerts_for(tenant=row.tenant, user=row.user, month=month,
                                  spent=spent_by[row.user.get_username()], budget=Decimal(row.monthly_budget_usd))
    return raised


def _alerts_for(*, tenant: Tenant, user, month: str, spent: Decimal, budget: Decimal) -> list[str]:
    """The thresholds `spent` reached for the first time this month (user None: the team's budget)."""
    raised = []
    for threshold in BUDGET_THRESHOLDS:
        if spent * 100 < budget * threshold:
            continue
        _, created = BudgetAlert.objects.get_or_create(
            tenant=tenant, user=user, month=month, threshold_pct=threshold,
            defaults={"spent_usd": spent, "budget_usd": budget})
        if not created:
            continue
        who = tenant.slug if user is None else f"user {user.get_username()} of {tenant.slug}"
        log.warning("budget: %s has spent $%s of its $%s budget for %s (%d%%)", who, spent, budget, month, threshold)
        raised.append(f"{tenant.slug}:{threshold}" if user is None
                      else f"{tenant.slug}/{user.get_username()}:{threshold}")
    return raised


@dataclass
class RebuildReport:
    checked: int = 0
    missing: list[str] = field(default_factory=list)
    differing: list[str] = field(default_factory=list)
    extra: list[str] = field(default_factory=list)
    inserted: int = 0

    @property
    def agrees(self) -> bool:
        return not (self.missing or self.differing or self.extra)


COMPARED = ("tenant_id", "seconds", "gpu_seconds", "rate_usd_per_gpu_hour", "amount_usd", "day", "kind",
            "cpu_core_seconds", "memory_gib_seconds", "cpu_rate_usd_per_core_hour", "memory_rate_usd_per_gib_hour",
            "cpu_amount_usd", "memory_amount_usd")


def rebuild(*, start: date | None = None, end: date | None = None, check_only: bool = True,
            now: datetime | None = None) -> RebuildReport:
    """Recompute every final line from allocations and instances (at their fixed prices) and compare
    with the stored records of days [start, end): missing, differing and extra records. Without
    check_only, missing records are inserted (stored ones are never changed: append-only)."""
    now = now or timezone.now()
    report = RebuildReport()
    expected: dict[str, Line] = {}
    for alloc in allocations_for_billing().select_related("meter"):
        for ln in allocation_lines(alloc, getattr(alloc, "meter", None), until=now):
            if ln.final:
                expected[ln.key] = ln
    for instance in CloudInstance.objects.exclude(provider_id="").select_related("pool__tenant", "node"):
        for ln in instance_idle_lines(instance, until=now):
            if ln.final:
                expected[ln.key] = ln
    in_range = {k: ln for k, ln in expected.items()
                if (start is None or ln.day >= start) and (end is None or ln.day < end)}
    stored = UsageRecord.objects.all()
    if start is not None:
        stored = stored.filter(day__gte=start)
    if end is not None:
        stored = stored.filter(day__lt=end)
    seen = set()
    for record in stored.iterator():
        seen.add(record.key)
        report.checked += 1
        ln = in_range.get(record.key)
        if ln is None:
            report.extra.append(record.key)
            continue
        diffs = [name for name in COMPARED if getattr(record, name) != getattr(ln, name)]
        if diffs:
            report.differing.append(f"{record.key} ({', '.join(diffs)})")
    missing = [ln for k, ln in sorted(in_range.items()) if k not in seen]
    report.missing = [ln.key for ln in missing]
    if not check_only and missing:
        outcome = MeterOutcome()
        lines_store(missing, outcome)
        report.inserted = outcome.written
    return report
