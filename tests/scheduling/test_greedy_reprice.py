"""The engine's greedy placer prices every node as it is now, not as it was when the cycle started.

One cycle places a whole batch. Priced from the cycle-start state, the second job of a batch saw a
node the first had just opened as if it were still empty (an 8-GPU node whose only-home value the
first gang had already spent was charged for it again; a share saw a GPU the first share had opened
as still whole), so the batch spread where one job at a time would not have. The reference here is
the plainest placer there is: each job, in the greedy's own order, to the node where the node cost
(`patterns.node_cost_batch`: fragmentation over both look-ahead horizons, less the scarce capacity
it keeps) plus the stranding term grows least, recomputed after every placement.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from engine_factories import FAST, gpu_node, job, snapshot

from scheduling.capacity import NodeCapacity, PartDemand
from scheduling.engine import schedule
from scheduling.greedy import greedy_order
from scheduling.model import WorkloadClass
from scheduling.patterns import node_cost_batch, stranded_gpus, stranding_coefficients
from scheduling.problem import build_problem
from scheduling.validate import plan_violations

GREEDY = replace(FAST, method="greedy")
MIX = (WorkloadClass(gpus=1, gpu_milli=1000, weight=6.0, cpu_milli=8_000, memory_mb=32 * 1024),
       WorkloadClass(gpus=2, gpu_milli=1000, weight=2.0, cpu_milli=16_000, memory_mb=64 * 1024),
       WorkloadClass(gpus=1, gpu_milli=500, weight=3.0, cpu_milli=4_000, memory_mb=16 * 1024),
       WorkloadClass(gpus=8, gpu_milli=1000, weight=1.0, cpu_milli=100_000, memory_mb=600 * 1024))


def one_at_a_time(snap, priced_now: bool = True) -> dict[str, str]:
    """Each job, in the greedy's order, to the node whose cost grows least as it is now (or, with
    `priced_now` False, as it was when the cycle started: the prices greedy used before)."""
    problem = build_problem(snap, GREEDY)
    alpha, cpu_ratio, mem_ratio = stranding_coefficients(problem.workload)
    caps = [NodeCapacity(node) for node in snap.nodes]
    start = [NodeCapacity(node) for node in snap.nodes]
    chosen = {}
    for job_id in greedy_order(problem, [j.job_id for j in snap.pending]):
        demand = problem.jobs_by_id[job_id]
        milli = min(demand.gpu_milli, 1000)
        part = PartDemand(demand.gpus, milli, 0, False, demand.cpu_milli, demand.memory_mb, ())
        best = None
        for cap, at_start in zip(caps, start):
            if cap.choose(part) is None:
                continue
            priced = cap if priced_now else at_start  # the start state has at least as much room
            positions = priced.choose(part)
            after = list(priced.free_milli)
            for p in positions:
                after[p] = after[p] - milli if part.fractional else 0
            model = priced.node.gpus[0].model
            now_cost, after_cost = node_cost_batch(
                [list(priced.free_milli), after], [priced.free_cpu, priced.free_cpu - part.cpu_milli], [model, model],
                problem.workload, [priced.free_mem, priced.free_mem - part.memory_mb])
            total = sum(priced.free_milli)
            strand = (stranded_gpus(total - (part.gpus * milli), priced.free_cpu - part.cpu_milli,
                                    priced.free_mem - part.memory_mb, cpu_ratio, mem_ratio)
                      - stranded_gpus(total, priced.free_cpu, priced.free_mem, cpu_ratio, mem_ratio))
            cost = round(float(after_cost - now_cost) + alpha * strand, 6)
            if best is None or cost < best[0]:
                best = (cost, cap)
        if best is not None:
            cap = best[1]
            cap.take(cap.choose(part), part)
            chosen[job_id] = cap.node.id
    return chosen


def cluster(r: random.Random):
    """Four 8-GPU nodes, each its own shape (different CPU, some GPUs busy)."""
    nodes = []
    for i in range(4):
        busy = r.sample(range(8), r.choice([0, 0, 1, 3]))
        nodes.append(gpu_node(f"n{i}", gpus=8, cpu_milli=96_000 + 8_000 * i, memory=768 * 1024,
                              used={g: 1000 for g in busy}))
    return nodes


def batch(r: random.Random, shares: bool):
    sizes = [1, 1, 2, 2, 4] + ([0.5, 0.5, 0.3] if shares else [])
    jobs = []
    for i in range(r.randint(3, 6)):
        size = r.choice(sizes)
        gpus, milli = (1, int(size * 1000)) if size < 1 else (int(size), 1000)
        jobs.append(job(f"j{i}", gpus=gpus, gpu_milli=milli, cpu_milli=r.choice([4_000, 8_000, 24_000]),
                        memory_mb=r.choice([16, 64]) * 1024, submitted_at=float(i)))
    return jobs


@pytest.mark.parametrize("shares", [False, True], ids=["gangs", "gangs-and-shares"])
def test_a_batch_lands_where_one_job_at_a_time_on_the_current_nodes_would(shares: bool) -> None:
    differs_from_cycle_start = 0
    for seed in range(25):
        r = random.Random(seed)
        snap = snapshot(cluster(r), batch(r, shares), workload=MIX, task_mix=MIX)
        plan = schedule(snap, GREEDY)
        assert plan_violations(snap, plan) == []
        placed = {p.job_id: p.parts[0].node_id for p in plan.placements}
        expected = one_at_a_time(snap)
        assert placed == expected, seed
        differs_from_cycle_start += expected != one_at_a_time(snap, priced_now=False)
    assert differs_from_cycle_start, "no batch where the order of placing mattered: the test shows nothing"


@pytest.mark.parametrize("method", ["auto", "greedy"])
def test_of_two_node_kinds_a_gang_fills_equally_well_it_takes_the_one_with_less_memory(method: str) -> None:
    """An 8-GPU gang leaves nothing free on either 8-GPU node, so every measure scores them the same;
    the node with twice the memory is what a later memory-hungry task needs. Listed first, it used to
    win the tie (the shape's number), and on the multi-GPU list the engine trailed whalezen-online."""
    nodes = [gpu_node("roomy", gpus=8, cpu_milli=96_000, memory=768 * 1024),
             gpu_node("tight", gpus=8, cpu_milli=96_000, memory=384 * 1024)]
    mix = (WorkloadClass(gpus=8, gpu_milli=1000, weight=1.0, cpu_milli=64_000, memory_mb=256 * 1024),)
    snap = snapshot(nodes, [job("gang", gpus=8, cpu_milli=64_000, memory_mb=256 * 1024)], workload=mix)
    plan = schedule(snap, replace(FAST, method=method))
    assert plan.placement_for("gang").parts[0].node_id == "tight"
