"""The aggregated MILP: (demand class x target) counts plus (target x packing pattern) counts.

Variables
- x[c,t] integer: node-parts of class c placed on target t (a target is a shape of identical
  nodes or a cloud offer variant).
- y[c,g] integer: multi-node jobs of class c placed in fabric group g (parts = nodes * y).
- u[c] >= 0: explicit slack, members of class c left pending (priced at their waiting cost).
- z[t,p] integer: nodes of shape t that use whole-GPU pattern p; for small offers, instances
  launched with job mix p (exact per instance).
- n[t] integer: instances of a larger offer variant (pooled: fresh identical instances).
- o[t] integer: whole GPUs of target t opened for fractional jobs.

Equalities keep it honest (see DESIGN.md): sum_p z[t,p] == nodes in shape t (the empty pattern
included), and gangs of each item type placed == slots the patterns provide, so the solver can
neither reserve empty slots to game the fragmentation term nor place more than patterns allow.
Shares, CPU and memory are pooled per shape with dual-feasible-function bin cuts; mapping and
greedy repair absorb what pooling over-promises. Solved in phases (`_solve_in_two_phases`).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import pulp

from scheduling.model import WHOLE_GPU_MILLI
from scheduling.patterns import (
    ItemType, Pattern, enumerate_instance_patterns, enumerate_patterns, node_fragmentation_gpus, part_gpu_milli,
    stranding_coefficients,
)
from scheduling.plugins import owned
from scheduling.problem import Problem
from scheduling.solver import MIP_GAP_ABS, Costs, SolveResult, solve


PACKING_EFFICIENCY = 1.0
# Offers with at most this many GPUs get exact per-instance job mixes instead of pooled capacity.
SMALL_INSTANCE_GPUS = 2
# ... and at most this many demand classes on them (enumeration grows with both).
SMALL_INSTANCE_CLASSES = 40
# Above this many variables phase two (measured: 1.2 s at 2,344 variables, 5,000 Alibaba jobs)
# cannot finish within a sub-second cycle, so the LP is rounded and repaired instead.
PHASE_TWO_MAX_VARIABLES = 1500
# The full model runs after an unproven phase two only with at least this many times phase two's own
# time left. Where it found a better answer it took 0.9-4.0x phase two's time (30 cycles of the FGD
# protocol's engine run); given less, it ran to its limit for nothing (a 1,000-job service cycle:
# phase two 0.40 s, the full model 0.58 s to its limit, the answer not better, greedy's kept anyway).
FULL_MILP_TIME_FACTOR = 4.0
LP_TIME_LIMIT_S = 10.0


@dataclass
class AggregateSolution:
    # (class index, target index) -> node-parts placed
    parts: dict[tuple[int, int], int]
    # target index -> list of (pattern, how many nodes/instances use it)
    patterns: dict[int, list[tuple[Pattern, int]]]
    instances: dict[int, int]  # offer target index -> instances to launch
    result: SolveResult
    build_seconds: float
    variables: int
    patterns_by_target: dict[int, list[Pattern]] = field(default_factory=dict)


def item_type(part_gpus: int, nvlink: bool) -> ItemType:
    return (part_gpus, nvlink and part_gpus > 1)


def fabric_group(problem: Problem, target_index: int) -> str:
    target = problem.targets[target_index]
    if target.kind == "offer":
        return f"offer:{target.key}"
    return f"pool:{target.node.provider}:{target.node.pool}"


def build_and_solve(problem: Problem, time_limit_s: float) -> AggregateSolution:
    started = time.perf_counter()
    prob = pulp.LpProblem("whalezen_aggregate", pulp.LpMinimize)
    weights = problem.weights
    workload = problem.workload
    objective = Costs()

    x: dict[tuple[int, int], pulp.LpVariable] = {}
    by_target: dict[int, list[int]] = {}
    for demand_class in problem.classes:
        job = demand_class.demand
        for candidate in demand_class.candidates:
            c, t = demand_class.index, candidate.target
            upper = demand_class.size * max(1, job.nodes)
            x[c, t] = pulp.LpVariable(f"x_{c}_{t}", 0, upper, cat=pulp.LpInteger)
            objective.append((x[c, t], weights["money"] * candidate.money / max(1, job.nodes)
                              + weights["fragmentation"] * candidate.host_cost))
            by_target.setdefault(t, []).append(c)

    # Class totals: placed + slack == members.
    for demand_class in problem.classes:
        c = demand_class.index
        slack = pulp.LpVariable(f"u_{c}", 0, demand_class.size)
        objective.append((slack, demand_class.waiting_cost))
        nodes = max(1, demand_class.demand.nodes)
        targets_of_class = [cand.target for cand in demand_class.candidates]
        if nodes == 1:
            prob += pulp.lpSum(x[c, t] for t in targets_of_class) + slack == demand_class.size, f"class_{c}"
            continue
        groups: dict[str, list[int]] = {}
        for t in targets_of_class:
            groups.setdefault(fabric_group(problem, t), []).append(t)
        jobs_in_groups = []
        for number, (group, members) in enumerate(sorted(groups.items())):
            y = pulp.LpVariable(f"y_{c}_{number}", 0, demand_class.size, cat=pulp.LpInteger)
            jobs_in_groups.append(y)
            prob += pulp.lpSum(x[c, t] for t in members) == nodes * y, f"gang_{c}_{number}"
        prob += pulp.lpSum(jobs_in_groups) + slack == demand_class.size, f"class_{c}"

    patterns_by_target: dict[int, list[Pattern]] = {}
    z: dict[tuple[int, int], pulp.LpVariable] = {}
    offer_instances: dict[str, list[pulp.LpVariable]] = {}
    opened: dict[int, pulp.LpVariable] = {}
    for t, class_indices in sorted(by_target.items()):
        target = problem.targets[t]
        parts = {c: _candidate_part(problem, c, t) for c in class_indices}
        if target.kind == "offer":
            mixes = None
            if len(target.node.gpus) <= SMALL_INSTANCE_GPUS and len(class_indices) <= SMALL_INSTANCE_CLASSES \
                    and all(max(1, problem.classes[c].demand.nodes) == 1 for c in class_indices):
                mixes = enumerate_instance_patterns(target.rep, parts,
                                                    {c: problem.classes[c].size for c in class_indices})
            if mixes:
                instance_vars = _instance_mix_constraints(problem, prob, x, t, class_indices, mixes, objective, z)
                patterns_by_target[t] = [Pattern(items=(), gpus_used=m.gpus_busy, fragmentation_gpus=0.0)
                                         for m in mixes]
                offer_instances.setdefault(target.offer.id, []).extend(instance_vars)  # type: ignore[union-attr]
                continue
            instances_var = _offer_constraints(problem, prob, x, t, class_indices, parts, objective)
            z[t, 0] = instances_var
            patterns_by_target[t] = [Pattern(items=(), gpus_used=0, fragmentation_gpus=0.0)]
            offer_instances.setdefault(target.offer.id, []).append(instances_var)  # type: ignore[union-attr]
            continue
        whole_types = sorted({item_type(p.gpus, p.nvlink) for p in parts.values() if p.gpus and not p.fractional})
        patterns = enumerate_patterns(target.rep, whole_types, workload)
        patterns_by_target[t] = patterns
        total_whole = len([1 for p, m in enumerate(target.rep.free_milli)
                           if m >= WHOLE_GPU_MILLI and target.node.gpus[p].healthy])
        pattern_vars = []
        for number, pattern in enumerate(patterns):
            var = pulp.LpVariable(f"z_{t}_{number}", 0, target.count, cat=pulp.LpInteger)
            z[t, number] = var
            pattern_vars.append(var)
            objective.append((var, weights["fragmentation"] * pattern.fragmentation_gpus))
        instances = pulp.lpSum(pattern_vars)
        prob += instances == target.count, f"shape_{t}"
        for kind in whole_types:
            users = [c for c in class_indices if item_type(parts[c].gpus, parts[c].nvlink) == kind
                     and not parts[c].fractional and parts[c].gpus]
            slots = pulp.lpSum(pattern.count(kind) * z[t, n] for n, pattern in enumerate(patterns) if pattern.count(kind))
            prob += pulp.lpSum(x[c, t] for c in users) == slots, f"slots_{t}_{kind[0]}_{int(kind[1])}"
        _fractional_constraints(problem, prob, x, t, class_indices, parts, patterns, z, opened, objective,
                                workload, total_whole)
        cpu = pulp.lpSum(parts[c].cpu_milli * x[c, t] for c in class_indices if parts[c].cpu_milli)
        mem = pulp.lpSum(parts[c].memory_mb * x[c, t] for c in class_indices if parts[c].memory_mb)
        # Only part of a shape's pooled CPU and memory is usable: single nodes are bins, and
        # packing many bins to the brim is not possible (measured: at 99.5% of the pool the
        # mapping stranded a fifth of the jobs).
        cpu_pool, mem_pool = PACKING_EFFICIENCY * target.rep.free_cpu, PACKING_EFFICIENCY * target.rep.free_mem
        prob += cpu <= cpu_pool * instances, f"cpu_{t}"
        prob += mem <= mem_pool * instances, f"mem_{t}"
        _host_bin_cuts(prob, x, t, class_indices, parts, target.rep.free_cpu, target.rep.free_mem, target.count)
        _stranding(problem, prob, x, t, class_indices, parts, objective, workload)
        # Gangs only use the CPU and memory of nodes whose pattern holds gangs, not of empty ones.
        gang_classes = [c for c in class_indices if parts[c].gpus and not parts[c].fractional]
        busy = pulp.lpSum(z[t, n] for n, pattern in enumerate(patterns) if pattern.gpus_used)
        if gang_classes:
            prob += pulp.lpSum(parts[c].cpu_milli * x[c, t] for c in gang_classes) <= cpu_pool * busy, \
                f"cpu_gangs_{t}"
            prob += pulp.lpSum(parts[c].memory_mb * x[c, t] for c in gang_classes) <= mem_pool * busy, \
                f"mem_gangs_{t}"

    for number, (offer_id, variables) in enumerate(sorted(offer_instances.items())):
        launchable = next(t.count for t in problem.targets if t.offer is not None and t.offer.id == offer_id)
        prob += pulp.lpSum(variables) <= launchable, f"launchable_{number}"
    # A pool's instance cap is shared by all its instance types.
    for number, (remaining, offer_ids) in enumerate(problem.group_caps):
        variables = [v for offer_id in offer_ids for v in offer_instances.get(offer_id, ())]
        if variables:
            prob += pulp.lpSum(variables) <= remaining, f"launch_group_{number}"

    _tenant_constraints(problem, prob, x)
    _team_quota_constraints(problem, prob, x)
    prob += pulp.LpAffineExpression(list(objective.items()))
    build_seconds = time.perf_counter() - started
    result = _solve_in_two_phases(problem, prob, z, patterns_by_target, started, time_limit_s)
    solution = AggregateSolution(parts={}, patterns={}, instances={}, result=result, build_seconds=build_seconds,
                                 variables=len(prob.variables()), patterns_by_target=patterns_by_target)
    if not result.has_solution:
        return solution
    for key, var in x.items():
        value = int(round(var.value() or 0))
        if value:
            solution.parts[key] = value
    for (t, number), var in z.items():
        value = int(round(var.value() or 0))
        if value:
            solution.patterns.setdefault(t, []).append((patterns_by_target[t][number], value))
            if problem.targets[t].kind == "offer":
                solution.instances[t] = solution.instances.get(t, 0) + value
    return solution


def _instance_mix_constraints(problem: Problem, prob: pulp.LpProblem, x: dict, t: int, class_indices: list[int],
                              mixes: list, objective: "Costs", z: dict) -> list[pulp.LpVariable]:
    """Small instances: one integer per job mix (exact per instance, see `enumerate_instance_patterns`)."""
    target = problem.targets[t]
    weights = problem.weights
    overhead = problem.snapshot.weights.launch_overhead_hours * target.instance_price
    idle = 0.5 * target.node.price_per_gpu_hour * problem.reference_hours
    gpus = len(target.node.gpus)
    variables = []
    for number, mix in enumerate(mixes):
        var = pulp.LpVariable(f"z_{t}_{number}", 0, target.count, cat=pulp.LpInteger)
        z[t, number] = var
        variables.append(var)
        objective.append((var, weights["money"] * (overhead + idle * (gpus - mix.gpus_busy))))
    for c in class_indices:
        slots = pulp.LpAffineExpression([(z[t, n], mix.count(c)) for n, mix in enumerate(mixes) if mix.count(c)])
        prob += x[c, t] == slots, f"mix_{t}_{c}"
    return variables


def _offer_constraints(problem: Problem, prob: pulp.LpProblem, x: dict, t: int, class_indices: list[int],
                       parts: dict, objective: "Costs") -> pulp.LpVariable:
    """Instances of one offer variant: fresh and identical, so pooled capacity needs no patterns.

    Gang sizes that divide the instance's GPU count (1, 2, 4, 8 of 8) pack exactly by pooled
    count; others are rare and left to mapping and repair. Each instance pays its launch overhead
    and half the price of the GPUs it leaves idle over the reference run time, as in `objective`.
    """
    target = problem.targets[t]
    weights = problem.weights
    gpus_per_instance = len(target.node.gpus)
    instances = pulp.LpVariable(f"n_{t}", 0, target.count, cat=pulp.LpInteger)
    overhead = problem.snapshot.weights.launch_overhead_hours * target.instance_price
    idle = 0.5 * target.node.price_per_gpu_hour * problem.reference_hours
    objective.append((instances, weights["money"] * (overhead + idle * gpus_per_instance)))
    gangs = [c for c in class_indices if parts[c].gpus and not parts[c].fractional]
    for c in gangs:
        objective.append((x[c, t], -weights["money"] * idle * parts[c].gpus))
    used = pulp.LpAffineExpression([(x[c, t], parts[c].gpus) for c in gangs])
    fractional = [c for c in class_indices if parts[c].fractional]
    if fractional:
        opened = pulp.LpVariable(f"o_{t}", 0, None, cat=pulp.LpInteger)
        objective.append((opened, -weights["money"] * idle + 1e-3))
        prob += opened <= pulp.lpSum(x[c, t] for c in fractional), f"open_used_{t}"
        _dff_cuts(prob, x, t, fractional, parts, opened, 0.0)
        used += opened
    prob += used <= gpus_per_instance * instances, f"gpus_{t}"
    cpu = pulp.LpAffineExpression([(x[c, t], parts[c].cpu_milli) for c in class_indices if parts[c].cpu_milli])
    mem = pulp.LpAffineExpression([(x[c, t], parts[c].memory_mb) for c in class_indices if parts[c].memory_mb])
    prob += cpu <= target.rep.free_cpu * instances, f"cpu_{t}"
    prob += mem <= target.rep.free_mem * instances, f"mem_{t}"
    _host_bin_cuts(prob, x, t, class_indices, parts, target.rep.free_cpu, target.rep.free_mem, instances)
    return instances


def _host_bin_cuts(prob: pulp.LpProblem, x: dict, t: int, class_indices: list[int], parts: dict,
                   cpu_capacity: int, mem_capacity: int, bins) -> None:
    """Each node or instance is a bin for CPU and for memory: the same dual-feasible-function cuts
    as for GPU shares. Pooled totals alone let the solver put 22 jobs on 16 small instances
    whose memory could hold 18 (measured on the optimality-gap instances)."""
    for resource, capacity in (("cpu", cpu_capacity), ("mem", mem_capacity)):
        if capacity <= 0:
            continue
        for k in (1, 2, 3):
            weighted = []
            for c in class_indices:
                need = parts[c].cpu_milli if resource == "cpu" else parts[c].memory_mb
                weight = _dff(min(1.0, need / capacity), k)
                if weight > 0:
                    weighted.append((x[c, t], weight))
            if weighted:
                prob += pulp.LpAffineExpression(weighted) <= bins, f"{resource}_dff{k}_{t}"


def _dff_cuts(prob: pulp.LpProblem, x: dict, t: int, fractional: list[int], parts: dict,
              opened: pulp.LpVariable, room: float | list[int]) -> None:
    """Bin-packing cuts: for dual feasible functions u_k (Fekete & Schepers), the shares on one
    GPU satisfy sum u_k(share) <= u_k(room). Without them the solver filled a shape's GPUs to 99.9%
    of their milli (0.81 + 0.23 "fitting" on one GPU) and mapping stranded the rest. `room`: the
    shares already free on partly used GPUs (summed over the shape), as a list of milli values."""
    for k in (1, 2, 3, 4):
        weighted = [(x[c, t], _dff(parts[c].milli / WHOLE_GPU_MILLI, k)) for c in fractional]
        weighted = [(var, w) for var, w in weighted if w > 0]
        if weighted:
            free_room = sum(_dff(m / WHOLE_GPU_MILLI, k) for m in room) if isinstance(room, list) else room
            prob += pulp.LpAffineExpression(weighted) <= opened + free_room, f"frac_dff{k}_{t}"


def _solve_in_two_phases(problem: Problem, prob: pulp.LpProblem, z: dict, patterns_by_target: dict,
                         started: float, time_limit_s: float) -> SolveResult:
    """LP relaxation for a bound, then the MILP with pattern counts confined near the LP values.

    The full MILP spends most of its time finding a first integer point (measured: 1 s at 1,000
    jobs, 4 s at 5,000) while its LP bound is already within a dollar of the optimum. Confining
    each pattern count to the floor or ceiling of its LP value leaves a small MILP that solves in
    a fraction of that; comparing its objective with the LP bound proves (to the gap tolerance)
    when it is optimal for the full model too. When it is not and enough time is left (a quarter of
    the limit, and FULL_MILP_TIME_FACTOR times what phase two took), the full MILP runs with what
    remains and the better answer is kept.
    """
    policy = problem.policy

    def left() -> float:
        return time_limit_s - (time.perf_counter() - started)

    # The LP is cheap (0.04 s CPU at 5,000 jobs) and everything after it hangs on it, so its limit
    # is generous: on a loaded machine a tight wall-clock limit turned it into "no answer".
    relaxed = solve(prob, preference=policy.solver, time_limit_s=max(left(), LP_TIME_LIMIT_S),
                    mip_gap=policy.mip_gap, relax=True)
    if not relaxed.proven_optimal or relaxed.objective is None:  # only an optimal LP is a bound
        return solve(prob, preference=policy.solver, time_limit_s=left(), mip_gap=policy.mip_gap)
    bound = relaxed.objective
    lp_values = {var.name: var.varValue for var in prob.variables()}

    def rounded(why: str) -> SolveResult:
        # Round the LP down; mapping and greedy repair place the rest. Deterministic, unlike a
        # MILP stopped by the clock.
        for var in prob.variables():
            var.varValue = math.floor((lp_values[var.name] or 0.0) + 1e-6)
        return SolveResult(relaxed.solver, True, False, time.perf_counter() - started,
                           f"LP rounded down ({why}); LP bound {bound:.4f}", None)

    if len(lp_values) > PHASE_TWO_MAX_VARIABLES:
        return rounded(f"{len(lp_values)} variables: phase two would not finish in time")
    _bound_patterns_near_lp(z, patterns_by_target)
    phase_two_started = time.perf_counter()
    fixed = solve(prob, preference=policy.solver, time_limit_s=left(), mip_gap=policy.mip_gap)
    if not fixed.has_solution:
        return rounded(f"{fixed.status} in phase two")
    tolerance = max(MIP_GAP_ABS, policy.mip_gap * abs(bound))
    proven = fixed.has_solution and fixed.objective is not None and fixed.objective - bound <= tolerance
    seconds = time.perf_counter() - started
    phase_two_s = time.perf_counter() - phase_two_started
    if proven or left() < max(0.25 * time_limit_s, FULL_MILP_TIME_FACTOR * phase_two_s):
        return SolveResult(fixed.solver, fixed.has_solution, proven, seconds,
                           f"{fixed.status}; LP bound {bound:.4f}", fixed.objective)
    kept = {var.name: var.varValue for var in prob.variables()}
    for var in z.values():
        var.lowBound, var.upBound = 0, var.upBound_original  # type: ignore[attr-defined]
    full = solve(prob, preference=policy.solver, time_limit_s=left(), mip_gap=policy.mip_gap)
    if full.has_solution and (not fixed.has_solution or (full.objective or 0) <= (fixed.objective or 0)):
        return SolveResult(full.solver, True, full.proven_optimal, time.perf_counter() - started,
                           f"{full.status} (full MILP); LP bound {bound:.4f}", full.objective)
    for var in prob.variables():
        var.varValue = kept[var.name]
    return SolveResult(fixed.solver, fixed.has_solution, False, time.perf_counter() - started,
                       f"{fixed.status}; full MILP not better; LP bound {bound:.4f}", fixed.objective)


def _bound_patterns_near_lp(z: dict, patterns_by_target: dict) -> None:
    """Confine every pattern count to the floor or ceiling of its LP value."""
    for t, patterns in patterns_by_target.items():
        for n in range(len(patterns)):
            var = z[t, n]
            value = var.varValue or 0.0
            var.upBound_original = var.upBound  # type: ignore[attr-defined]
            var.lowBound, var.upBound = math.floor(value + 1e-6), math.ceil(value - 1e-6)


def _candidate_part(problem: Problem, c: int, t: int):
    for candidate in problem.classes[c].candidates:
        if candidate.target == t:
            return candidate.part
    raise KeyError((c, t))


def _fractional_constraints(problem, prob, x, t, class_indices, parts, patterns, z, opened, objective, workload,
                            total_whole) -> None:
    fractional = [c for c in class_indices if parts[c].fractional]
    if not fractional:
        return
    target = problem.targets[t]
    cap = target.rep
    partial = [m for p, m in enumerate(cap.free_milli) if 0 < m < WHOLE_GPU_MILLI and cap.node.gpus[p].healthy]
    leftover = pulp.lpSum((total_whole - pattern.gpus_used) * z[t, n] for n, pattern in enumerate(patterns))
    open_gpus = pulp.LpVariable(f"o_{t}", 0, None, cat=pulp.LpInteger)
    opened[t] = open_gpus
    prob += open_gpus <= leftover, f"open_{t}"
    prob += open_gpus <= pulp.lpSum(x[c, t] for c in fractional), f"open_used_{t}"
    milli = pulp.LpAffineExpression([(x[c, t], parts[c].milli) for c in fractional])
    prob += milli <= target.count * sum(partial) + WHOLE_GPU_MILLI * open_gpus, f"frac_{t}"
    _dff_cuts(prob, x, t, fractional, parts, open_gpus, [m for m in partial for _ in range(target.count)])
    # An opened GPU stops being a whole free GPU: charge what taking one more whole GPU off an
    # untouched node of this shape adds to its FGD (the evaluated objective counts it that way).
    whole = [p for p, m in enumerate(cap.free_milli) if m >= WHOLE_GPU_MILLI]
    cost = 0.0
    if whole:
        after = list(cap.free_milli)
        after[whole[0]] = 0
        cost = (node_fragmentation_gpus(after, cap, workload)
                - node_fragmentation_gpus(list(cap.free_milli), cap, workload))
    objective.append((open_gpus, problem.weights["fragmentation"] * max(0.0, cost) + 1e-3))


def _stranding(problem: Problem, prob: pulp.LpProblem, x: dict, t: int, class_indices: list[int], parts: dict,
               objective: "Costs", workload) -> None:
    """CPU/memory stranding of shape t, pooled over its nodes: s >= 0 and, per resource,
    s >= (free GPU - placed GPU - (free CPU - placed CPU) / ratio) in GPUs over the shape; charged
    alpha x s (the constant stranding before the cycle left out). Per node it is convex, so the
    pooled value is a lower bound of the per-node sum that `objective.evaluate` charges (exact
    for the one-node shapes that partly used nodes form)."""
    alpha, cpu_ratio, mem_ratio = stranding_coefficients(workload)
    weight = problem.weights["fragmentation"] * alpha
    if not weight:
        return
    target = problem.targets[t]
    cap, count = target.rep, target.count
    gpu_total = sum(cap.free_milli) * count
    stranded = pulp.LpVariable(f"strand_{t}", 0, None)
    for name, ratio, free, need in (("cpu", cpu_ratio, cap.free_cpu, "cpu_milli"),
                                    ("mem", mem_ratio, cap.free_mem, "memory_mb")):
        if ratio <= 0:
            continue
        terms = [(x[c, t], (-part_gpu_milli(parts[c]) + getattr(parts[c], need) / ratio) / WHOLE_GPU_MILLI)
                 for c in class_indices]
        terms = [(var, coefficient) for var, coefficient in terms if coefficient]
        constant = (gpu_total - free * count / ratio) / WHOLE_GPU_MILLI
        if not terms and constant <= 0:
            continue
        prob += stranded >= pulp.LpAffineExpression(terms, constant=constant), f"strand_{name}_{t}"
    objective.append((stranded, weight))


def _dff(share: float, k: int) -> float:
    """Fekete-Schepers dual feasible function u^(k): superadditive, u(1) = 1."""
    scaled = (k + 1) * share
    if abs(scaled - round(scaled)) < 1e-9:
        return share
    return math.floor(scaled) / k


def _tenant_constraints(problem: Problem, prob: pulp.LpProblem, x: dict) -> None:
    """Cumulative tenant GPU / CU quotas and budgets over everything placed this cycle."""
    tenants = problem.ctx.tenants
    pricing = problem.pricing
    for number, (name, budget) in enumerate(sorted(tenants.items())):
        gpu_terms, cu_terms, money_terms = [], [], []
        for demand_class in problem.classes:
            job = demand_class.demand
            if job.tenant != name:
                continue
            nodes = max(1, job.nodes)
            for candidate in demand_class.candidates:
                var = x[demand_class.index, candidate.target]
                model = problem.targets[candidate.target].gpu_model
                gpu_terms.append((var, pricing.gpu_share(job, model) / nodes))
                cu_terms.append((var, pricing.compute_units(job, model) / nodes))
                money_terms.append((var, candidate.money / nodes))
        if not gpu_terms:
            continue
        if budget.gpu_quota is not None:
            prob += pulp.LpAffineExpression(gpu_terms) <= max(0.0, budget.gpu_quota - budget.gpus_in_use), \
                f"quota_gpu_{number}"
        if budget.cu_quota is not None:
            prob += pulp.LpAffineExpression(cu_terms) <= max(0.0, budget.cu_quota - budget.cu_in_use), \
                f"quota_cu_{number}"
        if budget.remaining_budget is not None:
            prob += pulp.LpAffineExpression(money_terms) <= max(0.0, budget.remaining_budget), f"budget_{number}"


def _team_quota_constraints(problem: Problem, prob: pulp.LpProblem, x: dict) -> None:
    """Quotas of owned capacity (scheduling/quota.py), per team and managed flavor: what the cycle
    places on owned nodes fits in what the team may still take (its nominal only, in the nominal
    phase or without borrowing; a job that cannot be preempted never borrows), and all borrowers
    together take no more than the cohort lends (p[team] >= use beyond the never-lent reserve)."""
    ledger, ctx, pricing = problem.ctx.quota, problem.ctx, problem.pricing
    if ledger is None:
        return
    terms: dict[tuple[str, str], list[tuple[pulp.LpVariable, float]]] = {}
    fixed_terms: dict[tuple[str, str], list[tuple[pulp.LpVariable, float]]] = {}
    for demand_class in problem.classes:
        job = demand_class.demand
        nodes = max(1, job.nodes)
        for candidate in demand_class.candidates:
            target = problem.targets[candidate.target]
            if not owned(target):
                continue
            share = pricing.gpu_share(job, target.gpu_model) / nodes
            for flavor, amount in ledger.amounts(target.gpu_model, share):
                term = (x[demand_class.index, candidate.target], amount)
                terms.setdefault((job.tenant, flavor), []).append(term)
                if not job.preemptible:
                    fixed_terms.setdefault((job.tenant, flavor), []).append(term)
    strict = ctx.nominal_only or not ctx.borrowing
    for number, ((team, flavor), team_terms) in enumerate(sorted(terms.items())):
        room = ledger.nominal_left(team, flavor) if strict else ledger.available(team, flavor)
        prob += pulp.LpAffineExpression(team_terms) <= room, f"team_quota_{number}"
        if not strict and (team, flavor) in fixed_terms:
            prob += pulp.LpAffineExpression(fixed_terms[team, flavor]) <= ledger.nominal_left(team, flavor), \
                f"team_quota_fixed_{number}"
    if strict:
        return
    for number, flavor in enumerate(ledger.flavors):
        teams = sorted(team for team, f in terms if f == flavor)
        if len(teams) < 2:
            continue  # one team's own row already holds its share of the pool
        pool_use = []
        for team in teams:
            use = pulp.LpVariable(f"pool_use_{number}_{len(pool_use)}", lowBound=0)
            reserved = ledger.limits_of(team, flavor).reserved
            prob += use >= pulp.LpAffineExpression(terms[team, flavor]) + ledger.usage[team, flavor] - reserved, \
                f"pool_use_{number}_{len(pool_use)}"
            pool_use.append(use)
        others = sum(max(0.0, ledger.usage[t, flavor] - ledger.limits_of(t, flavor).reserved)
                     for t in ledger.teams if t not in teams)
        prob += pulp.lpSum(pool_use) <= max(0.0, ledger.pool(flavor) - others), f"cohort_pool_{number}"
