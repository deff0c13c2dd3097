"""Greedy placement: the fallback when the MILP has no answer in time, and the repair step after
mapping. Its quality is known and stated: jobs go in priority order (then bigger first, then
older), each to its cheapest feasible candidate, best-fit within the target (`packer.py`); it
never breaks a constraint. The engine scores it with the same objective as the MILP's answer and
reports which one it used.
"""

from __future__ import annotations

from scheduling.book import Book
from scheduling.problem import Candidate, Problem


def greedy_order(problem: Problem, job_ids: list[str]) -> list[str]:
    def key(job_id: str) -> tuple:
        job = problem.jobs_by_id[job_id]
        size = job.compute_units if job.compute_units is not None else job.gpus * min(job.gpu_milli, 1000) / 1000
        return (-job.priority, -size * max(1, job.nodes), job.submitted_at, job_id)
    return sorted(job_ids, key=key)


def candidate_order(problem: Problem, candidates: list[Candidate]) -> list[Candidate]:
    # Owned nodes before launches at equal price: a launch also costs boot time and overhead.
    return sorted(candidates, key=lambda c: (round(c.money, 6), problem.targets[c.target].kind != "node",
                                             problem.targets[c.target].key))


def place_greedily(problem: Problem, book: Book, job_ids: list[str]) -> list[str]:
    """Place what fits, in greedy order; return the job ids left unplaced (in that order)."""
    unplaced = []
    ordered_candidates: dict[int, list[Candidate]] = {}
    # Capacity only shrinks during a greedy pass, so a target that could not take a member of a
    # class cannot take the next member either: skip it (this keeps the pass linear).
    exhausted: set[tuple[int, int]] = set()
    for job_id in greedy_order(problem, job_ids):
        job = problem.jobs_by_id[job_id]
        class_index = problem.class_of[job_id]
        if class_index not in ordered_candidates:
            ordered_candidates[class_index] = candidate_order(problem, problem.classes[class_index].candidates)
        waiting_cost = problem.classes[class_index].waiting_cost
        for candidate in ordered_candidates[class_index]:
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
                break
            exhausted.add((class_index, candidate.target))
        else:
            unplaced.append(job_id)
    return unplaced
