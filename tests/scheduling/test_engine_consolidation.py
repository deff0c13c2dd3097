"""Consolidation (`scheduling.consolidate`): the engine empties a rented instance when its jobs
cost less elsewhere, and only then."""

from __future__ import annotations

from dataclasses import replace

from engine_factories import FAST, gpu_node, job, snapshot
from scheduling.engine import schedule
from scheduling.model import RunningAllocation
from scheduling.validate import plan_violations

POLICY = replace(FAST, consolidation=True)


def rented(node_id: str, jobs: int, gpus: int = 8, price: float = 4.0):
    """A rented instance whose first `jobs` GPUs are busy."""
    return gpu_node(node_id, gpus=gpus, price=price, provider="aws", rented=True,
                    used={g: 1000 for g in range(jobs)})


def running(job_id: str, node_id: str, gpu: int, run_s: float = 3600.0, hours: float = 8.0, milli: int = 1000,
            **fields):
    """A running job on one GPU of a node (`milli` of it: below 1000, a share)."""
    fields.setdefault("checkpointable", True)
    fields.setdefault("preemptible", True)
    return RunningAllocation(job_id, node_id, (gpu,), tenant="acme", gpu_milli=milli, run_seconds=run_s,
                             checkpoint_age_s=60.0, restart_cost_s=120.0, cpu_milli=1000, memory_mb=1024,
                             demand=job(job_id, gpu_milli=milli, expected_duration_hours=hours), **fields)


def moves(plan):
    return sorted((m.job_id, m.from_node_id, m.to.node_id, m.reason) for m in plan.migrations)


def test_a_half_empty_instance_is_emptied_onto_free_owned_gpus():
    snap = snapshot([rented("i-1", jobs=2), gpu_node("onprem", gpus=8, price=1.0)],
                    running=[running("a", "i-1", 0), running("b", "i-1", 1)])
    plan = schedule(snap, POLICY)
    assert moves(plan) == [("a", "i-1", "onprem", "cheaper"), ("b", "i-1", "onprem", "cheaper")]
    assert len({g for m in plan.migrations for g in m.to.gpu_indices}) == 2
    assert plan_violations(snap, plan) == []


def test_jobs_of_a_sparse_instance_move_to_the_fuller_one_already_paid_for():
    snap = snapshot([rented("i-sparse", jobs=2), rented("i-full", jobs=5)],
                    running=[running("a", "i-sparse", 0), running("b", "i-sparse", 1)]
                    + [running(f"f{g}", "i-full", g) for g in range(5)])
    plan = schedule(snap, POLICY)
    assert moves(plan) == [("a", "i-sparse", "i-full", "cheaper"), ("b", "i-sparse", "i-full", "cheaper")]
    assert plan_violations(snap, plan) == []


def test_nothing_moves_when_not_every_job_of_the_instance_has_a_place():
    snap = snapshot([rented("i-1", jobs=2), gpu_node("onprem", gpus=8, price=1.0, used={g: 1000 for g in range(7)})],
                    running=[running("a", "i-1", 0), running("b", "i-1", 1)])
    assert schedule(snap, POLICY).migrations == ()


def test_nothing_moves_when_the_owned_gpus_cost_more_than_the_instance():
    # A 2-GPU instance at $1 per GPU-hour costs $2/h; its two jobs would cost $3/h on-prem.
    snap = snapshot([rented("i-1", jobs=2, gpus=2, price=1.0), gpu_node("onprem", gpus=8, price=1.5)],
                    running=[running("a", "i-1", 0), running("b", "i-1", 1)])
    assert schedule(snap, POLICY).migrations == ()


def test_young_short_or_unmovable_jobs_keep_their_instance():
    nodes = [rented("i-1", jobs=2), gpu_node("onprem", gpus=8, price=1.0)]
    young = [running("a", "i-1", 0, run_s=60.0), running("b", "i-1", 1)]
    ending = [running("a", "i-1", 0, run_s=3000.0, hours=1.0), running("b", "i-1", 1)]  # 10 min left
    pinned = [running("a", "i-1", 0, checkpointable=False), running("b", "i-1", 1)]
    for allocations in (young, ending, pinned):
        assert schedule(snapshot(nodes, running=allocations), POLICY).migrations == ()


def test_an_instance_that_got_a_new_job_this_cycle_is_kept():
    snap = snapshot([rented("i-1", jobs=2), gpu_node("onprem", gpus=1, price=1.0, used={0: 1000})],
                    [job("new")], running=[running("a", "i-1", 0), running("b", "i-1", 1)])
    plan = schedule(snap, POLICY)
    assert plan.placement_for("new").parts[0].node_id == "i-1"
    assert plan.migrations == ()


def test_consolidation_can_be_switched_off():
    snap = snapshot([rented("i-1", jobs=2), gpu_node("onprem", gpus=8, price=1.0)],
                    running=[running("a", "i-1", 0), running("b", "i-1", 1)])
    assert schedule(snap, replace(POLICY, consolidation=False)).migrations == ()


def multi(job_id: str, node_id: str, gpus: tuple[int, ...], run_s: float = 3600.0, hours: float = 8.0, **fields):
    """A running job on several GPUs of one node."""
    fields.setdefault("checkpointable", True)
    fields.setdefault("preemptible", True)
    return RunningAllocation(job_id, node_id, gpus, tenant="acme", run_seconds=run_s, checkpoint_age_s=60.0,
                             restart_cost_s=120.0, cpu_milli=1000, memory_mb=1024,
                             demand=job(job_id, gpus=len(gpus), expected_duration_hours=hours), **fields)


def fragmented(pinned_b: bool = False):
    """An 8-GPU job on a rented 8-GPU instance; two owned 8-GPU nodes with 4 GPUs free each: 8 free
    owned GPUs in all, none of them 8 on one node. a (4 GPUs) on node-a could join b on node-b."""
    nodes = [rented("i-1", jobs=8), gpu_node("node-a", used={g: 1000 for g in range(4)}),
             gpu_node("node-b", used={g: 1000 for g in range(4)})]
    running = [multi("big", "i-1", tuple(range(8))), multi("a", "node-a", (0, 1, 2, 3)),
               multi("b", "node-b", (0, 1, 2, 3), checkpointable=not pinned_b)]
    return snapshot(nodes, running=running)


def test_a_rented_job_comes_home_when_one_owned_node_can_be_emptied_for_it():
    snap = fragmented()
    plan = schedule(snap, POLICY)
    # The owned job that frees a node moves first (the simulator and the broker act in plan order).
    assert [(m.job_id, m.from_node_id, m.to.node_id, m.reason) for m in plan.migrations] == [
        ("a", "node-a", "node-b", "defragmentation"), ("big", "i-1", "node-a", "cheaper")]
    assert plan.migrations[0].for_job_id == "big"
    assert sorted(plan.migrations[0].to.gpu_indices) == [4, 5, 6, 7]
    assert sorted(plan.migrations[1].to.gpu_indices) == list(range(8))
    assert plan_violations(snap, plan) == []


def test_no_home_coming_when_it_would_take_an_unmovable_job_or_does_not_pay_or_exceeds_the_move_budget():
    # With b pinned, a is still free to make room (it joins b on node-b).
    pinned = fragmented(pinned_b=True)
    assert [m.job_id for m in schedule(pinned, POLICY).migrations] == ["a", "big"]
    nothing_movable = replace(pinned, running=tuple(
        replace(a, checkpointable=False) if a.job_id in ("a", "b") else a for a in pinned.running))
    assert schedule(nothing_movable, POLICY).migrations == ()
    # 10 minutes of work left: restarting costs more than the instance would.
    ending = replace(pinned, running=tuple(
        replace(a, run_seconds=3000.0, demand=replace(a.demand, expected_duration_hours=1.0)) if a.job_id == "big"
        else a for a in pinned.running))
    assert schedule(ending, POLICY).migrations == ()
    assert schedule(fragmented(), replace(POLICY, max_consolidation_moves=1)).migrations == ()


def test_no_home_coming_when_the_owned_gpus_are_not_there_in_total():
    snap = fragmented()
    busier = replace(snap, nodes=(snap.nodes[0], snap.nodes[1], gpu_node("node-b", used={g: 1000 for g in range(5)})),
                     running=snap.running[:2] + (multi("b", "node-b", (0, 1, 2, 3, 4)),))
    assert schedule(busier, POLICY).migrations == ()


def test_the_validator_lets_a_move_land_only_on_gpus_a_move_listed_before_it_leaves():
    from scheduling.model import Migration, Plan, PlacementPart
    snap = fragmented()
    leave = Migration("a", "node-a", PlacementPart((4, 5, 6, 7), 1000, node_id="node-b"), "defragmentation", "big")
    come = Migration("big", "i-1", PlacementPart(tuple(range(8)), 1000, node_id="node-a"), "cheaper")
    assert plan_violations(snap, Plan(migrations=(leave, come))) == []
    out_of_order = plan_violations(snap, Plan(migrations=(come, leave)))
    assert "big: GPU 0 on node-a over-allocated or unhealthy" in out_of_order


def shares_and_a_rented_pair(milli: tuple[int, ...]):
    """A 2-GPU job on a rented 2-GPU instance. Owned node-a: shares of `milli` on GPU 0, GPU 1 free.
    Owned node-b<k>, one per share: GPU 0 whole and free, GPU 1 taken by a job that cannot move, and
    CPU for one share only. The pair comes home only if every share moves off node-a's GPU 0, each
    onto a whole GPU of its own."""
    helpers = [f"node-b{k}" for k in range(len(milli))]
    nodes = [rented("i-1", jobs=2, gpus=2), gpu_node("node-a", gpus=2, used={0: sum(milli)})]
    nodes += [gpu_node(name, gpus=2, used={1: 1000}, free_cpu=1000) for name in helpers]
    jobs = [multi("pair", "i-1", (0, 1))] + [running(f"s{k}", "node-a", 0, milli=m) for k, m in enumerate(milli)]
    jobs += [multi(f"pinned{k}", name, (1,), checkpointable=False) for k, name in enumerate(helpers)]
    return snapshot(nodes, running=jobs)


def test_a_rented_job_comes_home_when_its_moves_split_no_more_owned_gpus_than_before():
    # The share leaves node-a's split GPU 0 (the pair takes it whole) and splits node-b0's: one for one.
    snap = shares_and_a_rented_pair((600,))
    plan = schedule(snap, POLICY)
    assert moves(plan) == [("pair", "i-1", "node-a", "cheaper"), ("s0", "node-a", "node-b0", "defragmentation")]
    assert plan_violations(snap, plan) == []


def test_no_home_coming_that_splits_more_owned_gpus_than_before():
    # Two shares of one GPU would each split a whole GPU elsewhere (CPU for one share per node): one
    # split GPU becomes two, with slivers few jobs can use, so the rented pair stays where it is.
    assert schedule(shares_and_a_rented_pair((500, 400)), POLICY).migrations == ()
