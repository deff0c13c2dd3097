"""Run a PuLP problem on HiGHS (through highspy) or CBC, always under a time limit.

`prob.status` can read Optimal when CBC stopped at its limit with an incumbent, so whether the
answer is proven comes from `prob.sol_status` (LpSolutionOptimal only when the solver proved it).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import pulp

# Stop when the answer is provably within this many objective units (dollars) of the optimum:
# cents do not justify branching for seconds, and the objective is in dollars.
MIP_GAP_ABS = 0.01


class Costs(dict):
    """Objective coefficients by variable. `append((var, cost))` adds to what the variable has:
    `LpAffineExpression(list)` would silently keep only the last of two entries for a variable."""

    def append(self, item: tuple[pulp.LpVariable, float]) -> None:
        var, cost = item
        self[var] = self.get(var, 0.0) + cost


@dataclass(frozen=True, slots=True)
class SolveResult:
    solver: str
    has_solution: bool  # an integer-feasible assignment is loaded in the variables
    proven_optimal: bool
    seconds: float
    status: str
    objective: float | None


def _make_solver(name: str, time_limit_s: float, mip_gap: float, relax: bool) -> pulp.LpSolver | None:
    limit = max(0.05, float(time_limit_s))
    if name == "HiGHS":
        # No `threads` option: HiGHS sizes one thread pool per process at first use, and a later
        # instance asking for another size gets status kNotset (seen when a benchmark's own HiGHS
        # solve ran first in the same process). The default keeps every caller compatible.
        solver = pulp.HiGHS(mip=not relax, msg=False, timeLimit=limit, gapRel=mip_gap, gapAbs=MIP_GAP_ABS)
    else:
        # CBC takes whole seconds only; it may overrun a sub-second limit by up to one second.
        solver = pulp.PULP_CBC_CMD(mip=not relax, msg=False, timeLimit=max(1, round(limit)), gapRel=mip_gap,
                                   gapAbs=MIP_GAP_ABS, threads=1)
    return solver if solver.available() else None


def solver_order(preference: str) -> list[str]:
    if preference == "cbc":
        return ["PULP_CBC_CMD"]
    if preference == "highs":
        return ["HiGHS"]
    return ["HiGHS", "PULP_CBC_CMD"]


def solve(prob: pulp.LpProblem, *, preference: str, time_limit_s: float, mip_gap: float,
          relax: bool = False) -> SolveResult:
    """Solve `prob` (its LP relaxation when `relax`); the first available solver in order wins."""
    started = time.perf_counter()
    last_status = "no solver available"
    for name in solver_order(preference):
        solver = _make_solver(name, time_limit_s - (time.perf_counter() - started), mip_gap, relax)
        if solver is None:
            continue
        try:
            prob.solve(solver)
        except pulp.PulpSolverError as error:  # a broken solver install: try the next one
            last_status = f"{name} failed: {error}"
            continue
        seconds = time.perf_counter() - started
        status = pulp.LpStatus.get(prob.status, str(prob.status))
        has_solution = prob.sol_status in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible)
        proven = prob.sol_status == pulp.LpSolutionOptimal
        objective = pulp.value(prob.objective) if has_solution else None
        return SolveResult(name, has_solution, proven, seconds, status, objective)
    return SolveResult("", False, False, time.perf_counter() - started, last_status, None)
