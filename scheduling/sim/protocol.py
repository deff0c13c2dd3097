"""The FGD paper's placement protocol (USENIX ATC'23, "Beware of Fragmentation").

Tasks arrive one at a time in a random order and never leave.  Per seed: shuffle the task list,
then append clones drawn at random from the list until the next one would push the arrived GPU
demand past ``target`` (130%) of the cluster's GPU capacity.  A task that fits nowhere is dropped
at once, but its demand still counts as arrived.  After every arrival we record the arrived
demand and the allocation (allocated milli-GPU / total milli-GPU, fractions count fractionally);
the published figure at N% is the mean allocation over the arrivals whose arrived demand rounds
to N%.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from scheduling.sim.cluster import ArrayCluster, TaskSpec
from scheduling.sim.policies import Policy


@dataclass
class ProtocolRun:
    arrived_pct: np.ndarray  # after each arrival, percent of GPU capacity that has arrived
    alloc_pct: np.ndarray  # after each arrival, percent of GPU capacity allocated
    placements: list[tuple[str, int, list[int]]] = field(default_factory=list)  # name, node, gpus
    dropped: int = 0
    migrations: int = 0  # tasks moved while running (whalezen-broker)

    def curve(self) -> dict[int, float]:
        """Mean allocation per arrived-demand percent (rounded half up), as published."""
        buckets = np.floor(self.arrived_pct + 0.5).astype(np.int64)
        out: dict[int, float] = {}
        for b in np.unique(buckets):
            out[int(b)] = float(self.alloc_pct[buckets == b].mean())
        return out

    def alloc_at(self, pct: int) -> float:
        """Allocation at ``pct`` arrived; the nearest lower bucket when none rounds to it exactly."""
        c = self.curve()
        if pct in c:
            return c[pct]
        lower = [k for k in c if k <= pct]
        return c[max(lower)] if lower else 0.0


def build_arrivals(tasks: Sequence[TaskSpec], total_gpu_milli: int, rng: np.random.Generator,
                   target: float = 1.3) -> list[TaskSpec]:
    """Shuffled list plus random clones, stopping before demand would exceed ``target``."""
    limit = target * total_gpu_milli
    order = rng.permutation(len(tasks))
    out: list[TaskSpec] = []
    arrived = 0
    for i in order:
        t = tasks[int(i)]
        if arrived + t.total_milli > limit:
            return out
        out.append(t)
        arrived += t.total_milli
    k = 0
    while True:
        t = tasks[int(rng.integers(len(tasks)))]
        if arrived + t.total_milli > limit:
            return out
        k += 1
        out.append(TaskSpec(f"{t.name}#clone{k}", t.cpu_milli, t.memory_mib, t.num_gpu, t.gpu_milli,
                            t.gpu_models))
        arrived += t.total_milli


def run_online(cluster: ArrayCluster, arrivals: Sequence[TaskSpec], policy: Policy,
               rng: np.random.Generator, record_placements: bool = False) -> ProtocolRun:
    """Place each arriving task with ``policy`` (one decision per task, nothing ever moves)."""
    cluster.reset()
    policy.start(cluster, rng)
    arrived = np.empty(len(arrivals))
    alloc = np.empty(len(arrivals))
    run = ProtocolRun(arrived, alloc)
    cum = 0
    total = cluster.total_gpu_milli
    for i, t in enumerate(arrivals):
        cum += t.total_milli
        d = policy.choose(t)
        if d is None:
            run.dropped += 1
        else:
            node, gpus = d
            cluster.place(node, gpus, t)
            policy.observe(node, gpus, t)
            if record_placements:
                run.placements.append((t.name, node, gpus))
        arrived[i] = 100.0 * cum / total
        alloc[i] = 100.0 * cluster.allocated_milli / total
    return run

