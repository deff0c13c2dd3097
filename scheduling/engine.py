"""The scheduling cycle: `schedule(snapshot, policy) -> Plan`.

1. Build the problem: node shapes, offer variants, demand classes, filtered candidates.
2. Place (`place`): method "auto" runs the aggregated MILP (mapped back to nodes, repaired
   greedily) and the greedy placer and keeps the better under one objective; "milp" keeps the
   MILP's answer; "greedy" and "exact" (per-node model) run alone. `Plan.solver` says which
   answer was used, whether it was proven optimal, and why.
   Under quotas (`Snapshot.quotas`, scheduling/quota.py) placing runs in two phases, as Kueue
   admits workloads that do not borrow before those that do: first every team's jobs on owned
   capacity within its unused nominal quota (no launches), then the rest, borrowing idle owned
   capacity (fair share orders the borrowers) or renting, on what the first phase left.
   Within a team, like jobs then start oldest first (`scheduling/start_order.py`): the younger
   ones wait for new instances' boots.
3. For jobs still held back by capacity: reclaim of borrowed capacity for jobs within their
   team's nominal quota, preemption plan (within a team), then defragmentation plan.
4. Consolidation: empty rented instances whose jobs cost less elsewhere.
5. Explain every job left pending; under quotas each reason also names the job's quota step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

from scheduling.book import Book
from scheduling.capacity import NodeCapacity
from scheduling.collector import fewer_collections
from scheduling.consolidate import plan_consolidation
from scheduling.defrag import plan_defragmentation
from scheduling.explain import explain_pending
from scheduling.greedy import place_greedily
from scheduling.improve import hand_over, improve
from scheduling.mapping import map_solution
from scheduling.milp import build_and_solve
from scheduling.model import (
    Migration, Placement, Plan, Policy, Preemption, Reason, ReasonCode, Snapshot, SolverInfo,
)
from scheduling.objective import Score, end_state_cost, score
from scheduling.preemption import plan_preemptions, plan_reclaims, waits_for_borrowed, within_nominal
from scheduling.problem import Problem, build_problem, workload_classes
from scheduling.quota import quota_governed
from scheduling.quota_reasons import annotate_quota_steps
from scheduling.start_order import start_oldest_first

# Share of the cycle's time limit the MILP may use (LP, phase two, full model).
MILP_SHARE = 0.5
# Above this many (demand class, target) pairs the model takes seconds just to build (measured:
# 17,000 pairs, 216 partly used node shapes, 1.3 s CPU): the cycle answers greedily instead.
MAX_MILP_PAIRS = 40_000
# Pending reasons that freeing capacity (preemption, defragmentation) cannot cure. Any other code
# may hide a capacity block: the headline code is the plugin that rejected the most nodes (e.g.
# NODE_NOT_READY on a cluster that is mostly offline while the one ready node is full), and the
# planners check every node themselves.
NOT_CAPACITY_CODES = frozenset({
    ReasonCode.INVALID_DEMAND, ReasonCode.QUOTA_EXCEEDED, ReasonCode.BUDGET_EXCEEDED,
    ReasonCode.BORROWING_LIMIT, ReasonCode.NO_POOL_ACCESS,
})


def schedule(snapshot: Snapshot, policy: Policy | None = None) -> Plan:
    with fewer_collections():  # scheduling/collector.py: the cycle's objects live until it ends
        return _schedule(snapshot, policy)


def _schedule(snapshot: Snapshot, policy: Policy | None) -> Plan:
    started = time.perf_counter()
    policy = policy or Policy()
    nominal_placements: dict[str, Placement] = {}
    preemptions: tuple[Preemption, ...] = ()
    early: dict[str, Reason] = {}
    if snapshot.quotas:
        phases = _place_in_quota_phases(snapshot, policy, started)
        problem, book, info, nominal_placements = phases.problem, phases.book, phases.info, phases.nominal_placements
        preemptions, early = phases.reclaims, phases.reclaiming or {}
    else:
        problem = build_problem(snapshot, policy)
        book, info = place(problem, [cap.copy() for cap in problem.capacities], started)

    pending = [job.job_id for job in sorted(problem.snapshot.pending, key=lambda j: (j.submitted_at, j.job_id))
               if job.job_id not in book.placements]
    reasons: dict[str, Reason] = explain_pending(problem, book, pending)
    # Not for jobs held back by quota, budget or an invalid demand, nor those for which waiting
    # is cheaper than any fit.
    blocked = [job_id for job_id in pending if reasons[job_id].code not in NOT_CAPACITY_CODES
               and not reasons[job_id].data.get("waiting_cheaper")]
    migrations: tuple[Migration, ...] = ()
    if book.quota is not None and policy.reclaim and blocked:
        late = plan_reclaims(problem, book, blocked, exclude=frozenset(p.victim_job_id for p in preemptions))
        _explain_reclaims(problem, reasons, late)
        preemptions += late
        blocked = [job_id for job_id in blocked if reasons[job_id].code != ReasonCode.RECLAIMING]
    if policy.preemption and blocked:
        priority = plan_preemptions(problem, book, blocked)
        _explain_preemptions(reasons, priority)
        preemptions += priority
    if policy.defragmentation and blocked:
        waiting = [j for j in blocked if reasons[j].code != ReasonCode.WAITING_FOR_PREEMPTION]
        migrations = plan_defragmentation(problem, book, waiting)
        _explain_migrations(reasons, migrations)

    if policy.consolidation and snapshot.running:
        busy = {p.victim_job_id for p in preemptions} | {m.job_id for m in migrations}
        # One budget for every move of the cycle: consolidation gets what defragmentation left.
        budget = min(policy.max_consolidation_moves, policy.max_moves_per_cycle - len(migrations))
        migrations += plan_consolidation(problem, book, busy, budget)

    # Last: what is pending, reclaimed or moved above does not depend on which like job holds which
    # placement, and a job swapped into the nominal phase's placements must not count as pending.
    start_oldest_first({job.job_id: job for job in snapshot.pending}, book, nominal_placements)
    book.compact_instances()
    reasons.update(early)
    if book.quota is not None:
        annotate_quota_steps(problem, book, reasons, {job.job_id: job for job in snapshot.pending})
    placed = {**nominal_placements, **book.placements}
    placements = tuple(placed[j.job_id] for j in sorted(snapshot.pending, key=lambda j: j.job_id)
                       if j.job_id in placed)
    info = SolverInfo(info.method, info.proven_optimal, time.perf_counter() - started, info.objective,
                      info.solver, info.status, info.variables, info.note)
    return Plan(placements=placements, launches=book.launches(), preemptions=preemptions,
                migrations=migrations, pending=dict(sorted(reasons.items())), solver=info)


@dataclass
class QuotaPhases:
    """What the quota phases hand the rest of the cycle (`_place_in_quota_phases`)."""

    problem: Problem  # the borrowing phase's: what the planners and explanations work on
    book: Book
    info: SolverInfo
    nominal_placements: dict[str, Placement]
    # Reclaims planned before the borrowing phase, and the jobs they are for (kept out of it).
    reclaims: tuple[Preemption, ...] = ()
    reclaiming: dict[str, Reason] | None = None


def _place_in_quota_phases(snapshot: Snapshot, policy: Policy, started: float) -> QuotaPhases:
    """Step 2 under quotas: the nominal phase; reclaim for jobs whose nominal share other teams
    borrow (before the next phase, or they would rent instead and the team would never get its
    share back); then the borrowing-and-renting phase on what the nominal phase left. Each phase
    has half the cycle's time."""
    halved = replace(policy, time_limit_s=policy.time_limit_s * 0.5)
    # Both phases measure fragmentation against the whole queue's task mix.
    workload = snapshot.workload or workload_classes(snapshot)
    first = build_problem(replace(snapshot, offers=(), launch_limits=(), workload=workload), halved,
                          nominal_only=True)
    if first.ctx.quota is None:  # quotas name no flavor this snapshot has: one phase as usual
        problem = build_problem(snapshot, policy)
        book, info = place(problem, [cap.copy() for cap in problem.capacities], started)
        return QuotaPhases(problem, book, info, {})
    first_book, first_info = place(first, [cap.copy() for cap in first.capacities], started)
    rest = [job for job in snapshot.pending if job.job_id not in first_book.placements]
    ledger = first_book.quota.copy()
    reclaims: tuple[Preemption, ...] = ()
    reclaiming: dict[str, Reason] = {}
    if policy.reclaim and rest:
        models = sorted({g.model for cap in first_book.caps if quota_governed(cap.node) for g in cap.node.gpus
                         if g.healthy})
        waiting = [job for job in rest if waits_for_borrowed(ledger, first.pricing, job, models)]
        if waiting:
            probe = build_problem(replace(snapshot, pending=tuple(waiting), workload=workload), halved,
                                  capacities=first_book.caps, quota=ledger.copy())
            probe.policy = policy
            probe_book = Book(probe, capacities=first_book.caps)
            reclaims = plan_reclaims(probe, probe_book, [job.job_id for job in waiting])
            lent_out = {job.job_id: Reason(ReasonCode.NOMINAL_QUOTA_USED,
                                           "NOMINAL_QUOTA_USED: its team's unused nominal share is lent to other teams",
                                           {}) for job in waiting}
            _explain_reclaims(probe, lent_out, reclaims)
            reclaiming = {job_id: reason for job_id, reason in lent_out.items() if reason.code == ReasonCode.RECLAIMING}
            for job in waiting:  # their share is theirs from now: the borrowing phase must not count it free
                if job.job_id in reclaiming:
                    model = next((m for m in models if within_nominal(ledger, first.pricing, job, m)), "")
                    ledger.charge(job, model, first.pricing.gpu_share(job, model))
    rest = tuple(job for job in rest if job.job_id not in reclaiming)
    problem = build_problem(replace(snapshot, pending=rest, workload=workload), halved,
                            capacities=first_book.caps, quota=ledger)
    book, info = place(problem, [cap.copy() for cap in problem.capacities], started)
    problem.policy = policy  # the planners after placing use the cycle's own policy
    note = f"nominal phase placed {len(first_book.placements)} ({first_info.method})"
    if reclaims:
        note += f"; reclaiming for {len(reclaiming)} job(s) before borrowing"
    info = SolverInfo(info.method, info.proven_optimal and first_info.proven_optimal, info.solve_seconds,
                      (info.objective or 0.0) + (first_info.objective or 0.0), info.solver or first_info.solver,
                      info.status, info.variables + first_info.variables,
                      f"{note}; {info.note}" if info.note else note)
    return QuotaPhases(problem, book, info, dict(first_book.placements), reclaims, reclaiming)


def _explain_reclaims(problem: Problem, reasons: dict[str, Reason], preemptions: tuple[Preemption, ...]) -> None:
    team_of = {a.job_id: a.tenant for a in problem.snapshot.running}
    for job_id in dict.fromkeys(p.for_job_id for p in preemptions):
        mine = [p for p in preemptions if p.for_job_id == job_id]
        victims = [p.victim_job_id for p in mine]
        teams = sorted({team_of.get(v, "") for v in victims})
        before = reasons[job_id]
        team = problem.jobs_by_id[job_id].tenant
        reasons[job_id] = Reason(
            ReasonCode.RECLAIMING,
            f"RECLAIMING: {len(victims)} borrowed job(s) of {', '.join(teams)} on {mine[0].node_id} are "
            f"checkpointing to return {team}'s nominal share; before: {before.message}",
            {"victims": victims, "victim_teams": teams, "node_id": mine[0].node_id, "previous": before.code.value})


def _explain_preemptions(reasons: dict[str, Reason], preemptions: tuple[Preemption, ...]) -> None:
    for job_id in dict.fromkeys(p.for_job_id for p in preemptions):
        mine = [p for p in preemptions if p.for_job_id == job_id]
        victims = [p.victim_job_id for p in mine]
        lost = sum(p.lost_work_s for p in mine)
        before = reasons[job_id]
        reasons[job_id] = Reason(
            ReasonCode.WAITING_FOR_PREEMPTION,
            f"WAITING_FOR_PREEMPTION: preempting {len(victims)} lower-priority job(s) on {mine[0].node_id} "
            f"({', '.join(victims)}), {lost:,.0f} s of work lost; before: {before.message}",
            {"victims": victims, "node_id": mine[0].node_id, "lost_work_s": lost, "previous": before.code.value})


def _explain_migrations(reasons: dict[str, Reason], migrations: tuple[Migration, ...]) -> None:
    for job_id in dict.fromkeys(m.for_job_id for m in migrations if m.for_job_id):
        mine = [m for m in migrations if m.for_job_id == job_id]
        moved = [m.job_id for m in mine]
        before = reasons[job_id]
        reasons[job_id] = Reason(
            ReasonCode.WAITING_FOR_DEFRAGMENTATION,
            f"WAITING_FOR_DEFRAGMENTATION: moving {len(moved)} checkpointable job(s) ({', '.join(moved)}) off "
            f"{mine[0].from_node_id} to make room; before: {before.message}",
            {"moved": moved, "node_id": mine[0].from_node_id, "previous": before.code.value})


def place(problem: Problem, original: list[NodeCapacity], started: float) -> tuple[Book, SolverInfo]:
    """Run the policy's method; return the filled book and what was used.

    "auto": the aggregated MILP (LP bound, then pattern counts near the LP values, then the full
    model if time is left) mapped to nodes, repaired greedily and relocated (`improve`), and the
    greedy answer, relocated the same way; the one that leaves the nodes in the better state
    (`objective.end_state_cost`) is kept, and `SolverInfo.objective` is its `objective.evaluate`
    (the linear objective every method is scored by). The MILP sees the whole queue
    at once (money, quotas, budgets, offer quotas); greedy best-fit packs nodes tightly. Neither
    dominates, so keeping the better is never worse than either by that measure. "milp": the MILP's answer
    whenever it has one (relocated greedy when it has none). "greedy": greedy alone, as it packed.
    "exact": the per-node model.
    """
    policy = problem.policy
    all_jobs = [job.job_id for job in problem.snapshot.pending]
    if policy.method == "exact":
        from scheduling.exact import solve_exact  # only for measuring: keep it off the import path
        return solve_exact(problem, original, policy.time_limit_s)

    def run_greedy(relocate: bool) -> tuple[Book, Score, int]:
        """Greedy best-fit over the whole queue, then (unless asked for greedy alone) `local_moves`."""
        book = Book(problem)
        place_greedily(problem, book, all_jobs)
        moves = local_moves(book) if relocate else 0
        return book, score(problem, book, original), moves

    def local_moves(book: Book) -> int:
        """Relocations, then nodes handed over to waiting jobs (and relocations after those)."""
        moves = improve(problem, book, original)
        handed = hand_over(problem, book, original)
        return moves + (handed + improve(problem, book, original) if handed else 0)

    def moved(moves: int) -> str:
        return f"; {moves} local move(s)" if moves else ""

    if policy.method == "greedy" or not problem.classes:
        greedy_book, greedy_score, _ = run_greedy(relocate=False)
        return greedy_book, SolverInfo("greedy", False, 0.0, greedy_score.total, "", "greedy by policy")

    # The MILP (model build and solves) gets half the cycle's limit, whatever building the
    # problem took: on a loaded machine that keeps the answer from depending on the load more
    # than the solver's own time limit already does. Mapping, repair and greedy follow.
    milp_budget = MILP_SHARE * policy.time_limit_s
    pairs = sum(len(c.candidates) for c in problem.classes)
    if pairs > MAX_MILP_PAIRS:
        greedy_book, greedy_score, moves = run_greedy(relocate=True)
        return greedy_book, SolverInfo("greedy", False, 0.0, greedy_score.total, "", "model too large", 0,
                                       f"{pairs} (class, target) pairs > {MAX_MILP_PAIRS}: greedy used"
                                       + moved(moves))
    if milp_budget <= 0.02:
        greedy_book, greedy_score, moves = run_greedy(relocate=True)
        return greedy_book, SolverInfo("greedy", False, 0.0, greedy_score.total, "", "time limit",
                                       0, "time limit too small for the MILP; greedy used" + moved(moves))
    solution = build_and_solve(problem, milp_budget)
    result = solution.result
    if not result.has_solution:
        greedy_book, greedy_score, moves = run_greedy(relocate=True)
        return greedy_book, SolverInfo("greedy", False, 0.0, greedy_score.total, result.solver, result.status,
                                       solution.variables, "MILP gave no answer in time; greedy used" + moved(moves))
    book = Book(problem)
    map_solution(problem, book, solution)
    # Repair: what mapping could not hold, and what the MILP left in slack only because phase two
    # confined the pattern counts (or the LP was rounded down), goes through greedy.
    leftover = [job_id for job_id in all_jobs if job_id not in book.placements]
    still = place_greedily(problem, book, leftover) if leftover else []
    # Relocations that the per-node objective prefers to what mapping chose (the pooled terms'
    # errors).
    moves = local_moves(book)
    milp_score = score(problem, book, original)
    objective = milp_score.total
    note = (f"{len(leftover)} jobs left by the MILP or mapping went to greedy repair "
            f"({len(leftover) - len(still)} placed)" if leftover else "")
    if moves:
        note += f"{'; ' if note else ''}{moves} local move(s)"
    method = "milp"
    if policy.method == "auto":
        # Always run (not only when time is left): the plan must not depend on the wall clock.
        # Greedy's answer is relocated too: best-fit prices each job at the node it takes when it
        # takes it, and a later job can make an earlier choice the dearer one (ten seeds per list:
        # 242.7 against 244.0 GPUs unallocated at 130% on default, 325.0 against 327.0 on
        # constrained, 557.7 against 563.7 on multigpu; shares never move, so share-heavy lists
        # keep their plans).
        greedy_book, greedy_score, greedy_moves = run_greedy(relocate=True)
        # Kept by the state each answer leaves the nodes in (`objective.end_state_cost`, over the
        # nodes the two leave differently: 0.17 s of a 5,000-job cycle over every changed node), which
        # sees how shares split GPUs (by `evaluate`: 740.4 above, by the end state 735.7, no
        # relocation in either); on a tie greedy, whose ties break on purpose (`greedy._key`:
        # the tightest host fit), the MILP's wherever the solver happened to land.
        differ = [position for position, (mine, theirs) in enumerate(zip(book.caps, greedy_book.caps))
                  if not mine.same_free(theirs)]
        milp_end = end_state_cost(problem, book, differ, milp_score.jobs)
        greedy_end = end_state_cost(problem, greedy_book, differ, greedy_score.jobs)
        note += f"{'; ' if note else ''}end state: MILP {milp_end:.2f} vs greedy {greedy_end:.2f}"
        if greedy_end <= milp_end + 1e-9:
            book, objective, method = greedy_book, greedy_score.total, "greedy"
            note += "; greedy kept" + moved(greedy_moves)
    proven = method == "milp" and result.proven_optimal and not leftover and not moves
    return book, SolverInfo(method, proven, 0.0, objective, result.solver, result.status, solution.variables, note)
