"""Greedy placement: the fallback when the MILP has no answer in time, and the repair step after
mapping. Its quality is known and stated: jobs go in priority order (then bigger first, then
older), each to its cheapest feasible candidate, best-fit within the target (`packer.py`); it
never breaks a constraint. The engine scores it with the same objective as the MILP's answer and
reports which one it used.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from operator import itemgetter

from scheduling.book import Book
from scheduling.milp import fabric_group
from scheduling.model import JobDemand, Placement
from scheduling.patterns import node_cost_batch, part_gpu_milli, stranded_gpus, stranding_coefficients
from scheduling.problem import Candidate, Problem


# Above this many jobs in one pass, shapes of several nodes keep their cycle-start prices (their
# re-pricing tripled a 5,000-job cycle of bench.scale: 0.69 -> 1.9 s); the MILP prices shapes as a
# whole at that scale. The FGD protocol's cycles (64 arrivals) and most broker cycles are below it.
REPRICE_SHAPES_MAX_JOBS = 256


def greedy_order(problem: Problem, job_ids: list[str]) -> list[str]:
    # Under quotas with fair share, the team with the higher fair-share factor goes first at equal
    # priority (the MILP's waiting costs say the same).
    ledger = problem.ctx.quota if problem.policy.fair_share else None

    def key(job_id: str) -> tuple:
        job = problem.jobs_by_id[job_id]
        size = job.compute_units if job.compute_units is not None else job.gpus * min(job.gpu_milli, 1000) / 1000
        factor = -round(ledger.factor.get(job.tenant, 1.0), 6) if ledger is not None else 0.0
        return (-job.priority, factor, -size * max(1, job.nodes), job.submitted_at, job_id)
    return sorted(job_ids, key=key)


def candidate_order(problem: Problem, candidates: list[Candidate]) -> list[Candidate]:
    # Money plus the node-cost change of the job alone on the target (CPU/memory stranding and
    # fragmentation), weighted as in the objective; ties as `_key` says.
    return sorted(candidates, key=lambda c: _key(problem, c, c.fit_cost))


def _key(problem: Problem, candidate: Candidate, fit: float) -> tuple:
    """Money plus weighted fit cost; owned nodes before launches at equal cost (a launch also
    costs boot time and overhead); then the tightest host fit, the least free memory and CPU on
    the target (two node kinds a gang takes whole cost the same, and the one with more memory is
    what a later memory-hungry task needs: keeping it, the engine left 583.5 GPUs unallocated at
    130% on the multi-GPU list, seed 42, instead of 627.5 with ties on the shape's number); then
    the target's key."""
    target = problem.targets[candidate.target]
    rep = target.rep
    return (round(problem.weights["money"] * candidate.money + problem.weights["fragmentation"] * fit, 6),
            target.kind != "node", rep.free_mem, rep.free_cpu, target.key)


@dataclass(slots=True)
class _Repricing:
    """What the pass knows about the targets it has placed on: how many placements each took
    (`touched`), the members it placed on (`used`, packer indices), and the prices it made, each
    with the count it was made at (`priced`: (class, target) -> (count, key, packer index))."""

    touched: dict[int, int] = field(default_factory=dict)
    used: dict[int, set[int]] = field(default_factory=dict)
    priced: dict[tuple[int, int], tuple[int, tuple, int | None]] = field(default_factory=dict)
    fresh_from: dict[int, int] = field(default_factory=dict)
    # Re-price shapes of several nodes too (each costs a best-fit look and a measure per class
    # and placement: passes of up to REPRICE_SHAPES_MAX_JOBS jobs only; one-node shapes always).
    shapes: bool = True

    def placed(self, book: Book, placement: Placement) -> None:
        for part in placement.parts:
            if part.launch_id is not None:
                continue
            position = book.position_of(part.node_id)
            target, inside = book.node_slot[position]
            self.touched[target] = self.touched.get(target, 0) + 1
            self.used.setdefault(target, set()).add(inside)

    def fresh_member(self, problem: Problem, book: Book, t: int) -> int | None:
        """A member of shape `t` still as the cycle found it (the static price holds there)."""
        packer, rep, used = book.packer(t), problem.targets[t].rep, self.used.get(t, set())
        inside = self.fresh_from.get(t, 0)
        while inside < len(packer.caps) and (inside in used or not packer.caps[inside].same_free(rep)):
            inside += 1
        self.fresh_from[t] = inside
        return inside if inside < len(packer.caps) else None


def _current_order(problem: Problem, book: Book, class_index: int, keyed: list[tuple[tuple, Candidate]],
                   by_target: dict[int, tuple[tuple, Candidate]], state: _Repricing,
                   coefficients: tuple[float, float, float]) -> tuple[list[Candidate], dict[int, int]] | None:
    """`candidate_order` with node shapes this pass already placed on priced again: at the node
    best fit would now use, the part's exact change of the node cost (`patterns.node_cost_batch`:
    fragmentation and scarce homes) plus the change of its stranded GPUs, or at the static price
    on a member still as the cycle found it, whichever is lower (and the job goes there). Priced
    from the cycle's start, a pass piled a class onto one node (each member priced as if alone
    there), charged the second gang of a batch again for the only-home capacity the first had
    already spent on a node, and priced a share as if the GPU the previous one had opened were
    still whole (`tests/scheduling/test_greedy_reprice.py`). A (class, target) price is kept until
    the target takes another placement. Returns the order and the chosen member per re-priced
    shape; None when none of the class's targets was touched (the static order stands)."""
    import numpy as np

    alpha, cpu_ratio, mem_ratio = coefficients
    changed: list[tuple[tuple, Candidate]] = []
    nodes: dict[int, int] = {}
    stale = []
    for t, version in state.touched.items():
        entry = by_target.get(t)
        if entry is None or (not state.shapes and problem.targets[t].count > 1):
            continue
        known = state.priced.get((class_index, t))
        if known is None or known[0] != version:
            fresh = state.fresh_member(problem, book, t)
            found = book.packer(t).peek(entry[1].part)
            if found is None:
                known = (version, entry[0], fresh)
                state.priced[(class_index, t)] = known
            else:
                inside, positions = found
                stale.append((t, version, entry, fresh, inside, book.packer(t).caps[inside], positions))
                continue
        changed.append((known[1], entry[1]))
        if known[2] is not None:
            nodes[t] = known[2]
    if stale:
        width = max(len(cap.free_milli) for *_, cap, _ in stale)
        gpu = np.zeros((2 * len(stale), width), dtype=np.int64)
        cpu = np.zeros(2 * len(stale), dtype=np.int64)
        mem = np.zeros(2 * len(stale), dtype=np.int64)
        models: list[str] = []
        for number, (_, _, (_, candidate), _, _, cap, positions) in enumerate(stale):
            part = candidate.part
            after = list(cap.free_milli)
            for p in positions:
                after[p] = after[p] - part.milli if part.fractional else 0
            gpu[2 * number, : len(after)] = cap.free_milli
            gpu[2 * number + 1, : len(after)] = after
            cpu[2 * number], cpu[2 * number + 1] = cap.free_cpu, max(0, cap.free_cpu - part.cpu_milli)
            mem[2 * number], mem[2 * number + 1] = cap.free_mem, max(0, cap.free_mem - part.memory_mb)
            models += [cap.node.gpus[0].model if cap.node.gpus else ""] * 2
        cost = node_cost_batch(gpu, cpu, models, problem.workload, mem)
        for number, (t, version, (static_key, candidate), fresh, inside, cap, _) in enumerate(stale):
            part = candidate.part
            total = sum(cap.free_milli)
            now = stranded_gpus(total, cap.free_cpu, cap.free_mem, cpu_ratio, mem_ratio)
            after = stranded_gpus(max(0, total - part_gpu_milli(part)), max(0, cap.free_cpu - part.cpu_milli),
                                  max(0, cap.free_mem - part.memory_mb), cpu_ratio, mem_ratio)
            key = _key(problem, candidate, float(cost[2 * number + 1] - cost[2 * number]) + alpha * (after - now))
            if fresh is not None and static_key[0] < key[0]:
                key, inside = static_key, fresh
            state.priced[(class_index, t)] = (version, key, inside)
            changed.append((key, candidate))
            nodes[t] = inside
    if not changed:
        return None
    done = {candidate.target for _, candidate in changed}
    merged = [entry for entry in keyed if entry[1].target not in done] + changed
    merged.sort(key=itemgetter(0))
    return [candidate for _, candidate in merged], nodes


def place_greedily(problem: Problem, book: Book, job_ids: list[str]) -> list[str]:
    """Place what fits, in greedy order; return the job ids left unplaced (in that order)."""
    unplaced = []
    ordered_candidates: dict[int, list[Candidate]] = {}
    keyed_candidates: dict[int, tuple[list, dict]] = {}
    coefficients = stranding_coefficients(problem.workload) \
        if problem.weights["fragmentation"] else (0.0, 0.0, 0.0)
    # Node shapes placed on in this pass (their cost has changed) and their new prices.
    state = _Repricing(shapes=len(job_ids) <= REPRICE_SHAPES_MAX_JOBS)
    reprice = bool(problem.weights["fragmentation"]) and problem.workload is not None
    # Capacity only shrinks during a greedy pass, so a target that could not take a member of a
    # class cannot take the next member either: skip it (this keeps the pass linear).
    exhausted: set[tuple[int, int]] = set()
    for job_id in greedy_order(problem, job_ids):
        job = problem.jobs_by_id[job_id]
        class_index = problem.class_of[job_id]
        if class_index not in ordered_candidates:
            ordered_candidates[class_index] = candidate_order(problem, problem.classes[class_index].candidates)
        waiting_cost = problem.classes[class_index].waiting_cost
        candidates = ordered_candidates[class_index]
        chosen_nodes: dict[int, int] = {}
        if state.touched and reprice:
            if class_index not in keyed_candidates:
                keyed = [(_key(problem, c, c.fit_cost), c) for c in candidates]
                keyed_candidates[class_index] = (keyed, {c.target: (k, c) for k, c in keyed})
            current = _current_order(problem, book, class_index, *keyed_candidates[class_index], state,
                                     coefficients)
            if current is not None:
                candidates, chosen_nodes = current
        for candidate in candidates:
            if (class_index, candidate.target) in exhausted:
                continue
            # The objective's own trade-off: a job whose run here costs more than leaving it
            # waiting this cycle stays pending (explained as CAPACITY_TAKEN), as in the MILP.
            target = problem.targets[candidate.target]
            if problem.weights["money"] * candidate.hourly * problem.pricing.runtime_hours(job, target.gpu_model) \
                    > waiting_cost:
                continue
            if not book.admits(job, target):
                continue
            placement = book.place_job(job, candidate.target, candidate.part, chosen_nodes.get(candidate.target))
            if placement is not None:
                if target.kind == "node":
                    state.placed(book, placement)
                break
            exhausted.add((class_index, candidate.target))
        else:
            spread = _place_spread(problem, book, job, candidates, waiting_cost) if job.nodes > 1 else []
            if spread:
                state.placed(book, book.placements[job_id])
                continue
            unplaced.append(job_id)
    return unplaced


def _place_spread(problem: Problem, book: Book, job: JobDemand, candidates: list[Candidate],
                  waiting_cost: float) -> list[int]:
    """A gang that no single node shape holds, over several shapes of one fabric group (one pool) with one GPU
    model, price and part: two nodes of a pool that differ in a label or in their running jobs are two shapes.
    The groups are tried in candidate order (cheapest first); the MILP's counts may split a gang the same way,
    and mapping leaves such a gang to this repair. The targets of the group it went to; [] when it fits
    nowhere."""
    groups: dict[tuple, list[int]] = {}
    for candidate in candidates:
        target = problem.targets[candidate.target]
        if target.kind != "node" or problem.weights["money"] * candidate.hourly \
                * problem.pricing.runtime_hours(job, target.gpu_model) > waiting_cost:
            continue
        key = (fabric_group(problem, candidate.target), target.gpu_model, target.node.price_per_gpu_hour,
               candidate.part)
        groups.setdefault(key, []).append(candidate.target)
    for key, targets in groups.items():
        if len(targets) > 1 and book.place_spread_gang(job, targets, key[-1]) is not None:
            return targets
    return []
