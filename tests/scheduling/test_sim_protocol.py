"""The FGD protocol: arrival list, stop rule, drops, curve buckets; broker and LP bound on tiny cases."""

from __future__ import annotations

import numpy as np
import pytest

from scheduling.fragmentation import TaskClass, normalise
from scheduling.sim.broker import Broker, run_broker
from scheduling.sim.cluster import ArrayCluster, NodeSpec, TaskSpec
from scheduling.sim.protocol import ProtocolRun, build_arrivals, run_online
from scheduling.sim.registry import make_policy
from scheduling.sim.upper_bound import allocation_upper_bound

WL = normalise([TaskClass(1000, 1000, 1, 1.0)])


def test_arrivals_shuffle_then_clone_until_next_would_pass_target() -> None:
    tasks = [TaskSpec(f"t{i}", 0, 0, 1, 1000) for i in range(3)]
    # capacity 4 GPUs, target 130% = 5.2 GPUs: the 3 originals, then 2 clones (a 3rd would pass)
    out = build_arrivals(tasks, 4000, np.random.default_rng(1), target=1.3)
    assert sorted(t.name for t in out[:3]) == ["t0", "t1", "t2"]
    assert len(out) == 5 and all("#clone" in t.name for t in out[3:])
    assert sum(t.total_milli for t in out) <= 1.3 * 4000
    again = build_arrivals(tasks, 4000, np.random.default_rng(1), target=1.3)
    assert [t.name for t in again] == [t.name for t in out]  # deterministic per seed


def test_arrivals_truncate_a_list_that_already_passes_target() -> None:
    tasks = [TaskSpec(f"t{i}", 0, 0, 1, 1000) for i in range(10)]
    assert len(build_arrivals(tasks, 4000, np.random.default_rng(0), target=1.3)) == 5


def test_cpu_only_tasks_arrive_without_demand() -> None:
    tasks = [TaskSpec("cpu", 1000, 0, 0, 0), TaskSpec("gpu", 0, 0, 1, 1000)]
    out = build_arrivals(tasks, 1000, np.random.default_rng(0), target=1.0)
    assert sum(t.total_milli for t in out) == 1000 and any(t.num_gpu == 0 for t in out)


def test_a_task_that_fits_nowhere_is_dropped_but_counts_as_arrived() -> None:
    cluster = ArrayCluster([NodeSpec("n", 4000, 4000, 2, "T4")])
    arrivals = [TaskSpec("a", 1000, 0, 1, 1000), TaskSpec("big", 1000, 0, 4, 1000), TaskSpec("b", 1000, 0, 1, 1000)]
    run = run_online(cluster, arrivals, make_policy("bestfit", WL), np.random.default_rng(0), True)
    assert run.dropped == 1
    assert run.arrived_pct.tolist() == [50.0, 250.0, 300.0]
    assert run.alloc_pct.tolist() == [50.0, 50.0, 100.0]
    assert [p[0] for p in run.placements] == ["a", "b"]
    assert sorted(g for p in run.placements for g in p[2]) == [0, 1]


def test_curve_rounds_half_up_and_averages_each_bucket() -> None:
    run = ProtocolRun(np.array([99.4, 99.6, 100.4, 129.6, 130.0]), np.array([90.0, 91.0, 93.0, 95.0, 97.0]))
    assert run.curve() == {99: 90.0, 100: 92.0, 130: 96.0}
    assert run.alloc_at(130) == 96.0
    assert run.alloc_at(101) == 92.0  # nearest bucket below when none rounds to it


def test_broker_places_hardest_first_within_a_cycle() -> None:
    # Online in arrival order, the small task takes node "a" first and the 2-GPU task finds no node
    # with 2 free GPUs left... unless it is placed first, which the broker does.
    nodes = [NodeSpec("a", 8000, 8000, 2, "T4"), NodeSpec("b", 8000, 8000, 1, "T4")]
    arrivals = [TaskSpec("small", 1000, 0, 1, 1000), TaskSpec("small2", 1000, 0, 1, 1000),
                TaskSpec("pair", 1000, 0, 2, 1000)]
    cluster = ArrayCluster(nodes)
    run = run_broker(cluster, arrivals, WL, np.random.default_rng(0), every=3, max_moves=0, order="hardest")
    assert run.dropped == 1  # 4 GPUs asked, 3 exist
    assert cluster.gpu_free[0].tolist() == [0, 0]  # "pair" got node a
    assert run.alloc_pct[-1] == pytest.approx(100.0)


def test_broker_defragments_by_moving_a_shared_task() -> None:
    # Two 1-GPU nodes, each with a 0.4 share on it: a whole-GPU task fits nowhere until one share
    # moves next to the other (0.4 + 0.4 on one GPU), which the broker plans and commits.
    nodes = [NodeSpec("a", 8000, 8000, 1, "T4"), NodeSpec("b", 8000, 8000, 1, "T4")]
    cluster = ArrayCluster(nodes)
    policy = make_policy("whalezen-online", WL)
    policy.start(cluster, np.random.default_rng(0))
    broker = Broker(cluster, policy, max_moves=2)
    share = TaskSpec("s", 1000, 0, 1, 400)
    broker._place(0, share, 0, [0])
    broker._place(1, TaskSpec("s2", 1000, 0, 1, 400), 1, [0])
    broker.cycle([(2, TaskSpec("whole", 1000, 0, 1, 1000))])
    assert broker.migrations == 1 and 2 in broker.placed_at
    assert sorted(cluster.gpu_free[:, 0].tolist()) == [0, 200]
    assert cluster.allocated_milli == 1800


def test_broker_keeps_nothing_when_the_moved_task_cannot_land() -> None:
    nodes = [NodeSpec("a", 8000, 8000, 1, "T4"), NodeSpec("b", 8000, 8000, 1, "T4")]
    cluster = ArrayCluster(nodes)
    policy = make_policy("whalezen-online", WL)
    policy.start(cluster, np.random.default_rng(0))
    broker = Broker(cluster, policy, max_moves=2)
    broker._place(0, TaskSpec("s", 1000, 0, 1, 700), 0, [0])
    broker._place(1, TaskSpec("s2", 1000, 0, 1, 700), 1, [0])
    before = cluster.gpu_free.copy()
    broker.cycle([(2, TaskSpec("whole", 1000, 0, 1, 1000))])
    assert broker.migrations == 0 and 2 not in broker.placed_at
    assert (cluster.gpu_free == before).all()


def test_upper_bound_lp_on_a_hand_example() -> None:
    nodes = [NodeSpec("n", 4000, 1000, 2, "T4")]
    # three 0.6-GPU tasks: at most one per GPU (the > half-GPU cut), so 1200 milli at best;
    # a 1-GPU task needing 5 cores never fits (node has 4).
    tasks = [TaskSpec(f"s{i}", 100, 0, 1, 600) for i in range(3)] + [TaskSpec("cpu", 5000, 0, 1, 1000)]
    assert allocation_upper_bound(nodes, tasks) == pytest.approx(1200.0)
    tasks2 = tasks + [TaskSpec("q", 100, 0, 1, 400), TaskSpec("q2", 100, 0, 1, 400)]
    assert allocation_upper_bound(nodes, tasks2) == pytest.approx(2000.0)


def test_dual_feasible_cuts_pack_shares_into_whole_gpus() -> None:
    from scheduling.sim.upper_bound import dff

    assert dff(600, 1) == 1.0 and dff(500, 1) == 0.5 and dff(400, 1) == 0.0
    assert dff(810, 4) == 1.0 and dff(470, 4) == 0.5 and dff(400, 2) == 0.5
    # three 0.4 shares cannot share one GPU: only two of them (800 milli) can be placed
    nodes = [NodeSpec("n", 64000, 1000, 1, "T4")]
    tasks = [TaskSpec(f"s{i}", 100, 0, 1, 400) for i in range(3)]
    assert allocation_upper_bound(nodes, tasks) == pytest.approx(800.0)


def test_engine_broker_applies_the_engines_placements_and_moves() -> None:
    from scheduling.model import Migration, Placement, PlacementPart, Plan, SolverInfo
    from scheduling.sim.engine_broker import run_engine_broker

    nodes = [NodeSpec("a", 8000, 8000, 1, "T4"), NodeSpec("b", 8000, 8000, 1, "T4")]
    arrivals = [TaskSpec("s", 1000, 0, 1, 400), TaskSpec("s2", 1000, 0, 1, 400), TaskSpec("w", 1000, 0, 1, 1000)]
    calls = []

    def fake(snapshot, policy=None):
        calls.append(snapshot)
        ids = [j.job_id for j in snapshot.pending]
        if ids == ["t0", "t1"]:  # first cycle: one share on each node
            return Plan(placements=(Placement("t0", (PlacementPart((0,), 400, node_id="a"),)),
                                    Placement("t1", (PlacementPart((0,), 400, node_id="b"),))),
                        solver=SolverInfo("greedy", False, 0.0))
        # second cycle: move t0 next to t1, then the whole-GPU task takes node a
        return Plan(placements=(Placement("t2", (PlacementPart((0,), node_id="a"),)),),
                    migrations=(Migration("t0", "a", PlacementPart((0,), 400, node_id="b"), "defragmentation"),),
                    solver=SolverInfo("greedy", False, 0.0))

    cluster = ArrayCluster(nodes)
    run = run_engine_broker(cluster, arrivals, WL, every=2, schedule=fake)
    assert run.dropped == 0 and cluster.gpu_free[:, 0].tolist() == [0, 200]
    second = calls[1]
    assert [(r.job_id, r.node_id, r.gpu_milli) for r in second.running] == [("t0", "a", 400), ("t1", "b", 400)]
    assert [g.milli_used for n in second.nodes for g in n.gpus] == [400, 400]
    assert second.workload and second.workload[0].gpus == 1


def test_engine_broker_with_the_real_engine_places_what_fits() -> None:
    from scheduling.sim.engine_broker import run_engine_broker

    nodes = [NodeSpec("a", 16000, 64000, 2, "T4"), NodeSpec("b", 16000, 64000, 2, "T4")]
    arrivals = [TaskSpec(f"t{i}", 2000, 1000, 1, [1000, 500, 500, 1000, 2000 // 2][i]) for i in range(5)]
    cluster = ArrayCluster(nodes)
    run = run_engine_broker(cluster, arrivals, WL, every=5)
    assert run.dropped == 0
    assert cluster.allocated_milli == sum(t.total_milli for t in arrivals) == 4000


@pytest.mark.parametrize("movable", [True, False])
def test_engine_broker_moves_a_task_for_a_blocked_one_and_then_places_it(movable: bool) -> None:
    # Two 2-GPU nodes, each with one 1-GPU task: no node has the 2 GPUs the last task needs. The
    # engine moves one task next to the other and the broker's next cycle starts the blocked task
    # on the node that move emptied; without movable tasks it is dropped.
    from scheduling.engine import schedule as engine_schedule
    from scheduling.model import Placement, PlacementPart, Plan, SolverInfo
    from scheduling.sim.engine_broker import run_engine_broker

    nodes = [NodeSpec("a", 16000, 64000, 2, "T4"), NodeSpec("b", 16000, 64000, 2, "T4")]
    arrivals = [TaskSpec("t0", 1000, 1000, 1, 1000), TaskSpec("t1", 1000, 1000, 1, 1000),
                TaskSpec("big", 1000, 1000, 2, 1000)]
    calls = []

    def spread_first(snapshot, policy=None):
        calls.append([j.job_id for j in snapshot.pending])
        if len(calls) == 1:  # the first cycle spreads the two small tasks, one per node
            return Plan(placements=(Placement("t0", (PlacementPart((0,), node_id="a"),)),
                                    Placement("t1", (PlacementPart((0,), node_id="b"),))),
                        solver=SolverInfo("greedy", False, 0.0))
        return engine_schedule(snapshot, policy)

    cluster = ArrayCluster(nodes)
    run = run_engine_broker(cluster, arrivals, WL, every=2, schedule=spread_first, movable=movable)
    if movable:
        assert calls == [["t0", "t1"], ["t2"], ["t2"]]  # the follow-up cycle holds only the moved-for task
        assert run.migrations == 1 and run.dropped == 0
        assert cluster.allocated_milli == 4000
        assert sorted(name for name, _, _ in run.placements) == ["big", "t0", "t1"]
    else:
        assert calls == [["t0", "t1"], ["t2"]]
        assert run.migrations == 0 and run.dropped == 1 and cluster.allocated_milli == 2000
