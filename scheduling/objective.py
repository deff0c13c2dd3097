"""One objective for every method, evaluated on concrete placements.

The MILP answer (after mapping and repair), the greedy answer and the exact per-node answer are
all scored here, so "which is better" and the optimality gap compare like with like:

    money * dollars of placed jobs (+ launch overhead and half the idle GPUs of each instance)
  + fragmentation * FGD increase on the nodes touched (GPUs the task mix cannot use)
  + waiting cost of every job left pending
"""

from __future__ import annotations

from scheduling.book import Book
from scheduling.capacity import NodeCapacity
from scheduling.model import WHOLE_GPU_MILLI
from scheduling.patterns import node_fragmentation_gpus, to_workload
from scheduling.problem import Problem, workload_classes


def evaluate(problem: Problem, book: Book, original: list[NodeCapacity] | None = None) -> float:
    weights = problem.weights
    pricing = problem.pricing
    total = 0.0
    placed = set()
    targets_by_model_price = problem.targets
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
        touched = [(before, after) for before, after in zip(original, book.caps)
                   if before.free_milli != after.free_milli or before.free_cpu != after.free_cpu]
        if touched:
            total += weights["fragmentation"] * (
                _fragmentation_sum([a for _, a in touched], workload) - _fragmentation_sum([b for b, _ in touched], workload))
    used_instances: set[tuple[str, int]] = set()
    for placement in book.placements.values():
        for part in placement.parts:
            if part.launch_id is not None:
                used_instances.add((part.launch_id, part.instance))
    for instance in book.instances:
        target = targets_by_model_price[instance.target]
        from scheduling.book import launch_id
        if (launch_id(target), instance.number) not in used_instances:
            continue
        idle = sum(1 for m in instance.cap.free_milli if m >= WHOLE_GPU_MILLI)
        overhead = problem.snapshot.weights.launch_overhead_hours * target.instance_price
        waste = idle * target.node.price_per_gpu_hour * problem.reference_hours
        total += weights["money"] * (overhead + 0.5 * waste)
        empty = NodeCapacity(target.node)
        total += weights["fragmentation"] * (
            node_fragmentation_gpus(list(instance.cap.free_milli), instance.cap, workload)
            - node_fragmentation_gpus(list(empty.free_milli), empty, workload))
    return total


def _fragmentation_sum(caps: list[NodeCapacity], workload) -> float:
    """FGD of many nodes in one vectorised call (GPUs), as `node_fragmentation_gpus` one by one."""
    import numpy as np

    from scheduling.fragmentation import fragmentation_batch

    width = max(1, max(len(cap.free_milli) for cap in caps))
    gpu_free = np.zeros((len(caps), width), dtype=np.int64)
    for row, cap in enumerate(caps):
        gpu_free[row, : len(cap.free_milli)] = cap.free_milli
    cpu = np.array([cap.free_cpu for cap in caps], dtype=np.int64)
    models = [cap.node.gpus[0].model if cap.node.gpus else "" for cap in caps]
    access = workload.model_access(models)
    return float(fragmentation_batch(gpu_free, cpu, workload, None, access).sum()) / WHOLE_GPU_MILLI
