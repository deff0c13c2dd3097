"""Preemption plan: free room for a pending job by stopping lower-priority running jobs.

For each pending job (highest priority first, then oldest) the planner looks at every node that
could host it, and on each finds the smallest set of victims by lost work (time since their last
committed checkpoint plus restart cost). A victim must be preemptible, of strictly lower
priority, and have run at least `Policy.min_run_before_preempt_s` (so a job is never thrashed).
The node with the least total lost work wins. The freed GPUs are reserved in the cycle's book so
neither another preemption nor defragmentation hands them out again. Multi-node jobs are not
preempted for (a gang would need victims on several nodes at once).

Priority only decides within a team: a job never preempts another team's job for priority. Across
teams capacity is taken back only by reclaim (`plan_reclaims`): a pending job that fits in its
team's unused nominal quota may stop jobs of teams that borrow that flavor, whatever their priority
or run time (borrowed capacity is lent on those terms, as in Kueue), those with the fewest
GPU-seconds left to run again elsewhere first (work left plus work lost: a victim usually restarts
on a rented instance, and a long one would rent for long). Victims that leave their team
at or above its nominal are preferred; a borrowed job larger than what its team borrows may be
taken when nothing else frees the room (its team then holds a little less than its nominal, and
that job cannot reclaim back: it no longer fits its team's unused nominal).
"""

from __future__ import annotations

from scheduling.book import Book
from scheduling.model import Policy, Preemption, RunningAllocation, Snapshot
from scheduling.problem import Problem, build_problem
from scheduling.quota import model_at, quota_governed
from scheduling.whatif import could_ever_fit, minimal_victims, release, remaining_run_s, running_by_node

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
            victims = [a for a in allocations if a.job_id not in taken and a.preemptible and a.tenant == job.tenant
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


def plan_reclaims(problem: Problem, book: Book, pending: list[str],
                  exclude: frozenset[str] = frozenset()) -> tuple[Preemption, ...]:
    """Reclaim preemptions (module docstring) for blocked jobs that fit in their team's unused nominal
    quota; the freed GPUs are reserved for them and charged to their team in the book's ledger.
    `exclude`: running jobs already reclaimed this cycle."""
    ledger = book.quota
    if ledger is None or not problem.policy.reclaim:
        return ()
    by_node = running_by_node(problem)
    # The quota filter is what reclaim cures: the team's nominal is lent out, so it is not asked.
    plugins = tuple(p for p in problem.plugins if p.name != "team_quota")
    pricing = problem.pricing
    taken: set[str] = set(exclude)
    plan: list[Preemption] = []
    owned_models = sorted({g.model for p in by_node for g in book.caps[p].node.gpus
                           if g.healthy and quota_governed(book.caps[p].node)})
    # Only jobs that fit their team's unused nominal are considered, so a backlog of borrowers' jobs
    # does not fill the window of JOBS_CONSIDERED.
    eligible = [j for j in pending if any(within_nominal(ledger, pricing, problem.jobs_by_id[j], m)
                                          for m in owned_models)]
    order = sorted(eligible, key=lambda j: (-problem.jobs_by_id[j].priority, problem.jobs_by_id[j].submitted_at, j))
    for job_id in order[:JOBS_CONSIDERED]:
        job = problem.jobs_by_id[job_id]
        if job.nodes > 1 or problem.classes[problem.class_of[job_id]].invalid:
            continue
        best = None
        for position, allocations in sorted(by_node.items()):
            cap = book.caps[position]
            model = next((g.model for g in cap.node.gpus if g.healthy), "")
            if not quota_governed(cap.node) or not within_nominal(ledger, pricing, job, model):
                continue
            victims = [a for a in allocations if a.job_id not in taken and a.preemptible and a.tenant != job.tenant
                       and _borrowing(ledger, a, cap.node)]
            if not victims or not could_ever_fit(problem, job, cap, position, plugins):
                continue
            rerun = _rerun_cost(problem, position)
            found = minimal_victims(problem, job, book, position, victims, plugins, cost=rerun)
            if found is None:
                continue
            # Least taken below lenders' nominal, then GPU-seconds the victims must run again
            # elsewhere (one 8-GPU victim is not cheaper than four 1-GPU ones).
            score = (round(_shortfall(ledger, found[0], cap.node), 6),
                     sum(rerun(a) for a in found[0]), len(found[0]), cap.node.id)
            if best is None or score < best[0]:
                best = (score, position, found, model)
        if best is None:
            continue
        _, position, (chosen, target, part, positions), model = best
        cap = book.caps[position]
        for allocation in chosen:
            release(cap, allocation)
            ledger.release(allocation.tenant, cap.node, allocation.gpu_indices, allocation.gpu_milli)
            taken.add(allocation.job_id)
            plan.append(Preemption(victim_job_id=allocation.job_id, for_job_id=job_id, node_id=cap.node.id,
                                   lost_work_s=allocation.lost_work_s, cause="reclaim"))
        cap.take(positions, part)  # reserved for the job once its victims have stopped
        ledger.charge(job, model, pricing.gpu_share(job, model))
        book.refresh_node(position)
    return tuple(plan)


def _rerun_cost(problem: Problem, position: int):
    """A reclaim victim's cost: the GPU-seconds it must run again elsewhere, its work left plus
    the work it loses (`lost_work_s`). With the owned capacity full, it restarts on a rented
    instance: a victim with little left rents for a short while, where a long one would hold the
    instance (and the GPUs it shares) long after the owned capacity frees up. Measured in
    bench.fairshare: victims chosen by lost work alone sent borrowers with days left to rented
    8-GPU instances while owned GPUs stood idle at night."""
    def cost(allocation: RunningAllocation) -> float:
        left = max(0.0, remaining_run_s(problem, position, allocation))
        return len(allocation.gpu_indices) * (left + allocation.lost_work_s)
    return cost


def within_nominal(ledger, pricing, job, model: str) -> bool:
    """The job on owned `model` fits its team's unused nominal in every managed flavor it counts in."""
    if job.allowed_models and model not in job.allowed_models:
        return False
    amounts = ledger.amounts(model, pricing.gpu_share(job, model))
    return bool(amounts) and all(amount <= ledger.nominal_left(job.tenant, flavor) + 1e-9
                                 for flavor, amount in amounts)


def waits_for_borrowed(ledger, pricing, job, models: list[str]) -> bool:
    """A job that fits its team's unused nominal on some owned model of which other teams borrow at
    least its size: reclaim, not renting, is how it gets its share (engine, before the borrowing
    phase)."""
    if job.nodes > 1:
        return False
    for model in models:
        if not within_nominal(ledger, pricing, job, model):
            continue
        amounts = ledger.amounts(model, pricing.gpu_share(job, model))
        if all(sum(ledger.borrowed(team, flavor) for team in ledger.teams if team != job.tenant) >= amount - 1e-9
               for flavor, amount in amounts):
            return True
    return False


def _held(ledger, allocation, node) -> dict[str, float]:
    """What an allocation counts against each managed flavor."""
    held: dict[str, float] = {}
    for index in allocation.gpu_indices:
        model = model_at(node, index)
        for flavor, amount in ledger.amounts(model, min(allocation.gpu_milli, 1000) / 1000):
            held[flavor] = held.get(flavor, 0.0) + amount
    return held


def _borrowing(ledger, allocation, node) -> bool:
    """Its team holds more than its nominal of every flavor this allocation counts in."""
    held = _held(ledger, allocation, node)
    return bool(held) and all(ledger.borrowed(allocation.tenant, flavor) > 1e-9 for flavor in held)


def _shortfall(ledger, chosen, node) -> float:
    """How far below their nominal taking all of `chosen` would leave the victims' teams."""
    taking: dict[tuple[str, str], float] = {}
    for allocation in chosen:
        for flavor, amount in _held(ledger, allocation, node).items():
            taking[allocation.tenant, flavor] = taking.get((allocation.tenant, flavor), 0.0) + amount
    return sum(max(0.0, amount - ledger.borrowed(team, flavor)) for (team, flavor), amount in taking.items())


def preemptions_for(snapshot: Snapshot, policy: Policy | None = None,
                    job_ids: list[str] | None = None) -> tuple[Preemption, ...]:
    """The preemption plan alone, on a snapshot as it is (nothing placed first)."""
    problem = build_problem(snapshot, policy or Policy())
    pending = job_ids if job_ids is not None else [job.job_id for job in snapshot.pending]
    return plan_preemptions(problem, Book(problem), pending)
