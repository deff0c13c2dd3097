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
from scheduling.patterns import part_gpu_milli, stranded_gpus, stranding_coefficients
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


def _current_order(problem: Problem, book: Book, keyed: list[tuple[tuple, Candidate]],
                   by_target: dict[int, tuple[tuple, Candidate]], touched: set[int],
                   coefficients: tuple[float, float, float]):
    """`candidate_order` with the stranding part of the fit cost of one-node targets this pass
    already placed on recomputed from the node as it is now (a static cost let a pass pile a
    whole class onto one node: each member was priced as if it were alone there). The
    static order with the few re-priced candidates re-sorted in; None when none of the class's
    targets was touched (the static order stands)."""
    alpha, cpu_ratio, mem_ratio = coefficients
    changed = []
    for t in touched:
        entry = by_target.get(t)
        if entry is None:
            continue
        candidate = entry[1]
        cap = book.caps[problem.targets[t].members[0]]
        part = candidate.part
        total = sum(cap.free_milli)
        now = stranded_gpus(total, cap.free_cpu, cap.free_mem, cpu_ratio, mem_ratio)
        after = stranded_gpus(max(0, total - part_gpu_milli(part)), max(0, cap.free_cpu - part.cpu_milli),
                              max(0, cap.free_mem - part.memory_mb), cpu_ratio, mem_ratio)
        fit = candidate.fit_cost - candidate.strand_cost + alpha * (after - now)
        changed.append((_key(problem, candidate, fit), candidate))
    if not changed:
        return None
    merged = [entry for entry in keyed if entry[1].target not in touched] + changed
    merged.sort(key=itemgetter(0))
    return [candidate for _, candidate in merged]


def place_greedily(problem: Problem, book: Book, job_ids: list[str]) -> list[str]:
    """Place what fits, in greedy order; return the job ids left unplaced (in that order)."""
    unplaced = []
    ordered_candidates: dict[int, list[Candidate]] = {}
    keyed_candidates: dict[int, tuple[list, dict]] = {}
    coefficients = stranding_coefficients(problem.workload) \
        if problem.weights["fragmentation"] else (0.0, 0.0, 0.0)
    # One-node shapes placed on in this pass (their stranding cost has changed).
    touched: set[int] = set()
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
        if touched and coefficients[0]:
            if class_index not in keyed_candidates:
                keyed = [(_key(problem, c, c.fit_cost), c) for c in candidates]
                keyed_candidates[class_index] = (keyed, {c.target: (k, c) for k, c in keyed})
            candidates = _current_order(problem, book, *keyed_candidates[class_index], touched,
                                        coefficients) or candidates
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
                    touched.add(candidate.target)
                break
            exhausted.add((class_index, candidate.target))
        else:
            spread = _place_spread(problem, book, job, candidates, waiting_cost) if job.nodes > 1 else []
            if spread:
                touched.update(t for t in spread if problem.targets[t].count == 1)
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
