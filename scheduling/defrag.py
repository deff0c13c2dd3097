"""Defragmentation plan: move small checkpointable jobs so a blocked job gets a whole node/island.

Rules (DESIGN.md, issue 4):
- only for a job that total free capacity could hold (enough free GPUs of a model it accepts
  across all nodes) but no single node can;
- only jobs that are checkpointable, preemptible, have a demand to be placed again, have run at
  least `Policy.min_run_before_move_s`, and are not above the blocked job's priority, are moved;
- before proposing, every moved job is placed again elsewhere on the capacity left after this
  cycle (a what-if run of the greedy placer); if any cannot be, nothing is proposed;
- the plan may not leave more GPUs partly used than it found (`improve`'s rule for its own moves):
  a share moved onto a whole GPU must be paid for by a split GPU the plan fills;
- at most `Policy.max_moves_per_cycle` moves per cycle in total.
"""

from __future__ import annotations

from dataclasses import replace

from scheduling.book import Book
from scheduling.capacity import NodeCapacity, PartDemand
from scheduling.greedy import place_greedily
from scheduling.model import (
    WHOLE_GPU_MILLI, JobDemand, Migration, PlacementPart, Policy, RunningAllocation, Snapshot,
)
from scheduling.problem import Problem, build_problem, class_fields
from scheduling.whatif import can_move, could_ever_fit, minimal_victims, node_target, release, running_by_node

# Nodes tried per blocked job (fewest moves first), to bound the what-if work per cycle.
NODES_TRIED = 8
# Blocked jobs considered per cycle (highest priority, then oldest): the rest wait a cycle.
JOBS_CONSIDERED = 16


def plan_defragmentation(problem: Problem, book: Book, pending: list[str]) -> tuple[Migration, ...]:
    policy = problem.policy
    budget = policy.max_moves_per_cycle
    if budget <= 0:
        return ()
    by_node = running_by_node(problem)
    if not any(can_move(a, policy) for allocations in by_node.values() for a in allocations):
        return ()
    moved: set[str] = set()
    plan: list[Migration] = []
    # Demands (team included) that found no plan since the book last changed: an identical blocked
    # job would search the same nodes with the same movers and fail the same way.
    hopeless: set[tuple] = set()
    # Where each movable demand could go now (`_room_elsewhere`); a job with nowhere to go is
    # never taken as a victim, so the search does not spend a what-if placement on it.
    homes: dict[tuple, tuple[int, ...]] = {}
    order = sorted(pending, key=lambda j: (-problem.jobs_by_id[j].priority, problem.jobs_by_id[j].submitted_at, j))
    for job_id in order[:JOBS_CONSIDERED]:
        if len(plan) >= budget:
            break
        job = problem.jobs_by_id[job_id]
        if job.nodes > 1 or problem.classes[problem.class_of[job_id]].invalid:
            continue
        demand_key = (job.tenant,) + class_fields(job)
        if demand_key in hopeless:
            continue
        # Static filters (model, provider, price, ...) do not depend on free capacity: ask each shape once.
        compatible = sorted(p for t in problem.targets if t.kind == "node"
                            and could_ever_fit(problem, job, t.rep, t.members[0]) for p in t.members)
        model = book.caps[compatible[0]].node.gpus[0].model if compatible and book.caps[compatible[0]].node.gpus else ""
        need = problem.pricing.gpu_share(job, model)
        free_total = sum(sum(m for m in book.caps[p].free_milli) / WHOLE_GPU_MILLI for p in compatible)
        if not compatible or free_total + 1e-9 < need:
            continue  # defragmenting cannot help: the free capacity is not there at all
        options = []
        for position in compatible:
            movable = [a for a in by_node.get(position, []) if a.job_id not in moved and can_move(a, policy, job.priority)
                       and _room_elsewhere(problem, book, position, a.demand, False, homes)]  # type: ignore[arg-type]
            if not movable or not _could_make_room(problem, job, book.caps[position], position, movable):
                continue
            found = minimal_victims(problem, job, book, position, movable)
            if found is not None and len(found[0]) <= budget - len(plan) and book.admits(job, found[1]):
                options.append((len(found[0]), sum(a.lost_work_s for a in found[0]), book.caps[position].node.id,
                                position, found))
        for _, _, _, position, (movers, target, part, positions) in sorted(options)[:NODES_TRIED]:
            destinations = replace_elsewhere(problem, book, position, movers)
            if destinations is None or splits_more(book, position, movers, part, positions, destinations):
                continue
            cap = book.caps[position]
            for allocation in movers:
                release(cap, allocation)
                moved.add(allocation.job_id)
            cap.take(positions, part)  # reserved for the blocked job
            book.refresh_node(position)
            for allocation, (to_position, to_part, to_positions) in zip(movers, destinations):
                destination = book.caps[to_position]
                destination.take(to_positions, to_part)
                book.refresh_node(to_position)
                plan.append(Migration(
                    job_id=allocation.job_id, from_node_id=cap.node.id, reason="defragmentation", for_job_id=job_id,
                    to=PlacementPart(gpu_indices=destination.gpu_indices(to_positions), gpu_milli=to_part.milli,
                                     node_id=destination.node.id)))
            hopeless.clear()  # the book changed: a demand that failed before may succeed now
            homes.clear()
            break
        else:
            hopeless.add(demand_key)
    return tuple(plan)


def _could_make_room(problem: Problem, job: JobDemand, cap: NodeCapacity, position: int,
                     movable: list[RunningAllocation]) -> bool:
    """A necessary condition for `minimal_victims` to find victims on this node, checked without
    copying it: moving every movable job would free enough CPU, memory and (for whole GPUs) GPUs.
    Most nodes of a full cluster fail it, and the search then skips them at once."""
    part = problem.pricing.part(job, node_target(cap, position).gpu_model)
    if part is None:
        return False
    if cap.free_cpu + sum(a.cpu_milli for a in movable) < part.cpu_milli:
        return False
    if cap.free_mem + sum(a.memory_mb for a in movable) < part.memory_mb:
        return False
    if part.fractional or part.gpus == 0:
        return True
    touched = {p for a in movable for p in cap.positions_of(a.gpu_indices)}
    freeable = sum(1 for p, milli in enumerate(cap.free_milli) if milli == WHOLE_GPU_MILLI or p in touched)
    return freeable >= part.gpus


def splits_more(book: Book, source: int, movers: list[RunningAllocation], part: PartDemand,
                positions: tuple[int, ...], destinations: list) -> bool:
    """The plan (movers out, the job it makes room for in, movers placed at `destinations`) would
    leave more GPUs partly used than it found: `improve`'s rule for its own moves, also kept by
    consolidation when it makes room at home for a rented job. A share moved onto a whole GPU
    leaves a sliver beside it that later whole-GPU jobs cannot use; on the gpuspec33 list such
    moves started T4-only tasks early but left the engine 0.2 points lower at 130% arrived."""
    after = {source: book.caps[source].copy()}
    for allocation in movers:
        release(after[source], allocation)
    after[source].take(positions, part)
    for (to_position, to_part, to_positions) in destinations:
        if to_position not in after:
            after[to_position] = book.caps[to_position].copy()
        after[to_position].take(to_positions, to_part)
    return sum(_split(after[p]) - _split(book.caps[p]) for p in after) > 0


def _split(cap: NodeCapacity) -> int:
    return sum(1 for milli in cap.free_milli if 0 < milli < WHOLE_GPU_MILLI)


def replace_elsewhere(problem: Problem, book: Book, source: int, movers: list[RunningAllocation],
                      owned_only: bool = False):
    """Place every mover on another node of the current book (what-if); None if any fails.
    `owned_only`: not on rented instances (moving an owned job to make room must not rent)."""
    if not all(_room_elsewhere(problem, book, source, a.demand, owned_only) for a in movers):  # type: ignore[arg-type]
        return None
    capacities = [cap.copy() for cap in book.caps]
    capacities[source].schedulable = False  # a moved job must land somewhere else
    if owned_only:
        for cap in capacities:
            if cap.node.rented:
                cap.schedulable = False
    demands = tuple(replace(a.demand, job_id=a.job_id, submitted_at=0.0) for a in movers)  # type: ignore[arg-type]
    snapshot = replace(problem.snapshot, pending=demands, offers=(), running=())
    mini = build_problem(snapshot, replace(problem.policy, method="greedy"), capacities)
    trial = Book(mini, capacities)
    if place_greedily(mini, trial, [d.job_id for d in demands]):
        return None
    result = []
    part_by_job = {d.job_id: next(c.part for c in mini.classes[mini.class_of[d.job_id]].candidates
                                  if c.target == _target_of(mini, trial, d.job_id)) for d in demands}
    for demand in demands:
        placement = trial.placements[demand.job_id]
        node_position = book.position_of(placement.node_id)
        positions = book.caps[node_position].positions_of(placement.gpu_indices)
        result.append((node_position, part_by_job[demand.job_id], positions))
    return result


def _room_elsewhere(problem: Problem, book: Book, source: int, demand: JobDemand, owned_only: bool,
                    memo: dict[tuple, tuple[int, ...]] | None = None) -> bool:
    """A necessary condition for the what-if placement of one mover, checked on the book's free
    capacity without building a problem: a node other than `source` has its CPU, memory and
    eligible GPUs free (`NodeCapacity.eligible`; filters and NVLink islands are left to the what-if
    run). A multi-node demand passes. `memo`: the first two such nodes per demand, valid while the
    book does not change."""
    if demand.nodes > 1:
        return True
    memo = {} if memo is None else memo
    key = (owned_only,) + class_fields(demand)
    if key not in memo:
        memo[key] = _free_homes(problem, book, demand, owned_only, limit=2)
    return any(p != source for p in memo[key])


def _free_homes(problem: Problem, book: Book, demand: JobDemand, owned_only: bool, limit: int) -> tuple[int, ...]:
    parts: dict[str, PartDemand | None] = {}  # per GPU model: a node has one in practice
    found: list[int] = []
    for position, cap in enumerate(book.caps):
        if (not cap.schedulable or (owned_only and cap.node.rented)
                or cap.free_cpu < demand.cpu_milli or cap.free_mem < demand.memory_mb):
            continue
        model = node_target(cap, position).gpu_model
        if model not in parts:
            parts[model] = problem.pricing.part(demand, model)
        part = parts[model]
        if part is not None and (part.gpus == 0 or sum(
                cap.eligible(p, part) for p in range(len(cap.node.gpus))) >= part.gpus):
            found.append(position)
            if len(found) >= limit:
                break
    return tuple(found)


def _target_of(problem: Problem, book: Book, job_id: str) -> int:
    node_id = book.placements[job_id].node_id
    for index, target in enumerate(problem.targets):
        if target.kind == "node" and any(problem.capacities[m].node.id == node_id for m in target.members):
            return index
    raise KeyError(job_id)


def defragmentation_for(snapshot: Snapshot, policy: Policy | None = None,
                        job_ids: list[str] | None = None) -> tuple[Migration, ...]:
    """The defragmentation plan alone, on a snapshot as it is (nothing placed first)."""
    problem = build_problem(snapshot, policy or Policy())
    pending = job_ids if job_ids is not None else [job.job_id for job in snapshot.pending]
    return plan_defragmentation(problem, Book(problem), pending)
