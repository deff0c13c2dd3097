"""Shared what-if helpers for the preemption and defragmentation planners.

Both ask "if these running jobs left this node, would the blocked job fit?", so both need: the
node's position, the running allocations on it, a copy of its capacity with some of them
released, and the filter plugins run against that copy (model, memory, topology, price, quota).
"""

from __future__ import annotations

from typing import Callable

from scheduling.book import Book
from scheduling.capacity import NodeCapacity, PartDemand
from scheduling.model import JobDemand, RunningAllocation, WHOLE_GPU_MILLI
from scheduling.plugins import FilterPlugin, first_rejection
from scheduling.problem import Problem
from scheduling.targets import Target

# Filters about free capacity: ignored when asking "could this node ever host the job".
CAPACITY_FILTERS = frozenset({"gpu_count", "topology", "cpu_memory", "gpu_memory"})


def running_by_node(problem: Problem) -> dict[int, list[RunningAllocation]]:
    position = {cap.node.id: p for p, cap in enumerate(problem.capacities)}
    grouped: dict[int, list[RunningAllocation]] = {}
    for allocation in sorted(problem.snapshot.running, key=lambda a: a.job_id):
        if allocation.node_id in position:
            grouped.setdefault(position[allocation.node_id], []).append(allocation)
    return grouped


def can_move(allocation: RunningAllocation, policy, priority: int | None = None) -> bool:
    """A running job the planners may move: checkpointable, preemptible, with a demand to place
    it again, run at least `Policy.min_run_before_move_s`, and (when `priority` is given) not
    above it."""
    return (allocation.checkpointable and allocation.preemptible and allocation.demand is not None
            and allocation.run_seconds >= policy.min_run_before_move_s
            and (priority is None or allocation.priority <= priority))


def release(cap: NodeCapacity, allocation: RunningAllocation) -> None:
    positions = cap.positions_of(allocation.gpu_indices)
    gpu_memory = allocation.demand.min_gpu_memory_mb if allocation.demand is not None else 0
    cap.release(positions, allocation.gpu_milli, gpu_memory if allocation.gpu_milli < WHOLE_GPU_MILLI else 0,
                allocation.cpu_milli, allocation.memory_mb)


def node_target(cap: NodeCapacity, position: int) -> Target:
    return Target(key=f"whatif:{cap.node.id}", kind="node", rep=cap, count=1, members=(position,))


def fits_on(problem: Problem, job: JobDemand, cap: NodeCapacity, position: int,
            plugins: tuple[FilterPlugin, ...]) -> tuple[Target, PartDemand, tuple[int, ...]] | None:
    """Filters pass and GPUs are free on this (what-if) capacity: the target, part and GPUs."""
    target = node_target(cap, position)
    part = problem.pricing.part(job, target.gpu_model)
    if part is None or first_rejection(plugins, job, part, target, problem.ctx) is not None:
        return None
    positions = cap.choose(part)
    return None if positions is None else (target, part, positions)


def could_ever_fit(problem: Problem, job: JobDemand, cap: NodeCapacity, position: int,
                   plugins: tuple[FilterPlugin, ...] | None = None) -> bool:
    """Filters that do not depend on free capacity pass (right model, provider, price, ...)."""
    target = node_target(cap, position)
    part = problem.pricing.part(job, target.gpu_model)
    static = tuple(p for p in (problem.plugins if plugins is None else plugins) if p.name not in CAPACITY_FILTERS)
    if part is None or first_rejection(static, job, part, target, problem.ctx) is not None:
        return False
    if part.gpus == 0:
        return True
    usable = [g for g in cap.node.gpus if g.healthy and (not part.allowed_models or g.model in part.allowed_models)
              and g.memory_mb >= part.min_gpu_memory_mb]
    return len(usable) >= part.gpus


def minimal_victims(problem: Problem, job: JobDemand, book: Book, position: int,
                    movable: list[RunningAllocation], plugins: tuple[FilterPlugin, ...] | None = None,
                    cost: Callable[[RunningAllocation], float] | None = None,
                    ) -> tuple[list[RunningAllocation], Target, PartDemand, tuple[int, ...]] | None:
    """Cheapest set of `movable` jobs whose departure lets `job` fit on node `position`.

    Adds jobs in order of `cost` (default: lost work) until the job fits, then drops any that
    turn out unneeded (most expensive first), so no victim is taken without need. `plugins`: the
    filters to pass (default the policy's).
    """
    plugins = problem.plugins if plugins is None else plugins
    cost = cost or (lambda a: a.lost_work_s)
    ordered = sorted(movable, key=lambda a: (cost(a), a.job_id))
    cap = book.caps[position].copy()
    chosen: list[RunningAllocation] = []
    fit = fits_on(problem, job, cap, position, plugins)
    for allocation in ordered:
        if fit is not None:
            break
        release(cap, allocation)
        chosen.append(allocation)
        fit = fits_on(problem, job, cap, position, plugins)
    if fit is None or not chosen:
        return None
    for allocation in sorted(chosen, key=lambda a: (-cost(a), a.job_id)):
        trial = book.caps[position].copy()
        for other in chosen:
            if other is not allocation:
                release(trial, other)
        if fits_on(problem, job, trial, position, plugins) is not None:
            chosen = [a for a in chosen if a is not allocation]
    final = book.caps[position].copy()
    for allocation in chosen:
        release(final, allocation)
    fit = fits_on(problem, job, final, position, plugins)
    if fit is None:
        return None
    return chosen, fit[0], fit[1], fit[2]


def remaining_run_s(problem: Problem, position: int, allocation: RunningAllocation) -> float:
    """Run time left where the job runs now: its demand's expected run at this node's speed
    (`expected_duration_hours` of a running job's demand is its run from its last start) minus
    what it has run."""
    if allocation.demand is None:
        return 0.0
    node = problem.capacities[position].node
    model = next((g.model for g in node.gpus if g.index in allocation.gpu_indices), "")
    return problem.pricing.runtime_hours(allocation.demand, model) * 3600.0 - allocation.run_seconds
