"""Savings for a period: what each job's GPU time would have cost on the cheapest single-cloud on-demand
offer for its GPU model, against what it cost (its usage lines; idle lines are the team's, shown apart).

The counterfactual per job = its GPU-hours on each GPU model and day x the lowest on-demand price per
GPU-hour of that model among the cloud offers the team could rent through that day
(broker.provisioning.offers.cloud_offers, the scheduler's own, every provider and region). The metering
task records those prices once per team and UTC day (OnDemandPrice); a day from before the recording
began, or today before its first metering run, uses the offers as they are now. A job whose model no
offer has has no counterfactual (`on_demand_usd: null`) and is left out of the totals' comparison.
"""
from __future__ import annotations

import logging
from collections import defaultdict
from datetime import date, datetime
from decimal import ROUND_HALF_EVEN, Decimal

from django.db.models import Sum
from django.utils import timezone

from broker.billing.metering import CENT
from broker.billing.models import OnDemandPrice, UsageKind
from broker.billing.selectors import ZERO, _stored, consistent_read, live_lines
from broker.tenancy.models import Tenant

log = logging.getLogger(__name__)


def cheapest_on_demand(*, tenant: Tenant) -> dict[str, tuple[Decimal, str]]:
    """GPU model -> (lowest on-demand $ per GPU-hour, 'provider region instance_type')."""
    from broker.inventory.selectors import scheduling_component
    from broker.provisioning.offers import cloud_offers

    offers, _ = cloud_offers(tenants=scheduling_component(tenant))
    best: dict[str, tuple[Decimal, str]] = {}
    for offer in offers:
        if offer.gpu_count <= 0 or offer.ondemand_price_per_hour <= 0:
            continue
        per_gpu = Decimal(str(offer.ondemand_price_per_hour)) / offer.gpu_count
        if offer.gpu_model not in best or per_gpu < best[offer.gpu_model][0]:
            best[offer.gpu_model] = (per_gpu, f"{offer.provider} {offer.region} {offer.instance_type}")
    return best


def on_demand_prices_record(*, now: datetime | None = None) -> int:
    """Record today's cheapest on-demand price per GPU model for every team that has none for today yet
    (the metering task calls this every run; after the first run of a day it is one query). Returns how
    many prices were written. A team whose offers cannot be read is skipped and tried again next run."""
    today = (now or timezone.now()).date()
    done = set(OnDemandPrice.objects.filter(day=today).values_list("tenant_id", flat=True).distinct())
    written = 0
    for tenant in Tenant.objects.exclude(pk__in=done):
        try:
            prices = cheapest_on_demand(tenant=tenant)
        except Exception:  # noqa: BLE001 - a pool's broken config must not stop metering (logged)
            log.exception("savings: could not read %s's cloud offers; its prices for %s are recorded later",
                          tenant.slug, today)
            continue
        rows = [OnDemandPrice(tenant=tenant, day=today, gpu_model=model, usd_per_gpu_hour=price, offer=offer[:200])
                for model, (price, offer) in prices.items()]
        # A team with no cloud offer at all gets no row and is asked again: cheap, and it may gain one.
        written += len(OnDemandPrice.objects.bulk_create(rows, ignore_conflicts=True))
    return written


def _prices_by_day(*, tenant: Tenant, start: date, end: date) -> dict[tuple[date, str], tuple[Decimal, str]]:
    return {(p.day, p.gpu_model): (Decimal(p.usd_per_gpu_hour), p.offer)
            for p in OnDemandPrice.objects.filter(tenant=tenant, day__gte=start, day__lt=end)}


def savings_report(*, tenant: Tenant, start: date, end: date, user: str | None = None,
                   now: datetime | None = None) -> dict:
    now = now or timezone.now()
    held: dict[tuple, dict] = defaultdict(lambda: {"gs": Decimal(0), "cost": ZERO})
    with consistent_read():
        for row in (_stored(tenants=[tenant], start=start, end=end, user=user).filter(kind=UsageKind.USAGE)
                    .values("job_id", "job_name", "gpu_model", "day")
                    .annotate(gs=Sum("gpu_seconds"), cost=Sum("amount_usd")).order_by()):
            item = held[(row["job_id"], row["job_name"], row["gpu_model"], row["day"])]
            item["gs"] += Decimal(row["gs"])
            item["cost"] += Decimal(row["cost"]).quantize(CENT)
        idle = ZERO
        for ln in live_lines(tenant=tenant, start=start, end=end, now=now, user=user):
            if ln.kind == UsageKind.IDLE:
                idle += ln.amount_usd
                continue
            item = held[(ln.job_id, ln.job_name, ln.gpu_model, ln.day)]
            item["gs"] += ln.gpu_seconds
            item["cost"] += ln.amount_usd
        stored_idle = (_stored(tenants=[tenant], start=start, end=end, user=user).filter(kind=UsageKind.IDLE)
                       .aggregate(total=Sum("amount_usd"))["total"])
        idle += Decimal(stored_idle or ZERO).quantize(CENT)
    recorded = _prices_by_day(tenant=tenant, start=start, end=end)
    recorded_days = {day for day, _ in recorded}
    current: dict[str, tuple[Decimal, str]] | None = None  # today's offers, read only if a day has no record
    jobs: dict[int, dict] = {}
    # GPU-seconds per job, model and price: a job's days at one price are priced (and rounded) together.
    at_price: dict[tuple, Decimal] = defaultdict(Decimal)
    for (job_id, job_name, model, day), item in held.items():
        job = jobs.setdefault(job_id, {"job": job_id, "job_name": job_name, "gpu_hours": Decimal(0), "cost": ZERO,
                                       "on_demand": ZERO, "comparable": True, "offers": []})
        job["gpu_hours"] += item["gs"] / 3600
        job["cost"] += item["cost"]
        price = recorded.get((day, model))
        if price is None and day not in recorded_days:  # before recording began: the offers as they are now
            current = cheapest_on_demand(tenant=tenant) if current is None else current
            price = current.get(model)
        if price is None:
            job["comparable"] = False
        else:
            at_price[(job_id, model, price[0])] += item["gs"]
            job["offers"].append(price[1])
    for (job_id, _, rate), gpu_seconds in at_price.items():
        jobs[job_id]["on_demand"] += (gpu_seconds / 3600 * rate).quantize(CENT, rounding=ROUND_HALF_EVEN)
    rows = []
    cost_total = on_demand_total = compared_cost = ZERO
    for job in sorted(jobs.values(), key=lambda j: j["job"] or 0):
        cost_total += job["cost"]
        on_demand = job["on_demand"] if job["comparable"] else None
        if on_demand is not None:
            on_demand_total += on_demand
            compared_cost += job["cost"]
        rows.append({"job": job["job"], "job_name": job["job_name"],
                     "gpu_hours": float(round(job["gpu_hours"], 4)), "cost_usd": str(job["cost"]),
                     "on_demand_usd": None if on_demand is None else str(on_demand),
                     "saved_usd": None if on_demand is None else str(on_demand - job["cost"]),
                     "cheapest_offer": sorted(set(job["offers"]))[0] if job["offers"] and on_demand is not None
                     else None})
    return {"from": start.isoformat(), "to": end.isoformat(), "currency": "USD", "jobs": rows,
            "totals": {"cost_usd": str(cost_total), "idle_usd": str(idle),
                       "compared_cost_usd": str(compared_cost), "on_demand_usd": str(on_demand_total),
                       "saved_usd": str(on_demand_total - compared_cost)}}
