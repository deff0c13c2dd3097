"""Greedy placement: the fallback when the MILP has no answer in time, and the repair step after
mapping. Its quality is known and stated: jobs go in priority order (then bigger first, then
older), each to its cheapest feasible candidate, best-fit within the target (`packer.py`); it
never breaks a constraint. The engine scores it with the same objective as the MILP's answer and
reports which one it used.
"""

from __future__ import annotations

from operator import itemgetter

from scheduling.book import Book
from scheduling.milp import fabric_group
from scheduling.model import JobDemand
from scheduling.patterns import node_cost_batch, part_gpu_milli, stranded_gpus, stranding_coefficients
from scheduling.problem import Candidate, Problem


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
    # Owned nodes before launches at equal price: a launch also costs boot time and overhead.
    # Money plus the node-cost change of the job alone on the target (CPU/memory stranding and
    # fragmentation), weighted as in the objective.
    money, fragmentation = problem.weights["money"], problem.weights["fragmentation"]
    return sorted(candidates, key=lambda c: (round(money * c.money + fragmentation * c.fit_cost, 6),
                                             problem.targets[c.target].kind != "node",
                                             problem.targets[c.target].key))


def _key(problem: Problem, candidate: Candidate, fit: float) -> tuple:
    target = problem.targets[candidate.target]
    return (round(problem.weights["money"] * candidate.money + problem.weights["fragmentation"] * fit, 6),
            target.kind != "node", target.key)


def _current_order(problem: Problem, book: Book, class_index: int, keyed: list[tuple[tuple, Candidate]],
                   by_target: dict[int, tuple[tuple, Candidate]], touched: dict[int, int],
                   coefficients: tuple[float, float, float], priced: dict[tuple[int, int], tuple[int, tuple]]):
    """`candidate_order` with the fit cost of one-node targets this pass already placed on
    recomputed from the node as it is now: the part's exact change of the node cost
    (`patterns.node_cost_batch`: fragmentation and scarce homes) plus the change of its stranded
    GPUs. A static cost let a pass pile a whole class onto one node (each member priced as if it
    were alone there) and price a share on a node as if the GPUs it had just opened were still
    whole (on the share-only list that alone left 877.9 GPUs unallocated at 130% against 801.0,
    seed 42). `touched` counts placements per target; `priced` keeps each (class, target) price
    with the count it was made at, so a node is priced again only after it changed. The static
    order with the re-priced candidates re-sorted in; None when none of the class's targets was
    touched (the static order stands)."""
    import numpy as np

    alpha, cpu_ratio, mem_ratio = coefficients
    changed: list[tuple[tuple, Candidate]] = []
    stale = []
    for t, version in touched.items():
        entry = by_target.get(t)
        if entry is None:
            continue
        known = priced.get((class_index, t))
        if known is not None and known[0] == version:
            if known[1] is not None:
                changed.append((known[1], entry[1]))
            continue
        cap = book.caps[problem.targets[t].members[0]]
        positions = cap.choose(entry[1].part)
        if positions is None:  # it no longer fits there: the placing loop finds that out itself
            priced[(class_index, t)] = (version, None)
            changed.append(entry)
            continue
        stale.append((t, version, entry[1], cap, positions))
    if stale:
        width = max(len(cap.free_milli) for *_, cap, _ in stale)
        gpu = np.zeros((2 * len(stale), width), dtype=np.int64)
        cpu = np.zeros(2 * len(stale), dtype=np.int64)
        mem = np.zeros(2 * len(stale), dtype=np.int64)
        models: list[str] = []
        for number, (_, _, candidate, cap, positions) in enumerate(stale):
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
        for number, (t, version, candidate, cap, _) in enumerate(stale):
            part = candidate.part
            total = sum(cap.free_milli)
            now = stranded_gpus(total, cap.free_cpu, cap.free_mem, cpu_ratio, mem_ratio)
            after = stranded_gpus(max(0, total - part_gpu_milli(part)), max(0, cap.free_cpu - part.cpu_milli),
                                  max(0, cap.free_mem - part.memory_mb), cpu_ratio, mem_ratio)
            key = _key(problem, candidate, float(cost[2 * number + 1] - cost[2 * number]) + alpha * (after - now))
            priced[(class_index, t)] = (version, key)
            changed.append((key, candidate))
    if not changed:
        return None
    done = {candidate.target for _, candidate in changed}
    merged = [entry for entry in keyed if entry[1].target not in done] + changed
    merged.sort(key=itemgetter(0))
    return [candidate for _, candidate in merged]


def place_greedily(problem: Problem, book: Book, job_ids: list[str]) -> list[str]:
    """Place what fits, in greedy order; return the job ids left unplaced (in that order)."""
    unplaced = []
    ordered_candidates: dict[int, list[Candidate]] = {}
    keyed_candidates: dict[int, tuple[list, dict]] = {}
    coefficients = stranding_coefficients(problem.workload) \
        if problem.weights["fragmentation"] else (0.0, 0.0, 0.0)
    # One-node shapes placed on in this pass, with how many placements each took (their cost has
    # changed), and the prices `_current_order` made for them.
    touched: dict[int, int] = {}
    priced: dict[tuple[int, int], tuple[int, tuple]] = {}
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
        if touched and reprice:
            if class_index not in keyed_candidates:
                keyed = [(_key(problem, c, c.fit_cost), c) for c in candidates]
                keyed_candidates[class_index] = (keyed, {c.target: (k, c) for k, c in keyed})
            candidates = _current_order(problem, book, class_index, *keyed_candidates[class_index], touched,
                                        coefficients, priced) or candidates
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
            if book.place_job(job, candidate.target, candidate.part) is not None:
                if target.kind == "node" and target.count == 1:
                    touched[candidate.target] = touched.get(candidate.target, 0) + 1
                break
            exhausted.add((class_index, candidate.target))
        else:
            spread = _place_spread(problem, book, job, candidates, waiting_cost) if job.nodes > 1 else []
            if spread:
                for t in spread:
                    if problem.targets[t].count == 1:
                        touched[t] = touched.get(t, 0) + 1
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
