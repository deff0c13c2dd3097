"""Hypothesis properties on random snapshots: safety, explanations and determinism."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine_factories import DETERMINISM_LIMIT_S, budget, gpu_node, job, offer, snapshot
from scheduling.engine import schedule
from scheduling.model import Plan, Policy, RunningAllocation
from scheduling.validate import plan_violations

POLICIES = [Policy(time_limit_s=DETERMINISM_LIMIT_S), Policy(method="greedy"),
            Policy(method="milp", time_limit_s=DETERMINISM_LIMIT_S)]


@st.composite
def nodes_and_running(draw):
    nodes, runs = [], []
    for n in range(draw(st.integers(0, 4))):
        gpus = draw(st.sampled_from([0, 1, 2, 4, 8]))
        used = {}
        for g in range(gpus):
            used[g] = draw(st.sampled_from([0, 0, 0, 300, 1000]))
        node = gpu_node(f"n{n}", gpus=gpus, model=draw(st.sampled_from(["A100", "T4"])),
                        island_size=draw(st.sampled_from([1, 2, 4, 8])), used=used,
                        unhealthy=tuple(g for g in range(gpus) if draw(st.booleans()) and g == 0),
                        price=draw(st.sampled_from([0.0, 0.5, 2.0])), free_cpu=draw(st.sampled_from([2000, 32000])),
                        fast_fabric=draw(st.booleans()), state=draw(st.sampled_from(["ready", "ready", "draining"])),
                        rented=draw(st.booleans()))
        nodes.append(node)
        for g, milli in used.items():
            if milli == 1000:
                runs.append(RunningAllocation(
                    job_id=f"r{n}-{g}", node_id=node.id, gpu_indices=(g,), tenant="acme",
                    priority=draw(st.integers(0, 2)), preemptible=draw(st.booleans()),
                    checkpointable=draw(st.booleans()), run_seconds=draw(st.sampled_from([10.0, 5000.0])),
                    checkpoint_age_s=draw(st.sampled_from([None, 30.0])), restart_cost_s=30.0,
                    demand=job(f"r{n}-{g}", expected_duration_hours=draw(st.sampled_from([1.0, 8.0])))))
    return nodes, runs


@st.composite
def snapshots(draw):
    nodes, runs = draw(nodes_and_running())
    offers = [offer(f"o{k}", model=draw(st.sampled_from(["A100", "T4"])), gpus=draw(st.sampled_from([1, 4, 8])),
                    price=draw(st.sampled_from([3.0, 20.0])), spot=draw(st.sampled_from([None, 1.0])),
                    launchable=draw(st.integers(0, 2)), fast_fabric=draw(st.booleans()))
              for k in range(draw(st.integers(0, 2)))]
    pending = []
    for k in range(draw(st.integers(1, 7))):
        fractional = draw(st.booleans()) and draw(st.booleans())
        nodes_wanted = 1 if fractional else draw(st.sampled_from([1, 1, 1, 2]))
        gpus = 1 if fractional else nodes_wanted * draw(st.sampled_from([0, 1, 2, 4]))
        compute_units = None if fractional or not gpus or draw(st.booleans()) else draw(st.sampled_from([0.5, 2.0]))
        pending.append(job(
            f"j{k}", gpus=gpus, compute_units=compute_units, gpu_milli=draw(st.sampled_from([250, 500])) if fractional else 1000,
            nodes=nodes_wanted if gpus else 1, tenant=draw(st.sampled_from(["acme", "beta"])),
            interconnect=draw(st.sampled_from(["any", "nvlink"])), priority=draw(st.integers(0, 3)),
            allowed_models=draw(st.sampled_from([(), ("A100",)])), spot=draw(st.sampled_from(["never", "allowed", "required"])),
            max_price_per_hour=draw(st.sampled_from([None, 5.0])), expected_duration_hours=draw(st.sampled_from([1.0, 8.0])),
            cpu_milli=draw(st.sampled_from([1000, 8000])), submitted_at=float(k)))
    tenants = [budget("acme", gpu_quota=draw(st.sampled_from([None, 2.0, 6.0])),
                      remaining_budget=draw(st.sampled_from([None, 10.0, 100.0]))),
               budget("beta", cu_quota=draw(st.sampled_from([None, 1.0])))]
    return snapshot(nodes, pending, offers, tenants, running=runs)


def comparable(plan: Plan):
    return (plan.placements, plan.launches, plan.preemptions, plan.migrations, plan.pending, plan.solver.method)


def check_planners(snap, plan, policy):
    running = {r.job_id: r for r in snap.running}
    pending = {j.job_id: j for j in snap.pending}
    victims = [p.victim_job_id for p in plan.preemptions]
    assert len(victims) == len(set(victims))
    for p in plan.preemptions:
        victim = running[p.victim_job_id]
        assert victim.preemptible and victim.priority < pending[p.for_job_id].priority
        assert victim.run_seconds >= policy.min_run_before_preempt_s
    assert len(plan.migrations) <= policy.max_moves_per_cycle  # defragmentation and consolidation together
    assert len([m for m in plan.migrations if m.reason == "cheaper"]) <= policy.max_consolidation_moves
    taken = {(part.node_id, g) for placement in plan.placements for part in placement.parts for g in part.gpu_indices}
    for m in plan.migrations:
        moved = running[m.job_id]
        assert moved.checkpointable and moved.preemptible and m.to.node_id != m.from_node_id
        assert all((m.to.node_id, g) not in taken for g in m.to.gpu_indices)
        nodes = {n.id: n for n in snap.nodes}
        assert all(nodes[m.to.node_id].gpus[g].milli_used == 0 for g in m.to.gpu_indices)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(snapshots(), st.sampled_from(POLICIES))
def test_plans_are_safe_explained_and_deterministic(snap, policy):
    plan = schedule(snap, policy)
    assert plan_violations(snap, plan) == []
    placed = {p.job_id for p in plan.placements}
    assert placed | set(plan.pending) == {j.job_id for j in snap.pending}
    check_planners(snap, plan, policy)
    assert comparable(schedule(snap, policy)) == comparable(plan)


@settings(max_examples=15, deadline=None)
@given(snapshots())
def test_input_order_does_not_change_the_plan(snap):
    policy = Policy(time_limit_s=DETERMINISM_LIMIT_S)
    shuffled = replace(snap, nodes=tuple(reversed(snap.nodes)), pending=tuple(reversed(snap.pending)),
                       offers=tuple(reversed(snap.offers)))
    assert comparable(schedule(shuffled, policy)) == comparable(schedule(snap, policy))


def test_validator_catches_a_broken_plan():
    from scheduling.model import Placement, PlacementPart
    snap = snapshot([gpu_node("n", gpus=2, used={0: 1000})], [job("a"), job("b")])
    bad = Plan(placements=(Placement("a", (PlacementPart((0,), node_id="n"),)),
                           Placement("b", (PlacementPart((1, 1), node_id="n"),))))
    problems = plan_violations(snap, bad)
    assert any("over-allocated" in p for p in problems)
    assert any("listed twice" in p for p in problems)
