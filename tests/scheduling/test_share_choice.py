"""Which GPU of a node a share takes: the one that leaves the least fragmentation for the task mix,
not the tightest fit (`patterns.ShareChoice`). A quarter-GPU share on a node with 0.3 and 0.7 GPUs
free: best fit leaves 0.05 on the first, which no quarter ever fills; the choice leaves 0.45 on the
second (a quarter still fits there and in the 0.3 beside it)."""

from __future__ import annotations

from dataclasses import replace

from engine_factories import FAST, gpu_node, job, snapshot

from scheduling.capacity import NodeCapacity, PartDemand
from scheduling.engine import schedule
from scheduling.model import WorkloadClass
from scheduling.patterns import ShareChoice, node_cost_batch, to_workload
from scheduling.validate import plan_violations

QUARTERS = (WorkloadClass(gpus=1, gpu_milli=250, weight=1.0, cpu_milli=1000, memory_mb=1024),)
QUARTER = PartDemand(1, 250, 0, False, 1000, 1024, ())


def node(used: dict[int, int]):
    return gpu_node("n1", gpus=4, model="T4", island_size=1, used=used)


def test_a_share_goes_where_it_leaves_no_dust_and_ties_go_to_the_tighter_gpu():
    cap = NodeCapacity(node({0: 700, 1: 300}))  # free: 300, 700, 1000, 1000
    assert cap.choose(QUARTER) == (0,)  # without a choice: best fit, 50 milli of dust
    cap.share_choice = ShareChoice(to_workload(QUARTERS))
    assert cap.choose(QUARTER) == (1,)
    # 0.7 -> 0.45 and a whole GPU -> 0.75 both leave nothing a quarter cannot use: the tighter one.
    workload = to_workload(QUARTERS)
    after = [[300, 450, 1000, 1000], [300, 700, 750, 1000], [50, 700, 1000, 1000]]
    cost = node_cost_batch(after, [cap.free_cpu - 1000] * 3, ["T4"] * 3, workload, [cap.free_mem - 1024] * 3)
    assert cost[0] == cost[1] < cost[2]


def test_one_gpu_free_value_needs_no_measure():
    calls = []

    def counting(cap, part, eligible):
        calls.append(eligible)
        return eligible[-1]

    cap = NodeCapacity(node({0: 500, 1: 500}))  # 500, 500, 1000, 1000: two values, asked
    cap.share_choice = counting
    assert cap.choose(QUARTER) == (3,) and len(calls) == 1
    cap = NodeCapacity(node({0: 500, 1: 500, 2: 500, 3: 500}))  # all 500: nothing to choose
    cap.share_choice = counting
    assert cap.choose(QUARTER) == (0,) and len(calls) == 1


def test_the_engine_places_the_share_where_the_choice_says():
    snap = snapshot(nodes=[node({0: 700, 1: 300})], pending=[job("q", gpu_milli=250, cpu_milli=1000)],
                    workload=QUARTERS)
    for method in ("greedy", "milp"):
        plan = schedule(snap, replace(FAST, method=method))
        assert not plan_violations(snap, plan)
        (placement,) = plan.placements
        assert [(p.node_id, p.gpu_indices) for p in placement.parts] == [("n1", (1,))], method
