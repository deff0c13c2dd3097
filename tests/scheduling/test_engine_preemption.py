"""Preemption and defragmentation planners, alone and through schedule()."""

from __future__ import annotations

from engine_factories import gpu_node, job, snapshot
from scheduling.book import Book
from scheduling.defrag import plan_defragmentation
from scheduling.engine import schedule
from scheduling.model import Policy, ReasonCode, RunningAllocation
from scheduling.preemption import plan_preemptions
from scheduling.problem import build_problem

POLICY = Policy(time_limit_s=5.0, min_run_before_preempt_s=600, min_run_before_move_s=600, max_moves_per_cycle=4)


def running(job_id, node, gpus, priority=0, preemptible=True, checkpointable=True, run=5000.0, age=100.0,
            restart=60.0, demand=True, tenant="acme"):
    return RunningAllocation(
        job_id=job_id, node_id=node, gpu_indices=tuple(gpus), tenant=tenant, priority=priority, preemptible=preemptible,
        checkpointable=checkpointable, run_seconds=run, checkpoint_age_s=age, restart_cost_s=restart,
        cpu_milli=1000 * len(gpus), memory_mb=1024,
        demand=job(job_id, gpus=len(gpus), cpu_milli=1000 * len(gpus)) if demand else None)


def busy_node(node_id, used_gpus, gpus=8):
    return gpu_node(node_id, gpus=gpus, used={g: 1000 for g in used_gpus},
                    free_cpu=64000 - 1000 * len(used_gpus), free_mem=512 * 1024 - 1024 * 4)


def test_preempts_the_set_with_least_lost_work():
    nodes = [busy_node("n0", range(8)), busy_node("n1", range(8))]
    runs = [running("a", "n0", range(4), age=3000), running("b", "n0", range(4, 8), age=3000),
            running("c", "n1", range(4), age=10), running("d", "n1", range(4, 8), age=20)]
    snap = snapshot(nodes, [job("urgent", gpus=4, priority=10)], running=runs)
    plan = schedule(snap, POLICY)
    assert [(p.victim_job_id, p.node_id) for p in plan.preemptions] == [("c", "n1")]
    assert plan.preemptions[0].lost_work_s == 70.0
    assert plan.pending["urgent"].code == ReasonCode.WAITING_FOR_PREEMPTION
    assert plan.pending["urgent"].data["victims"] == ["c"]


def test_never_preempts_young_equal_priority_or_protected_jobs():
    nodes = [busy_node("n0", range(8))]
    for victim in (running("v", "n0", range(8), run=100.0),            # ran less than the minimum
                   running("v", "n0", range(8), priority=10),         # not lower priority
                   running("v", "n0", range(8), preemptible=False)):  # not preemptible
        plan = schedule(snapshot(nodes, [job("urgent", gpus=8, priority=10)], running=[victim]), POLICY)
        assert plan.preemptions == ()
        assert plan.pending["urgent"].code == ReasonCode.INSUFFICIENT_GPUS


def test_priority_never_preempts_another_teams_job():
    # Another team's job on a shared node is taken back only by reclaim (quotas), not for priority.
    nodes = [busy_node("n0", range(8))]
    plan = schedule(snapshot(nodes, [job("urgent", gpus=8, priority=10)],
                             running=[running("theirs", "n0", range(8), tenant="globex")]), POLICY)
    assert plan.preemptions == ()
    plan = schedule(snapshot(nodes, [job("urgent", gpus=8, priority=10)],
                             running=[running("ours", "n0", range(8), tenant="acme")]), POLICY)
    assert [p.victim_job_id for p in plan.preemptions] == ["ours"]


def test_a_victim_is_taken_once_and_freed_gpus_are_not_reused():
    nodes = [busy_node("n0", range(8))]
    runs = [running("v", "n0", range(8))]
    pending = [job("first", gpus=8, priority=10, submitted_at=1), job("second", gpus=8, priority=10, submitted_at=2)]
    plan = schedule(snapshot(nodes, pending, running=runs), POLICY)
    assert [(p.victim_job_id, p.for_job_id) for p in plan.preemptions] == [("v", "first")]
    assert plan.pending["second"].code != ReasonCode.WAITING_FOR_PREEMPTION


def test_preemption_planner_alone():
    nodes = [busy_node("n0", range(8))]
    snap = snapshot(nodes, [job("urgent", gpus=2, priority=3)], running=[running("v", "n0", range(8))])
    problem = build_problem(snap, POLICY)
    plan = plan_preemptions(problem, Book(problem), ["urgent"])
    assert [p.victim_job_id for p in plan] == ["v"]


def fragmented_cluster():
    # Two 8-GPU nodes, each with 4 GPUs taken by small checkpointable jobs: 8 free in total, but
    # no node has 8 free.
    nodes = [busy_node("n0", [0, 1, 2, 3]), busy_node("n1", [0, 1, 2, 3])]
    runs = [running(f"s{k}", f"n{k // 4}", [k % 4]) for k in range(8)]
    return nodes, runs


def test_defragmentation_moves_small_jobs_and_replaces_them_first():
    nodes, runs = fragmented_cluster()
    snap = snapshot(nodes, [job("big", gpus=8)], running=runs)
    plan = schedule(snap, POLICY)
    assert len(plan.migrations) == 4
    source = plan.migrations[0].from_node_id
    assert {m.from_node_id for m in plan.migrations} == {source}
    assert all(m.to.node_id != source and m.reason == "defragmentation" for m in plan.migrations)
    targets = [(m.to.node_id, m.to.gpu_indices) for m in plan.migrations]
    assert len(set(targets)) == 4  # every moved job got its own GPU elsewhere
    assert plan.pending["big"].code == ReasonCode.WAITING_FOR_DEFRAGMENTATION


def test_defragmentation_respects_the_move_limit_and_movability():
    nodes, runs = fragmented_cluster()
    snap = snapshot(nodes, [job("big", gpus=8)], running=runs)
    assert schedule(snap, Policy(time_limit_s=5.0, max_moves_per_cycle=3)).migrations == ()
    stuck = [r if r.job_id != "s0" and r.job_id != "s4" else running(r.job_id, r.node_id, r.gpu_indices,
                                                                        checkpointable=False) for r in runs]
    snap = snapshot(nodes, [job("big", gpus=8)], running=stuck)
    assert schedule(snap, POLICY).migrations == ()


def test_no_defragmentation_when_total_free_capacity_is_short():
    nodes = [busy_node("n0", [0, 1, 2, 3, 4]), busy_node("n1", [0, 1, 2, 3])]
    runs = [running(f"s{k}", "n0", [k]) for k in range(5)] + [running(f"t{k}", "n1", [k]) for k in range(4)]
    snap = snapshot(nodes, [job("big", gpus=8)], running=runs)
    problem = build_problem(snap, POLICY)
    # 7 GPUs free in total for an 8-GPU job: moving jobs around cannot help.
    assert plan_defragmentation(problem, Book(problem), ["big"]) == ()


def test_no_defragmentation_when_moved_jobs_cannot_be_placed_again():
    # Both nodes half full; the moved jobs would need the other node's 4 free GPUs, but they ask for
    # a GPU model that only the source node has.
    nodes = [busy_node("n0", [0, 1, 2, 3]), busy_node("n1", [0, 1, 2, 3])]
    runs = [RunningAllocation(job_id=f"s{k}", node_id=f"n{k // 4}", gpu_indices=(k % 4,), preemptible=True,
                              checkpointable=True, run_seconds=5000, cpu_milli=1000, memory_mb=1024,
                              demand=job(f"s{k}", allowed_models=("H100",))) for k in range(8)]
    snap = snapshot(nodes, [job("big", gpus=8)], running=runs)
    assert schedule(snap, POLICY).migrations == ()


def test_defragmentation_moves_a_job_that_can_land_elsewhere_not_the_cheapest_one_that_cannot():
    # Each node has 4 of 8 GPUs free and 20 free cores. The job with the least lost work on each
    # node asks 30 cores, so no other node can take it; moving one of its 1-core neighbours instead
    # still frees the fifth GPU the blocked job needs.
    nodes = [gpu_node(n, used={g: 1000 for g in range(4)}, free_cpu=20_000) for n in ("n0", "n1")]
    runs = []
    for n in ("n0", "n1"):
        hungry = f"{n}-hungry"
        runs.append(RunningAllocation(
            job_id=hungry, node_id=n, gpu_indices=(0,), tenant="acme", preemptible=True, checkpointable=True,
            run_seconds=5000, checkpoint_age_s=10, cpu_milli=30_000, memory_mb=1024,
            demand=job(hungry, gpus=1, cpu_milli=30_000)))
        runs += [running(f"{n}-s{g}", n, [g]) for g in range(1, 4)]
    plan = schedule(snapshot(nodes, [job("big", gpus=5)], running=runs), POLICY)
    assert len(plan.migrations) == 1
    move = plan.migrations[0]
    assert "hungry" not in move.job_id and move.for_job_id == "big" and move.to.node_id != move.from_node_id
    assert plan.pending["big"].code == ReasonCode.WAITING_FOR_DEFRAGMENTATION


def test_planners_alone_on_a_snapshot():
    from scheduling.defrag import defragmentation_for
    from scheduling.preemption import preemptions_for

    nodes = [busy_node("n0", range(8))]
    snap = snapshot(nodes, [job("urgent", gpus=2, priority=3)], running=[running("v", "n0", range(8))])
    assert [p.victim_job_id for p in preemptions_for(snap, POLICY)] == ["v"]
    nodes, runs = fragmented_cluster()
    moves = defragmentation_for(snapshot(nodes, [job("big", gpus=8)], running=runs), POLICY)
    assert len(moves) == 4 and {m.for_job_id for m in moves} == {"big"}


def test_preemption_when_most_nodes_are_offline():
    # The headline reason is NODE_NOT_READY (3 of 4 nodes offline), yet the ready node is simply full.
    nodes = [busy_node("n0", range(8))] + [gpu_node(f"off{i}", state="offline") for i in range(3)]
    snap = snapshot(nodes, [job("urgent", gpus=8, priority=10)], running=[running("v", "n0", range(8))])
    plan = schedule(snap, POLICY)
    assert [p.victim_job_id for p in plan.preemptions] == ["v"]
    assert plan.pending["urgent"].data["previous"] == "NODE_NOT_READY"


def shares_on_a_t4_node_and_an_a100_node(a100_used: int):
    # n0: two T4s, each 600 milli taken by a movable share, so a 600-milli T4-only share has 800
    # milli free in total but no GPU with 600. n1: two A100s, the first with `a100_used` milli taken.
    nodes = [gpu_node("n0", gpus=2, model="T4", memory_mb=16 * 1024, used={0: 600, 1: 600}),
             gpu_node("n1", gpus=2, used={0: a100_used})]
    runs = [RunningAllocation(
        job_id=f"s{g}", node_id="n0", gpu_indices=(g,), tenant="acme", gpu_milli=600, preemptible=True,
        checkpointable=True, run_seconds=5000, checkpoint_age_s=10, cpu_milli=1000, memory_mb=1024,
        demand=job(f"s{g}", gpu_milli=600)) for g in range(2)]
    runs.append(RunningAllocation(job_id="a", node_id="n1", gpu_indices=(0,), tenant="acme", gpu_milli=a100_used,
                                  preemptible=False, checkpointable=False, run_seconds=5000, cpu_milli=1000,
                                  memory_mb=1024))
    blocked = job("t4-only", gpu_milli=600, allowed_models=("T4",))
    return snapshot(nodes, [blocked], running=runs)


def test_defragmentation_moves_a_share_onto_a_gpu_already_split():
    # The A100 split 400/600 takes a moved 600-milli share exactly: no GPU is left newly split.
    plan = schedule(shares_on_a_t4_node_and_an_a100_node(400), POLICY)
    assert [(m.from_node_id, m.to.node_id, m.to.gpu_indices) for m in plan.migrations] == [("n0", "n1", (0,))]
    assert plan.pending["t4-only"].code == ReasonCode.WAITING_FOR_DEFRAGMENTATION


def test_defragmentation_does_not_split_a_whole_gpu_for_a_moved_share():
    # The only room for a moved share is a whole A100: the move would start the blocked share but
    # leave one more GPU split than before (a 400-milli sliver few later jobs can use), so no move.
    plan = schedule(shares_on_a_t4_node_and_an_a100_node(700), POLICY)
    assert plan.migrations == ()
    assert "t4-only" in plan.pending
