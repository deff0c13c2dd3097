"""``whalezen-batch`` in the FGD protocol: the broker's cycles (one per N arrivals) decided in the
simulator's arrays with the ``whalezen-online`` score; ``whalezen-broker`` (``engine_broker``)
runs the same cycles through the engine itself.

A cycle sees every task that arrived since the last one.  It places them in arrival order with the
``whalezen-online`` score (``order="hardest"``, most GPU then most CPU first, the classic batch
heuristic, measured worse with that score: 248.1 against 239.4 GPUs unallocated on seeds 42-44;
smallest first 257.0), then, for tasks that still fit nowhere, plans defragmentation: on the
few nodes closest to fitting the blocked task it evicts the smallest running tasks until the
blocked one fits, and keeps the plan only if every evicted task is placed again elsewhere
(simulated before committing, exactly like the engine's defragmentation planner); at most
``max_moves`` migrations per cycle and ``max_victims`` per blocked task.  A task still blocked is
dropped (its demand counts as arrived), as in the online protocol.

Allocation is recorded per arrival as the demand of the tasks that had arrived by then and were
placed by their cycle, so the curve is comparable with the online policies; the broker's edge is
that a cycle decides with up to N arrivals in view.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from scheduling.fragmentation import Workload
from scheduling.sim.cluster import MILLI, ArrayCluster, TaskSpec
from scheduling.sim.policies import Policy, choose_gpus
from scheduling.sim.protocol import ProtocolRun
from scheduling.sim.whalezen import WhaleZenOnline

Running = dict[int, list[tuple[int, TaskSpec, list[int]]]]  # node -> (arrival index, task, gpus)


class Broker:
    def __init__(self, cluster: ArrayCluster, policy: Policy, max_moves: int = 8,
                 max_victims: int = 4, candidates: int = 8, order: str = "arrival") -> None:
        self.cluster = cluster
        self.policy = policy
        self.max_moves = max_moves
        self.max_victims = max_victims
        self.candidates = candidates
        self.order = order
        self.running: Running = {}
        self.placed_at: dict[int, int] = {}  # arrival index -> node
        self.migrations = 0

    # ------------------------------------------------------------------------------ bookkeeping

    def _place(self, idx: int, task: TaskSpec, node: int, gpus: list[int]) -> None:
        self.cluster.place(node, gpus, task)
        self.policy.observe(node, gpus, task)
        self.running.setdefault(node, []).append((idx, task, gpus))
        self.placed_at[idx] = node

    def _remove(self, idx: int, node: int) -> tuple[TaskSpec, list[int]]:
        entries = self.running[node]
        for k, (i, task, gpus) in enumerate(entries):
            if i == idx:
                del entries[k]
                self.cluster.release(node, gpus, task)
                del self.placed_at[idx]
                return task, gpus
        raise KeyError(idx)

    # ----------------------------------------------------------------------------------- cycle

    def cycle(self, batch: Sequence[tuple[int, TaskSpec]]) -> None:
        if self.order == "hardest":
            order = sorted(batch, key=lambda it: (-it[1].total_milli, -it[1].cpu_milli, it[0]))
        else:  # arrival
            order = list(batch)
        blocked: list[tuple[int, TaskSpec]] = []
        for idx, task in order:
            d = self.policy.choose(task)
            if d is None:
                blocked.append((idx, task))
            else:
                self._place(idx, task, d[0], d[1])
        moves = 0
        for idx, task in blocked:
            if moves >= self.max_moves or task.total_milli == 0:
                continue
            moves += self.defragment(idx, task, self.max_moves - moves)

    def _shortfall(self, task: TaskSpec) -> np.ndarray:
        """How far each node is from fitting ``task`` (inf where it never could)."""
        c = self.cluster
        never = (c.cpu_cap < task.cpu_milli) | (c.mem_cap < task.memory_mib) | (c.ngpu < task.num_gpu)
        never |= ~c.model_ok(task)[c.model]
        cpu = np.maximum(0, task.cpu_milli - c.cpu_free) / 1000.0
        mem = np.maximum(0, task.memory_mib - c.mem_free) / 4096.0
        usable = (c.gpu_free >= max(task.gpu_milli, 1)).sum(axis=1)
        gpu = np.maximum(0, task.num_gpu - usable) * 10.0
        return np.where(never, np.inf, cpu + mem + gpu)

    def defragment(self, idx: int, task: TaskSpec, budget: int) -> int:
        """Try to make room for a blocked task; return the number of migrations committed."""
        short = self._shortfall(task)
        finite = np.flatnonzero(np.isfinite(short))
        if len(finite) == 0:
            return 0
        cands = finite[np.argsort(short[finite], kind="stable")[: self.candidates]]
        for node in (int(n) for n in cands):
            moved = self._try_node(idx, task, node, min(budget, self.max_victims))
            if moved:
                self.migrations += moved
                return moved
        return 0

    def _victim_order(self, task: TaskSpec, node: int) -> list[tuple[int, TaskSpec, list[int]]]:
        """Running tasks of ``node`` in the order that best closes the gap for ``task``.

        Short of GPUs: empty the least-used partially used GPUs first (moving a 0.3-GPU task frees a
        whole GPU for a 1-GPU task).  Short of CPU or memory: move the tasks with the most CPU per
        GPU first (CPU-only tasks can run on any node with spare cores).
        """
        c = self.cluster
        entries = self.running.get(node, [])
        usable = int((c.gpu_free[node] >= max(task.gpu_milli, 1)).sum())
        if task.num_gpu > usable:
            used = MILLI - c.gpu_free[node]
            gpu_rank = {int(g): r for r, g in enumerate(np.argsort(np.where(used > 0, used, 10 * MILLI),
                                                                   kind="stable"))}
            key = lambda e: (min((gpu_rank[g] for g in e[2]), default=99), e[1].total_milli, e[0])  # noqa: E731
        else:
            key = lambda e: (-(e[1].cpu_milli / (e[1].total_milli + 100)), e[0])  # noqa: E731
        return sorted(entries, key=key)

    def _try_node(self, idx: int, task: TaskSpec, node: int, max_victims: int) -> int:
        c = self.cluster
        evicted: list[tuple[int, TaskSpec, list[int]]] = []
        fits = False
        for i, vt, vg in self._victim_order(task, node):
            if len(evicted) >= max_victims:
                break
            if vt.num_gpu > 1 or vt.gpu_milli >= MILLI and vt.num_gpu == 1 and task.num_gpu <= 1:
                continue  # moving whole-GPU work frees nothing a smaller blocked task needs
            self._remove(i, node)
            evicted.append((i, vt, vg))
            if bool(c.fits_states(c.state[node:node + 1], task)[0]):
                fits = True
                break
        if not fits:
            self._restore(node, evicted)
            return 0
        self._place(idx, task, node, choose_gpus(c, node, task))
        replaced: list[tuple[int, int]] = []
        for i, vt, _vg in evicted:
            d = self.policy.choose(vt)
            if d is None:
                for j, n2 in replaced:  # undo: the plan does not hold
                    self._remove(j, n2)
                self._remove(idx, node)
                self._restore(node, evicted)
                return 0
            self._place(i, vt, d[0], d[1])
            replaced.append((i, d[0]))
        return len(evicted)

    def _restore(self, node: int, evicted: list[tuple[int, TaskSpec, list[int]]]) -> None:
        for i, vt, vg in evicted:
            self._place(i, vt, node, vg)


def run_broker(cluster: ArrayCluster, arrivals: Sequence[TaskSpec], workload: Workload,
               rng: np.random.Generator, every: int = 64, max_moves: int = 8,
               policy: Policy | None = None, order: str = "arrival") -> ProtocolRun:
    """Replay ``arrivals`` through the broker; same result type as :func:`run_online`."""
    cluster.reset()
    pol = policy or WhaleZenOnline(workload, powers=(10.0,))  # measured with the long horizon alone
    pol.start(cluster, rng)
    broker = Broker(cluster, pol, max_moves=max_moves, order=order)
    batch: list[tuple[int, TaskSpec]] = []
    for i, t in enumerate(arrivals):
        batch.append((i, t))
        if len(batch) >= every or i == len(arrivals) - 1:
            broker.cycle(batch)
            batch = []
    demand = np.array([t.total_milli for t in arrivals], dtype=np.float64)
    placed = np.zeros(len(arrivals))
    idx = np.fromiter(broker.placed_at.keys(), dtype=np.int64, count=len(broker.placed_at))
    placed[idx] = demand[idx]
    total = cluster.total_gpu_milli
    run = ProtocolRun(100.0 * np.cumsum(demand) / total, 100.0 * np.cumsum(placed) / total)
    run.dropped = len(arrivals) - len(broker.placed_at)
    if abs(placed.sum() - cluster.allocated_milli) > 1e-6:
        raise AssertionError("broker bookkeeping out of step with the cluster")
    return run
