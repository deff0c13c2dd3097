"""The aggregated MILP against brute force, its patterns, aggregation and mapping, and fallbacks."""

from __future__ import annotations

import itertools
import random

import pytest

from engine_factories import DETERMINISM_LIMIT_S, gpu_node, job, offer, snapshot
from scheduling.capacity import NodeCapacity
from scheduling.engine import schedule
from scheduling.exact import optimality_gap
from scheduling.model import Policy
from scheduling.patterns import enumerate_patterns, fits, island_free_counts
from scheduling.problem import build_problem
from scheduling.targets import Pricing
from scheduling.validate import plan_violations

MONEY_ONLY = Policy(scores={"money": 1.0, "waiting": 1.0}, method="milp", time_limit_s=10.0,
                    preemption=False, defragmentation=False)


def brute_force_cost(snap, policy) -> float:
    """Cheapest money + waiting over every assignment of whole-GPU single-node jobs to nodes."""
    problem = build_problem(snap, policy)
    pricing = Pricing(snap)
    best = float("inf")
    nodes = list(snap.nodes)
    for choice in itertools.product(range(len(nodes) + 1), repeat=len(snap.pending)):
        free = {n.id: sum(1 for g in n.gpus if g.milli_used == 0) for n in nodes}
        cost = 0.0
        ok = True
        for demand, pick in zip(snap.pending, choice):
            demand_class = problem.classes[problem.class_of[demand.job_id]]
            if pick == len(nodes):
                cost += demand_class.waiting_cost
                continue
            node = nodes[pick]
            free[node.id] -= demand.gpus
            if free[node.id] < 0:
                ok = False
                break
            hours = pricing.runtime_hours(demand, node.gpus[0].model)
            cost += demand.gpus * node.price_per_gpu_hour * hours
        if ok:
            best = min(best, cost)
    return best


@pytest.mark.parametrize("seed", range(6))
def test_milp_matches_brute_force_on_tiny_instances(seed):
    rng = random.Random(seed)
    nodes = [gpu_node(f"n{i}", gpus=rng.choice([2, 4]), island_size=1, price=rng.choice([0.5, 1.0, 3.0]),
                      model=rng.choice(["A100", "H100"])) for i in range(3)]
    pending = [job(f"j{k}", gpus=rng.choice([1, 2, 3]), priority=rng.choice([0, 1]),
                   expected_duration_hours=rng.choice([1.0, 5.0]), submitted_at=k) for k in range(4)]
    snap = snapshot(nodes, pending)
    plan = schedule(snap, MONEY_ONLY)
    assert plan.solver.method == "milp"
    assert plan.solver.objective == pytest.approx(brute_force_cost(snap, MONEY_ONLY), rel=1e-6, abs=1e-6)
    assert plan_violations(snap, plan) == []


def test_faster_gpus_cost_less_per_unit_of_work():
    # An H100 (CU 2.0) at $3/h finishes in half the time of an A100 at $2/h: $3 vs $4 for the job.
    snap = snapshot([gpu_node("a100", price=2.0), gpu_node("h100", model="H100", price=3.0)],
                    [job("j", expected_duration_hours=2.0)])
    plan = schedule(snap, MONEY_ONLY)
    assert plan.placement_for("j").node_id == "h100"


def test_compute_units_pick_the_cheapest_mix():
    # 2 CU: 2 A100 at $1 for 1 h ($2) or 8 T4 (CU 0.25) at $0.2 for 1 h ($1.6).
    snap = snapshot([gpu_node("a", price=1.0), gpu_node("t", model="T4", memory_mb=16384, price=0.2)],
                    [job("cu", gpus=0, compute_units=2.0)])
    plan = schedule(snap, MONEY_ONLY)
    placement = plan.placement_for("cu")
    assert placement.node_id == "t" and len(placement.gpu_indices) == 8


def test_global_decision_beats_per_job_greedy():
    # Greedy gives the cheaper island node to the first job, and the NVLink job then fits nowhere;
    # the MILP sees that only the island node holds the NVLink job and sends the other to PCIe.
    nodes = [gpu_node("island", gpus=4, island_size=4, price=1.0), gpu_node("pcie", gpus=4, island_size=1, price=1.5)]
    pending = [job("small", gpus=4, submitted_at=1), job("nvl", gpus=4, interconnect="nvlink", submitted_at=2)]
    plan = schedule(snapshot(nodes, pending), MONEY_ONLY)
    assert plan.placement_for("nvl").node_id == "island"
    assert plan.placement_for("small").node_id == "pcie"


def test_patterns_respect_nvlink_islands():
    assert fits([4, 4], [(4, True), (4, True)])
    assert not fits([4, 4], [(8, True)])
    assert fits([4, 4], [(3, True), (1, False), (4, False)])
    assert not fits([4, 2], [(3, True), (3, True)])
    cap = NodeCapacity(gpu_node("n", gpus=8, island_size=4, used={0: 1000}))
    assert island_free_counts(cap) == [4, 3]
    patterns = enumerate_patterns(cap, [(4, True), (2, False)], None)
    assert patterns[0].items == ()  # the empty pattern comes first
    assert all(fits([4, 3], [kind for kind, n in p.items for _ in range(n)]) for p in patterns)
    assert {p.items for p in patterns} >= {(((4, True), 1),), (((2, False), 1), ((4, True), 1))}


def test_aggregation_groups_identical_nodes_and_maps_back_deterministically():
    nodes = [gpu_node(f"a{i:02d}", gpus=8) for i in range(20)] + [gpu_node(f"t{i}", gpus=2, model="T4") for i in range(5)]
    nodes.append(gpu_node("a-used", gpus=8, used={0: 500}))
    pending = [job(f"j{k}", gpus=[1, 2, 4, 8][k % 4], submitted_at=k) for k in range(30)]
    snap = snapshot(nodes, pending)
    problem = build_problem(snap, Policy())
    assert sorted(t.count for t in problem.targets if t.kind == "node") == [1, 5, 20]
    policy = Policy(method="milp", preemption=False, defragmentation=False, time_limit_s=DETERMINISM_LIMIT_S)
    first = schedule(snap, policy)
    second = schedule(snap, policy)
    assert first.placements == second.placements
    assert plan_violations(snap, first) == []
    assert len(first.placements) == 30


def test_greedy_fallback_when_time_limit_is_tiny():
    nodes = [gpu_node(f"n{i}") for i in range(10)]
    pending = [job(f"j{k}", gpus=2, submitted_at=k) for k in range(20)]
    snap = snapshot(nodes, pending)
    plan = schedule(snap, Policy(method="milp", time_limit_s=0.0, preemption=False, defragmentation=False))
    assert plan.solver.method == "greedy"
    assert not plan.solver.proven_optimal
    assert "greedy used" in plan.solver.note
    assert len(plan.placements) == 20 and plan_violations(snap, plan) == []


def test_auto_reports_which_method_it_kept():
    snap = snapshot([gpu_node("n")], [job("j")])
    plan = schedule(snap, Policy(preemption=False, defragmentation=False))
    assert plan.solver.method in ("milp", "greedy")
    assert "vs greedy" in plan.solver.note


def test_cloud_launch_when_on_prem_is_full():
    snap = snapshot([gpu_node("n", gpus=2)], [job("big", gpus=8, interconnect="nvlink")],
                    [offer("cheap", price=20.0, launchable=1), offer("dear", price=40.0, launchable=3)])
    plan = schedule(snap, MONEY_ONLY)
    placement = plan.placement_for("big")
    (launch,) = plan.launches
    assert launch.offer_id == "cheap" and launch.count == 1 and launch.job_ids == ("big",)
    assert placement.launch_id == launch.launch_id and placement.gpu_indices == tuple(range(8))


def test_exact_model_and_gap_on_a_small_instance():
    nodes = [gpu_node("a", gpus=4, island_size=2, price=1.0), gpu_node("b", gpus=2, price=2.0)]
    pending = [job("x", gpus=2, interconnect="nvlink"), job("y", gpus=1, gpu_milli=500), job("z", gpus=2)]
    snap = snapshot(nodes, pending, [offer("o", gpus=4, price=10.0, launchable=1)])
    result = optimality_gap(snap, Policy(time_limit_s=10.0))
    assert result["exact_proven"] is True
    assert result["gap_pct"] <= 1.0
    exact = schedule(snap, Policy(method="exact", time_limit_s=10.0, preemption=False, defragmentation=False))
    assert exact.solver.method == "exact" and plan_violations(snap, exact) == []


def test_cbc_fallback_solver_gives_the_same_optimum():
    rng = random.Random(3)
    nodes = [gpu_node(f"n{i}", gpus=rng.choice([2, 4]), island_size=1, price=rng.choice([0.5, 1.0, 3.0]))
             for i in range(3)]
    pending = [job(f"j{k}", gpus=rng.choice([1, 2, 3]), submitted_at=k) for k in range(4)]
    snap = snapshot(nodes, pending)
    cbc = Policy(scores={"money": 1.0, "waiting": 1.0}, method="milp", solver="cbc", time_limit_s=10.0,
                 preemption=False, defragmentation=False)
    plan = schedule(snap, cbc)
    assert plan.solver.method == "milp" and plan.solver.solver == "PULP_CBC_CMD"
    assert plan.solver.objective == pytest.approx(brute_force_cost(snap, cbc), rel=1e-6, abs=1e-6)
