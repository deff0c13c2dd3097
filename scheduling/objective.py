"""One objective for every method, evaluated on concrete placements.

The MILP answer (after mapping and repair), the greedy answer and the exact per-node answer are
all scored here, so "which is better" and the optimality gap compare like with like:

    money * dollars of placed jobs (+ launch overhead and half the idle GPUs of each instance)
  + fragmentation * FGD increase of each owned node from the whole GPUs this cycle took from it
  + waiting cost of every job left pending

The fragmentation term is the linear one the MILPs optimise: a node's FGD measure (expected free
GPU capacity the task mix cannot use, `scheduling.fragmentation`) after the GPUs that were whole
and free before the cycle and are not any more (taken by gangs or opened for shares) are taken
away, minus before. Exact FGD of the final node state also depends on how shares split a GPU and
on CPU left, which no linear model can carry; scoring the same linear term everywhere keeps the
exact model's optimum a true lower bound for the others (the optimality gap is never negative).
"""

from __future__ import annotations

from scheduling.book import Book, launch_id
from scheduling.capacity import NodeCapacity
from scheduling.model import WHOLE_GPU_MILLI
from scheduling.patterns import to_workload
from scheduling.problem import Problem, workload_classes


def evaluate(problem: Problem, book: Book, original: list[NodeCapacity] | None = None) -> float:
    weights = problem.weights
    pricing = problem.pricing
    total = 0.0
    placed = set()
    for job_id, placement in book.placements.items():
        job = problem.jobs_by_id.get(job_id)
        if job is None:
            continue
        placed.add(job_id)
        # Dollars at the price the placement recorded, for the run time on its GPU model.
        total += weights["money"] * placement.price_per_hour * pricing.runtime_hours(job, placement.gpu_model)
    for demand_class in problem.classes:
        for job_id in demand_class.job_ids:
            if job_id not in placed:
                total += demand_class.waiting_cost
    workload = to_workload(workload_classes(problem.snapshot))
    if original is not None and weights["fragmentation"] and workload is not None:
        before_caps, after_vectors = [], []
        for before, after in zip(original, book.caps):
            taken = sum(1 for b, a in zip(before.free_milli, after.free_milli)
                        if b >= WHOLE_GPU_MILLI and a < WHOLE_GPU_MILLI)
            if taken:
                vector = list(before.free_milli)
                for position in [p for p, m in enumerate(vector) if m >= WHOLE_GPU_MILLI][:taken]:
                    vector[position] = 0
                before_caps.append(before)
                after_vectors.append(vector)
        if before_caps:
            total += weights["fragmentation"] * (
                _fragmentation_sum(before_caps, workload, after_vectors)
                - _fragmentation_sum(before_caps, workload, [list(c.free_milli) for c in before_caps]))
    used_instances: set[tuple[str, int]] = set()
    for placement in book.placements.values():
        for part in placement.parts:
            if part.launch_id is not None:
                used_instances.add((part.launch_id, part.instance))
    for instance in book.instances:
        target = problem.targets[instance.target]
        if (launch_id(target), instance.number) not in used_instances:
            continue
        idle = sum(1 for m in instance.cap.free_milli if m >= WHOLE_GPU_MILLI)
        overhead = problem.snapshot.weights.launch_overhead_hours * target.instance_price
        waste = idle * target.node.price_per_gpu_hour * problem.reference_hours
        total += weights["money"] * (overhead + 0.5 * waste)
    return total


def _fragmentation_sum(caps: list[NodeCapacity], workload, vectors: list[list[int]]) -> float:
    """FGD (GPUs) of the nodes `caps` with free milli `vectors`, CPU as the cycle found it; one
    vectorised call instead of `node_fragmentation_gpus` per node."""
    import numpy as np

    from scheduling.fragmentation import fragmentation_batch

    width = max(1, max(len(cap.free_milli) for cap in caps))
    gpu_free = np.zeros((len(caps), width), dtype=np.int64)
    for row, vector in enumerate(vectors):
        gpu_free[row, : len(vector)] = vector
    cpu = np.array([cap.free_cpu for cap in caps], dtype=np.int64)
    models = [cap.node.gpus[0].model if cap.node.gpus else "" for cap in caps]
    access = workload.model_access(models)
    return float(fragmentation_batch(gpu_free, cpu, workload, None, access).sum()) / WHOLE_GPU_MILLI
