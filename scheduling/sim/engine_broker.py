"""``whalezen-broker``: the FGD protocol driven by the core engine itself, as the broker runs it.

Every ``every`` arrivals the batch becomes the pending jobs of a :class:`Snapshot` of the whole
cluster (every GPU's used share, free CPU and memory, every task placed so far as a running,
checkpointable allocation, the task mix as the fragmentation workload, no cloud offers), and
``scheduling.engine.schedule`` decides; its migrations and placements are applied to the array
cluster (which re-checks every one); whatever it leaves pending is dropped, as in the protocol.
With ``movable`` each placed task carries the demand it would be placed again with, so the engine's
defragmentation can move it; a task that the engine moved others for then stays pending as in the
broker, whose next cycle (run here at once, before anything else arrives) starts it on the room the
moves made (``bench.fragmentation``'s default since 2026-12-07). Without it nothing can be moved
(``--no-broker-defrag``, the harness before that day). Slow compared
with :mod:`scheduling.sim.broker` (a 1,213-node snapshot per cycle: 100 s per seed on 2026-11-29,
140-230 s on 2026-12-07).
"""

from __future__ import annotations

from collections import Counter
from typing import Callable, Sequence

import numpy as np

from scheduling.fragmentation import Workload
from scheduling.model import (
    GpuState, JobDemand, NodeState, Plan, Policy, RunningAllocation, Snapshot, WorkloadClass,
)
from scheduling.sim.cluster import MILLI, ArrayCluster, TaskSpec
from scheduling.sim.protocol import ProtocolRun

GPU_MEMORY_MB = 16_384
# Cycles run at once for tasks that the engine moved others for (each may plan more moves).
FOLLOW_UP_CYCLES = 2


def _demand(idx: int, t: TaskSpec) -> JobDemand:
    """Task ``idx`` as the engine sees it: pending, and when placed the demand it is moved with."""
    return JobDemand(f"t{idx}", gpus=t.num_gpu, gpu_milli=t.gpu_milli if t.num_gpu else MILLI,
                     allowed_models=tuple(sorted(t.gpu_models)) if t.gpu_models else (),
                     cpu_milli=t.cpu_milli, memory_mb=t.memory_mib, submitted_at=float(idx))


def _snapshot(cluster: ArrayCluster, batch: Sequence[tuple[int, TaskSpec]],
              placed: dict[int, tuple[TaskSpec, int, list[int]]], workload: tuple[WorkloadClass, ...],
              seed: int, task_mix: tuple[WorkloadClass, ...] = (), movable: bool = False) -> Snapshot:
    nodes = []
    for i, spec in enumerate(cluster.nodes):
        gpus = tuple(GpuState(g, f"{spec.name}-{g}", spec.model, GPU_MEMORY_MB, GPU_MEMORY_MB,
                              milli_used=int(MILLI - cluster.gpu_free[i, g])) for g in range(spec.num_gpu))
        nodes.append(NodeState(spec.name, spec.name, gpus, spec.cpu_milli, spec.memory_mib,
                               int(cluster.cpu_free[i]), int(cluster.mem_free[i]), price_per_gpu_hour=1.0))
    # Every placed task is a checkpointable job that has run long enough to be moved; only with its
    # demand (``movable``) may the engine's defragmentation move it to make room for a blocked task.
    running = tuple(RunningAllocation(f"t{idx}", cluster.names[node], tuple(gpus), gpu_milli=t.gpu_milli or MILLI,
                                      preemptible=True, checkpointable=True, run_seconds=1e6,
                                      checkpoint_age_s=0.0, cpu_milli=t.cpu_milli, memory_mb=t.memory_mib,
                                      demand=_demand(idx, t) if movable else None)
                    for idx, (t, node, gpus) in sorted(placed.items()) if t.num_gpu > 0)
    pending = tuple(_demand(idx, t) for idx, t in batch)
    return Snapshot(now=0.0, nodes=tuple(nodes), pending=pending, running=running, workload=workload, seed=seed,
                    task_mix=task_mix)


def task_mix_of(tasks: Sequence[TaskSpec]) -> tuple[WorkloadClass, ...]:
    """The whole list as classes with their counts, memory and rare classes included (the
    engine's scarce-homes term; the typical-task workload drops both)."""
    counts = Counter((t.num_gpu, t.gpu_milli, t.cpu_milli, t.memory_mib, tuple(sorted(t.gpu_models or ())))
                     for t in tasks if t.num_gpu > 0)
    return tuple(WorkloadClass(gpus, milli, float(n), cpu, mem, models)
                 for (gpus, milli, cpu, mem, models), n in sorted(counts.items()))


def run_engine_broker(cluster: ArrayCluster, arrivals: Sequence[TaskSpec], workload: Workload,
                      every: int = 64, seed: int = 0, policy: Policy | None = None,
                      schedule: Callable[[Snapshot, Policy | None], Plan] | None = None,
                      tasks: Sequence[TaskSpec] | None = None, movable: bool = False) -> ProtocolRun:
    """``tasks``: the whole task list, for the engine's scarce-homes term (without it the engine
    derives it from the typical-task workload, which has no rare class). ``movable``: placed tasks
    carry their demand, so the engine's defragmentation may move them."""
    if schedule is None:
        from scheduling.engine import schedule as engine_schedule
        schedule = engine_schedule
    cluster.reset()
    index = {n: i for i, n in enumerate(cluster.names)}
    wl = tuple(WorkloadClass(c.num_gpu, c.gpu_milli or MILLI, c.weight, c.cpu_milli, c.memory_mib,
                             tuple(sorted(c.gpu_models)) if c.gpu_models else ()) for c in workload.classes)
    mix = task_mix_of(tasks) if tasks is not None else ()
    placed: dict[int, tuple[TaskSpec, int, list[int]]] = {}
    migrations = 0

    def apply(plan: Plan, batch: list[tuple[int, TaskSpec]]) -> list[tuple[int, TaskSpec]]:
        """Apply a plan's migrations (source first, then target) and placements; return the batch's
        tasks that migrations were planned for and that are still waiting."""
        nonlocal migrations
        for m in plan.migrations:
            idx = int(m.job_id[1:])
            task, node, gpus = placed.pop(idx)
            cluster.release(node, gpus, task)
            dest = index[m.to.node_id]  # type: ignore[index]
            cluster.place(dest, list(m.to.gpu_indices), task)
            placed[idx] = (task, dest, list(m.to.gpu_indices))
            migrations += 1
        by_index = dict(batch)
        for p in plan.placements:
            idx = int(p.job_id[1:])
            node = index[p.parts[0].node_id]  # type: ignore[index]
            gpus = list(p.parts[0].gpu_indices) if by_index[idx].num_gpu else []
            cluster.place(node, gpus, by_index[idx])
            placed[idx] = (by_index[idx], node, gpus)
        helped = {int(m.for_job_id[1:]) for m in plan.migrations if m.for_job_id and m.reason == "defragmentation"}
        return [(idx, t) for idx, t in batch if idx in helped and idx not in placed]

    batch: list[tuple[int, TaskSpec]] = []
    for i, t in enumerate(arrivals):
        batch.append((i, t))
        if len(batch) < every and i < len(arrivals) - 1:
            continue
        helped = apply(schedule(_snapshot(cluster, batch, placed, wl, seed, mix, movable), policy), batch)
        # The broker keeps a task that others were moved for pending, and its next cycle (here at
        # once, before anything else arrives) starts it on the room the moves made; what is still
        # left then is dropped, as in the protocol.
        for _ in range(FOLLOW_UP_CYCLES):
            if not helped:
                break
            helped = apply(schedule(_snapshot(cluster, helped, placed, wl, seed, mix, movable), policy), helped)
        batch = []
    demand = np.array([t.total_milli for t in arrivals], dtype=np.float64)
    got = np.zeros(len(arrivals))
    for idx in placed:
        got[idx] = demand[idx]
    total = cluster.total_gpu_milli
    run = ProtocolRun(100.0 * np.cumsum(demand) / total, 100.0 * np.cumsum(got) / total)
    run.dropped = len(arrivals) - len(placed)
    run.migrations = migrations
    # where each placed task ended (after any migration), for an independent replay
    run.placements = [(task.name, node, list(gpus)) for _, (task, node, gpus) in sorted(placed.items())]
    return run
