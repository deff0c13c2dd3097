"""Where a job can go: groups of interchangeable nodes ("shapes") and cloud offer variants.

Both are `Target`s with a representative `NodeCapacity`, so every filter plugin, cost term and
GPU-choice rule is written once. A cloud offer becomes a synthetic empty node of its instance
type; an offer with a spot price becomes two variants (spot and on-demand) that share the
offer's launchable count.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from scheduling.capacity import NodeCapacity, PartDemand
from scheduling.model import (
    WHOLE_GPU_MILLI, CloudOffer, GpuModelInfo, GpuState, JobDemand, NodeState, Snapshot,
)


@dataclass(slots=True)
class Target:
    key: str
    kind: str  # "node" (a shape of existing nodes) or "offer" (instances still to launch)
    rep: NodeCapacity  # representative free capacity (all members are identical)
    count: int  # nodes in the shape, or instances still launchable (shared by offer variants)
    members: tuple[int, ...] = ()  # positions into the cycle's node list (shapes only)
    offer: CloudOffer | None = None
    spot: bool = False
    gpu_model: str = ""  # model of the first healthy GPU (nodes hold one model in practice)

    def __post_init__(self) -> None:
        healthy = [g.model for g in self.rep.node.gpus if g.healthy]
        self.gpu_model = healthy[0] if healthy else ""

    @property
    def node(self) -> NodeState:
        return self.rep.node

    @property
    def gpu_total(self) -> int:
        return len(self.node.gpus)

    @property
    def instance_price(self) -> float:
        return self.node.price_per_gpu_hour * max(1, len(self.node.gpus))

    def describe(self) -> str:
        if self.offer is not None:
            o = self.offer
            return f"{o.provider} {o.region} {o.instance_type}{' spot' if self.spot else ''}"
        return f"{self.node.provider} {self.node.pool} {len(self.members)}x{self.gpu_total} {self.gpu_model}"


def offer_price(offer: CloudOffer, spot: bool) -> float:
    return float(offer.spot_price_per_hour) if spot else float(offer.ondemand_price_per_hour)


def offer_node(offer: CloudOffer, spot: bool) -> NodeState:
    """An empty instance of `offer`, as a node; one NVLink island when the offer has NVLink."""
    island = 0 if offer.nvlink else None
    gpus = tuple(
        GpuState(index=i, uuid=f"{offer.id}-gpu{i}", model=offer.gpu_model, memory_mb=offer.gpu_memory_mb,
                 free_memory_mb=offer.gpu_memory_mb, nvlink_island=island)
        for i in range(offer.gpu_count)
    )
    return NodeState(
        id=f"offer:{offer.id}:{'spot' if spot else 'od'}", name=offer.instance_type, gpus=gpus,
        cpu_milli=offer.vcpus * 1000, memory_mb=offer.memory_mb,
        free_cpu_milli=offer.vcpus * 1000, free_memory_mb=offer.memory_mb,
        pool=f"{offer.provider}:{offer.region}", provider=offer.provider, region=offer.region,
        price_per_gpu_hour=offer_price(offer, spot) / max(1, offer.gpu_count), fast_fabric=offer.fast_fabric,
        tenants=offer.tenants, container_runtimes=offer.container_runtimes,
    )


def build_shape_targets(capacities: list[NodeCapacity]) -> list[Target]:
    """Group nodes by free-capacity shape; order is deterministic (first member's position)."""
    by_key: dict[tuple, list[int]] = {}
    for position, cap in enumerate(capacities):
        by_key.setdefault(cap.shape_key(), []).append(position)
    targets = []
    for number, members in enumerate(by_key.values()):
        rep = capacities[members[0]].copy()
        targets.append(Target(key=f"shape{number}", kind="node", rep=rep, count=len(members), members=tuple(members)))
    return targets


def offer_launch_bound(offer: CloudOffer, group_limits: Mapping[str, int]) -> int:
    """Instances of `offer` one cycle may launch: its own count, and its group's shared cap."""
    bound = max(0, offer.launchable)
    if offer.launch_group in group_limits:
        bound = min(bound, max(0, group_limits[offer.launch_group]))
    return bound


def offer_group_caps(offers: tuple[CloudOffer, ...] | list[CloudOffer],
                     group_limits: Mapping[str, int]) -> list[tuple[int, tuple[str, ...]]]:
    """(remaining launches, offer ids) for every capped group that has offers, in a stable order."""
    members: dict[str, set[str]] = {}
    for offer in offers:
        if offer.launch_group in group_limits:
            members.setdefault(offer.launch_group, set()).add(offer.id)
    return [(max(0, group_limits[group]), tuple(sorted(ids))) for group, ids in sorted(members.items())]


def build_offer_targets(offers: tuple[CloudOffer, ...], group_limits: Mapping[str, int] | None = None) -> list[Target]:
    targets = []
    for offer in offers:
        if offer.gpu_count <= 0:
            continue
        variants = [False] + ([True] if offer.has_spot else [])
        count = offer_launch_bound(offer, group_limits or {})
        for spot in variants:
            targets.append(Target(key=f"{offer.id}:{'spot' if spot else 'od'}", kind="offer",
                                  rep=NodeCapacity(offer_node(offer, spot)), count=count,
                                  offer=offer, spot=spot))
    return targets


# ------------------------------------------------------------------------------ job on target


class Pricing:
    """GPU counts, run times and dollars for a job on a GPU model, from CU ratings and speeds."""

    def __init__(self, snapshot: Snapshot) -> None:
        self.models: dict[str, GpuModelInfo] = {m.name: m for m in snapshot.gpu_models}
        self.throughputs = snapshot.throughputs

    def gpu_count(self, job: JobDemand, model: str) -> int:
        return job.gpu_count_for(self.models.get(model))

    def speed(self, job: JobDemand, model: str) -> float:
        info = self.models.get(model)
        rating = info.cu_rating if info is not None and info.cu_rating > 0 else 1.0
        return self.throughputs.speed(job.job_family, model, rating)

    def runtime_hours(self, job: JobDemand, model: str) -> float:
        """Expected hours on `model`; `expected_duration_hours` is at speed 1.0 (an A100)."""
        speed = self.speed(job, model)
        if job.compute_units is not None:
            delivered = self.gpu_count(job, model) * speed
            return job.expected_duration_hours * job.compute_units / max(delivered, 1e-9)
        return job.expected_duration_hours / max(speed, 1e-9)

    def gpu_share(self, job: JobDemand, model: str) -> float:
        """GPUs the job occupies in total, fractional jobs counting their fraction."""
        return self.gpu_count(job, model) * min(job.gpu_milli, WHOLE_GPU_MILLI) / WHOLE_GPU_MILLI

    def hourly_price(self, job: JobDemand, target: Target) -> float:
        return self.gpu_share(job, target.gpu_model) * target.node.price_per_gpu_hour

    def money(self, job: JobDemand, target: Target) -> float:
        return self.hourly_price(job, target) * self.runtime_hours(job, target.gpu_model)

    def compute_units(self, job: JobDemand, model: str) -> float:
        info = self.models.get(model)
        rating = info.cu_rating if info is not None and info.cu_rating > 0 else 1.0
        return self.gpu_share(job, model) * rating

    def part(self, job: JobDemand, model: str) -> PartDemand | None:
        """Per-node demand on `model`, or None when the demand cannot be split evenly."""
        count = self.gpu_count(job, model)
        nodes = max(1, job.nodes)
        if count % nodes:
            return None
        fractional = job.gpu_milli < WHOLE_GPU_MILLI
        if fractional and (count != 1 or nodes != 1):
            return None
        return PartDemand(
            gpus=count // nodes, milli=job.gpu_milli if fractional else WHOLE_GPU_MILLI,
            min_gpu_memory_mb=job.min_gpu_memory_mb, nvlink=job.interconnect == "nvlink",
            cpu_milli=job.cpu_milli, memory_mb=job.memory_mb, allowed_models=job.allowed_models,
        )


def priority_weight(priority_rank: int, step: float) -> float:
    """Waiting cost multiplier: each priority rank multiplies it by `step` (capped to stay numeric)."""
    return math.pow(max(step, 1.0), min(priority_rank, 12))
