"""Quotes: where a job spec could run now and what it would cost, from the scheduler's own engine.

The spec goes through the submission parser (broker.jobs.spec.JobSpecSerializer); the job is never
saved. The snapshot is the scheduler's (broker.scheduler.snapshot.component_snapshot with the same cloud
offers and launch limits) with that one job as the only pending one, scheduled by scheduling.engine
with preemption, defragmentation and consolidation off (a quote moves nobody). The engine is asked
several times, once per variant (the spec as given; on-demand only; spot only where allowed; each
provider alone), and the distinct answers are the options, cheapest first.

Expected cost = what billing would charge (broker.billing.metering): an owned node at its pool's
chargeback rate, a rented instance at the job's share of its price, for the expected duration at that
GPU's speed (scheduling.targets.Pricing.runtime_hours; `expected_duration_hours` is at A100 speed, 1 h
when the spec gives none).
"""
from __future__ import annotations

import dataclasses
from datetime import datetime, timedelta
from decimal import ROUND_HALF_EVEN, Decimal

from django.utils import timezone

from broker.billing.metering import CENT, requested_cores_gib
from broker.billing.models import ChargebackRate
from broker.inventory.models import OWNED_POOL_KINDS, Node
from broker.inventory.selectors import scheduling_component
from broker.jobs.models import Job
from broker.provisioning.offers import cloud_offers, pool_launch_limits
from broker.scheduler.services import BROKER_POLICY
from broker.scheduler.snapshot import component_snapshot, job_demand
from broker.tenancy.models import Tenant
from scheduling import model as sm
from scheduling.engine import schedule
from scheduling.targets import Pricing

QUOTE_JOB_ID = "quote"
# How long a launched instance takes before the job starts (boot + agent registration): an estimate.
BOOT_SECONDS = 180
QUOTE_POLICY = dataclasses.replace(BROKER_POLICY, preemption=False, defragmentation=False, consolidation=False)


def _unsaved_job(*, tenant: Tenant, validated: dict) -> Job:
    from broker.jobs.services import job_columns

    return Job(tenant=tenant, **job_columns(validated))


def _variants(demand: sm.JobDemand, providers: set[str]) -> list[sm.JobDemand]:
    out = [demand]
    if demand.spot != "never":
        out.append(dataclasses.replace(demand, spot="never"))
    if demand.spot == "allowed":
        out.append(dataclasses.replace(demand, spot="required"))
    if not demand.providers:
        for provider in sorted(providers):
            out.append(dataclasses.replace(demand, providers=(provider,)))
    return out


def _owned_rate(node: Node, gpu_model: str) -> Decimal:
    override = ChargebackRate.objects.filter(pool=node.pool, gpu_model=gpu_model).first()
    return Decimal(override.rate_usd_per_gpu_hour if override else node.pool.gpu_hour_rate_usd)


def _resource_rate(pool, demand: sm.JobDemand) -> Decimal:
    """$ per hour of the job's CPUs and memory on an owned pool that charges them (billing meters the
    same per node: broker/billing/metering.py), 0 where the pool sets no rate."""
    cores, gib = requested_cores_gib(cpu_milli=demand.cpu_milli, memory_mb=demand.memory_mb)
    hourly = Decimal(0)
    if pool.cpu_rate_usd_per_core_hour is not None:
        hourly += Decimal(pool.cpu_rate_usd_per_core_hour) * cores
    if pool.memory_rate_usd_per_gib_hour is not None:
        hourly += Decimal(pool.memory_rate_usd_per_gib_hour) * gib
    return hourly * max(1, demand.nodes)


def quote(*, tenant: Tenant, validated: dict, now: datetime | None = None, user: str = "") -> dict:
    """`user`: who asks (the job's owner-to-be): a member's own budget limits what is quoted, as it
    would limit the placement."""
    now = now or timezone.now()
    job = _unsaved_job(tenant=tenant, validated=validated)
    demand = dataclasses.replace(job_demand(job), job_id=QUOTE_JOB_ID, submitted_at=now.timestamp(), owner=user)
    component = scheduling_component(tenant)
    offers, offer_index = cloud_offers(tenants=component)
    base = component_snapshot(tenants=component, now=now, offers=offers,
                              launch_limits=pool_launch_limits(tenants=component))
    providers = {n.provider for n in base.nodes} | {o.provider for o in base.offers}
    pricing = Pricing(base)
    nodes = {str(n.pk): n for n in Node.objects.filter(pk__in=[int(n.id) for n in base.nodes])
             .select_related("pool__tenant")}
    options: dict[tuple, dict] = {}
    reasons: list[dict] = []
    for variant in _variants(demand, providers):
        plan = schedule(dataclasses.replace(base, pending=(variant,)), QUOTE_POLICY)
        placement = plan.placement_for(QUOTE_JOB_ID)
        if placement is None:
            reason = plan.pending.get(QUOTE_JOB_ID)
            if reason is not None:
                reasons.append({"variant": {"spot": variant.spot, "providers": list(variant.providers)},
                                "code": reason.code.value, "message": reason.message})
            continue
        option = _option(placement=placement, plan=plan, demand=variant, pricing=pricing, nodes=nodes,
                         offer_index=offer_index, now=now)
        key = (option["where"], option["spot"], option["gpu_model"])
        options.setdefault(key, option)
    ordered = sorted(options.values(), key=lambda o: (Decimal(o["expected_cost_usd"]), o["starts_at"]))
    return {"job": {"name": job.name, "gpus": demand.gpus, "gpu_milli": demand.gpu_milli,
                    "expected_duration_hours_at_a100": demand.expected_duration_hours, "spot": demand.spot},
            "options": ordered, "unplaceable": reasons if not ordered else [], "quoted_at": now.isoformat()}


def _option(*, placement: sm.Placement, plan: sm.Plan, demand: sm.JobDemand, pricing: Pricing, nodes: dict,
            offer_index: dict, now: datetime) -> dict:
    model = placement.gpu_model
    hours = pricing.runtime_hours(demand, model)
    share = Decimal(str(pricing.gpu_share(demand, model)))
    if placement.launch_id:
        launch = next(la for la in plan.launches if la.launch_id == placement.launch_id)
        ref = offer_index.get(launch.offer_id)
        offer = ref.offer if ref is not None else None
        where = {"kind": "launch", "provider": ref.pool.kind if ref else "", "pool": ref.pool.name if ref else "",
                 "region": offer.region if offer else "", "zone": offer.zone if offer else "",
                 "instance_type": offer.instance_type if offer else "", "instances": launch.count}
        hourly = Decimal(str(placement.price_per_hour))
        starts = now + timedelta(seconds=BOOT_SECONDS)
        label = f"launch {where['provider']} {where['instance_type']} {where['zone'] or where['region']}"
    else:
        node = nodes.get(placement.node_id or "")
        pool = node.pool if node else None
        where = {"kind": "node", "provider": pool.kind if pool else "", "pool": pool.name if pool else "",
                 "region": pool.region if pool else "", "node": node.name if node else placement.node_id,
                 "owned": bool(pool and pool.kind in OWNED_POOL_KINDS)}
        if node is not None and pool.kind in OWNED_POOL_KINDS:
            hourly = _owned_rate(node, model) * share + _resource_rate(pool, demand)
        else:
            hourly = Decimal(str(placement.price_per_hour))
        starts = now
        label = f"node {where['node']}"
    cost = (hourly * Decimal(str(hours))).quantize(CENT, rounding=ROUND_HALF_EVEN)
    return {"where": label, "placement": where, "gpu_model": model, "gpus": float(share), "spot": placement.spot,
            "market": "spot" if placement.spot else "on-demand",
            "price_per_hour_usd": str(hourly.quantize(Decimal("0.0001"))), "expected_hours": round(hours, 3),
            "expected_cost_usd": str(cost), "starts_at": starts.isoformat()}
