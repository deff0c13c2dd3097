"""WhaleZen's own placement policies for the simulator.

``whalezen-online`` (one task per decision, nothing ever moves) extends FGD's measure with what
FGD cannot see.  FGD asks, class by class, "could one more task of this class start here now?";
a CPU-only task that eats 12 cores of a 96-core, 8-GPU node changes no such answer, so FGD scores
every node the same for it and the tie-break decides.  On the Alibaba cluster that strands GPUs:
at 130% arrived demand FGD leaves most of its unallocated GPUs on 8-GPU nodes whose CPU is gone,
while the 104-core, 2-GPU nodes still have thousands of free cores.

So we add a fluid look-ahead term: the GPU capacity a node will not be able to sell because its
CPU (or memory) runs out first, if it keeps receiving the average task of the mix::

    stranded(node) = max(0, gpu_free - cpu_free / cpu_per_gpu, gpu_free - mem_free / mem_per_gpu)

with ``cpu_per_gpu`` the mix's expected CPU per milli-GPU over GPU tasks (popularity weighted).
The node cost is ``F_fgd + alpha * stranded`` and a task goes where that cost grows least; the
score keeps FGD's integer sigmoid so that equal scores tie and the fixed per-node priority packs
them (the published protocol shows the tie-break is worth several points).
"""

from __future__ import annotations

import numpy as np

from scheduling.fragmentation import Workload, fluid_fragmentation_batch
from scheduling.sim.cluster import ArrayCluster
from scheduling.sim.policies import FGDPolicy


def mix_ratios(workload: Workload) -> tuple[float, float]:
    """Expected CPU milli and memory MiB per milli-GPU over the GPU classes of the mix."""
    w = workload.weights
    gpu = workload.gpu_milli * workload.num_gpu
    has = gpu > 0
    g = float((w * gpu)[has].sum())
    if g <= 0:
        return 0.0, 0.0
    return float((w * workload.cpu)[has].sum()) / g, float((w * workload.mem)[has].sum()) / g


class WhaleZenOnline(FGDPolicy):
    name = "whalezen-online"

    def __init__(self, workload: Workload, alpha: float = 1.0, cpu_per_gpu: float | None = None,
                 mem_per_gpu: float | None = None, resolution: float = 100.0,
                 tie: str = "priority", measure: str = "fgd", beta: float = 1.0) -> None:
        super().__init__(workload)
        self.alpha = alpha
        c, m = mix_ratios(workload)
        self.cpu_per_gpu = c if cpu_per_gpu is None else cpu_per_gpu
        self.mem_per_gpu = m if mem_per_gpu is None else mem_per_gpu
        self.resolution = resolution
        self.tie = tie
        self.measure = measure
        self.beta = beta

    def start(self, cluster: ArrayCluster, rng: np.random.Generator) -> None:
        super().start(cluster, rng)

    def frag_of(self, gpu: np.ndarray, cpu: np.ndarray, mem: np.ndarray, model: np.ndarray) -> np.ndarray:
        if self.measure == "fgd":
            base = super().frag_of(gpu, cpu, mem, model)
        elif self.measure == "fluid":
            base = fluid_fragmentation_batch(gpu, cpu, self.workload, mem, self.access[model])
        else:  # both
            base = super().frag_of(gpu, cpu, mem, model) + self.beta * fluid_fragmentation_batch(
                gpu, cpu, self.workload, mem, self.access[model])
        total = gpu.sum(axis=1).astype(np.float64)
        stranded = np.zeros_like(total)
        if self.cpu_per_gpu > 0:
            stranded = np.maximum(stranded, total - cpu / self.cpu_per_gpu)
        if self.mem_per_gpu > 0:
            stranded = np.maximum(stranded, total - mem / self.mem_per_gpu)
        return base + self.alpha * stranded

    def score_states(self, sids: np.ndarray, task) -> tuple[np.ndarray, np.ndarray]:  # type: ignore[override]
        d, valid = self.deltas(sids, task)
        s = np.where(valid, np.floor(self.resolution / (1.0 + np.exp(d / 1000.0))), -1.0)
        pick = np.argmax(s, axis=1)
        best = s[np.arange(len(s)), pick]
        if self.tie == "bestfit":
            st = self.cluster.states
            left = ((st.cpu[sids] - task.cpu_milli) / 128000 + (st.gpu[sids].sum(axis=1) - task.total_milli) / 8000) / 2
            best = best + 0.5 * (1.0 - np.clip(left, 0, 1))
        elif self.tie == "used":
            st = self.cluster.states
            used = (st.gpu[sids].sum(axis=1) < st.ngpu[sids] * 1000) | (task.num_gpu == 0)
            best = best + 0.5 * used
        elif self.tie == "cpu":
            st = self.cluster.states
            total = st.gpu[sids].sum(axis=1) - task.total_milli
            excess = (st.cpu[sids] - task.cpu_milli) - total * self.cpu_per_gpu
            best = best + 0.5 * (1.0 / (1.0 + np.exp(-excess / 16000.0)))
        from scheduling.sim.policies import is_shared
        return best, (pick if is_shared(task) else np.full(len(s), -1))
