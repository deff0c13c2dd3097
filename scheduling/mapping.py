"""Map the aggregated MILP's counts back to concrete nodes, GPUs and instances, deterministically.

The MILP decides how many jobs of each demand class go to each target (shape or offer variant)
and proves, pattern by pattern, that the whole-GPU gangs fit the shape's nodes. Mapping then
places each target's jobs with the best-fit packer, biggest gangs first, then fractional shares
by size, then CPU-only jobs; members of a class are taken oldest first. Whatever the counts
promised but the concrete nodes cannot hold (the MILP pools CPU, memory and fractional shares per
shape) is returned for the greedy repair step.
"""

from __future__ import annotations

from scheduling.book import Book
from scheduling.milp import AggregateSolution
from scheduling.problem import Problem


def map_solution(problem: Problem, book: Book, solution: AggregateSolution) -> list[str]:
    """Commit the solution's placements into `book`; return job ids it could not map."""
    next_member = {c.index: 0 for c in problem.classes}
    per_class: dict[int, list[tuple[int, int]]] = {}
    for (c, t), parts in sorted(solution.parts.items()):
        jobs = parts // max(1, problem.classes[c].demand.nodes)
        if jobs:
            per_class.setdefault(c, []).append((t, jobs))
    # Within a class the oldest members are the ones placed; among them the longest runs get the
    # cheapest hours (the MILP priced the class at its mean duration).
    per_target: dict[int, list[tuple[str, int]]] = {}
    for c, uses in sorted(per_class.items()):
        demand_class = problem.classes[c]
        hourly = {cand.target: cand.hourly / max(1e-9, problem.pricing.speed(demand_class.demand,
                                                                              problem.targets[cand.target].gpu_model))
                  for cand in demand_class.candidates}
        total = sum(jobs for _, jobs in uses)
        chosen = demand_class.job_ids[:total]
        next_member[c] = len(chosen)
        chosen = sorted(chosen, key=lambda j: (-problem.jobs_by_id[j].expected_duration_hours,
                                               problem.jobs_by_id[j].submitted_at, j))
        for t, jobs in sorted(uses, key=lambda tj: (hourly[tj[0]], tj[0])):
            per_target.setdefault(t, []).extend((job_id, c) for job_id in chosen[:jobs])
            chosen = chosen[jobs:]
    unmapped: list[str] = []
    for t in sorted(per_target):
        work = []
        for job_id, c in per_target[t]:
            part = next(cand.part for cand in problem.classes[c].candidates if cand.target == t)
            work.append((problem.jobs_by_id[job_id], part))
        work.sort(key=lambda jp: (-jp[1].gpus * max(1, jp[0].nodes), -jp[1].milli, -jp[1].cpu_milli,
                                  -jp[1].memory_mb, jp[0].submitted_at, jp[0].job_id))
        failed: set[tuple] = set()  # capacity only shrinks: a part that failed here fails again
        for job, part in work:
            key = (part, job.nodes, job.tenant)
            if key in failed or book.place_job(job, t, part) is None:
                failed.add(key)
                unmapped.append(job.job_id)
    # Members the MILP left in no target (multi-node parts that did not add up to whole jobs).
    for demand_class in problem.classes:
        placed = next_member[demand_class.index]
        planned = sum(parts for (c, _), parts in solution.parts.items() if c == demand_class.index)
        if max(1, demand_class.demand.nodes) > 1 and planned % demand_class.demand.nodes:
            unmapped.extend(demand_class.job_ids[placed: placed + 1])
    return unmapped
