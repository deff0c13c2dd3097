"""Where the unallocated GPU capacity sits at the end of a protocol run (`bench.fragmentation --leftover`).

A policy's figure at 130% says how much is left, not why. This replays a run's final placements
(each task where it ended) on an empty cluster and splits the free GPU capacity three ways:

- whole GPUs that nothing uses, also by node shape (model and GPU count: `T4x2`);
- capacity on nodes where no GPU task of the list fits any more (by GPU share or count, CPU,
  memory and model): stranded for good, whatever arrives next;
- the gaps of partly used GPUs, grouped by what occupies the GPU (``[810]``: one task of 0.81 GPU),
  each group with the fraction of the list's GPU tasks small enough to fill its gap, and summed
  by that fraction (under 1%, 1-5%, 5% or more of the list).

The last column is what bounds any policy that places every task that fits: a gap beside a 0.81
task can only take tasks of at most 0.19 GPU, and on the default list they are 1.5% of the GPU tasks.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Iterable, Sequence

import numpy as np

from scheduling.sim.cluster import MILLI, ArrayCluster, NodeSpec, TaskSpec

# Occupant groups listed per run, largest free capacity first.
TOP_GROUPS = 6
# The gaps of partly used GPUs are also summed by the fraction of the list's GPU tasks that fit them.
FIT_BANDS = ((0.01, "under 1%"), (0.05, "1-5%"), (float("inf"), "5% or more"))


class _Classes:
    """The list's GPU tasks as arrays, to ask of a node's end state: does any of them still fit?"""

    def __init__(self, tasks: Sequence[TaskSpec]) -> None:
        gpu_tasks = [t for t in tasks if t.num_gpu > 0]
        kinds = sorted({t.type_key for t in gpu_tasks})
        self.cpu = np.array([k[0] for k in kinds], dtype=np.int64)
        self.mem = np.array([k[1] for k in kinds], dtype=np.int64)
        self.gpus = np.array([k[2] for k in kinds], dtype=np.int64)
        self.milli = np.array([k[3] for k in kinds], dtype=np.int64)
        self._models = [k[4] for k in kinds]
        self._allowed: dict[str, np.ndarray] = {}
        shares = np.array([t.gpu_milli for t in gpu_tasks if t.num_gpu == 1], dtype=np.int64)
        self._share_sorted = np.sort(shares)
        self._gpu_task_count = max(len(gpu_tasks), 1)

    def allowed(self, model: str) -> np.ndarray:
        if model not in self._allowed:
            self._allowed[model] = np.array([not m or model in m for m in self._models], dtype=bool)
        return self._allowed[model]

    def any_fits(self, model: str, gpu_free: np.ndarray, cpu_free: int, mem_free: int) -> bool:
        largest_share = int(gpu_free.max()) if gpu_free.size else 0
        whole = int((gpu_free >= MILLI).sum())
        gpu_ok = np.where(self.gpus == 1, self.milli <= largest_share, self.gpus <= whole)
        return bool((gpu_ok & (self.cpu <= cpu_free) & (self.mem <= mem_free) & self.allowed(model)).any())

    def fraction_fitting_gap(self, gap_milli: int) -> float:
        """Share of the list's GPU tasks that ask for one GPU of at most ``gap_milli``."""
        return int(np.searchsorted(self._share_sorted, gap_milli, side="right")) / self._gpu_task_count


def leftover(nodes: Sequence[NodeSpec], list_tasks: Sequence[TaskSpec],
             placements: Iterable[tuple[TaskSpec, int, Sequence[int]]]) -> dict:
    """Free GPU capacity of the end state that ``placements`` (task, node index, GPU indices) leave,
    split as the module docstring says; GPU figures in GPUs. The replay is on the simulator's own
    cluster, which refuses a placement that does not fit."""
    cluster = ArrayCluster(nodes)
    occupants: dict[tuple[int, int], list[int]] = defaultdict(list)
    for task, node, gpus in placements:
        cluster.place(node, list(gpus), task)
        for g in gpus:
            occupants[(node, g)].append(task.gpu_milli)
    classes = _Classes(list_tasks)
    free_total = whole = stranded = 0
    groups: dict[tuple[int, ...], list[int]] = defaultdict(lambda: [0, 0])  # occupants -> [GPUs, free milli]
    whole_by_shape: dict[str, int] = defaultdict(int)
    for i, node in enumerate(nodes):
        gpu_free = cluster.gpu_free[i, :node.num_gpu]
        node_free = int(gpu_free.sum())
        free_total += node_free
        whole_here = int((gpu_free == MILLI).sum())
        whole += whole_here * MILLI
        if whole_here:
            whole_by_shape[f"{node.model}x{node.num_gpu}"] += whole_here
        if node_free and not classes.any_fits(node.model, gpu_free, int(cluster.cpu_free[i]),
                                              int(cluster.mem_free[i])):
            stranded += node_free
        for g, free in enumerate(gpu_free.tolist()):
            if 0 < free < MILLI:
                group = groups[tuple(sorted(occupants[(i, g)], reverse=True))]
                group[0] += 1
                group[1] += free
    fractions = {key: classes.fraction_fitting_gap(MILLI - sum(key)) for key in groups}
    bands = {label: 0 for _, label in FIT_BANDS}
    for key, (_, free) in groups.items():
        bands[next(label for bound, label in FIT_BANDS if fractions[key] < bound)] += free
    top = sorted(groups.items(), key=lambda kv: -kv[1][1])[:TOP_GROUPS]
    return {"free_gpus": free_total / MILLI, "whole_free_gpus": whole / MILLI,
            "whole_free_by_shape": dict(sorted(whole_by_shape.items(), key=lambda kv: -kv[1])),
            "free_where_nothing_fits": stranded / MILLI,
            "partly_used_gpus": sum(g[0] for g in groups.values()),
            "gap_free_by_list_fraction_that_fits": {label: free / MILLI for label, free in bands.items()},
            "gaps": [{"occupants": list(key), "gpus": count, "free_gpus": free / MILLI,
                      "list_fraction_that_fits": round(fractions[key], 4)}
                     for key, (count, free) in top]}


def mean_leftover(per_seed: Sequence[dict]) -> dict:
    """Mean over seeds; occupant groups summed over seeds then divided, the largest kept."""
    n = max(len(per_seed), 1)
    out = {k: round(sum(s[k] for s in per_seed) / n, 1)
           for k in ("free_gpus", "whole_free_gpus", "free_where_nothing_fits", "partly_used_gpus")}
    shapes: dict[str, float] = defaultdict(float)
    for s in per_seed:
        for shape, gpus in s["whole_free_by_shape"].items():
            shapes[shape] += gpus / n
    out["whole_free_by_shape"] = {shape: round(gpus, 1) for shape, gpus in
                                  sorted(shapes.items(), key=lambda kv: -kv[1])[:TOP_GROUPS]}
    out["gap_free_by_list_fraction_that_fits"] = {
        label: round(sum(s["gap_free_by_list_fraction_that_fits"][label] for s in per_seed) / n, 1)
        for _, label in FIT_BANDS}
    merged: dict[tuple[int, ...], list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])
    for s in per_seed:
        for g in s["gaps"]:
            m = merged[tuple(g["occupants"])]
            m[0] += g["gpus"]
            m[1] += g["free_gpus"]
            m[2] = g["list_fraction_that_fits"]
    top = sorted(merged.items(), key=lambda kv: -kv[1][1])[:TOP_GROUPS]
    out["gaps"] = [{"occupants": list(key), "gpus": round(gpus / n, 1), "free_gpus": round(free / n, 1),
                    "list_fraction_that_fits": fraction} for key, (gpus, free, fraction) in top]
    return out


def leftover_table(by_policy: dict[str, dict]) -> str:
    """One block per policy: the three parts, then its largest gap groups."""
    lines = []
    for name, s in by_policy.items():
        lines.append(f"{name}: {s['free_gpus']:.1f} GPUs free at the end; whole GPUs {s['whole_free_gpus']:.1f}; "
                     f"on nodes where no task of the list fits {s['free_where_nothing_fits']:.1f}; "
                     f"{s['partly_used_gpus']:.0f} GPUs partly used")
        if s["whole_free_by_shape"]:
            lines.append("    whole GPUs free by node shape: " + ", ".join(
                f"{shape} {gpus:.1f}" for shape, gpus in s["whole_free_by_shape"].items()))
        lines.append("    gaps by the fraction of the list's GPU tasks that fit them: " + ", ".join(
            f"{label} {free:.1f}" for label, free in s["gap_free_by_list_fraction_that_fits"].items()))
        for g in s["gaps"]:
            share = "+".join(f"{o / MILLI:.2f}" for o in g["occupants"])
            lines.append(f"    beside {share:<18} {g['gpus']:>7.1f} GPUs, {g['free_gpus']:>6.1f} free; "
                         f"{100 * g['list_fraction_that_fits']:.1f}% of the list's GPU tasks fit the gap")
    return "\n".join(lines)
