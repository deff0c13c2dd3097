"""The exact per-node model: one binary per (job, node or instance, island or GPU).

Only for small instances: DESIGN.md measured 10 to 24 s for 200 jobs on the 1,213-node cluster.
It exists to measure how far the aggregated model (plus mapping and repair) is from the optimum:
`optimality_gap(snapshot, policy)` solves both and compares them with the one objective of
`objective.evaluate`. Its fragmentation term is exactly the one `objective.evaluate` scores (FGD of
each owned node by the number of whole free GPUs taken), so its proven optimum is a true lower
bound for every other method's evaluated objective.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import pulp

from scheduling.book import Book
from scheduling.capacity import NodeCapacity, PartDemand
from scheduling.model import WHOLE_GPU_MILLI, Policy, Snapshot, SolverInfo
from scheduling.objective import evaluate
from scheduling.patterns import (
    node_fragmentation_gpus, part_gpu_milli, stranding_coefficients,
)
from scheduling.problem import Problem
from scheduling.solver import Costs, solve
from scheduling.targets import offer_node


@dataclass
class _Unit:
    cap: NodeCapacity
    target: int
    position: int | None  # node position, or None for an instance slot
    slot: int = 0  # instance slot number for offers


def _units(problem: Problem) -> list[_Unit]:
    units: list[_Unit] = []
    wanted: dict[int, int] = {}
    for demand_class in problem.classes:
        for candidate in demand_class.candidates:
            if problem.targets[candidate.target].kind == "offer":
                wanted[candidate.target] = wanted.get(candidate.target, 0) + demand_class.size * max(
                    1, demand_class.demand.nodes)
    for index, target in enumerate(problem.targets):
        if target.kind == "node":
            units.extend(_Unit(problem.capacities[p], index, p) for p in target.members)
        elif index in wanted:
            slots = min(target.count, wanted[index])
            units.extend(_Unit(NodeCapacity(offer_node(target.offer, target.spot)), index, None, s)  # type: ignore[arg-type]
                         for s in range(slots))
    return units


def solve_exact(problem: Problem, original: list[NodeCapacity], time_limit_s: float) -> tuple[Book, SolverInfo]:
    started = time.perf_counter()
    weights = problem.weights
    workload = problem.workload
    units = _units(problem)
    prob = pulp.LpProblem("whalezen_exact", pulp.LpMinimize)
    # Coefficients are summed per variable: LpAffineExpression(list) keeps only the last duplicate.
    objective: Costs = Costs()
    # choice[(job, unit, gpu-or-island key)] -> (variable, part, positions-or-None)
    choices: dict[str, list[tuple[pulp.LpVariable, int, PartDemand, object]]] = {}
    per_unit_whole: dict[int, list[tuple[pulp.LpVariable, int]]] = {}
    per_island: dict[tuple[int, object], list[tuple[pulp.LpVariable, int]]] = {}
    per_gpu: dict[tuple[int, int], list[tuple[pulp.LpVariable, int]]] = {}
    per_unit_any: dict[int, list[pulp.LpVariable]] = {}
    cpu: dict[int, list[tuple[pulp.LpVariable, int]]] = {}
    mem: dict[int, list[tuple[pulp.LpVariable, int]]] = {}
    tenant_terms: dict[str, list[tuple[pulp.LpVariable, float, float, float]]] = {}
    strand_terms: dict[int, list[tuple[pulp.LpVariable, PartDemand]]] = {}
    for demand_class in problem.classes:
        by_target = {c.target: c for c in demand_class.candidates}
        for job_id in demand_class.job_ids:
            job = problem.jobs_by_id[job_id]
            options = choices.setdefault(job_id, [])
            for u, unit in enumerate(units):
                candidate = by_target.get(unit.target)
                if candidate is None:
                    continue
                part, cap = candidate.part, unit.cap
                model = problem.targets[unit.target].gpu_model
                # Per job, not per class: a class may pool jobs of different durations.
                job_money = candidate.hourly * problem.pricing.runtime_hours(job, model)
                money = weights["money"] * job_money / max(1, job.nodes)
                if unit.position is not None:  # the part's host cost, as the MILP and `evaluate`
                    money += weights["fragmentation"] * candidate.host_cost
                share = problem.pricing.gpu_share(job, model) / max(1, job.nodes)
                cus = problem.pricing.compute_units(job, model) / max(1, job.nodes)
                keys: list[object]
                if part.gpus == 0:
                    keys = ["cpu"]
                elif part.fractional:
                    keys = [p for p in range(len(cap.node.gpus)) if cap.eligible(p, part)]
                elif part.nvlink and part.gpus > 1:
                    keys = sorted({cap.node.gpus[p].nvlink_island for p in range(len(cap.node.gpus))
                                   if cap.eligible(p, part) and cap.node.gpus[p].nvlink_island is not None}, key=str)
                else:
                    keys = ["any"] if cap.choose(part) is not None else []
                for key in keys:
                    var = pulp.LpVariable(f"a_{len(objective)}_{u}", cat=pulp.LpBinary)
                    objective.append((var, money))
                    options.append((var, u, part, key))
                    per_unit_any.setdefault(u, []).append(var)
                    cpu.setdefault(u, []).append((var, part.cpu_milli))
                    if unit.position is not None:
                        strand_terms.setdefault(u, []).append((var, part))
                    mem.setdefault(u, []).append((var, part.memory_mb))
                    tenant_terms.setdefault(job.tenant, []).append((var, share, cus, job_money / max(1, job.nodes)))
                    if part.gpus and not part.fractional:
                        per_unit_whole.setdefault(u, []).append((var, part.gpus))
                        if key != "any":
                            per_island.setdefault((u, key), []).append((var, part.gpus))
                    elif part.fractional:
                        per_gpu.setdefault((u, key), []).append((var, part.milli))  # type: ignore[arg-type]

    # Each job: all parts or none, at most one part per unit.
    placed: dict[str, pulp.LpVariable] = {}
    for demand_class in problem.classes:
        for job_id in demand_class.job_ids:
            job = problem.jobs_by_id[job_id]
            # Explicit slack (DESIGN.md): "constant minus placed" lets a relative-gap stop return
            # answers dollars worse, because the constant inflates the objective the gap is taken of.
            slack = pulp.LpVariable(f"s_{len(placed)}", cat=pulp.LpBinary)
            placed[job_id] = slack
            objective.append((slack, demand_class.waiting_cost))
            options = choices.get(job_id, [])
            prob += pulp.lpSum(v for v, *_ in options) + max(1, job.nodes) * slack == max(1, job.nodes)
            by_unit: dict[int, list] = {}
            for v, u, _, _ in options:
                by_unit.setdefault(u, []).append(v)
            if max(1, job.nodes) > 1:
                for u, vs in by_unit.items():
                    prob += pulp.lpSum(vs) <= 1

    opened: dict[tuple[int, int], pulp.LpVariable] = {}
    for u, unit in enumerate(units):
        cap = unit.cap
        is_instance = unit.position is None
        open_var = pulp.LpVariable(f"y_{u}", cat=pulp.LpBinary) if is_instance else None
        scale = open_var if open_var is not None else 1
        whole_positions = [p for p, m in enumerate(cap.free_milli) if m >= WHOLE_GPU_MILLI and cap.node.gpus[p].healthy]
        for p in whole_positions:
            if (u, p) in per_gpu:
                opened[u, p] = pulp.LpVariable(f"w_{u}_{p}", cat=pulp.LpBinary)
        for (uu, p), terms in per_gpu.items():
            if uu != u:
                continue
            capacity = WHOLE_GPU_MILLI * opened[u, p] if (u, p) in opened else cap.free_milli[p]
            prob += pulp.LpAffineExpression(terms) <= capacity
            if (u, p) in opened:  # a GPU counts as opened only when a share is on it
                prob += opened[u, p] <= pulp.lpSum(v for v, _ in terms)
        opened_here = [opened[u, p] for p in whole_positions if (u, p) in opened]
        used = pulp.LpAffineExpression(per_unit_whole.get(u, [])) + pulp.lpSum(opened_here)
        prob += used <= len(whole_positions) * scale if is_instance else used <= len(whole_positions)
        for (uu, island), terms in per_island.items():
            if uu == u:
                island_gpus = [p for p in whole_positions if cap.node.gpus[p].nvlink_island == island]
                prob += pulp.LpAffineExpression(terms) + pulp.lpSum(opened[u, p] for p in island_gpus
                                                                   if (u, p) in opened) <= len(island_gpus)
        if u in cpu:
            prob += pulp.LpAffineExpression(cpu[u]) <= (cap.free_cpu * open_var if is_instance else cap.free_cpu)
            prob += pulp.LpAffineExpression(mem[u]) <= (cap.free_mem * open_var if is_instance else cap.free_mem)
        if is_instance:
            for v in per_unit_any.get(u, []):
                prob += v <= open_var
        # Fragmentation: FGD of the node by whole GPUs used (one indicator per level), as patterns.
        levels = range(len(whole_positions) + 1)
        if weights["fragmentation"] and not is_instance and len(whole_positions) and (u in per_unit_whole or opened_here):
            before = node_fragmentation_gpus(list(cap.free_milli), cap, workload)
            level_vars = [pulp.LpVariable(f"l_{u}_{n}", cat=pulp.LpBinary) for n in levels]
            prob += pulp.lpSum(level_vars) == 1
            prob += pulp.lpSum(n * v for n, v in zip(levels, level_vars)) == used
            for n, v in zip(levels, level_vars):
                after = list(cap.free_milli)
                for p in whole_positions[:n]:
                    after[p] = 0
                objective.append((v, weights["fragmentation"] * (node_fragmentation_gpus(after, cap, workload) - before)))
        if not is_instance and u in strand_terms:
            _stranding(prob, objective, u, cap, strand_terms[u], weights["fragmentation"], workload)
        if is_instance:
            target = problem.targets[unit.target]
            overhead = problem.snapshot.weights.launch_overhead_hours * target.instance_price
            idle_cost = 0.5 * target.node.price_per_gpu_hour * problem.reference_hours
            objective.append((open_var, weights["money"] * (overhead + idle_cost * len(whole_positions))))
            for v, k in per_unit_whole.get(u, []):
                objective.append((v, -weights["money"] * idle_cost * k))
            for v in opened_here:  # a GPU shared out to fractional jobs is not idle either
                objective.append((v, -weights["money"] * idle_cost))
            unit.open_var = open_var  # type: ignore[attr-defined]

    for offer_id in sorted({t.offer.id for t in problem.targets if t.offer is not None}):
        slots = [unit.open_var for unit in units if unit.position is None  # type: ignore[attr-defined]
                 and problem.targets[unit.target].offer.id == offer_id]  # type: ignore[union-attr]
        if slots:
            launchable = next(t.count for t in problem.targets if t.offer is not None and t.offer.id == offer_id)
            prob += pulp.lpSum(slots) <= launchable
    for remaining, offer_ids in problem.group_caps:  # a pool's cap, shared by its instance types
        slots = [unit.open_var for unit in units if unit.position is None  # type: ignore[attr-defined]
                 and problem.targets[unit.target].offer.id in offer_ids]  # type: ignore[union-attr]
        if slots:
            prob += pulp.lpSum(slots) <= remaining
    for tenant, terms in sorted(tenant_terms.items()):
        budget = problem.ctx.tenants.get(tenant)
        if budget is None:
            continue
        if budget.gpu_quota is not None:
            prob += pulp.lpSum(v * s for v, s, _, _ in terms) <= max(0.0, budget.gpu_quota - budget.gpus_in_use)
        if budget.cu_quota is not None:
            prob += pulp.lpSum(v * c for v, _, c, _ in terms) <= max(0.0, budget.cu_quota - budget.cu_in_use)
        if budget.remaining_budget is not None:
            prob += pulp.lpSum(v * d for v, _, _, d in terms) <= max(0.0, budget.remaining_budget)
    prob += pulp.LpAffineExpression(list(objective.items()))
    result = solve(prob, preference=problem.policy.solver, time_limit_s=time_limit_s - (time.perf_counter() - started),
                   mip_gap=problem.policy.mip_gap)
    book = Book(problem)
    if result.has_solution:
        _commit(problem, book, units, choices)
    value = evaluate(problem, book, original)
    return book, SolverInfo("exact", result.proven_optimal, time.perf_counter() - started, value, result.solver,
                            result.status, len(prob.variables()),
                            f"per-node model objective {result.objective}" if result.objective is not None else "")


def _commit(problem: Problem, book: Book, units: list[_Unit], choices: dict) -> None:
    """Turn the chosen binaries into concrete GPUs, units in order (fractional shares last)."""
    instance_of: dict[int, object] = {}
    picks = {job_id: [(u, part, key) for var, u, part, key in options if (var.value() or 0) > 0.5]
             for job_id, options in choices.items()}

    def order(job_id: str) -> tuple:
        # Islands first, then other gangs, then shares: the order the model's counts assume.
        part = picks[job_id][0][1]
        return (not (part.nvlink and part.gpus > 1), part.fractional, -part.gpus, job_id)

    for job_id in sorted((j for j in picks if picks[j]), key=order):
        picked = picks[job_id]
        job = problem.jobs_by_id[job_id]
        slots = []
        for u, part, key in picked:
            unit = units[u]
            if unit.position is not None:
                cap = book.caps[unit.position]
                instance = None
            else:
                if u not in instance_of:
                    instance_of[u] = book.launch(unit.target)
                instance = instance_of[u]
                cap = instance.cap  # type: ignore[union-attr]
            if part.fractional:
                positions: tuple[int, ...] | None = (key,) if cap.free_milli[key] >= part.milli else cap.choose(part)
            elif part.nvlink and part.gpus > 1:
                positions = _island_positions(cap, part, key) or cap.choose(part)
            else:
                positions = cap.choose(part)
            if positions is None:
                slots = []
                break
            slots.append((cap, positions, instance))
        if slots:
            book.commit(job, problem.targets[units[picked[0][0]].target], slots, picked[0][1])


def _island_positions(cap: NodeCapacity, part: PartDemand, island: object) -> tuple[int, ...] | None:
    free = [p for p in range(len(cap.node.gpus)) if cap.node.gpus[p].nvlink_island == island and cap.eligible(p, part)]
    return tuple(free[: part.gpus]) if len(free) >= part.gpus else None


def optimality_gap(snapshot: Snapshot, policy: Policy | None = None) -> dict[str, float | bool | str]:
    """Objective of the default engine vs the exact per-node model, on one (small) snapshot.

    Returns both objectives, the gap in percent of the exact objective's magnitude, and whether
    the exact optimum was proven (the gap is only meaningful when it was).
    """
    from scheduling.engine import schedule

    policy = policy or Policy()
    fast = schedule(snapshot, policy)
    exact = schedule(snapshot, replace(policy, method="exact", time_limit_s=max(policy.time_limit_s, 30.0),
                                       preemption=False, defragmentation=False))
    a, b = fast.solver.objective or 0.0, exact.solver.objective or 0.0
    gap = 0.0 if abs(a - b) < 1e-9 else 100.0 * (a - b) / max(abs(b), 1e-9)
    return {"engine_objective": a, "exact_objective": b, "gap_pct": gap, "engine_method": fast.solver.method,
            "exact_proven": exact.solver.proven_optimal}


def _stranding(prob: pulp.LpProblem, objective: Costs, u: int, cap: NodeCapacity,
               terms: list[tuple[pulp.LpVariable, PartDemand]], weight: float, workload) -> None:
    """CPU/memory stranding of one owned node, exactly as `objective.stranding_change`:
    s >= 0, s >= stranded GPUs after (per resource), charged alpha x s (the stranding before the
    cycle is a constant: the plan is scored by `objective.evaluate`)."""
    alpha, cpu_ratio, mem_ratio = stranding_coefficients(workload)
    if not alpha or not weight:
        return
    stranded = pulp.LpVariable(f"strand_{u}", 0, None)
    gpu_total = sum(cap.free_milli)
    for ratio, free, need in ((cpu_ratio, cap.free_cpu, "cpu_milli"), (mem_ratio, cap.free_mem, "memory_mb")):
        if ratio <= 0:
            continue
        expression = [(var, (-part_gpu_milli(part) + getattr(part, need) / ratio) / WHOLE_GPU_MILLI)
                      for var, part in terms]
        prob += stranded >= pulp.LpAffineExpression(expression, constant=(gpu_total - free / ratio) / WHOLE_GPU_MILLI)
    objective.append((stranded, weight * alpha))
