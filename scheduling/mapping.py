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
    per_target: dict[int, list[tuple[int, int]]] = {}
    for (c, t), parts in sorted(solution.parts.items()):
        jobs = parts // max(1, problem.classes[c].demand.nodes)
        if jobs:
            per_target.setdefault(t, []).append((c, jobs))
    unmapped: list[str] = []
    for t in sorted(per_target):
        work = []
        for c, jobs in per_target[t]:
            demand_class = problem.classes[c]
            start = next_member[c]
            job_ids = demand_class.job_ids[start: start + jobs]
            next_member[c] = start + len(job_ids)
            part = next(cand.part for cand in demand_class.candidates if cand.target == t)
            work.extend((problem.jobs_by_id[job_id], part) for job_id in job_ids)
        work.sort(key=lambda jp: (-jp[1].gpus * max(1, jp[0].nodes), -jp[1].milli, -jp[1].cpu_milli,
                                  -jp[1].memory_mb, jp[0].submitted_at, jp[0].job_id))
        for job, part in work:
            if book.place_job(job, t, part) is None:
                unmapped.append(job.job_id)
    # Members the MILP left in no target (multi-node parts that did not add up to whole jobs).
    for demand_class in problem.classes:
        placed = next_member[demand_class.index]
        planned = sum(parts for (c, _), parts in solution.parts.items() if c == demand_class.index)
        if max(1, demand_class.demand.nodes) > 1 and planned % demand_class.demand.nodes:
            unmapped.extend(demand_class.job_ids[placed: placed + 1])
    return unmapped
