"""Mutable free-capacity bookkeeping for one cycle, and the concrete "which GPUs" choice.

The engine never mutates the snapshot; it copies free capacity into `NodeCapacity` objects,
places work on them (mapping, greedy, preemption and defragmentation all share this code, so a
GPU chosen by one is never chosen again by another) and reads the chosen indices back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from scheduling.model import WHOLE_GPU_MILLI, NodeState, SCHEDULABLE_NODE_STATES


@dataclass(frozen=True, slots=True)
class PartDemand:
    """What one node must give a job: `gpus` GPUs with `milli` each (k=1 when fractional)."""

    gpus: int
    milli: int
    min_gpu_memory_mb: int
    nvlink: bool
    cpu_milli: int
    memory_mb: int
    allowed_models: tuple[str, ...]
    # Set from gpus and milli (a plain field, not a property: it is read on every placement).
    fractional: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "fractional", self.gpus > 0 and self.milli < WHOLE_GPU_MILLI)


class NodeCapacity:
    """Free capacity of one node, updated as the cycle places work on it."""

    __slots__ = ("node", "free_milli", "free_memory", "free_cpu", "free_mem", "schedulable", "share_choice")

    def __init__(self, node: NodeState) -> None:
        self.node = node
        self.free_milli = [g.free_milli if g.healthy else 0 for g in node.gpus]
        self.free_memory = [g.free_memory_mb if g.healthy else 0 for g in node.gpus]
        self.free_cpu = node.free_cpu_milli
        self.free_mem = node.free_memory_mb
        self.schedulable = node.state in SCHEDULABLE_NODE_STATES
        # Which GPU of this node a share takes when several could (`patterns.ShareChoice`: the one
        # that leaves the least fragmentation); None: best fit.
        self.share_choice: Callable[[NodeCapacity, PartDemand, list[int]], int] | None = None

    def whole_free(self) -> int:
        return self.free_milli.count(WHOLE_GPU_MILLI)  # free milli never exceeds a whole GPU

    def shape_key(self) -> tuple:
        """Nodes with equal keys are interchangeable for every filter, cost and packing choice."""
        node = self.node
        islands: dict[object, list[tuple]] = {}
        for position, gpu in enumerate(node.gpus):
            group = gpu.nvlink_island if gpu.nvlink_island is not None else ("solo", position)
            islands.setdefault(group, []).append(
                (gpu.model, gpu.memory_mb, self.free_milli[position], self.free_memory[position])
            )
        # Solo GPUs and islands are compared as sorted multisets so GPU numbering does not matter.
        canonical = tuple(sorted(
            (isinstance(group, tuple), tuple(sorted(members))) for group, members in islands.items()
        ))
        # Exact free CPU and memory: bucketing them merged shapes whose representative then refused
        # jobs that some members could hold (a wrong "does not fit" is worse than a bigger model).
        return (
            node.provider, node.region, node.pool, node.fast_fabric, node.price_per_gpu_hour,
            node.state, self.schedulable, canonical, self.free_cpu, self.free_mem, node.rented,
            tuple(sorted(node.tenants)), tuple(sorted(node.container_runtimes)),
            # Labels only matter to jobs with a node selector, but a shape must not mix nodes
            # that such a job would tell apart.
            tuple(sorted(node.labels.items())),
        )

    # ---------------------------------------------------------------------------- GPU choice

    def eligible(self, position: int, part: PartDemand) -> bool:
        gpu = self.node.gpus[position]
        if not gpu.healthy:
            return False
        if part.allowed_models and gpu.model not in part.allowed_models:
            return False
        if self.free_memory[position] < part.min_gpu_memory_mb:
            return False
        if part.fractional:
            return self.free_milli[position] >= part.milli
        return self.free_milli[position] >= WHOLE_GPU_MILLI

    def choose(self, part: PartDemand) -> tuple[int, ...] | None:
        """GPU positions for `part`, or None when it does not fit (capacity is not changed)."""
        if not self.schedulable or part.cpu_milli > self.free_cpu or part.memory_mb > self.free_mem:
            return None
        if part.gpus == 0:
            return ()
        eligible = [p for p in range(len(self.node.gpus)) if self.eligible(p, part)]
        if part.fractional:
            if not eligible:
                return None
            if self.share_choice is not None and len({self.free_milli[p] for p in eligible}) > 1:
                return (self.share_choice(self, part, eligible),)
            # Best fit: the GPU with the least room left that still fits, so whole GPUs stay whole.
            best = min(eligible, key=lambda p: (self.free_milli[p], p))
            return (best,)
        if len(eligible) < part.gpus:
            return None
        groups: dict[object, list[int]] = {}
        for p in eligible:
            island = self.node.gpus[p].nvlink_island
            groups.setdefault(island if island is not None else ("solo", p), []).append(p)
        fitting = [members for members in groups.values() if len(members) >= part.gpus]
        if fitting:
            # Best-fit island: the smallest one that holds the whole gang keeps big islands free.
            members = min(fitting, key=lambda m: (len(m), m[0]))
            return tuple(members[: part.gpus])
        if part.nvlink:
            return None
        # Spread only when no island holds the gang: take from the smallest groups first.
        ordered = sorted(groups.values(), key=lambda m: (len(m), m[0]))
        chosen = [p for members in ordered for p in members][: part.gpus]
        return tuple(sorted(chosen))

    def take(self, positions: tuple[int, ...], part: PartDemand) -> None:
        for p in positions:
            if part.fractional:
                self.free_milli[p] -= part.milli
                self.free_memory[p] -= part.min_gpu_memory_mb
            else:
                self.free_milli[p] = 0
                self.free_memory[p] = 0
        self.free_cpu -= part.cpu_milli
        self.free_mem -= part.memory_mb

    def release(self, positions: tuple[int, ...], milli: int, gpu_memory_mb: int,
                cpu_milli: int, memory_mb: int) -> None:
        """Give back what a running job holds (preemption and defragmentation what-ifs)."""
        for p in positions:
            whole = milli >= WHOLE_GPU_MILLI
            self.free_milli[p] = min(WHOLE_GPU_MILLI, self.free_milli[p] + milli)
            self.free_memory[p] = (self.node.gpus[p].memory_mb if whole
                                   else min(self.node.gpus[p].memory_mb, self.free_memory[p] + gpu_memory_mb))
        self.free_cpu += cpu_milli
        self.free_mem += memory_mb

    def gpu_indices(self, positions: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(self.node.gpus[p].index for p in positions)

    def positions_of(self, gpu_indices: tuple[int, ...]) -> tuple[int, ...]:
        """The inverse of `gpu_indices` (positions in ascending order, as `choose` gives them)."""
        return tuple(p for p, gpu in enumerate(self.node.gpus) if gpu.index in gpu_indices)

    def same_free(self, other: "NodeCapacity") -> bool:
        """Same free GPU shares, CPU and memory (nothing placed or released between the two)."""
        return (self.free_milli == other.free_milli and self.free_cpu == other.free_cpu
                and self.free_mem == other.free_mem)

    def copy(self) -> "NodeCapacity":
        clone = NodeCapacity.__new__(NodeCapacity)
        clone.node = self.node
        clone.free_milli = list(self.free_milli)
        clone.free_memory = list(self.free_memory)
        clone.free_cpu = self.free_cpu
        clone.free_mem = self.free_mem
        clone.schedulable = self.schedulable
        clone.share_choice = self.share_choice
        return clone
