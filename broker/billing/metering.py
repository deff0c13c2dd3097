"""Metering: turn allocations and rented instances into usage lines (OpenCost's allocation model).

Rules (also in README.md, "Billing and cost reports"):
1. An allocation pays from the moment its GPUs are held (`Allocation.created_at`) to their release
   (`released_at`), by the second: both instants are truncated to the whole second, so it pays
   floor(release) - floor(hold) seconds, split at UTC midnight into one line per day (a line never
   crosses a day, hence never a month: every statement and every `group_by=day` row is exact).
2. Its rate is fixed when its commit completes (AllocationMeter, broker.billing.signals; else by the
   next metering run) and never changes: a node of a rented instance pays the instance's hourly price as
   launched (on-demand or spot, `CloudInstance.hourly_price_usd`) divided by the instance's GPU count,
   so jobs sharing an instance split it by GPU share; an owned node pays the pool's chargeback rate
   for that GPU model (ChargebackRate, else `Pool.gpu_hour_rate_usd`), never the scheduler's marginal
   cost. A fraction of a GPU holds ceil(fraction x 10) slots and pays slots / 10 of a GPU.
3. amount = GPU-seconds / 3600 x rate, rounded once per line to the cent, ROUND_HALF_EVEN.
3b. CPU and memory: on an owned node whose pool sets them (Pool.cpu_rate_usd_per_core_hour,
   memory_rate_usd_per_gib_hour; null = not charged), the job's requested vCPUs (cpu_milli / 1000) and
   GiB (memory_mb / 1024) per node pay core-seconds / 3600 x CPU rate and GiB-seconds / 3600 x memory
   rate, each rounded once per line the same way; the rates are fixed with the GPU rate. The line's
   amount is GPU + CPU + memory (so every total, budgets included, counts them). A rented instance's
   price already covers its CPU and memory: nothing more is charged there.
4. Idle: a rented instance the cloud confirmed (it has a provider id) costs from its request
   (`created_at`: booting counts) to its termination; the GPU-seconds of that life no allocation held
   are one `__idle__` line per day at the same per-GPU rate, charged to the team whose job caused the
   launch (its first placement) -- or, with WHALEZEN_BILLING_IDLE_RULE=owner, to the pool's owner.
   Owned idle capacity is not charged.
A line is final once its day is over or its allocation released (its instance terminated); only
final lines are stored (UsageRecord, append-only); the rest is computed live by the selectors.
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from datetime import date, datetime, time, timedelta, timezone as dt_timezone
from decimal import ROUND_HALF_EVEN, Decimal
from typing import Iterable, NamedTuple

from broker.billing.models import IDLE, AllocationMeter, ChargebackRate, UsageKind
from broker.inventory.models import OWNED_POOL_KINDS, CloudInstance, Gpu
from broker.jobs.models import Allocation

CENT = Decimal("0.01")
ROUNDING_RULE = ("amount = GPU-seconds / 3600 x rate, rounded once per line (one allocation or idle instance, "
                 "one UTC day) to the cent, ROUND_HALF_EVEN, plus CPU (core-seconds / 3600 x rate) and memory "
                 "(GiB-seconds / 3600 x rate) where the pool sets those rates, each rounded the same way; "
                 "totals are sums of lines")
SLOTS = Gpu.SLOTS
IDLE_RULES = ("launcher", "owner")


def idle_rule() -> str:
    rule = os.environ.get("WHALEZEN_BILLING_IDLE_RULE", "launcher")
    return rule if rule in IDLE_RULES else "launcher"


def money(gpu_seconds: Decimal, rate: Decimal) -> Decimal:
    """The one rounding: a line's amount to the cent, half to even."""
    return (gpu_seconds * rate / Decimal(3600)).quantize(CENT, rounding=ROUND_HALF_EVEN)


def month_of(day: date) -> str:
    return f"{day.year:04d}-{day.month:02d}"


def _secs(moment: datetime) -> int:
    return int(moment.timestamp())  # truncated to the whole second (instants are after 1970)


def _at(second: int) -> datetime:
    return datetime.fromtimestamp(second, tz=dt_timezone.utc)


def day_segments(start_s: int, end_s: int) -> Iterable[tuple[date, int, int]]:
    """(UTC day, start second, end second) pieces of [start_s, end_s)."""
    cursor = start_s
    while cursor < end_s:
        day = _at(cursor).date()
        midnight = _secs(datetime.combine(day + timedelta(days=1), time.min, tzinfo=dt_timezone.utc))
        piece_end = min(end_s, midnight)
        yield day, cursor, piece_end
        cursor = piece_end


def _day_end_s(day: date) -> int:
    return _secs(datetime.combine(day + timedelta(days=1), time.min, tzinfo=dt_timezone.utc))


@dataclass
class Line:
    """One usage line, stored or live (the fields of UsageRecord)."""

    key: str
    kind: str
    tenant_id: int
    month: str
    day: date
    job_id: int | None
    job_name: str
    user: str
    allocation_id: int | None
    instance_id: int | None
    node: str
    gpu_model: str
    provider: str
    pool: str
    region: str
    spot: bool
    start: datetime
    end: datetime
    seconds: int
    gpus: Decimal
    gpu_seconds: Decimal
    rate_usd_per_gpu_hour: Decimal
    amount_usd: Decimal
    avg_gpu_utilisation: float | None
    final: bool
    # CPU and memory (owned pools with those rates; zero and None elsewhere). amount_usd includes them.
    cpu_core_seconds: Decimal = Decimal(0)
    memory_gib_seconds: Decimal = Decimal(0)
    cpu_rate_usd_per_core_hour: Decimal | None = None
    memory_rate_usd_per_gib_hour: Decimal | None = None
    cpu_amount_usd: Decimal = Decimal("0.00")
    memory_amount_usd: Decimal = Decimal("0.00")

    def record_fields(self) -> dict:
        data = asdict(self)
        data.pop("final")
        return data


def instance_gpu_count(instance: CloudInstance) -> int:
    count = int((instance.offer or {}).get("gpu_count") or 0)
    if not count and instance.node_id:
        count = instance.node.gpus.count()
    return max(1, count)


def instance_rate(instance: CloudInstance) -> Decimal:
    """$ per GPU-hour of a rented instance: its price as launched over its GPUs."""
    return Decimal(instance.hourly_price_usd) / instance_gpu_count(instance)


def current_rate(alloc: Allocation) -> tuple[Decimal, str, bool]:
    """(rate $/GPU-hour, source, spot) for an allocation as prices stand now (fixed once by its meter)."""
    pool = alloc.node.pool
    return current_rates([PriceBasis(allocation_id=alloc.pk, node_id=alloc.node_id, pool_id=pool.pk,
                                     pool_rate=Decimal(pool.gpu_hour_rate_usd), gpu_model=_gpu_model(alloc))])[alloc.pk]


class PriceBasis(NamedTuple):
    """What an allocation's price depends on, read as plain rows (rates_fix)."""
    allocation_id: int
    node_id: int
    pool_id: int
    pool_rate: Decimal
    gpu_model: str
    cpu_rate: Decimal | None = None  # the pool's $/vCPU-hour (None: CPU not charged)
    memory_rate: Decimal | None = None  # the pool's $/GiB-hour


def resource_rates(cpu_rate: Decimal | None, memory_rate: Decimal | None,
                   source: str) -> tuple[Decimal | None, Decimal | None]:
    """The (CPU, memory) rates an allocation pays given its pool's and its GPU rate's source: none on a
    rented instance (its price covers CPU and memory), the pool's own elsewhere."""
    if source == "instance":
        return None, None
    return (None if cpu_rate is None else Decimal(cpu_rate)), (None if memory_rate is None else Decimal(memory_rate))


def current_rates(bases: list[PriceBasis]) -> dict[int, tuple[Decimal, str, bool]]:
    """(rate $/GPU-hour, source, spot) of each allocation as prices stand now, in two queries (the
    instances, the pools' overrides): a rented instance's price, else the pool's override for the GPU
    model, else the pool's rate."""
    instances = {i.node_id: i for i in CloudInstance.objects.filter(node_id__in={b.node_id for b in bases})}
    overrides = {(o.pool_id, o.gpu_model): Decimal(o.rate_usd_per_gpu_hour) for o in ChargebackRate.objects.filter(
        pool_id__in={b.pool_id for b in bases})}
    rates = {}
    for basis in bases:
        instance = instances.get(basis.node_id)
        if instance is not None:
            rates[basis.allocation_id] = (instance_rate(instance), "instance", instance.spot)
            continue
        override = overrides.get((basis.pool_id, basis.gpu_model))
        rates[basis.allocation_id] = ((override, "pool_model", False) if override is not None
                                      else (basis.pool_rate, "pool", False))
    return rates


def _gpu_model(alloc: Allocation) -> str:
    for piece in alloc.slices.all():
        gpu = piece.gpu
        return gpu.model.name if gpu.model_id else gpu.model_name
    return ""


def _held_slots(alloc: Allocation) -> int:
    return sum(piece.slots for piece in alloc.slices.all())


def _pool_label(pool) -> str:
    return f"{pool.tenant.slug}/{pool.name}"


def allocation_lines(alloc: Allocation, meter: AllocationMeter | None, *, until: datetime) -> list[Line]:
    """Every line of `alloc` up to `until` (final ones and the live remainder of an open day).

    `alloc` needs job__owner, job__tenant, node__pool__tenant and slices__gpu__model loaded."""
    if meter is not None:
        rate, spot = Decimal(meter.rate_usd_per_gpu_hour), meter.spot
        cpu_rate, memory_rate = resource_rates(meter.cpu_rate_usd_per_core_hour, meter.memory_rate_usd_per_gib_hour,
                                               meter.rate_source)
        util = meter.avg_utilisation
    else:
        rate, source, spot = current_rate(alloc)
        cpu_rate, memory_rate = resource_rates(alloc.node.pool.cpu_rate_usd_per_core_hour,
                                               alloc.node.pool.memory_rate_usd_per_gib_hour, source)
        util = None
    start_s = _secs(alloc.created_at)
    until_s = _secs(until)
    released_s = _secs(alloc.released_at) if alloc.released_at else None
    end_s = min(released_s, until_s) if released_s is not None else until_s
    slots = _held_slots(alloc)
    gpus = Decimal(slots) / SLOTS
    pool = alloc.node.pool
    job = alloc.job
    lines = []
    for day, a, b in day_segments(start_s, end_s):
        gpu_seconds = Decimal(slots * (b - a)) / SLOTS
        final = b == _day_end_s(day) or (released_s is not None and b == released_s)
        extra = _resource_parts(job, b - a, cpu_rate, memory_rate)
        gpu_amount = money(gpu_seconds, rate)
        lines.append(Line(
            key=f"alloc:{alloc.pk}:{day.isoformat()}", kind=UsageKind.USAGE, tenant_id=job.tenant_id,
            month=month_of(day), day=day, job_id=job.pk, job_name=job.name[:200], user=job.owner.get_username(),
            allocation_id=alloc.pk, instance_id=None, node=alloc.node.name, gpu_model=_gpu_model(alloc),
            provider=pool.kind, pool=_pool_label(pool), region=pool.region, spot=spot, start=_at(a), end=_at(b),
            seconds=b - a, gpus=gpus, gpu_seconds=gpu_seconds, rate_usd_per_gpu_hour=rate,
            amount_usd=gpu_amount + extra["cpu_amount_usd"] + extra["memory_amount_usd"], avg_gpu_utilisation=util,
            final=final, **extra))
    return lines


def requested_cores_gib(*, cpu_milli: int, memory_mb: int) -> tuple[Decimal, Decimal]:
    """A job's CPU and memory request per node in the units their rates are per: vCPUs and GiB (exact)."""
    return Decimal(cpu_milli) / 1000, Decimal(memory_mb) / 1024


def _resource_parts(job, seconds: int, cpu_rate: Decimal | None, memory_rate: Decimal | None) -> dict:
    """A line's CPU and memory fields: the job's request per node for `seconds`, priced where a rate is set
    (quantities are recorded only where charged, so a pool without rates stores what it always did)."""
    parts: dict = {"cpu_rate_usd_per_core_hour": cpu_rate, "memory_rate_usd_per_gib_hour": memory_rate}
    cores, gib = requested_cores_gib(cpu_milli=job.cpu_milli, memory_mb=job.memory_mb)
    cpu = cores * seconds if cpu_rate is not None else Decimal(0)
    memory = gib * seconds if memory_rate is not None else Decimal(0)
    parts.update(cpu_core_seconds=cpu, memory_gib_seconds=memory,
                 cpu_amount_usd=money(cpu, cpu_rate) if cpu_rate is not None else Decimal("0.00"),
                 memory_amount_usd=money(memory, memory_rate) if memory_rate is not None else Decimal("0.00"))
    return parts


def idle_tenant_id(instance: CloudInstance) -> int:
    """Who pays an instance's idle time: the team whose job caused the launch (its first placement), or
    the pool's owner under WHALEZEN_BILLING_IDLE_RULE=owner (and when no placement names a job)."""
    if idle_rule() == "launcher":
        from broker.jobs.models import Job

        for part in instance.placements or ():
            tenant_id = Job.objects.filter(pk=part.get("job_id")).values_list("tenant_id", flat=True).first()
            if tenant_id is not None:
                return tenant_id
    return instance.tenant_id


def instance_charged(instance: CloudInstance) -> bool:
    """Only an instance the cloud confirmed exists (it has a provider id) costs money."""
    return bool(instance.provider_id)


def instance_idle_lines(instance: CloudInstance, *, until: datetime, tenant_id: int | None = None) -> list[Line]:
    """The `__idle__` lines of one rented instance up to `until`."""
    if not instance_charged(instance):
        return []
    tenant_id = idle_tenant_id(instance) if tenant_id is None else tenant_id
    start_s = _secs(instance.created_at)
    until_s = _secs(until)
    ended_s = _secs(instance.terminated_at) if instance.terminated_at else None
    end_s = min(ended_s, until_s) if ended_s is not None else until_s
    total_slots = instance_gpu_count(instance) * SLOTS
    held: list[tuple[int, int, int]] = []  # (start s, end s, slots) of allocations on its node
    if instance.node_id:
        for alloc in Allocation.objects.filter(node_id=instance.node_id).prefetch_related("slices"):
            a = _secs(alloc.created_at)
            b = _secs(alloc.released_at) if alloc.released_at else until_s
            held.append((a, b, sum(piece.slots for piece in alloc.slices.all())))
    rate = instance_rate(instance)
    pool = instance.pool
    offer = instance.offer or {}
    lines = []
    for day, a, b in day_segments(start_s, end_s):
        capacity = total_slots * (b - a)
        used = sum(max(0, min(b, hb) - max(a, ha)) * slots for ha, hb, slots in held)
        idle_slot_seconds = max(0, capacity - used)
        final = b == _day_end_s(day) or (ended_s is not None and b == ended_s)
        if idle_slot_seconds == 0:
            continue
        gpu_seconds = Decimal(idle_slot_seconds) / SLOTS
        lines.append(Line(
            key=f"idle:{instance.pk}:{day.isoformat()}", kind=UsageKind.IDLE, tenant_id=tenant_id,
            month=month_of(day), day=day, job_id=None, job_name=IDLE, user=IDLE, allocation_id=None,
            instance_id=instance.pk, node=instance.node_name, gpu_model=str(offer.get("gpu_model", "")),
            provider=pool.kind, pool=_pool_label(pool), region=str(offer.get("region") or pool.region),
            spot=instance.spot, start=_at(a), end=_at(b), seconds=b - a,
            gpus=(gpu_seconds / (b - a)).quantize(Decimal("0.001")), gpu_seconds=gpu_seconds,
            rate_usd_per_gpu_hour=rate, amount_usd=money(gpu_seconds, rate), avg_gpu_utilisation=None,
            final=final))
    return lines


def rented(pool) -> bool:
    return pool.kind not in OWNED_POOL_KINDS
