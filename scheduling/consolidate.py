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

When the owned capacity has room for an instance's lone job in total but not on any one node (it is
fragmented), the job is brought home by defragmenting first (`_home_by_defragmenting`): the fewest
movable jobs of one owned node are moved to other owned nodes (what-if placed there first) and the
instance's job takes the room they leave, all in one plan, the movers listed first. It must pay
the same way, with every mover's restart priced at the instance's price per GPU, and it may not
leave more owned GPUs split between jobs than it found (`defrag.splits_more`). Measured in
bench.fairshare: owned GPUs stood idle in fragments while 8-GPU jobs rented whole instances for
days.

The emptied instance is then idle: releasing idle instances is the provisioner's job.
"""

from __future__ import annotations

from dataclasses import replace

from scheduling.book import Book
from scheduling.capacity import NodeCapacity, PartDemand
from scheduling.model import WHOLE_GPU_MILLI, Migration, PlacementPart, RunningAllocation
from scheduling.problem import Problem
from scheduling.quota import quota_governed
from scheduling.defrag import NODES_TRIED, replace_elsewhere, splits_more
from scheduling.whatif import (
    can_move, could_ever_fit, fits_on, minimal_victims, release, remaining_run_s, running_by_node,
)

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
        remaining = [remaining_run_s(problem, source, a) for a in allocations]
        if any(not can_move(a, policy) or a.job_id in busy for a in allocations) \
                or min(remaining) < policy.min_remaining_to_move_s:
            continue
        moves = _land_elsewhere(problem, book, source, allocations, draining, plugins)
        if moves is None:
            home = (_home_by_defragmenting(problem, book, source, allocations[0], remaining[0], busy,
                                           budget - len(plan), plugins) if len(allocations) == 1 else [])
            if home:
                draining.add(source)
                plan += home
            continue
        if not _pays(problem, source, allocations, moves, remaining):
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


def _home_by_defragmenting(problem: Problem, book: Book, source: int, allocation: RunningAllocation,
                           remaining_s: float, busy: set[str], budget: int, plugins) -> list[Migration]:
    """Moves that free room on one owned node for the instance's lone job, then its own move there
    (module docstring); [] when none pays or fits the budget. `busy` gains every job moved."""
    if budget < 2:
        return []
    policy = problem.policy
    demand = replace(allocation.demand, job_id=allocation.job_id)  # type: ignore[arg-type]
    caps = book.caps
    owned_positions = [p for p, cap in enumerate(caps) if not cap.node.rented and cap.schedulable
                       and could_ever_fit(problem, demand, cap, p, plugins)]
    model = caps[owned_positions[0]].node.gpus[0].model if owned_positions and caps[owned_positions[0]].node.gpus else ""
    need = problem.pricing.gpu_share(demand, model)
    if not owned_positions or sum(sum(caps[p].free_milli) for p in owned_positions) / WHOLE_GPU_MILLI + 1e-9 < need:
        return []  # the room is not there at all
    by_node = running_by_node(problem)
    options = []
    for position in owned_positions:
        # As for defragmentation: never a job above the one it makes room for.
        movable = [a for a in by_node.get(position, []) if a.job_id not in busy
                   and can_move(a, policy, allocation.priority)]
        if not movable:
            continue
        found = minimal_victims(problem, demand, book, position, movable, plugins)
        if found is None or len(found[0]) + 1 > budget or not _quota_admits(problem, book, demand, found[1], found[2]):
            continue
        options.append((len(found[0]), sum(a.lost_work_s for a in found[0]), caps[position].node.id, position, found))
    node = problem.capacities[source].node
    for _, _, _, position, (movers, target, part, positions) in sorted(options)[:NODES_TRIED]:
        destinations = replace_elsewhere(problem, book, position, movers, owned_only=True)
        if destinations is None or splits_more(book, position, movers, part, positions, destinations):
            continue
        if not _pays(problem, source, [allocation], [(position, part, positions)], [remaining_s], movers):
            return []
        cap = caps[position]
        plan = []
        for mover, (to_position, to_part, to_positions) in zip(movers, destinations):
            release(cap, mover)
            destination = caps[to_position]
            destination.take(to_positions, to_part)
            book.refresh_node(to_position)
            busy.add(mover.job_id)
            plan.append(Migration(job_id=mover.job_id, from_node_id=cap.node.id, reason="defragmentation",
                                  for_job_id=allocation.job_id,
                                  to=PlacementPart(gpu_indices=destination.gpu_indices(to_positions),
                                                   gpu_milli=to_part.milli, node_id=destination.node.id)))
        cap.take(positions, part)
        book.refresh_node(position)
        if book.quota is not None and quota_governed(cap.node):
            book.quota.charge(demand, target.gpu_model, _share(part))
        busy.add(allocation.job_id)
        plan.append(Migration(job_id=allocation.job_id, from_node_id=node.id, reason="cheaper",
                              to=PlacementPart(gpu_indices=cap.gpu_indices(positions), gpu_milli=part.milli,
                                               node_id=cap.node.id)))
        return plan
    return []


def _quota_admits(problem: Problem, book: Book, demand, target, part: PartDemand) -> bool:
    """The move onto owned capacity keeps the job's team within its quota of owned GPUs."""
    if book.quota is None or not quota_governed(target.rep.node):
        return True
    return book.quota.admits(demand, target.gpu_model, _share(part), borrowing=problem.ctx.borrowing)


def _moved_cost(problem: Problem, source: int, allocation: RunningAllocation, position: int, part: PartDemand,
                remaining_s: float) -> float:
    """What the job costs to finish on owned node `position` (its rate, at that node's speed)."""
    destination = problem.capacities[position].node
    here = _model_of(problem.capacities[source].node, allocation.gpu_indices)
    there = destination.gpus[0].model if destination.gpus else ""
    pricing = problem.pricing
    left_there_h = remaining_s / 3600.0 * pricing.speed(allocation.demand, here) / max(
        pricing.speed(allocation.demand, there), 1e-9)
    return _share(part) * destination.price_per_gpu_hour * left_there_h


def _utilisation(cap: NodeCapacity) -> float:
    total = len(cap.node.gpus) * WHOLE_GPU_MILLI
    return (total - sum(cap.free_milli)) / total if total else 1.0


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
          moves: list[tuple[int, PartDemand, tuple[int, ...]]], remaining: list[float],
          movers: list[RunningAllocation] = ()) -> bool:  # type: ignore[assignment]
    """Keeping the instance costs its price until its longest job ends; moving costs each job's
    GPUs where it lands for the rest of its work at that node's speed (owned nodes at their rate;
    free GPUs of an instance that stays are paid already), plus the restarts (of `movers` too: owned
    jobs moved to make room), each at the instance's price per GPU. Comparing hourly prices instead
    moved a lone long job off an 8 x A100 spot instance onto a slower on-prem V100 that cost more to
    finish it."""
    node = problem.capacities[source].node
    keep = node.price_per_gpu_hour * len(node.gpus) * max(remaining) / 3600.0
    move = sum(_moved_cost(problem, source, allocation, position, part, left_s)
               for allocation, (position, part, _), left_s in zip(allocations, moves, remaining)
               if not problem.capacities[position].node.rented and allocation.demand is not None)
    restarts = sum(a.restart_cost_s / 3600.0 * len(a.gpu_indices) * node.price_per_gpu_hour
                   for a in [*allocations, *movers])
    return keep - move > restarts


def _model_of(node, gpu_indices: tuple[int, ...]) -> str:
    return next((g.model for g in node.gpus if g.index in gpu_indices), "")


def _share(part: PartDemand) -> float:
    return part.gpus * min(part.milli, WHOLE_GPU_MILLI) / WHOLE_GPU_MILLI if part.gpus else 0.0

