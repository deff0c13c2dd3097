"""Preemption plan: free room for a pending job by stopping lower-priority running jobs.

For each pending job (highest priority first, then oldest) the planner looks at every node that
could host it, and on each finds the smallest set of victims by lost work (time since their last
committed checkpoint plus restart cost). A victim must be preemptible, of strictly lower
priority, and have run at least `Policy.min_run_before_preempt_s` (so a job is never thrashed).
The node with the least total lost work wins. The freed GPUs are reserved in the cycle's book so
neither another preemption nor defragmentation hands them out again. Multi-node jobs are not
preempted for (a gang would need victims on several nodes at once).
"""

from __future__ import annotations

from scheduling.book import Book
from scheduling.model import Policy, Preemption, Snapshot
from scheduling.problem import Problem, build_problem
from scheduling.whatif import could_ever_fit, minimal_victims, release, running_by_node

# Pending jobs considered per cycle (highest priority, then oldest): bounds the what-if work.
JOBS_CONSIDERED = 32


def plan_preemptions(problem: Problem, book: Book, pending: list[str]) -> tuple[Preemption, ...]:
    policy = problem.policy
    by_node = running_by_node(problem)
    if not any(a.preemptible for allocations in by_node.values() for a in allocations):
        return ()
    taken: set[str] = set()
    plan: list[Preemption] = []
    order = sorted(pending, key=lambda j: (-problem.jobs_by_id[j].priority, problem.jobs_by_id[j].submitted_at, j))
    for job_id in order[:JOBS_CONSIDERED]:
        job = problem.jobs_by_id[job_id]
        if job.nodes > 1 or problem.classes[problem.class_of[job_id]].invalid:
            continue
        best = None
        for position, allocations in sorted(by_node.items()):
            victims = [a for a in allocations if a.job_id not in taken and a.preemptible
                       and a.priority < job.priority and a.run_seconds >= policy.min_run_before_preempt_s]
            if not victims or not could_ever_fit(problem, job, book.caps[position], position):
                continue
            found = minimal_victims(problem, job, book, position, victims)
            if found is None or not book.admits(job, found[1]):
                continue
            chosen = found[0]
            score = (sum(a.lost_work_s for a in chosen), len(chosen), book.caps[position].node.id)
            if best is None or score < best[0]:
                best = (score, position, found)
        if best is None:
            continue
        _, position, (chosen, target, part, positions) = best
        cap = book.caps[position]
        for allocation in chosen:
            release(cap, allocation)
            taken.add(allocation.job_id)
            plan.append(Preemption(victim_job_id=allocation.job_id, for_job_id=job_id, node_id=cap.node.id,
                                   lost_work_s=allocation.lost_work_s))
        cap.take(positions, part)  # reserved for the job once its victims have stopped
        book.refresh_node(position)
    return tuple(plan)


def preemptions_for(snapshot: Snapshot, policy: Policy | None = None,
                    job_ids: list[str] | None = None) -> tuple[Preemption, ...]:
    """The preemption plan alone, on a snapshot as it is (nothing placed first)."""
    problem = build_problem(snapshot, policy or Policy())
    pending = job_ids if job_ids is not None else [job.job_id for job in snapshot.pending]
    return plan_preemptions(problem, Book(problem), pending)
