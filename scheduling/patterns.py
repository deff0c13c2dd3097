"""Packing patterns: the multisets of whole-GPU gangs one node (or instance) of a target can hold.

A pattern lists how many gangs of each item type `(gpus, needs_nvlink)` go on one node. The
aggregated MILP chooses how many nodes of each shape use each pattern (equality with the shape's
node count, the empty pattern included, so no slot is ever reserved and left empty). Fractional
and CPU-only jobs are not in patterns: they use the GPUs a pattern leaves free.

Each pattern carries its fragmentation cost: the FGD measure of the node after the pattern minus
before, from `scheduling.fragmentation` (expected free GPU capacity the task mix cannot use).
"""

from __future__ import annotations

from dataclasses import dataclass

from scheduling import fragmentation as fgd
from scheduling.capacity import NodeCapacity
from scheduling.model import WHOLE_GPU_MILLI, WorkloadClass

ItemType = tuple[int, bool]  # (GPUs in the gang on this node, needs one NVLink island)
MAX_PATTERNS_PER_TARGET = 2000


@dataclass(frozen=True, slots=True)
class Pattern:
    items: tuple[tuple[ItemType, int], ...]  # (item type, how many) sorted
    gpus_used: int
    fragmentation_gpus: float  # FGD after - before, in GPUs

    def count(self, item: ItemType) -> int:
        for kind, n in self.items:
            if kind == item:
                return n
        return 0


def island_free_counts(cap: NodeCapacity) -> list[int]:
    """Whole free GPUs per NVLink island; GPUs without an island count as islands of one."""
    groups: dict[object, int] = {}
    for position, gpu in enumerate(cap.node.gpus):
        if cap.free_milli[position] >= WHOLE_GPU_MILLI and gpu.healthy:
            key = gpu.nvlink_island if gpu.nvlink_island is not None else ("solo", position)
            groups[key] = groups.get(key, 0) + 1
    return sorted(groups.values(), reverse=True)


def fits(islands: list[int], items: list[ItemType]) -> bool:
    """Can the gangs go on a node with these island sizes? NVLink gangs need one island each."""
    nvlink = sorted((k for k, needs in items if needs), reverse=True)
    spread = sum(k for k, needs in items if not needs)
    if sum(nvlink) + spread > sum(islands):
        return False

    def place(i: int, free: list[int]) -> bool:
        if i == len(nvlink):
            return True
        tried: set[int] = set()
        for j, room in enumerate(free):
            if room >= nvlink[i] and room not in tried:
                tried.add(room)
                free[j] -= nvlink[i]
                ok = place(i + 1, free)
                free[j] += nvlink[i]
                if ok:
                    return True
        return False

    return place(0, list(islands))


@dataclass(frozen=True)
class EngineWorkload(fgd.Workload):
    """The engine's task mix with the classes whose homes are scarce on this snapshot's nodes:
    every fragmentation measure the engine takes (`node_cost_batch`) carries both."""

    homes: fgd.ScarceHomes | None = None


def to_workload(classes: tuple[WorkloadClass, ...], homes: fgd.ScarceHomes | None = None) -> fgd.Workload | None:
    usable = [c for c in classes if c.weight > 0]
    if not usable:
        return None
    mix = fgd.normalise(
        fgd.TaskClass(cpu_milli=c.cpu_milli, gpu_milli=c.gpu_milli if c.gpus > 0 else 0, num_gpu=c.gpus,
                      weight=c.weight, memory_mib=c.memory_mb,
                      gpu_models=frozenset(c.gpu_models) if c.gpu_models else None)
        for c in usable
    )
    return mix if homes is None or not HOME_WEIGHT else EngineWorkload(mix.classes, homes)


# CPU/memory stranding (WhaleZen's look-ahead, as whalezen-online): the GPU capacity a node will
# not sell once its CPU or memory runs out under the mix's average GPU task
# (`fragmentation.stranded_batch`), STRANDING_ALPHA GPUs of cost per stranded GPU. It depends on
# a node's totals only, so each part is charged its exact change of it alone on a node of the
# shape (`problem._price_host_costs`). Without it the engine packed CPU-heavy and CPU-only tasks
# onto 8-GPU / 96-core nodes and left ~400 whole GPUs behind exhausted CPU on the FGD protocol
# (bench/README.md); 2 is whalezen-online's weight.
# Measured on the FGD protocol (seed 42, GPUs free at the end, before the packer change): alpha 2
# -> 373.5, alpha 4 -> 372.3.
STRANDING_ALPHA = 2.0
# Scarce homes (as whalezen-online, `scheduling.sim.whalezen`): a part's host and fit costs also
# carry HOME_WEIGHT x the scarce capacity it takes from task classes that fit few nodes
# (`fragmentation.home_value_batch`, in GPUs), so one-GPU tasks stay off the only nodes that
# take the largest gangs. 1 is whalezen-online's weight.
HOME_WEIGHT = 1.0
# The fragmentation measure's look-ahead horizons: whalezen-online's (`fragmentation.LOOKAHEAD_POWERS`,
# the mean over n = 2 and n = 10 later tasks of the chance that none can use a free share). With
# FGD's one-step measure (n = 1) the engine ended 96 GPUs behind whalezen-online on the multi-GPU
# list at 130% (703.5 against 607.5, seed 42), with these 635.5 (bench/README.md section 1).
LOOKAHEAD_POWERS = fgd.LOOKAHEAD_POWERS


def node_cost_batch(gpu_free, cpu_free, models: list[str], workload: fgd.Workload | None, mem_free=None):
    """Fragmentation measure in GPUs for N node states: (N, G) free milli, (N,) free CPU, GPU model,
    (N,) free memory when given (a class needing more memory than is free uses none of the node's
    GPUs); less HOME_WEIGHT x the scarce capacity they offer (`fragmentation.home_value_batch`)
    when the workload carries scarce homes and free memory is given."""
    import numpy as np

    gpu_free = np.asarray(gpu_free, dtype=np.int64)
    if workload is None or gpu_free.size == 0:
        return np.zeros(len(gpu_free))
    access = workload.model_access(models)
    # Free memory too, as whalezen-online's measure: a class the node's memory can no longer take
    # cannot use its free GPUs. Without it only the stranding term saw memory; share list, seeds
    # 42-44 at 130%: 759.7 -> 756.9 GPUs unallocated, 760.8 -> 759.8 in one session (about a
    # seed's noise, no seed worse; bench/README.md section 1).
    cost = fgd.horizons_fragmentation_batch(gpu_free, cpu_free, workload, mem_free, access, LOOKAHEAD_POWERS)
    homes = getattr(workload, "homes", None)
    if homes is not None and mem_free is not None:
        cost = cost - HOME_WEIGHT * fgd.home_value_batch(gpu_free, cpu_free, mem_free, homes,
                                                         homes.model_access(models))
    return cost / WHOLE_GPU_MILLI


_RATIOS: dict[int, tuple[object, tuple[float, float]]] = {}


def stranding_ratios(workload: fgd.Workload) -> tuple[float, float]:
    """`fragmentation.mix_ratios`, cached per workload object."""
    cached = _RATIOS.get(id(workload))
    if cached is None or cached[0] is not workload:
        if len(_RATIOS) > 64:
            _RATIOS.clear()
        cached = (workload, fgd.mix_ratios(workload))
        _RATIOS[id(workload)] = cached
    return cached[1]  # type: ignore[return-value]


def stranding_coefficients(workload: fgd.Workload | None) -> tuple[float, float, float]:
    """(alpha, CPU milli per milli-GPU, memory MiB per milli-GPU) of the stranding term; alpha 0
    when it is off (no workload, or a mix without GPU classes)."""
    if workload is None or not STRANDING_ALPHA:
        return 0.0, 0.0, 0.0
    cpu_ratio, mem_ratio = stranding_ratios(workload)
    if cpu_ratio <= 0 and mem_ratio <= 0:
        return 0.0, 0.0, 0.0
    return STRANDING_ALPHA, cpu_ratio, mem_ratio


def stranded_gpus(gpu_milli: float, cpu: float, mem: float, cpu_ratio: float, mem_ratio: float) -> float:
    """GPUs a node with these free totals will not sell (`fragmentation.stranded_batch`, scalar)."""
    out = 0.0
    if cpu_ratio > 0:
        out = max(out, gpu_milli - cpu / cpu_ratio)
    if mem_ratio > 0:
        out = max(out, gpu_milli - mem / mem_ratio)
    return out / WHOLE_GPU_MILLI


def part_gpu_milli(part) -> int:
    """Milli-GPU a part takes from its node's free total."""
    return part.gpus * part.milli if part.gpus else 0


def node_fragmentation_gpus(free_milli: list[int], cap: NodeCapacity, workload: fgd.Workload | None) -> float:
    if workload is None or not free_milli:
        return 0.0
    model = cap.node.gpus[0].model if cap.node.gpus else ""
    return float(node_cost_batch([list(free_milli)], [cap.free_cpu], [model], workload, [cap.free_mem])[0])


def enumerate_patterns(cap: NodeCapacity, item_types: list[ItemType],
                       workload: fgd.Workload | None) -> list[Pattern]:
    """All multisets of `item_types` that fit one node like `cap` (the empty one first)."""
    islands = island_free_counts(cap)
    types = sorted(set(item_types), reverse=True)
    whole_positions = [p for p, m in enumerate(cap.free_milli) if m >= WHOLE_GPU_MILLI and cap.node.gpus[p].healthy]
    before = node_fragmentation_gpus(list(cap.free_milli), cap, workload)
    frag_by_used: dict[int, float] = {}

    def frag_after(used: int) -> float:
        if used not in frag_by_used:
            after = list(cap.free_milli)
            for p in whole_positions[:used]:
                after[p] = 0
            frag_by_used[used] = node_fragmentation_gpus(after, cap, workload) - before
        return frag_by_used[used]

    patterns: list[Pattern] = []
    chosen: list[ItemType] = []

    def extend(start: int) -> None:
        if len(patterns) >= MAX_PATTERNS_PER_TARGET:
            return
        counts: dict[ItemType, int] = {}
        for item in chosen:
            counts[item] = counts.get(item, 0) + 1
        used = sum(k for k, _ in chosen)
        patterns.append(Pattern(items=tuple(sorted(counts.items())), gpus_used=used,
                                fragmentation_gpus=frag_after(used)))
        for index in range(start, len(types)):
            chosen.append(types[index])
            if fits(islands, chosen):
                extend(index)
            chosen.pop()

    extend(0)
    return patterns


# ----------------------------------------------------------------------- whole-instance patterns

MAX_INSTANCE_PATTERNS = 1500


@dataclass(frozen=True, slots=True)
class InstancePattern:
    """What one launched instance holds: (class index, jobs) pairs, and the GPUs they occupy."""

    jobs: tuple[tuple[int, int], ...]
    gpus_busy: int  # gang GPUs plus GPUs opened for shares (first-fit decreasing)

    def count(self, class_index: int) -> int:
        for c, n in self.jobs:
            if c == class_index:
                return n
        return 0


def _shares_fit(shares: list[int], gpus: int) -> int | None:
    """GPUs first-fit decreasing needs for these shares, or None when more than `gpus`."""
    bins: list[int] = []
    for share in sorted(shares, reverse=True):
        for i, room in enumerate(bins):
            if room >= share:
                bins[i] -= share
                break
        else:
            if len(bins) == gpus:
                return None
            bins.append(WHOLE_GPU_MILLI - share)
    return len(bins)


def enumerate_instance_patterns(cap: NodeCapacity, parts: dict, sizes: dict[int, int]) -> list[InstancePattern] | None:
    """Every non-empty job mix one fresh instance like `cap` can hold (per class: the part and
    how many members exist), or None when there would be more than MAX_INSTANCE_PATTERNS.

    Pooled capacity over-promised small instances (22 jobs on 16 one-GPU instances that held 19),
    so small offers get exact per-instance mixes: GPU gangs, shares packed per GPU, CPU, memory.
    """
    gpus = len(cap.node.gpus)
    classes = sorted(parts)
    patterns: list[InstancePattern] = []
    chosen: list[int] = []

    def state_fits() -> int | None:
        gang = sum(parts[c].gpus for c in chosen if not parts[c].fractional)
        if gang > gpus:
            return None
        if sum(parts[c].cpu_milli for c in chosen) > cap.free_cpu or sum(parts[c].memory_mb for c in chosen) > cap.free_mem:
            return None
        shares = [parts[c].milli for c in chosen if parts[c].fractional]
        opened = _shares_fit(shares, gpus - gang) if shares else 0
        return None if opened is None else gang + opened

    def extend(start: int) -> bool:
        for index in range(start, len(classes)):
            c = classes[index]
            if chosen.count(c) >= sizes[c]:
                continue
            chosen.append(c)
            busy = state_fits()
            if busy is not None:
                counts: dict[int, int] = {}
                for member in chosen:
                    counts[member] = counts.get(member, 0) + 1
                patterns.append(InstancePattern(tuple(sorted(counts.items())), busy))
                if len(patterns) > MAX_INSTANCE_PATTERNS or not extend(index):
                    chosen.pop()
                    return False
            chosen.pop()
        return True

    return patterns if extend(0) else None


class ShareChoice:
    """Which GPU of a node a share takes when GPUs with different free shares could hold it: the one
    after which the node's fragmentation measure (`node_cost_batch`) is lowest, as whalezen-online
    chooses, instead of the tightest fit. Best fit leaves whatever sliver is left, which on a list of
    shares is often dust that no later share fits (a 0.25 share on a GPU with 0.3 free leaves 0.05),
    where another GPU of the node would leave a gap that the mix fills; on the share-heavy list best fit
    left 4 GPUs more unallocated at 130% (seeds 42-44, bench/README.md section 1). Ties go to the tighter GPU, then
    the lower position. A cycle meets the same node state many times: each answer is kept."""

    def __init__(self, workload: fgd.Workload) -> None:
        self.workload = workload
        self._known: dict[tuple, int] = {}

    def __call__(self, cap: NodeCapacity, part, eligible: list[int]) -> int:
        import numpy as np

        options: dict[int, int] = {}  # free milli -> the first eligible GPU with it
        for position in eligible:
            options.setdefault(cap.free_milli[position], position)
        model = cap.node.gpus[0].model if cap.node.gpus else ""
        key = (tuple(cap.free_milli), cap.free_cpu, cap.free_mem, model, part.milli, part.cpu_milli,
               part.memory_mb, tuple(sorted(options)))
        milli = self._known.get(key)
        if milli is None:
            frees = sorted(options)
            rows = np.array([cap.free_milli] * len(frees), dtype=np.int64)
            for row, free in enumerate(frees):
                rows[row, options[free]] -= part.milli
            cpu = np.full(len(frees), max(0, cap.free_cpu - part.cpu_milli), dtype=np.int64)
            mem = np.full(len(frees), max(0, cap.free_mem - part.memory_mb), dtype=np.int64)
            cost = node_cost_batch(rows, cpu, [model] * len(frees), self.workload, mem)
            milli = frees[min(range(len(frees)), key=lambda row: (round(float(cost[row]), 9), row))]
            if len(self._known) > 100_000:
                self._known.clear()
            self._known[key] = milli
        return options[milli]
