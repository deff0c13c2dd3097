"""Discrete-event fleet simulator: event order, billing, stops, baselines, engine plan mapping."""

from __future__ import annotations

import pytest

from scheduling.model import (
    Launch as PlanLaunch, Migration, Placement, PlacementPart, Plan, Preemption, SolverInfo,
)
from scheduling.sim.engine_policy import EnginePolicy, build_snapshot, plan_to_actions
from scheduling.sim.events import Launch, SimJob, SimNode, SimOffer, Simulator, Start, Stop
from scheduling.sim.fleet_policies import GreedyCheapest, OnPremFifo

NODE = SimNode("op", "V100", 2, 1.0)
OFFERS = [SimOffer("big", "aws", "r", "z", "x8", "A100", 8, 16.0),
          SimOffer("one", "gcp", "r", "z", "x1", "A100", 1, 3.0)]
SPEEDS = {"V100": 1.0, "A100": 2.0}


def sim(jobs, nodes=(NODE,), offers=OFFERS, **kw) -> Simulator:
    kw.setdefault("cycle_s", 60.0)
    kw.setdefault("boot_s", 0.0)
    return Simulator(jobs, list(nodes), list(offers), SPEEDS, **kw)


def test_fifo_blocks_behind_the_head_and_events_come_in_order() -> None:
    jobs = [SimJob("a", 0, 2, 3600), SimJob("b", 10, 2, 600), SimJob("c", 20, 1, 60)]
    s = sim(jobs)
    res = s.run(OnPremFifo())
    starts = [(t, j) for t, e, j in s.log if e == "start"]
    # a starts at the first cycle (60 s); b and c wait for a (c may not jump ahead of b)
    assert starts == [(60.0, "a"), (3660.0, "b"), (4260.0, "c")]
    # at 3660 the completion of a is handled before the cycle that starts b
    events = [(t, e, j) for t, e, j in s.log if t == 3660.0]
    assert events == [(3660.0, "complete", "a"), (3660.0, "start", "b")]
    assert res.onprem_dollars == pytest.approx((2 * 3600 + 2 * 600 + 60) / 3600.0)
    assert res.cloud_dollars == 0 and res.unfinished == 0
    assert sorted(res.queue_s) == [60.0, 3650.0, 4240.0]


def test_greedy_uses_onprem_when_cheaper_then_the_cheapest_instance_per_job() -> None:
    jobs = [SimJob("a", 0, 2, 3600), SimJob("b", 0, 1, 3600), SimJob("c", 0, 2, 3600)]
    s = sim(jobs)
    res = s.run(GreedyCheapest())
    launches = sorted(j for t, e, j in s.log if e == "launch")
    assert launches == ["big#2", "one#1"]  # b: 1-GPU instance ($3); c: only the 8-GPU one fits
    # b and c run twice as fast on A100: 1800 s each; instances billed launch to release
    assert res.cloud_dollars == pytest.approx(0.5 * 3.0 + 0.5 * 16.0)
    assert res.onprem_dollars == pytest.approx(2.0)


def test_boot_delay_and_restart_cost_and_checkpoints() -> None:
    s = sim([SimJob("a", 0, 1, 7200)], nodes=(), boot_s=300.0, checkpoint_s=1800.0, restart_s=100.0)
    s.now = 0.0
    s.pending.append(s.jobs["a"])
    s._apply([Launch("one", ("a",))])
    r = s.jobs["a"]
    assert r.start_s == 300.0 and r.speed == 2.0
    s.now = 300.0 + 2000.0  # 4000 s of reference work done, last periodic checkpoint at 3600
    s._apply([Stop("a")])
    assert r.done_work_s == 3600.0 and r in s.pending
    nid = next(iter(s.nodes))
    s._apply([Start("a", nid, (0,))])
    assert r.start_s == s.now + 100.0  # restart cost
    s._apply([Stop("a", checkpoint=True)])
    assert r.done_work_s == 3600.0  # stopped before the restart finished: nothing new to keep
    assert r.restarts == 2


def test_empty_instance_released_after_the_policy_grace() -> None:
    class Keep(GreedyCheapest):
        idle_release_s = 600.0

    jobs = [SimJob("a", 0, 1, 3600), SimJob("b", 0, 2, 3600)]
    s = sim(jobs, nodes=())
    res = s.run(Keep())
    # each instance runs its job (1800 s at speed 2, from the cycle at 60 s) then stays 600 s idle
    assert res.cloud_dollars == pytest.approx((1800 + 600) / 3600 * 3.0 + (1800 + 600) / 3600 * 16.0)


def test_start_rejects_busy_gpus_and_wrong_models() -> None:
    s = sim([SimJob("a", 0, 1, 60), SimJob("b", 0, 1, 60, ("A100",))])
    s.pending.extend([s.jobs["a"], s.jobs["b"]])
    s._apply([Start("a", "op", (0,))])
    with pytest.raises(ValueError):
        s._apply([Start("b", "op", (1,))])
    with pytest.raises(ValueError):
        s._apply([Start("a", "op", (1,))])


def test_plan_to_actions_maps_placements_launches_moves_and_preemptions() -> None:
    plan = Plan(
        placements=(Placement("a", (PlacementPart((1,), node_id="op"),)),
                    Placement("b", (PlacementPart((0, 1), launch_id="L1", instance=0),)),
                    Placement("c", (PlacementPart((2,), launch_id="L1", instance=0),))),
        launches=(PlanLaunch("L1", "big", 1, False, ("b", "c"), 16.0),),
        preemptions=(Preemption("v", "a", "op", 10.0),),
        migrations=(Migration("m", "op", PlacementPart((0,), node_id="n2"), "defragmentation"),),
        solver=SolverInfo("milp", True, 0.01))
    assert plan_to_actions(plan) == [
        Stop("v"), Stop("m", checkpoint=True), Start("m", "n2", (0,)), Start("a", "op", (1,)),
        Launch("big", ("b", "c"), ((0, 1), (2,)))]


def test_engine_policy_sees_the_fleet_and_drives_the_simulator() -> None:
    seen = []

    def fake_schedule(snapshot, policy=None):
        seen.append(snapshot)
        placements = tuple(Placement(j.job_id, (PlacementPart((0,), node_id="op"),))
                           for j in snapshot.pending[:1] if snapshot.nodes[0].gpus[0].free_milli == 1000)
        return Plan(placements=placements, solver=SolverInfo("greedy", False, 0.0))

    s = sim([SimJob("a", 0, 1, 600)])
    res = s.run(EnginePolicy(schedule=fake_schedule))
    assert res.unfinished == 0 and res.jct_s == [600.0 + 60.0]
    snap = seen[0]
    assert [n.id for n in snap.nodes] == ["op"] and snap.pending[0].expected_duration_hours == pytest.approx(600 / 3600)
    assert len(snap.offers) == 2 and {m.name: m.cu_rating for m in snap.gpu_models} == SPEEDS
    assert build_snapshot(s, seen[0].weights, 5).offers[0].launchable == 5
