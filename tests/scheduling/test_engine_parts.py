"""Smaller pieces: GPU choice, packing cuts, instance mixes, gangs, shares, CU quotas, LP rounding."""

from __future__ import annotations

import dataclasses
import itertools
import time
import types

import pytest

import scheduling.milp as milp
from engine_factories import FAST, budget, gpu_node, job, offer, snapshot
from scheduling.capacity import NodeCapacity, PartDemand
from scheduling.engine import schedule
from scheduling.model import Policy, ReasonCode
from scheduling.patterns import enumerate_instance_patterns
from scheduling.validate import plan_violations


def part(gpus=1, milli=1000, nvlink=False, cpu=0, mem=0, models=()):
    return PartDemand(gpus=gpus, milli=milli, min_gpu_memory_mb=0, nvlink=nvlink, cpu_milli=cpu, memory_mb=mem,
                      allowed_models=models)


def test_gpu_choice_prefers_the_tightest_island_and_the_fullest_shared_gpu():
    cap = NodeCapacity(gpu_node("n", gpus=8, island_size=4, used={0: 1000}))
    assert cap.choose(part(gpus=2, nvlink=True)) == (1, 2)  # the island with 3 free, not the one with 4
    assert cap.choose(part(gpus=4, nvlink=True)) == (4, 5, 6, 7)
    assert cap.choose(part(gpus=5, nvlink=True)) is None
    assert cap.choose(part(gpus=5)) == (1, 2, 3, 4, 5)  # spread only when no island holds it
    shared = NodeCapacity(gpu_node("s", gpus=3, island_size=1, used={0: 300, 1: 600}))
    assert shared.choose(part(milli=400)) == (1,)  # 400 free beats 700 free and a whole GPU
    assert NodeCapacity(gpu_node("u", gpus=2, unhealthy=(0,), used={1: 1000})).choose(part()) is None


def test_dual_feasible_functions_are_superadditive():
    shares = [i / 20 for i in range(1, 20)]
    for k in (1, 2, 3, 4):
        assert milp._dff(1.0, k) == pytest.approx(1.0)
        for a, b in itertools.product(shares, shares):
            if a + b <= 1.0 + 1e-9:
                assert milp._dff(a, k) + milp._dff(b, k) <= milp._dff(min(1.0, a + b), k) + 1e-9


def test_instance_mixes_respect_gpus_cpu_and_memory():
    cap = NodeCapacity(gpu_node("i", gpus=1, cpu_milli=16000, memory=64 * 1024))
    parts = {0: part(milli=600, cpu=4000, mem=40 * 1024), 1: part(milli=300, cpu=4000, mem=10 * 1024),
             2: part(cpu=15000)}
    mixes = enumerate_instance_patterns(cap, parts, {0: 3, 1: 3, 2: 1})
    jobs = {mix.jobs for mix in mixes}
    assert ((0, 1), (1, 1)) in jobs  # 0.6 + 0.3 on one GPU
    assert ((0, 2),) not in jobs  # 1.2 GPUs
    assert ((1, 3),) in jobs and ((1, 4),) not in jobs  # only 3 members exist
    assert ((0, 1), (2, 1)) not in jobs  # gang takes the only GPU (and the CPU)


def test_multi_node_gang_on_fast_fabric_nodes():
    nodes = [gpu_node(f"ib{i}", fast_fabric=True) for i in range(2)] + [gpu_node("eth", fast_fabric=False)]
    snap = snapshot(nodes, [job("ddp", gpus=16, nodes=2, interconnect="nvlink")])
    plan = schedule(snap, FAST)
    placement = plan.placement_for("ddp")
    assert {p.node_id for p in placement.parts} == {"ib0", "ib1"}
    assert all(len(p.gpu_indices) == 8 for p in placement.parts)
    assert plan_violations(snap, plan) == []


def test_a_gang_spans_nodes_of_one_pool_that_differ_in_labels_or_running_jobs():
    # Each node its own shape: a Kubernetes node's hostname label, or a job already running on one of them.
    labelled = [dataclasses.replace(gpu_node(f"k{i}", fast_fabric=True),
                                    labels={"kubernetes.io/hostname": f"k{i}"}) for i in range(2)]
    busy = [gpu_node("ib0", fast_fabric=True), gpu_node("ib1", fast_fabric=True, used={7: 1000})]
    for nodes in (labelled, busy):
        snap = snapshot(nodes, [job("ddp", gpus=8, nodes=2)])
        plan = schedule(snap, FAST)
        placement = plan.placement_for("ddp")
        assert placement is not None, plan.pending
        assert {p.node_id for p in placement.parts} == {n.id for n in nodes}
        assert all(len(p.gpu_indices) == 4 for p in placement.parts) and plan_violations(snap, plan) == []
        assert schedule(snap, Policy(time_limit_s=5.0, preemption=False, defragmentation=False,
                                     method="greedy")).placement_for("ddp") is not None


def test_a_gang_does_not_span_two_pools_or_two_gpu_models():
    pools = [gpu_node("a0", fast_fabric=True, pool="a"), gpu_node("b0", fast_fabric=True, pool="b")]
    models = [gpu_node("a100", fast_fabric=True),
              gpu_node("h100", fast_fabric=True, model="H100", memory_mb=80 * 1024)]
    for nodes in (pools, models):
        snap = snapshot(nodes, [job("ddp", gpus=8, nodes=2)])
        plan = schedule(snap, FAST)
        assert plan.placement_for("ddp") is None and "ddp" in plan.pending


def test_shares_pack_onto_one_gpu():
    snap = snapshot([gpu_node("n", gpus=2, island_size=1)], [job(f"s{i}", gpu_milli=500) for i in range(4)])
    plan = schedule(snap, FAST)
    used = sorted((p.node_id, p.gpu_indices) for p in plan.placements)
    assert used == [("n", (0,)), ("n", (0,)), ("n", (1,)), ("n", (1,))]
    assert plan_violations(snap, plan) == []


def test_cu_quota_counts_ratings():
    # 2 H100 = 4 CU; the tenant has 3 CU left, so only one H100 job fits.
    snap = snapshot([gpu_node("h", model="H100", memory_mb=80 * 1024)],
                    [job("a", gpus=1, submitted_at=1), job("b", gpus=1, submitted_at=2)],
                    tenants=[budget(cu_quota=3.0)])
    plan = schedule(snap, FAST)
    assert [p.job_id for p in plan.placements] == ["a"]
    assert plan.pending["b"].code == ReasonCode.QUOTA_EXCEEDED


def test_lp_rounding_path_gives_a_valid_plan(monkeypatch):
    monkeypatch.setattr(milp, "PHASE_TWO_MAX_VARIABLES", 0)
    nodes = [gpu_node(f"n{i}", gpus=4) for i in range(3)]
    pending = [job(f"j{k}", gpus=[1, 2, 3][k % 3], submitted_at=k) for k in range(8)]
    snap = snapshot(nodes, pending, [offer("o", gpus=4, launchable=1)])
    plan = schedule(snap, Policy(method="milp", preemption=False, defragmentation=False))
    assert plan.solver.method == "milp" and "LP rounded down" in plan.solver.status
    assert not plan.solver.proven_optimal
    assert plan_violations(snap, plan) == []
    assert len(plan.placements) == 8


@pytest.mark.parametrize("phase_two_s, full_model_runs", [(0.05, True), (0.3, False)])
def test_the_full_model_runs_only_with_time_to_finish(monkeypatch, phase_two_s, full_model_runs):
    # Phase two is made unproven (its objective far above the LP bound) and to take `phase_two_s` of
    # the MILP's 1 s: with 0.95 s left the full model runs; with 0.7 s left, less than four times
    # phase two's time, it would only run to its limit, so the engine keeps phase two's answer.
    clock = {"offset": 0.0}
    real_clock = time.perf_counter
    monkeypatch.setattr(milp, "time", types.SimpleNamespace(perf_counter=lambda: real_clock() + clock["offset"]))
    calls = []
    real_solve = milp.solve

    def solve(prob, **kwargs):
        result = real_solve(prob, **kwargs)
        calls.append("lp" if kwargs.get("relax") else "milp")
        if calls == ["lp", "milp"]:  # phase two
            clock["offset"] += phase_two_s
            return dataclasses.replace(result, objective=result.objective + 100.0)
        return result

    monkeypatch.setattr(milp, "solve", solve)
    nodes = [gpu_node(f"n{i}", gpus=4) for i in range(3)]
    pending = [job(f"j{k}", gpus=1, submitted_at=k) for k in range(6)]
    snap = snapshot(nodes, pending)
    plan = schedule(snap, Policy(method="milp", time_limit_s=2.0, preemption=False, defragmentation=False))
    assert calls == (["lp", "milp", "milp"] if full_model_runs else ["lp", "milp"])
    assert ("full MILP" in plan.solver.status) is full_model_runs
    assert plan_violations(snap, plan) == [] and len(plan.placements) == 6


def test_waiting_is_cheaper_than_an_expensive_launch():
    weights_snap = snapshot([], [job("j", expected_duration_hours=100.0)], [offer("o", gpus=1, price=50.0)])
    plan = schedule(weights_snap, FAST)
    assert plan.pending["j"].code == ReasonCode.CAPACITY_TAKEN
    assert "waiting cost" in plan.pending["j"].message


def test_models_too_large_for_the_cycle_go_greedy(monkeypatch):
    import scheduling.engine as engine

    monkeypatch.setattr(engine, "MAX_MILP_PAIRS", 0)
    snap = snapshot([gpu_node("n")], [job("j")])
    plan = schedule(snap, FAST)
    assert plan.solver.method == "greedy" and "greedy used" in plan.solver.note
    assert plan.placement_for("j") is not None


def test_multi_node_gang_on_cloud_instances():
    snap = snapshot([], [job("ddp", gpus=16, nodes=2, interconnect="nvlink")],
                    [offer("slow", fast_fabric=False, price=20.0, launchable=4),
                     offer("efa", fast_fabric=True, price=30.0, launchable=2)])
    plan = schedule(snap, FAST)
    (launch,) = plan.launches
    assert launch.offer_id == "efa" and launch.count == 2
    assert sorted(p.instance for p in plan.placement_for("ddp").parts) == [0, 1]
    assert plan_violations(snap, plan) == []


def test_engine_and_other_highs_users_share_one_process():
    # HiGHS sizes its thread pool once per process; an engine that asked for another size got
    # "Not Solved" after a benchmark's own HiGHS solve. A fresh process makes the order certain.
    import subprocess
    import sys
    from pathlib import Path

    script = """
import pulp
from scheduling.engine import schedule
from scheduling.model import GpuState, JobDemand, NodeState, Policy, Snapshot
prob = pulp.LpProblem("other_user", pulp.LpMinimize)
x = pulp.LpVariable("x", 0, 5, cat="Integer")
prob += x
prob += x >= 1
prob.solve(pulp.HiGHS(msg=False))
assert prob.sol_status == pulp.LpSolutionOptimal
node = NodeState("n", "n", (GpuState(0, "g0", "A100", 40960, 40960),), 8000, 8192, 8000, 8192)
plan = schedule(Snapshot(now=0.0, nodes=(node,), pending=(JobDemand("a"),)), Policy(method="milp"))
print(plan.solver.method)
"""
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "milp"
