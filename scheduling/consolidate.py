"""Consolidation plan: empty a rented instance when its jobs cost less elsewhere (reason "cheaper").

A rented instance (`NodeState.rented`) is paid by the hour whether its GPUs are busy or not, so a
half-empty one is the most expensive place a job can sit. Each cycle, after placements,
preemptions and defragmentation, the least utilised instances are tried first:

- nothing was placed on the instance this cycle, and every job on it is movable: checkpointable,
  preemptible, with a demand to place it again, run at least `Policy.min_run_before_move_s`,
  with at least `Policy.min_remaining_to_move_s` of its run left (a short job just finishes),
  and not already preempted or moved by this plan;
- every job lands on another node with the filters passing (owned nodes first, cheapest per
  GPU-hour, then other rented nodes, fullest first: their free GPUs are paid already);
- it pays: the instance's price until its longest job would end exceeds what the moved jobs cost
  to finish where they land (at that node's speed; owned nodes at their rate, other instances
  nothing) by more than the restart time of every moved job at the instance's price per GPU;
- at most `budget` moves per cycle (the engine passes `Policy.max_consolidation_moves`, less the
  defragmentation moves already planned, within `Policy.max_moves_per_cycle`).

The emptied instance is then idle: releasing idle instances is the provisioner's job.
"""

from __future__ import annotations

from dataclasses import replace

from scheduling.book import Book
from scheduling.capacity import NodeCapacity, PartDemand
from scheduling.model import WHOLE_GPU_MILLI, Migration, PlacementPart, RunningAllocation
from scheduling.problem import Problem
from scheduling.quota import quota_governed
from scheduling.whatif import can_move, fits_on, running_by_node

# Filters that moving a running job does not touch: it already counts against its tenant's
# quota and budget, and it launches nothing.
NOT_FOR_MOVES = frozenset({"tenant_quota", "tenant_budget", "offer_quota",
                           # a move onto owned capacity is checked against the book's quota ledger
                           # instead, so the moves of one cycle add up (`_quota_admits`)
                           "team_quota"})


def plan_consolidation(problem: Problem, book: Book, busy: set[str], budget: int) -> tuple[Migration, ...]:
    """At most `budget` migrations that empty rented instances; `busy`: jobs this plan already stops
    or moves."""
    policy = problem.policy
    if not policy.consolidation or budget <= 0:
        return ()
    by_node = running_by_node(problem)
    rented = [p for p, cap in enumerate(problem.capacities)
              if cap.node.rented and by_node.get(p) and cap.same_free(book.caps[p])]
    if not rented:
        return ()
    plugins = tuple(p for p in problem.plugins if p.name not in NOT_FOR_MOVES)
    rented.sort(key=lambda p: (_utilisation(problem.capacities[p]), problem.capacities[p].node.id))
    draining: set[int] = set()
    plan: list[Migration] = []
    for source in rented:
        allocations = by_node[source]
        if len(plan) + len(allocations) > budget:
            continue
        remaining = [_remaining_s(problem, source, a) for a in allocations]
        if any(not can_move(a, policy) or a.job_id in busy for a in allocations) \
                or min(remaining) < policy.min_remaining_to_move_s:
            continue
        moves = _land_elsewhere(problem, book, source, allocations, draining, plugins)
        if moves is None or not _pays(problem, source, allocations, moves, remaining):
            continue
        draining.add(source)
        origin = book.caps[source].node.id
        for allocation, (position, part, positions) in zip(allocations, moves):
            destination = book.caps[position]
            destination.take(positions, part)
            book.refresh_node(position)
            if book.quota is not None and quota_governed(destination.node):
                model = destination.node.gpus[positions[0]].model if positions else ""
                book.quota.charge(replace(allocation.demand, job_id=allocation.job_id), model, _share(part))
            plan.append(Migration(
                job_id=allocation.job_id, from_node_id=origin, reason="cheaper",
                to=PlacementPart(gpu_indices=destination.gpu_indices(positions), gpu_milli=part.milli,
                                 node_id=destination.node.id)))
    return tuple(plan)


def _utilisation(cap: NodeCapacity) -> float:
    total = len(cap.node.gpus) * WHOLE_GPU_MILLI
    return (total - sum(cap.free_milli)) / total if total else 1.0


def _remaining_s(problem: Problem, position: int, allocation: RunningAllocation) -> float:
    """Run time left where the job runs now: its demand's expected run at this node's speed
    (`expected_duration_hours` of a running job's demand is its run from its last start) minus
    what it has run."""
    if allocation.demand is None:
        return 0.0
    model = _model_of(problem.capacities[position].node, allocation.gpu_indices)
    return problem.pricing.runtime_hours(allocation.demand, model) * 3600.0 - allocation.run_seconds


def _land_elsewhere(problem: Problem, book: Book, source: int, allocations: list[RunningAllocation],
                    draining: set[int], plugins) -> list[tuple[int, PartDemand, tuple[int, ...]]] | None:
    """A destination for every job of `source` on the capacity left (what-if); None if any has none."""
    caps = book.caps
    order = sorted((p for p in range(len(caps)) if p != source and p not in draining and caps[p].schedulable),
                   key=lambda p: (caps[p].node.rented, caps[p].node.price_per_gpu_hour
                                  if not caps[p].node.rented else caps[p].whole_free(), caps[p].node.id))
    trial: dict[int, NodeCapacity] = {}  # copies of the destinations taken from so far
    ledger = book.quota.copy() if book.quota is not None else None  # quota use of the moves so far
    found: list[tuple[int, PartDemand, tuple[int, ...]] | None] = [None] * len(allocations)
    biggest_first = sorted(range(len(allocations)), key=lambda i: (-len(allocations[i].gpu_indices),
                                                                  allocations[i].job_id))
    for i in biggest_first:
        demand = replace(allocations[i].demand, job_id=allocations[i].job_id)  # type: ignore[arg-type]
        for position in order:
            fit = fits_on(problem, demand, trial.get(position, caps[position]), position, plugins)
            owned_model = "" if not quota_governed(caps[position].node) or fit is None else fit[0].gpu_model
            if fit is not None and ledger is not None and owned_model and not ledger.admits(
                    demand, owned_model, _share(fit[1]), borrowing=problem.ctx.borrowing):
                fit = None  # it would take its team past its quota of owned GPUs
            if fit is not None:
                _, part, positions = fit
                if ledger is not None and owned_model:
                    ledger.charge(demand, owned_model, _share(part))
                trial.setdefault(position, caps[position].copy()).take(positions, part)
                found[i] = (position, part, positions)
                break
        if found[i] is None:
            return None
    return found  # type: ignore[return-value]


def _pays(problem: Problem, source: int, allocations: list[RunningAllocation],
          moves: list[tuple[int, PartDemand, tuple[int, ...]]], remaining: list[float]) -> bool:
    """Keeping the instance costs its price until its longest job ends; moving costs each job's
    GPUs where it lands for the rest of its work at that node's speed (owned nodes at their rate;
    free GPUs of an instance that stays are paid already), plus the restarts. Comparing hourly
    prices instead moved a lone long job off an 8 x A100 spot instance onto a slower on-prem V100
    that cost more to finish it."""
    node = problem.capacities[source].node
    keep = node.price_per_gpu_hour * len(node.gpus) * max(remaining) / 3600.0
    move = 0.0
    for allocation, (position, part, _), left_s in zip(allocations, moves, remaining):
        destination = problem.capacities[position].node
        if destination.rented or allocation.demand is None:
            continue
        here = _model_of(node, allocation.gpu_indices)
        there = destination.gpus[0].model if destination.gpus else ""
        pricing = problem.pricing
        left_there_h = left_s / 3600.0 * pricing.speed(allocation.demand, here) / max(
            pricing.speed(allocation.demand, there), 1e-9)
        share = part.gpus * part.milli / WHOLE_GPU_MILLI if part.gpus else 0.0
        move += share * destination.price_per_gpu_hour * left_there_h
    restarts = sum(a.restart_cost_s / 3600.0 * len(a.gpu_indices) * node.price_per_gpu_hour for a in allocations)
    return keep - move > restarts


def _model_of(node, gpu_indices: tuple[int, ...]) -> str:
    return next((g.model for g in node.gpus if g.index in gpu_indices), "")


def _share(part: PartDemand) -> float:
    return part.gpus * min(part.milli, WHOLE_GPU_MILLI) / WHOLE_GPU_MILLI if part.gpus else 0.0

