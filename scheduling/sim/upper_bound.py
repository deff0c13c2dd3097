"""Upper bound on what any placement could allocate: LP relaxation of offline packing.

Given every task that arrived (known in advance, placed all at once, fractional counts allowed),
maximise the allocated milli-GPU subject to each node shape's total CPU, memory and milli-GPU,
GPU-model constraints, and two valid cuts that keep the relaxation honest: a task needs a node
with at least as many GPUs (and as much CPU and memory) as it asks for, and tasks taking more
than half a GPU can share no GPU with each other (at most one per GPU).  Nodes with identical
shape are aggregated, so the LP has (task types x node shapes) variables whatever the count.
The optimum is an upper bound on the allocation of every online or batch policy.
"""

from __future__ import annotations

from collections import Counter
from typing import Sequence

import pulp

from scheduling.sim.cluster import MILLI, NodeSpec, TaskSpec


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
        big = [v * type_list[ti][2] for ti, v in here if type_list[ti][3] > MILLI // 2]
        if big:
            prob += pulp.lpSum(big) <= sgpu * cnt
    solver = pulp.HiGHS(msg=False, timeLimit=time_limit_s)
    prob.solve(solver)
    if pulp.LpStatus[prob.status] != "Optimal":
        raise RuntimeError(f"upper-bound LP not solved: {pulp.LpStatus[prob.status]}")
    return float(pulp.value(prob.objective))
