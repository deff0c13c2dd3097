"""Small builders for scheduling-engine tests (plain functions, no fixtures, no I/O)."""

from __future__ import annotations

from scheduling.model import (
    CloudOffer, GpuModelInfo, GpuState, JobDemand, NodeState, Policy, Snapshot, TenantBudget,
)

A100_MB = 40 * 1024
T4_MB = 16 * 1024

MODELS = (GpuModelInfo("A100", 1.0, A100_MB), GpuModelInfo("H100", 2.0, 80 * 1024), GpuModelInfo("T4", 0.25, T4_MB))

# Small solver limits keep the whole test area fast; no test asserts on timing.
FAST = Policy(time_limit_s=5.0, preemption=False, defragmentation=False)

# For tests that compare two plans of one snapshot: a limit their small snapshots come nowhere near
# (each cycle takes milliseconds). The engine's answer depends on the clock by design: after phase
# two the full MILP runs only if the time left is at least a quarter of the limit and four times what
# phase two took. Starved of CPU (a 2 s limit, six busy loops beside it), one quota world took three
# paths on three runs (the full MILP; phase two's answer alone; phase two out of time, the LP
# rounded) and placed three different sets of jobs. Those checks are about the engine's logic, not
# the machine's load.
DETERMINISM_LIMIT_S = 30.0


def gpu_node(node_id: str, gpus: int = 8, model: str = "A100", memory_mb: int = A100_MB, island_size: int = 8,
             used: dict[int, int] | None = None, free_memory: dict[int, int] | None = None,
             unhealthy: tuple[int, ...] = (), price: float = 1.0, cpu_milli: int = 64000,
             memory: int = 512 * 1024, free_cpu: int | None = None, free_mem: int | None = None,
             provider: str = "onprem", region: str = "dc1", pool: str = "default", fast_fabric: bool = False,
             state: str = "ready", rented: bool = False, tenants: tuple[str, ...] = ()) -> NodeState:
    used = used or {}
    free_memory = free_memory or {}
    gpu_states = tuple(
        GpuState(index=i, uuid=f"{node_id}-gpu{i}", model=model, memory_mb=memory_mb,
                 free_memory_mb=free_memory.get(i, memory_mb if not used.get(i) else memory_mb // 2),
                 nvlink_island=(i // island_size) if island_size > 1 else None,
                 healthy=i not in unhealthy, milli_used=used.get(i, 0))
        for i in range(gpus))
    return NodeState(id=node_id, name=node_id, gpus=gpu_states, cpu_milli=cpu_milli, memory_mb=memory,
                     free_cpu_milli=cpu_milli if free_cpu is None else free_cpu,
                     free_memory_mb=memory if free_mem is None else free_mem, pool=pool, provider=provider,
                     region=region, state=state, price_per_gpu_hour=price, fast_fabric=fast_fabric, rented=rented,
                     tenants=tenants)


def offer(offer_id: str, model: str = "A100", gpus: int = 8, price: float = 32.0, spot: float | None = None,
          launchable: int = 2, provider: str = "aws", region: str = "us-east-1", nvlink: bool = True,
          fast_fabric: bool = False, memory_mb: int = A100_MB) -> CloudOffer:
    return CloudOffer(id=offer_id, provider=provider, region=region, zone=f"{region}a", instance_type=f"{offer_id}.type",
                      gpu_model=model, gpu_count=gpus, gpu_memory_mb=memory_mb, ondemand_price_per_hour=price,
                      spot_price_per_hour=spot, launchable=launchable, nvlink=nvlink, fast_fabric=fast_fabric,
                      vcpus=96, memory_mb=1024 * 1024)


def job(job_id: str, gpus: int = 1, **fields) -> JobDemand:
    fields.setdefault("tenant", "acme")
    fields.setdefault("cpu_milli", 1000)
    fields.setdefault("memory_mb", 1024)
    return JobDemand(job_id=job_id, gpus=gpus, **fields)


def snapshot(nodes=(), pending=(), offers=(), tenants=(), running=(), **fields) -> Snapshot:
    fields.setdefault("gpu_models", MODELS)
    return Snapshot(now=1_000_000.0, nodes=tuple(nodes), pending=tuple(pending), offers=tuple(offers),
                    tenants=tuple(tenants), running=tuple(running), **fields)


def budget(tenant: str = "acme", **fields) -> TenantBudget:
    return TenantBudget(tenant=tenant, **fields)
