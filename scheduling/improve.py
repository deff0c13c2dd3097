"""Local improvement of a concrete plan under the evaluated objective.

The aggregated MILP pools what it cannot afford to model per node (CPU/memory stranding per
shape, fractional shares per shape) and mapping turns its counts into concrete nodes; the
evaluated objective (`scheduling.objective`) charges each node. Where the two disagree the plan
is a little worse than the per-node optimum (measured: 1.4% on the optimality-gap instances, most
of it a shape's stranding credited in full while mapping piled the jobs on one of its nodes).

`improve` relocates single-node jobs: for each placed job in id order it prices every other place
it may go (each owned node of its candidate shapes this cycle changed, one untouched node per
shape, every instance already launched for its candidate offers) and moves it to the cheapest
when that lowers the objective; passes repeat until one moves nothing, and in small cycles pairs
of jobs are exchanged when no single move helps. Only the terms a move touches are re-scored (the
jobs' own costs, the two nodes or instances); the work is bounded by a count of trials, not a
clock, so the plan stays identical for identical input.

Shares (a fraction of one GPU) never move: the objective prices a share by its node shape as the
cycle found it, blind to which GPU it splits and to the sliver it leaves beside another share, so
its moves undo good splits. Moves that spread shares over fresh GPUs cost the FGD protocol 180
GPUs (407 against 263 unallocated at 130%); even limited to GPUs already split, moving the MILP's
shares left 743.5 GPUs unallocated on the share-heavy list (seed 42) against 735.7 with shares
kept where mapping put them. Whole-GPU and CPU-only jobs take and free whole GPUs only, so no move
changes how many GPUs are split.

`hand_over` gives a node that one job of the cycle took to jobs at the head of the queue when the
objective drops (its docstring says why); the engine runs it after the relocations.

The engine runs both on the MILP's mapped answer (what they repair) and on greedy's best-fit answer,
whose placements were each priced when taken, before later jobs changed what the nodes are worth
(`scheduling/engine.py`); not under `method="greedy"`.
"""

from __future__ import annotations

from scheduling.book import Book, Instance, launch_id
from scheduling.capacity import NodeCapacity
from scheduling.model import JobDemand, Placement, PlacementPart
from scheduling.objective import instance_cost, owned_node_cost, placement_cost, shape_of_node
from scheduling.problem import Candidate, Problem

# Priced places per cycle: at about 0.03 ms each, 10,000 keep the moves to about 0.3 s (the
# 12-node / 30-job gap instances need about 5,000); a cycle whose first pass alone would price
# more is left as mapped.
MAX_TRIALS = 10_000
MAX_PASSES = 4
# Exchanges are tried between every two jobs (a trial costs about 0.05 ms), so only in cycles with
# at most this many jobs to move: 1,770 pairs per pass.
SWAP_MAX_JOBS = 60
# Fits tried per cycle when handing nodes over to waiting jobs (`hand_over`): each is a capacity
# check and, where it fits, a commit (about 20 us); a cycle that runs out keeps what was handed
# over so far. The multi-GPU list's most contended cycle (seed 42) needs under 500.
HANDOVER_MAX_FITS = 2_000
# ... offered to the oldest this many waiting jobs only (the head of the queue; a 5,000-job cycle
# on 100 nodes leaves 4,700 waiting, and scanning them all per node cost 0.3 s).
HANDOVER_QUEUE_HEAD = 256
# Improvements smaller than this (dollars of objective) are noise, not worth a move.
MIN_GAIN = 1e-6

# Where a job sits or may go: an owned node (position) or an instance already launched.
Unit = tuple[str, int, int]  # ("node", position, 0) or ("instance", target index, number)


class _Scorer:
    """Objective terms of owned nodes and instances, cached by the state that decides them."""

    def __init__(self, problem: Problem, book: Book, original: list[NodeCapacity]) -> None:
        self.problem, self.book, self.original = problem, book, original
        self.node_costs: dict[tuple, float] = {}
        self.jobs_on: dict[Unit, int] = {}
        # shape target -> positions of its nodes this cycle placed on (they differ from the rest)
        self.changed: dict[int, set[int]] = {}
        shape_of = shape_of_node(problem)
        for position, (before, now) in enumerate(zip(original, book.caps)):
            if not before.same_free(now):
                target = shape_of.get(now.node.id)
                if target is not None:
                    self.changed.setdefault(target, set()).add(position)
        self.instance_caps = {(i.target, i.number): i for i in book.instances}
        self.instances: dict[int, list[int]] = {}
        for target, number in sorted(self.instance_caps):
            self.instances.setdefault(target, []).append(number)
        for placement in book.placements.values():
            for part in placement.parts:
                unit = self.unit_of(part)
                self.jobs_on[unit] = self.jobs_on.get(unit, 0) + 1

    def unit_of(self, part: PlacementPart) -> Unit:
        if part.launch_id is None:
            return ("node", self.book.position_of(part.node_id), 0)
        return ("instance", self.book.target_of_launch(part.launch_id), part.instance)

    def cost(self, unit: Unit, cap: NodeCapacity, instance: Instance | None, jobs: int) -> float:
        """The unit's objective term with `jobs` jobs on it (an unused instance costs nothing)."""
        if instance is not None:
            return instance_cost(self.problem, instance) if jobs else 0.0
        position = unit[1]
        key = (position, tuple(cap.free_milli), cap.free_cpu, cap.free_mem)
        value = self.node_costs.get(key)
        if value is None:
            value = self.node_costs[key] = owned_node_cost(self.problem, self.original[position], cap)
        return value


def improve(problem: Problem, book: Book, original: list[NodeCapacity]) -> int:
    """Relocate (and in small cycles exchange) single-node jobs while the objective drops; return
    how many moves were made."""
    scorer = _Scorer(problem, book, original)
    movable = [job_id for job_id in sorted(book.placements)
               if job_id in problem.class_of and max(1, problem.jobs_by_id[job_id].nodes) == 1
               and not _is_share(problem.jobs_by_id[job_id])]
    # One pass prices about this many destinations; a cycle that big is left as mapped (all or
    # nothing, so that no job is favoured by its place in the order).
    if _destinations_exceed(problem, scorer, movable, MAX_TRIALS):
        return 0
    budget = [MAX_TRIALS]
    moves = 0
    for _ in range(MAX_PASSES):
        moved = _relocation_pass(problem, book, scorer, movable, budget)
        if not moved and len(movable) <= SWAP_MAX_JOBS:
            moved = _swap_pass(problem, book, scorer, movable, budget)
        moves += moved
        if not moved or budget[0] <= 0:
            break
    return moves


def _relocation_pass(problem: Problem, book: Book, scorer: _Scorer, movable: list[str], budget: list[int]) -> int:
    moved = 0
    for job_id in movable:
        if budget[0] <= 0:
            break
        tried, relocated = _relocate(problem, book, scorer, problem.jobs_by_id[job_id])
        budget[0] -= tried
        moved += relocated
    return moved


def _swap_pass(problem: Problem, book: Book, scorer: _Scorer, movable: list[str], budget: list[int]) -> int:
    """When no single move helps any more: exchange two jobs' places."""
    moved = 0
    for first, job_id in enumerate(movable):
        for other in movable[first + 1:]:
            if budget[0] <= 0:
                return moved
            a, b = problem.jobs_by_id[job_id], problem.jobs_by_id[other]
            if problem.class_of[job_id] == problem.class_of[other] \
                    and a.expected_duration_hours == b.expected_duration_hours:
                continue  # twins: exchanging them changes nothing
            tried, swapped = _swap(problem, book, scorer, a, b)
            budget[0] -= tried
            moved += swapped
    return moved


def _swap(problem: Problem, book: Book, scorer: _Scorer, a: JobDemand, b: JobDemand) -> tuple[int, bool]:
    """Exchange the places of `a` and `b` if that lowers the objective; (trials, swapped)."""
    placed_a, placed_b = book.placements[a.job_id], book.placements[b.job_id]
    unit_a, unit_b = scorer.unit_of(placed_a.parts[0]), scorer.unit_of(placed_b.parts[0])
    if unit_a == unit_b:
        return 0, False
    target_a, target_b = _target_of(problem, unit_a), _target_of(problem, unit_b)
    cands_a = {c.target: c for c in problem.classes[problem.class_of[a.job_id]].candidates}
    cands_b = {c.target: c for c in problem.classes[problem.class_of[b.job_id]].candidates}
    if target_b not in cands_a or target_a not in cands_b or target_a not in cands_a or target_b not in cands_b:
        return 0, False
    cap_a, instance_a = book.capacity_of(placed_a.parts[0])
    cap_b, instance_b = book.capacity_of(placed_b.parts[0])
    jobs_a, jobs_b = scorer.jobs_on[unit_a], scorer.jobs_on[unit_b]
    before = (placement_cost(problem, a, placed_a) + placement_cost(problem, b, placed_b)
              + scorer.cost(unit_a, cap_a, instance_a, jobs_a) + scorer.cost(unit_b, cap_b, instance_b, jobs_b))
    slots_a = book.unplace(a, problem.targets[target_a], cands_a[target_a].part)
    slots_b = book.unplace(b, problem.targets[target_b], cands_b[target_b].part)
    part_a, part_b = cands_a[target_b].part, cands_b[target_a].part
    saved = [(list(c.free_milli), list(c.free_memory), c.free_cpu, c.free_mem) for c in (cap_a, cap_b)]
    gain = 0.0
    positions_a = cap_b.choose(part_a)
    if positions_a is not None:
        cap_b.take(positions_a, part_a)
        positions_b = cap_a.choose(part_b)
        if positions_b is not None:
            cap_a.take(positions_b, part_b)
            after = (placement_cost(problem, a, _placement_at(problem, a, cands_a[target_b], cap_b, instance_b,
                                                              positions_a))
                     + placement_cost(problem, b, _placement_at(problem, b, cands_b[target_a], cap_a, instance_a,
                                                                positions_b))
                     + scorer.cost(unit_a, cap_a, instance_a, jobs_a) + scorer.cost(unit_b, cap_b, instance_b, jobs_b))
            gain = before - after
    for cap, (milli, memory, cpu, mem) in zip((cap_a, cap_b), saved):
        cap.free_milli, cap.free_memory, cap.free_cpu, cap.free_mem = milli, memory, cpu, mem
    if gain > MIN_GAIN and book.admits(a, problem.targets[target_b]):
        moved_a = [(cap_b, positions_a, instance_b)]
        book.commit(a, problem.targets[target_b], moved_a, part_a)
        if book.admits(b, problem.targets[target_a]):
            moved_b = [(cap_a, positions_b, instance_a)]
            book.commit(b, problem.targets[target_a], moved_b, part_b)
            book.reindex(moved_a + moved_b)
            return 1, True
        book.unplace(a, problem.targets[target_b], part_a)
    book.commit(a, problem.targets[target_a], slots_a, cands_a[target_a].part)
    book.commit(b, problem.targets[target_b], slots_b, cands_b[target_b].part)
    book.reindex(slots_a + slots_b)
    return 1, False


def _relocate(problem: Problem, book: Book, scorer: _Scorer, job: JobDemand) -> tuple[int, bool]:
    """Move `job` to its cheapest other spot if that lowers the objective; (trials, moved)."""
    placement = book.placements[job.job_id]
    source_unit = scorer.unit_of(placement.parts[0])
    candidates = {c.target: c for c in problem.classes[problem.class_of[job.job_id]].candidates}
    source_target = _target_of(problem, source_unit)
    source_candidate = candidates.get(source_target)
    if source_candidate is None:
        return 0, False
    source_cap, source_instance = book.capacity_of(placement.parts[0])
    jobs_at_source = scorer.jobs_on[source_unit]
    before = placement_cost(problem, job, placement) + scorer.cost(source_unit, source_cap, source_instance,
                                                                   jobs_at_source)
    target = problem.targets[source_target]
    slots = book.unplace(job, target, source_candidate.part)
    freed = scorer.cost(source_unit, source_cap, source_instance, jobs_at_source - 1)

    best: tuple[float, Unit, NodeCapacity, Instance | None, tuple[int, ...], Candidate] | None = None
    trials = 0
    for unit, cap, instance, candidate in _destinations(problem, book, scorer, candidates, source_unit):
        positions = cap.choose(candidate.part)
        if positions is None or not book.admits(job, problem.targets[candidate.target]):
            continue
        trials += 1
        jobs_there = scorer.jobs_on.get(unit, 0)
        old = scorer.cost(unit, cap, instance, jobs_there)
        saved = (list(cap.free_milli), list(cap.free_memory), cap.free_cpu, cap.free_mem)
        cap.take(positions, candidate.part)
        new = scorer.cost(unit, cap, instance, jobs_there + 1)
        cap.free_milli, cap.free_memory, cap.free_cpu, cap.free_mem = saved
        there = _placement_at(problem, job, candidate, cap, instance, positions)
        delta = placement_cost(problem, job, there) + new - old + freed - before
        if delta < -MIN_GAIN and (best is None or delta < best[0] - MIN_GAIN):
            best = (delta, unit, cap, instance, positions, candidate)
    if best is None:
        book.commit(job, target, slots, source_candidate.part)
        book.reindex(slots)
        return trials, False
    _, unit, cap, instance, positions, candidate = best
    moved_to = [(cap, positions, instance)]
    book.commit(job, problem.targets[candidate.target], moved_to, candidate.part)
    book.reindex(moved_to)
    scorer.jobs_on[source_unit] -= 1
    scorer.jobs_on[unit] = scorer.jobs_on.get(unit, 0) + 1
    if unit[0] == "node":
        scorer.changed.setdefault(_shape_of(problem, unit[1]), set()).add(unit[1])
    return trials, True


def _destinations(problem: Problem, book: Book, scorer: _Scorer, candidates: dict[int, Candidate],
                  source: Unit):
    """The other owned nodes of the candidate shapes that can differ in price (each node this
    cycle changed, and one untouched member: untouched members of a shape are identical) and the
    launched instances of the candidate offers."""
    for target_index, candidate in sorted(candidates.items()):
        target = problem.targets[target_index]
        if target.kind == "node":
            changed = scorer.changed.get(target_index, ())
            untouched = next((p for p in target.members if p not in changed), None)
            for position in sorted(changed) + ([] if untouched is None else [untouched]):
                unit: Unit = ("node", position, 0)
                if unit != source:
                    yield unit, book.caps[position], None, candidate
            continue
        for number in scorer.instances.get(target_index, ()):
            unit = ("instance", target_index, number)
            if unit != source and scorer.jobs_on.get(unit, 0):
                yield unit, scorer.instance_caps[target_index, number].cap, scorer.instance_caps[target_index, number], \
                    candidate


def _destinations_exceed(problem: Problem, scorer: _Scorer, job_ids: list[str], limit: int) -> bool:
    """Would a pass over these jobs price more than `limit` destinations? Counted once per demand class
    (its members have the same destinations) and only until the limit is passed: counted per job, this
    was 4% of the engine's time in a 5,000-job cycle (profiled)."""
    per_class: dict[int, int] = {}
    total = 0
    for job_id in job_ids:
        class_index = problem.class_of[job_id]
        if class_index not in per_class:
            count = 0
            for candidate in problem.classes[class_index].candidates:
                if problem.targets[candidate.target].kind == "node":
                    count += 1 + len(scorer.changed.get(candidate.target, ()))
                else:
                    count += len(scorer.instances.get(candidate.target, ()))
            per_class[class_index] = count
        total += per_class[class_index]
        if total > limit:
            return True
    return False


def _placement_at(problem: Problem, job: JobDemand, candidate: Candidate, cap: NodeCapacity,
                  instance: Instance | None, positions: tuple[int, ...]) -> Placement:
    target = problem.targets[candidate.target]
    part = PlacementPart(cap.gpu_indices(positions), candidate.part.milli,
                         node_id=None if instance is not None else cap.node.id,
                         launch_id=None if instance is None else launch_id(target),
                         instance=0 if instance is None else instance.number)
    return Placement(job.job_id, (part,), target.gpu_model, problem.pricing.hourly_price(job, target), target.spot)


def _is_share(job: JobDemand) -> bool:
    """A fraction of one GPU (module docstring: shares never move)."""
    return job.gpus > 0 and job.is_fractional


def _target_of(problem: Problem, unit: Unit) -> int:
    return unit[1] if unit[0] == "instance" else _shape_of(problem, unit[1])


def _shape_of(problem: Problem, position: int) -> int:
    return shape_of_node(problem)[problem.capacities[position].node.id]


def hand_over(problem: Problem, book: Book, original: list[NodeCapacity]) -> int:
    """Give an owned node that one job of this cycle took to jobs left waiting, where the objective
    drops; return how many nodes changed hands.

    Best fit and the MILP both fill a contended cycle biggest first: an 8-GPU gang takes an empty
    node that two 4-GPU jobs, older in the queue, could have shared, and no relocation undoes that
    (the gang has nowhere else to go). Waiting costs `(0.1 + GPUs)` per job, so two 4-GPU jobs
    placed save more than the gang alone; handing the node over starts more jobs on the same GPUs,
    and the older ones. On the multi-GPU list the engine trailed FGD at seven points of the curve
    (85-90% arrived, worst -0.18 point) and now at five (-0.04), the same GPUs placed at 100% and
    130%.

    The newest holders are offered first. Each class waiting at the head of the queue leads once
    (its oldest member), the rest follow oldest first where they fit, and the best gain is kept.
    Newer small jobs can thus take a node from an older big one, but only where they save more
    waiting, the trade the MILP's objective already makes. Requiring a taker older than the holder
    undid most of the gain (multi-GPU list: worst -0.14 point behind FGD instead of -0.04); with
    the rule kept, the fair-share windows do not change. Shares and multi-node jobs neither give
    nor take. Work is bounded by a count of fits tried, so the plan stays identical for identical
    input."""
    jobs = problem.jobs_by_id

    def age(job_id: str) -> tuple:
        return jobs[job_id].submitted_at, job_id

    waiting = sorted((job_id for job_id in problem.class_of
                      if job_id not in book.placements and _single_whole(jobs[job_id])), key=age)
    if not waiting:
        return 0  # the common case: everything placed, nothing to score
    scorer = _Scorer(problem, book, original)
    holders: dict[int, list[str]] = {}
    for job_id, placement in book.placements.items():
        if job_id in problem.class_of and len(placement.parts) == 1 and placement.parts[0].launch_id is None:
            holders.setdefault(book.position_of(placement.parts[0].node_id), []).append(job_id)
    budget = [HANDOVER_MAX_FITS]
    handed = 0
    alone = [(position, held[0]) for position, held in holders.items() if len(held) == 1]
    for position, holder in sorted(alone, key=lambda item: (-jobs[item[1]].submitted_at, item[0])):
        if budget[0] <= 0 or not waiting:
            break
        job = jobs[holder]
        candidate = _candidate_on(problem, holder, _shape_of(problem, position))
        if candidate is None or not _single_whole(job):
            continue
        head = waiting[:HANDOVER_QUEUE_HEAD]
        taken = _hand_over_node(problem, book, scorer, position, job, candidate, head, budget)
        if taken:
            waiting = sorted([j for j in waiting if j not in taken] + [holder], key=age)
            handed += 1
    return handed


def _hand_over_node(problem: Problem, book: Book, scorer: _Scorer, position: int, holder: JobDemand,
                    candidate: Candidate, waiting: list[str], budget: list[int]) -> set[str]:
    """Take `holder` off the node and fill it from `waiting` the best way tried; keep that if it
    lowers the objective (return the jobs placed), else put `holder` back (return nothing)."""
    target_index = candidate.target
    target = problem.targets[target_index]
    cap, unit = book.caps[position], ("node", position, 0)
    jobs_there = scorer.jobs_on.get(unit, 0)
    before = placement_cost(problem, holder, book.placements[holder.job_id]) \
        + scorer.cost(unit, cap, None, jobs_there)
    slots = book.unplace(holder, target, candidate.part)
    leaders, seen = [], set()
    for job_id in waiting:
        if problem.class_of[job_id] not in seen:
            seen.add(problem.class_of[job_id])
            leaders.append(job_id)
    best: tuple[float, list[str]] | None = None
    for leader in leaders:
        if budget[0] <= 0:
            break
        order = [leader] + [job_id for job_id in waiting if job_id != leader]
        placed = _fill(problem, book, cap, target_index, order, budget)
        if placed:
            after = problem.classes[problem.class_of[holder.job_id]].waiting_cost \
                + scorer.cost(unit, cap, None, jobs_there - 1 + len(placed)) \
                + sum(placement_cost(problem, problem.jobs_by_id[job_id], book.placements[job_id])
                      - problem.classes[problem.class_of[job_id]].waiting_cost for job_id in placed)
            gain = before - after
            if gain > MIN_GAIN and (best is None or gain > best[0] + MIN_GAIN):
                best = (gain, placed)
        _unfill(problem, book, target_index, placed)
    if best is None:
        book.commit(holder, target, slots, candidate.part)
        book.reindex(slots)
        return set()
    placed = _fill(problem, book, cap, target_index, best[1], [len(best[1])])
    scorer.jobs_on[unit] = jobs_there - 1 + len(placed)
    return set(placed)


def _fill(problem: Problem, book: Book, cap: NodeCapacity, target_index: int, order: list[str],
          budget: list[int]) -> list[str]:
    """Place the jobs of `order` that fit on one node, in that order; return them."""
    target = problem.targets[target_index]
    placed, full_classes = [], set()
    for job_id in order:
        if budget[0] <= 0:
            break
        class_index = problem.class_of[job_id]
        if class_index in full_classes:
            continue
        candidate = _candidate_on(problem, job_id, target_index)
        job = problem.jobs_by_id[job_id]
        budget[0] -= 1
        positions = cap.choose(candidate.part) if candidate is not None else None
        if positions is None or not book.admits(job, target):
            full_classes.add(class_index)  # the node only fills up: no later member fits either
            continue
        book.commit(job, target, [(cap, positions, None)], candidate.part)
        placed.append(job_id)
    if placed:
        book.reindex([(cap, (), None)])
    return placed


def _unfill(problem: Problem, book: Book, target_index: int, placed: list[str]) -> None:
    for job_id in reversed(placed):
        candidate = _candidate_on(problem, job_id, target_index)
        book.unplace(problem.jobs_by_id[job_id], problem.targets[target_index], candidate.part)


def _candidate_on(problem: Problem, job_id: str, target_index: int) -> Candidate | None:
    """The job's candidate on that target (None: it may not go there)."""
    return next((c for c in problem.classes[problem.class_of[job_id]].candidates if c.target == target_index), None)


def _single_whole(job: JobDemand) -> bool:
    """A single-node job of whole GPUs (or none): what may give or take a node."""
    return max(1, job.nodes) == 1 and not _is_share(job)
