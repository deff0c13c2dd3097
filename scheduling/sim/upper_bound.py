"""Upper bound on what any placement could allocate: LP relaxation of offline packing.

Given every task that arrived (known in advance, placed all at once, fractional counts allowed),
maximise the allocated milli-GPU subject to each node shape's total CPU, memory and milli-GPU,
GPU-model constraints, and valid cuts that keep the relaxation honest: a task needs a node with
at least as many GPUs (and as much CPU and memory) as it asks for, and shares of GPUs must pack
into whole GPUs, written as dual-feasible-function cuts (tasks over half a GPU take one GPU each,
three 0.4 shares do not fit on one GPU, ...).  Nodes with identical
shape are aggregated, so the LP has (task types x node shapes) variables whatever the count.
The optimum is an upper bound on the allocation of every online or batch policy.
"""

from __future__ import annotations

from collections import Counter
from typing import Sequence

import pulp

from scheduling.sim.cluster import MILLI, NodeSpec, TaskSpec


DFF_ORDERS = (1, 2, 3, 4, 5, 6)


def dff(milli: int, k: int) -> float:
    """Fekete-Schepers dual feasible function u_k of a share x = milli/1000 of one GPU.

    ``u_k(x) = x`` if ``(k+1) x`` is an integer, else ``floor((k+1) x) / k``.  Any set of shares
    that fits on one GPU has u_k values summing to at most 1, so ``sum u_k(task) <= GPUs`` is a
    valid cut: with k = 1 a task over half a GPU counts as a whole one (at most one per GPU), with
    k = 4 a 0.81 share still counts as a whole GPU and a 0.47 share as half, and so on.
    """
    x = milli * (k + 1)
    if x % MILLI == 0:
        return milli / MILLI
    return (x // MILLI) / k


def allocation_upper_bound(nodes: Sequence[NodeSpec], tasks: Sequence[TaskSpec],
                           time_limit_s: float = 30.0) -> float:
    """Largest allocatable milli-GPU (LP optimum); a float, an upper bound on any policy."""
    shapes = Counter((n.cpu_milli, n.memory_mib, n.num_gpu, n.model) for n in nodes)
    types = Counter(t.type_key for t in tasks if t.total_milli > 0)
    prob = pulp.LpProblem("alloc_upper_bound", pulp.LpMaximize)
    x: dict[tuple[int, int], pulp.LpVariable] = {}
    shape_list = sorted(shapes)
    type_list = sorted(types)
    for ti, (cpu, mem, num, milli, models) in enumerate(type_list):
        for si, (scpu, smem, sgpu, model) in enumerate(shape_list):
            if num > sgpu or cpu > scpu or mem > smem or (models and model not in models):
                continue
            x[ti, si] = pulp.LpVariable(f"x_{ti}_{si}", lowBound=0)
    if not x:
        return 0.0
    prob += pulp.lpSum(v * type_list[ti][2] * type_list[ti][3] for (ti, si), v in x.items())
    for ti in range(len(type_list)):
        vs = [v for (t, _), v in x.items() if t == ti]
        if vs:
            prob += pulp.lpSum(vs) <= types[type_list[ti]]
    for si, (scpu, smem, sgpu, _model) in enumerate(shape_list):
        cnt = shapes[shape_list[si]]
        here = [(ti, v) for (ti, s), v in x.items() if s == si]
        if not here:
            continue
        prob += pulp.lpSum(v * type_list[ti][0] for ti, v in here) <= scpu * cnt
        prob += pulp.lpSum(v * type_list[ti][1] for ti, v in here) <= smem * cnt
        prob += pulp.lpSum(v * type_list[ti][2] * type_list[ti][3] for ti, v in here) <= sgpu * MILLI * cnt
        for k in DFF_ORDERS:
            terms = [v * type_list[ti][2] * dff(type_list[ti][3], k) for ti, v in here]
            if any(dff(type_list[ti][3], k) > 0 for ti, _ in here):
                prob += pulp.lpSum(terms) <= sgpu * cnt
    solver = pulp.HiGHS(msg=False, timeLimit=time_limit_s)
    prob.solve(solver)
    if pulp.LpStatus[prob.status] != "Optimal":
        raise RuntimeError(f"upper-bound LP not solved: {pulp.LpStatus[prob.status]}")
    return float(pulp.value(prob.objective))
