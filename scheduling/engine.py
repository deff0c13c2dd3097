"""The scheduling cycle: `schedule(snapshot, policy) -> Plan`.

1. Build the problem: node shapes, offer variants, demand classes, filtered candidates.
2. Place (`place`): method "auto" runs the aggregated MILP (mapped back to nodes, repaired
   greedily) and the greedy placer and keeps the better under one objective; "milp" keeps the
   MILP's answer; "greedy" and "exact" (per-node model) run alone. `Plan.solver` says which
   answer was used, whether it was proven optimal, and why.
3. For jobs still held back by capacity: preemption plan, then defragmentation plan.
4. Consolidation: empty rented instances whose jobs cost less elsewhere.
5. Explain every job left pending.
"""

from __future__ import annotations

import time

from scheduling.book import Book
from scheduling.capacity import NodeCapacity
from scheduling.consolidate import plan_consolidation
from scheduling.defrag import plan_defragmentation
from scheduling.explain import explain_pending
from scheduling.greedy import place_greedily
from scheduling.improve import improve
from scheduling.mapping import map_solution
from scheduling.milp import build_and_solve
from scheduling.model import Migration, Plan, Policy, Preemption, Reason, ReasonCode, Snapshot, SolverInfo
from scheduling.objective import evaluate
from scheduling.preemption import plan_preemptions
from scheduling.problem import Problem, build_problem

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
})


def schedule(snapshot: Snapshot, policy: Policy | None = None) -> Plan:
    started = time.perf_counter()
    policy = policy or Policy()
    problem = build_problem(snapshot, policy)
    original = [cap.copy() for cap in problem.capacities]
    book, info = place(problem, original, started)

    pending = [job.job_id for job in sorted(snapshot.pending, key=lambda j: (j.submitted_at, j.job_id))
               if job.job_id not in book.placements]
    reasons: dict[str, Reason] = explain_pending(problem, book, pending)
    # Not for jobs held back by quota, budget or an invalid demand, nor those for which waiting
    # is cheaper than any fit.
    blocked = [job_id for job_id in pending if reasons[job_id].code not in NOT_CAPACITY_CODES
               and not reasons[job_id].data.get("waiting_cheaper")]
    preemptions: tuple[Preemption, ...] = ()
    migrations: tuple[Migration, ...] = ()
    if policy.preemption and blocked:
        preemptions = plan_preemptions(problem, book, blocked)
        _explain_preemptions(reasons, preemptions)
    if policy.defragmentation and blocked:
        waiting = [j for j in blocked if reasons[j].code != ReasonCode.WAITING_FOR_PREEMPTION]
        migrations = plan_defragmentation(problem, book, waiting)
        _explain_migrations(reasons, migrations)

    if policy.consolidation and snapshot.running:
        busy = {p.victim_job_id for p in preemptions} | {m.job_id for m in migrations}
        # One budget for every move of the cycle: consolidation gets what defragmentation left.
        budget = min(policy.max_consolidation_moves, policy.max_moves_per_cycle - len(migrations))
        migrations += plan_consolidation(problem, book, busy, budget)

    book.compact_instances()
    placements = tuple(book.placements[j.job_id] for j in sorted(snapshot.pending, key=lambda j: j.job_id)
                       if j.job_id in book.placements)
    info = SolverInfo(info.method, info.proven_optimal, time.perf_counter() - started, info.objective,
                      info.solver, info.status, info.variables, info.note)
    return Plan(placements=placements, launches=book.launches(), preemptions=preemptions,
                migrations=migrations, pending=dict(sorted(reasons.items())), solver=info)


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
    model if time is left) mapped to nodes and repaired greedily, and the greedy answer too; both
    are scored by `objective.evaluate` and the better one is kept. The MILP sees the whole queue
    at once (money, quotas, budgets, offer quotas); greedy best-fit packs nodes tightly. Neither
    dominates, so keeping the better is never worse than either. "milp": the MILP's answer
    whenever it has one. "greedy": greedy alone. "exact": the per-node model.
    """
    policy = problem.policy
    all_jobs = [job.job_id for job in problem.snapshot.pending]
    if policy.method == "exact":
        from scheduling.exact import solve_exact  # only for measuring: keep it off the import path
        return solve_exact(problem, original, policy.time_limit_s)

    def run_greedy() -> tuple[Book, float]:
        book = Book(problem)
        place_greedily(problem, book, all_jobs)
        return book, evaluate(problem, book, original)

    if policy.method == "greedy" or not problem.classes:
        greedy_book, greedy_objective = run_greedy()
        return greedy_book, SolverInfo("greedy", False, 0.0, greedy_objective, "", "greedy by policy")

    # The MILP (model build and solves) gets half the cycle's limit, whatever building the
    # problem took: on a loaded machine that keeps the answer from depending on the load more
    # than the solver's own time limit already does. Mapping, repair and greedy follow.
    milp_budget = MILP_SHARE * policy.time_limit_s
    pairs = sum(len(c.candidates) for c in problem.classes)
    if pairs > MAX_MILP_PAIRS:
        greedy_book, greedy_objective = run_greedy()
        return greedy_book, SolverInfo("greedy", False, 0.0, greedy_objective, "", "model too large", 0,
                                       f"{pairs} (class, target) pairs > {MAX_MILP_PAIRS}: greedy used")
    if milp_budget <= 0.02:
        greedy_book, greedy_objective = run_greedy()
        return greedy_book, SolverInfo("greedy", False, 0.0, greedy_objective, "", "time limit",
                                       0, "time limit too small for the MILP; greedy used")
    solution = build_and_solve(problem, milp_budget)
    result = solution.result
    if not result.has_solution:
        greedy_book, greedy_objective = run_greedy()
        return greedy_book, SolverInfo("greedy", False, 0.0, greedy_objective, result.solver, result.status,
                                       solution.variables, "MILP gave no answer in time; greedy used")
    book = Book(problem)
    map_solution(problem, book, solution)
    # Repair: what mapping could not hold, and what the MILP left in slack only because phase two
    # confined the pattern counts (or the LP was rounded down), goes through greedy.
    leftover = [job_id for job_id in all_jobs if job_id not in book.placements]
    still = place_greedily(problem, book, leftover) if leftover else []
    objective = evaluate(problem, book, original)
    note = (f"{len(leftover)} jobs left by the MILP or mapping went to greedy repair "
            f"({len(leftover) - len(still)} placed)" if leftover else "")
    method = "milp"
    if policy.method == "auto":
        # Always run (not only when time is left): the plan must not depend on the wall clock.
        greedy_book, greedy_objective = run_greedy()
        note += f"{'; ' if note else ''}MILP {objective:.2f} vs greedy {greedy_objective:.2f}"
        if greedy_objective < objective - 1e-9:
            book, objective, method = greedy_book, greedy_objective, "greedy"
            note += "; greedy kept"
    # Relocations that the per-node objective prefers to what mapping (or greedy) chose.
    moves = improve(problem, book, original)
    if moves:
        improved = evaluate(problem, book, original)
        note += f"{'; ' if note else ''}{moves} local move(s) {objective:.2f} -> {improved:.2f}"
        objective = improved
    proven = method == "milp" and result.proven_optimal and not leftover and not moves
    return book, SolverInfo(method, proven, 0.0, objective, result.solver, result.status, solution.variables, note)
