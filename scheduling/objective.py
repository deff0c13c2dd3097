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

The total is a sum of local terms (one per placement, per owned node, per used instance), so
`improve` can price a move by re-scoring only what the move touched.

`end_state_cost` scores the same money, waiting and instances, but each owned node by the measure
of the state the answer leaves it in (how shares split its GPUs, its CPU and memory as placed).
The engine keeps the MILP's or greedy's answer by it: under the linear term the MILP's answer won
cycles where its shares left slivers that greedy's did not (share-heavy list, seed 42, GPUs left
unallocated at 130%: 740.4 keeping by `evaluate`, 735.7 by the end state; scheduling/engine.py).
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

from scheduling.book import Book, Instance, launch_id
from scheduling.capacity import NodeCapacity
from scheduling.model import WHOLE_GPU_MILLI, JobDemand, Placement
from scheduling.patterns import stranded_gpus, stranding_coefficients
from scheduling.problem import Problem


class Score(NamedTuple):
    """`evaluate`'s terms: money, waiting and instances (`jobs`, what `end_state_cost` shares), the
    host costs of the placements' parts on owned nodes, and the owned nodes' linear term."""
    jobs: float
    hosts: float
    nodes: float

    @property
    def total(self) -> float:
        return self.jobs + self.hosts + self.nodes


def evaluate(problem: Problem, book: Book, original: list[NodeCapacity] | None = None) -> float:
    return score(problem, book, original).total


def score(problem: Problem, book: Book, original: list[NodeCapacity] | None = None) -> Score:
    jobs, hosts = _jobs_and_instances_cost(problem, book)
    return Score(jobs, hosts, owned_nodes_cost(problem, original, book.caps) if original is not None else 0.0)


def end_state_cost(problem: Problem, book: Book, positions: Sequence[int], jobs: float | None = None) -> float:
    """Money, waiting and instances as `evaluate` (`jobs`: its `Score.jobs` for this book, when
    already summed); plus, over the owned nodes at `positions`, the fragmentation weight x
    (stranded GPUs + fragmentation measure) of the state the answer leaves them in. Two answers
    are compared over the nodes they leave in different states: the others, and every node's
    state before the cycle, add the same to both."""
    total = jobs if jobs is not None else _jobs_and_instances_cost(problem, book)[0]
    weight = problem.weights["fragmentation"]
    if not weight or not positions:
        return total
    caps = [book.caps[position] for position in positions]
    alpha, cpu_ratio, mem_ratio = stranding_coefficients(problem.workload)
    if alpha:
        total += weight * alpha * sum(stranded_gpus(sum(cap.free_milli), cap.free_cpu, cap.free_mem, cpu_ratio,
                                                    mem_ratio) for cap in caps)
    if problem.workload is not None:
        total += weight * _fragmentation_sum(caps, problem.workload, [list(cap.free_milli) for cap in caps])
    return total


def _jobs_and_instances_cost(problem: Problem, book: Book) -> tuple[float, float]:
    """The money of each placed job of the cycle, the waiting cost of each one left pending and
    the instances the answer uses; and, apart, the host costs of the placed jobs' parts."""
    total = hosts = 0.0
    placed = set()
    for job_id, placement in book.placements.items():
        job = problem.jobs_by_id.get(job_id)
        if job is None:
            continue
        placed.add(job_id)
        total += money_cost(problem, job, placement)
        hosts += host_cost(problem, job, placement)
    for demand_class in problem.classes:
        for job_id in demand_class.job_ids:
            if job_id not in placed:
                total += demand_class.waiting_cost
    for instance in used_instances(problem, book):
        total += instance_cost(problem, instance)
    return total, hosts


def money_cost(problem: Problem, job: JobDemand, placement: Placement) -> float:
    """Dollars at the price the placement recorded, for the run time on its GPU model (weighted)."""
    return problem.weights["money"] * placement.price_per_hour * problem.pricing.runtime_hours(job, placement.gpu_model)


def placement_cost(problem: Problem, job: JobDemand, placement: Placement) -> float:
    """`money_cost` plus `host_cost`: what the placement adds to `evaluate`."""
    return money_cost(problem, job, placement) + host_cost(problem, job, placement)


def host_cost(problem: Problem, job: JobDemand, placement: Placement) -> float:
    """The host cost (`Candidate.host_cost`, weighted) of each part on an owned node, by the shape
    the node had when the cycle started."""
    weight = problem.weights["fragmentation"]
    if not weight:
        return 0.0
    class_index = problem.class_of.get(job.job_id)
    if class_index is None:
        return 0.0
    shape_of = shape_of_node(problem)
    costs = _host_costs_of_class(problem, class_index)
    return sum(weight * costs.get(shape_of[part.node_id], 0.0) for part in placement.parts
               if part.launch_id is None and part.node_id in shape_of)


def instance_cost(problem: Problem, instance: Instance) -> float:
    """A used instance pays its launch overhead and half the price of the GPUs it leaves idle over
    the reference run time."""
    target = problem.targets[instance.target]
    idle = sum(1 for m in instance.cap.free_milli if m >= WHOLE_GPU_MILLI)
    overhead = problem.snapshot.weights.launch_overhead_hours * target.instance_price
    waste = idle * target.node.price_per_gpu_hour * problem.reference_hours
    return problem.weights["money"] * (overhead + 0.5 * waste)


def used_instances(problem: Problem, book: Book) -> list[Instance]:
    used: set[tuple[str, int]] = set()
    for placement in book.placements.values():
        for part in placement.parts:
            if part.launch_id is not None:
                used.add((part.launch_id, part.instance))
    return [instance for instance in book.instances
            if (launch_id(problem.targets[instance.target]), instance.number) in used]


def owned_nodes_cost(problem: Problem, original: list[NodeCapacity], caps: list[NodeCapacity]) -> float:
    """Fragmentation weight x (stranding change + FGD change from whole GPUs taken) over the owned
    nodes, `original` being their capacity when the cycle started."""
    weight = problem.weights["fragmentation"]
    workload = problem.workload
    if not weight:
        return 0.0
    total = stranding_change(original, caps, workload)
    if workload is not None:
        changed = [(before, taken_vector(before, after)) for before, after in zip(original, caps)]
        changed = [(before, vector) for before, vector in changed if vector is not None]
        if changed:
            befores = [before for before, _ in changed]
            total += (_fragmentation_sum(befores, workload, [vector for _, vector in changed])
                      - _fragmentation_sum(befores, workload, [list(c.free_milli) for c in befores]))
    return weight * total


def owned_node_cost(problem: Problem, before: NodeCapacity, after: NodeCapacity) -> float:
    """`owned_nodes_cost` of one node."""
    return owned_nodes_cost(problem, [before], [after])


def taken_vector(before: NodeCapacity, after: NodeCapacity) -> list[int] | None:
    """The node's free milli before the cycle with the whole GPUs the cycle took zeroed (the
    first ones, so the value does not depend on which); None when it took none."""
    taken = sum(1 for b, a in zip(before.free_milli, after.free_milli) if b >= WHOLE_GPU_MILLI and a < WHOLE_GPU_MILLI)
    if not taken:
        return None
    vector = list(before.free_milli)
    for position in [p for p, m in enumerate(vector) if m >= WHOLE_GPU_MILLI][:taken]:
        vector[position] = 0
    return vector


def stranding_change(original: list[NodeCapacity], caps: list[NodeCapacity], workload) -> float:
    """alpha x (stranded GPUs after - before), summed over the owned nodes the cycle changed
    (`patterns.stranded_gpus`, free totals of each node)."""
    alpha, cpu_ratio, mem_ratio = stranding_coefficients(workload)
    if not alpha:
        return 0.0
    total = 0.0
    for before, after in zip(original, caps):
        if before.same_free(after):
            continue
        total += (stranded_gpus(sum(after.free_milli), after.free_cpu, after.free_mem, cpu_ratio, mem_ratio)
                  - stranded_gpus(sum(before.free_milli), before.free_cpu, before.free_mem, cpu_ratio, mem_ratio))
    return alpha * total


def shape_of_node(problem: Problem) -> dict[str, int]:
    shape_of = getattr(problem, "_shape_of_node", None)
    if shape_of is None:
        shape_of = {problem.capacities[p].node.id: t for t, target in enumerate(problem.targets)
                    if target.kind == "node" for p in target.members}
        problem._shape_of_node = shape_of  # type: ignore[attr-defined]
    return shape_of


def _host_costs_of_class(problem: Problem, class_index: int) -> dict[int, float]:
    cache = getattr(problem, "_host_costs_by_class", None)
    if cache is None:
        cache = problem._host_costs_by_class = {}  # type: ignore[attr-defined]
    costs = cache.get(class_index)
    if costs is None:
        costs = cache[class_index] = {c.target: c.host_cost for c in problem.classes[class_index].candidates}
    return costs


def _fragmentation_sum(caps: list[NodeCapacity], workload, vectors: list[list[int]]) -> float:
    """Fragmentation measure (GPUs, `patterns.node_cost_batch`) of the nodes `caps` with free milli
    `vectors`, CPU and memory as `caps` have them; one vectorised call instead of one per node."""
    import numpy as np

    from scheduling.patterns import node_cost_batch

    width = max(1, max(len(cap.free_milli) for cap in caps))
    gpu_free = np.zeros((len(caps), width), dtype=np.int64)
    for row, vector in enumerate(vectors):
        gpu_free[row, : len(vector)] = vector
    cpu = np.array([cap.free_cpu for cap in caps], dtype=np.int64)
    mem = np.array([cap.free_mem for cap in caps], dtype=np.int64)
    models = [cap.node.gpus[0].model if cap.node.gpus else "" for cap in caps]
    return float(node_cost_batch(gpu_free, cpu, models, workload, mem).sum())
