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
from scheduling.patterns import stranded_gpus, stranding_coefficients, to_workload
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
    if weights["fragmentation"]:
        total += weights["fragmentation"] * _host_costs(problem, book)
    if original is not None and weights["fragmentation"]:
        total += weights["fragmentation"] * stranding_change(original, book.caps, workload)
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


def stranding_change(original: list[NodeCapacity], caps: list[NodeCapacity], workload) -> float:
    """alpha x (stranded GPUs after - before), summed over the owned nodes the cycle changed
    (`patterns.stranded_gpus`, free totals of each node)."""
    alpha, cpu_ratio, mem_ratio = stranding_coefficients(workload)
    if not alpha:
        return 0.0
    total = 0.0
    for before, after in zip(original, caps):
        if before.free_cpu == after.free_cpu and before.free_mem == after.free_mem \
                and before.free_milli == after.free_milli:
            continue
        total += (stranded_gpus(sum(after.free_milli), after.free_cpu, after.free_mem, cpu_ratio, mem_ratio)
                  - stranded_gpus(sum(before.free_milli), before.free_cpu, before.free_mem, cpu_ratio, mem_ratio))
    return alpha * total


def _host_costs(problem: Problem, book: Book) -> float:
    """Sum of `Candidate.host_cost` over the node-parts placed on owned nodes (by the shape each
    node had when the cycle started)."""
    shape_of = getattr(problem, "_shape_of_node", None)
    if shape_of is None:
        shape_of = {problem.capacities[p].node.id: t for t, target in enumerate(problem.targets)
                    if target.kind == "node" for p in target.members}
        problem._shape_of_node = shape_of  # type: ignore[attr-defined]
    total = 0.0
    by_class: dict[int, dict[int, float]] = {}
    for job_id, placement in book.placements.items():
        class_index = problem.class_of.get(job_id)
        if class_index is None:
            continue
        costs = by_class.get(class_index)
        if costs is None:
            costs = by_class[class_index] = {c.target: c.host_cost for c in problem.classes[class_index].candidates}
        for part in placement.parts:
            if part.launch_id is None and part.node_id in shape_of:
                total += costs.get(shape_of[part.node_id], 0.0)
    return total


def _fragmentation_sum(caps: list[NodeCapacity], workload, vectors: list[list[int]]) -> float:
    """Fragmentation measure (GPUs, `patterns.node_cost_batch`) of the nodes `caps` with free milli
    `vectors`, CPU as the cycle found it; one vectorised call instead of one per node."""
    import numpy as np

    from scheduling.patterns import node_cost_batch

    width = max(1, max(len(cap.free_milli) for cap in caps))
    gpu_free = np.zeros((len(caps), width), dtype=np.int64)
    for row, vector in enumerate(vectors):
        gpu_free[row, : len(vector)] = vector
    cpu = np.array([cap.free_cpu for cap in caps], dtype=np.int64)
    models = [cap.node.gpus[0].model if cap.node.gpus else "" for cap in caps]
    return float(node_cost_batch(gpu_free, cpu, models, workload).sum())
