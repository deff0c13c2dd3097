"""Relocation after mapping (`scheduling.improve`): the per-node objective repairs what the
aggregated MILP's pooled terms and the mapping got wrong, without breaking the book."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings

import scheduling.improve as improve_module
from engine_factories import FAST, gpu_node, job, snapshot
from scheduling.book import Book
from scheduling.engine import schedule
from scheduling.improve import hand_over, improve
from scheduling.model import Policy, WorkloadClass
from scheduling.objective import end_state_cost, evaluate
from scheduling.problem import Problem, build_problem
from scheduling.validate import plan_violations
from test_engine_properties import snapshots

# 1-GPU tasks with 11 cores each: a node's GPUs strand once fewer than 11 cores per GPU are left.
MIX = (WorkloadClass(gpus=1, gpu_milli=1000, weight=3.0, cpu_milli=11_000),)


def dense(node_id: str, **fields):
    """An 8-GPU node with 96 cores (12 per GPU: little CPU to spare)."""
    return gpu_node(node_id, gpus=8, cpu_milli=96_000, **fields)


def put(problem: Problem, book: Book, job_id: str, node_id: str) -> None:
    """Place a job on a chosen node, bypassing the packer (as a poor mapping would)."""
    job_demand = problem.jobs_by_id[job_id]
    position = next(p for p, cap in enumerate(book.caps) if cap.node.id == node_id)
    for candidate in problem.classes[problem.class_of[job_id]].candidates:
        if position in problem.targets[candidate.target].members:
            positions = book.caps[position].choose(candidate.part)
            assert positions is not None
            book.commit(job_demand, problem.targets[candidate.target], [(book.caps[position], positions, None)],
                        candidate.part)
            return
    raise AssertionError(f"{job_id} cannot go to {node_id}")


def recomputed_caps(problem: Problem, book: Book) -> list[tuple]:
    """Free capacity of every owned node rebuilt from the placements alone."""
    caps = [cap.copy() for cap in problem.capacities]
    by_id = {cap.node.id: cap for cap in caps}
    for job_id, placement in book.placements.items():
        candidates = {c.target: c for c in problem.classes[problem.class_of[job_id]].candidates}
        for part in placement.parts:
            if part.node_id is None:
                continue
            cap = by_id[part.node_id]
            target = next(t for t in candidates if problem.targets[t].kind == "node"
                          and caps.index(cap) in problem.targets[t].members)
            positions = tuple(p for p, gpu in enumerate(cap.node.gpus) if gpu.index in part.gpu_indices)
            cap.take(positions, candidates[target].part)
    return [(c.free_milli, c.free_memory, c.free_cpu, c.free_mem) for c in caps]


def state(book: Book) -> list[tuple]:
    return [(c.free_milli, c.free_memory, c.free_cpu, c.free_mem) for c in book.caps]


def test_jobs_piled_onto_one_node_are_spread_where_their_cpu_strands_nothing():
    # Four 1-GPU jobs with 16 cores on one 96-core node leave 4 GPUs beside 32 cores: most of
    # them can no longer be sold. One per node strands nothing.
    snap = snapshot([dense(f"n{i}") for i in range(3)], [job(f"j{i}", gpus=1, cpu_milli=16_000) for i in range(4)],
                    workload=MIX)
    problem = build_problem(snap, FAST)
    original = [cap.copy() for cap in problem.capacities]
    book = Book(problem)
    for i in range(4):
        put(problem, book, f"j{i}", "n0")
    piled = evaluate(problem, book, original)

    assert improve(problem, book, original) >= 2
    nodes = [book.placements[f"j{i}"].parts[0].node_id for i in range(4)]
    assert sorted(nodes.count(n) for n in set(nodes)) == [1, 1, 2]
    assert evaluate(problem, book, original) < piled - 0.5
    assert state(book) == recomputed_caps(problem, book)


def test_a_job_moves_to_the_cheaper_node_and_the_tenant_is_charged_the_new_price():
    snap = snapshot([gpu_node("pricey", gpus=2, price=3.0), gpu_node("cheap", gpus=2, price=1.0)],
                    [job("a", gpus=1, expected_duration_hours=2.0)], tenants=())
    problem = build_problem(snap, FAST)
    original = [cap.copy() for cap in problem.capacities]
    book = Book(problem)
    put(problem, book, "a", "pricey")
    assert improve(problem, book, original) == 1
    placement = book.placements["a"]
    assert placement.parts[0].node_id == "cheap" and placement.price_per_hour == pytest.approx(1.0)
    assert state(book) == recomputed_caps(problem, book)


def test_two_full_nodes_exchange_jobs_when_no_single_move_can_help():
    # Each node has one GPU and holds one job, so neither job can move alone. The long job on the
    # dear node and the short one on the cheap node cost 8 x $3 + 1 x $1; exchanged, 8 x $1 + 1 x $3.
    snap = snapshot([gpu_node("cheap", gpus=1, price=1.0), gpu_node("dear", gpus=1, price=3.0)],
                    [job("long", expected_duration_hours=8.0), job("short", expected_duration_hours=1.0)])
    problem = build_problem(snap, FAST)
    original = [cap.copy() for cap in problem.capacities]
    book = Book(problem)
    put(problem, book, "short", "cheap")
    put(problem, book, "long", "dear")
    before = evaluate(problem, book, original)
    assert improve(problem, book, original) == 1
    assert book.placements["long"].parts[0].node_id == "cheap"
    assert book.placements["short"].parts[0].node_id == "dear"
    assert evaluate(problem, book, original) == pytest.approx(before - 14.0)
    assert state(book) == recomputed_caps(problem, book)


def test_a_share_is_not_moved_onto_a_fresh_gpu_for_a_little_less_stranding():
    # "tight" has half of GPU 0 used and little CPU left; the share fills GPU 0 exactly. On the
    # roomy node its CPU would strand nothing, so the objective alone prefers it there, but that
    # splits a fresh GPU and leaves a half-GPU sliver (the objective prices only whole GPUs taken).
    snap = snapshot([dense("roomy"), dense("tight", used={0: 500}, free_cpu=30_000)],
                    [job("share", gpus=1, gpu_milli=500, cpu_milli=10_000)], workload=MIX)
    problem = build_problem(snap, FAST)
    original = [cap.copy() for cap in problem.capacities]
    on_tight, on_roomy = Book(problem), Book(problem)
    put(problem, on_tight, "share", "tight")
    put(problem, on_roomy, "share", "roomy")
    assert evaluate(problem, on_roomy, original) < evaluate(problem, on_tight, original)
    assert improve(problem, on_tight, original) == 0
    assert on_tight.placements["share"].parts[0].node_id == "tight"


def test_unplace_and_commit_restore_the_node_exactly():
    # GPU 0 is partly used (its free memory below the total), GPU 1 whole and free.
    snap = snapshot([gpu_node("n", gpus=2, used={0: 500}, free_memory={0: 10_000, 1: 39_000})],
                    [job("whole", gpus=1), job("share", gpus=1, gpu_milli=250, min_gpu_memory_mb=2_000)])
    problem = build_problem(snap, FAST)
    book = Book(problem)
    before = state(book)
    for job_id in ("whole", "share"):
        put(problem, book, job_id, "n")
    placed = state(book)
    for job_id in ("whole", "share"):
        candidate = problem.classes[problem.class_of[job_id]].candidates[0]
        slots = book.unplace(problem.jobs_by_id[job_id], problem.targets[candidate.target], candidate.part)
        assert job_id not in book.placements
    assert state(book) == before
    assert book.caps[0].free_memory == [10_000, 39_000]  # not the GPU's full 40 GB
    candidate = problem.classes[problem.class_of["share"]].candidates[0]
    book.commit(problem.jobs_by_id["share"], problem.targets[candidate.target], slots, candidate.part)
    assert state(book) != before and state(book) != placed


def test_a_cycle_beyond_the_trial_budget_is_left_as_mapped(monkeypatch):
    snap = snapshot([dense(f"n{i}") for i in range(3)], [job(f"j{i}", gpus=1, cpu_milli=16_000) for i in range(4)],
                    workload=MIX)
    problem = build_problem(snap, FAST)
    original = [cap.copy() for cap in problem.capacities]
    book = Book(problem)
    for i in range(4):
        put(problem, book, f"j{i}", "n0")
    monkeypatch.setattr(improve_module, "MAX_TRIALS", 3)
    assert improve(problem, book, original) == 0
    assert {p.parts[0].node_id for p in book.placements.values()} == {"n0"}


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(snapshots())
def test_relocation_never_raises_the_objective_nor_breaks_the_plan(snap):
    from scheduling.engine import place

    policy = Policy(time_limit_s=2.0)
    problem = build_problem(snap, policy)
    original = [cap.copy() for cap in problem.capacities]
    book, _ = place(problem, original, 0.0)
    before = evaluate(problem, book, original)
    improve(problem, book, original)
    assert evaluate(problem, book, original) <= before + 1e-6
    assert state(book) == recomputed_caps(problem, book)
    assert plan_violations(snap, schedule(snap, policy)) == []


def test_the_engine_reaches_the_exact_optimum_where_mapping_alone_did_not(monkeypatch):
    # Two shapes of equal 8-GPU nodes; the MILP pools each shape's CPU, so its mapping may pile
    # CPU-heavy jobs onto one node. With relocation the answer matches the per-node optimum.
    nodes = [dense(f"a{i}") for i in range(3)] + [dense(f"b{i}", free_cpu=60_000) for i in range(2)]
    pending = [job(f"g{i}", gpus=1, cpu_milli=16_000) for i in range(5)] \
        + [job(f"s{i}", gpus=1, gpu_milli=500, cpu_milli=3_000) for i in range(3)]
    snap = snapshot(nodes, pending, workload=MIX)
    exact = schedule(snap, replace(FAST, method="exact"))
    assert exact.solver.proven_optimal
    engine = schedule(snap, replace(FAST, method="milp"))
    monkeypatch.setattr(improve_module, "MAX_TRIALS", 0)
    mapped_only = schedule(snap, replace(FAST, method="milp"))
    assert engine.solver.objective == pytest.approx(exact.solver.objective, abs=1e-6)
    assert mapped_only.solver.objective > engine.solver.objective + 0.1  # what the relocation repaired



def test_the_end_state_sees_which_gpu_a_share_splits_where_the_linear_objective_cannot():
    # GPU 0 has 0.7 free, GPU 1 0.3; the mix is 0.7-GPU tasks. A 0.3 share that fills GPU 1 keeps
    # GPU 0's 0.7 for the next task; on GPU 0 it leaves 0.4 and 0.3, which no task of the mix fits.
    # No whole GPU is taken either way, so the linear objective scores both the same; the engine
    # keeps answers by the end state (`objective.end_state_cost`), which tells them apart.
    mix = (WorkloadClass(gpus=1, gpu_milli=700, weight=1.0, cpu_milli=1_000),)
    snap = snapshot([gpu_node("n", gpus=2, used={0: 300, 1: 700})], [job("share", gpus=1, gpu_milli=300)],
                    workload=mix)
    problem = build_problem(snap, FAST)
    original = [cap.copy() for cap in problem.capacities]
    candidate = problem.classes[problem.class_of["share"]].candidates[0]
    books = {}
    for position in (0, 1):
        book = Book(problem)
        book.commit(problem.jobs_by_id["share"], problem.targets[candidate.target],
                    [(book.caps[0], (position,), None)], candidate.part)
        books[position] = book
    assert books[0].caps[0].free_milli == [400, 300] and books[1].caps[0].free_milli == [700, 0]
    assert evaluate(problem, books[0], original) == pytest.approx(evaluate(problem, books[1], original))
    assert end_state_cost(problem, books[1], [0]) < end_state_cost(problem, books[0], [0]) - 0.1


def test_greedy_s_answer_is_relocated_too_when_the_engine_falls_back_to_it(monkeypatch):
    # Too large a model for the MILP: greedy answers alone. Greedy takes the queue in order (older
    # first at equal priority and size), so the short job gets the cheap node and the long one the
    # dear node; relocation then exchanges them (8 x $1 + 1 x $3 instead of 8 x $3 + 1 x $1).
    import scheduling.engine as engine_module

    snap = snapshot([gpu_node("cheap", gpus=1, price=1.0), gpu_node("dear", gpus=1, price=3.0)],
                    [job("short", expected_duration_hours=1.0, submitted_at=1.0),
                     job("long", expected_duration_hours=8.0, submitted_at=2.0)])
    monkeypatch.setattr(engine_module, "MAX_MILP_PAIRS", 0)
    plan = schedule(snap, FAST)
    nodes = {p.job_id: p.parts[0].node_id for p in plan.placements}
    assert plan.solver.method == "greedy" and "greedy used; 1 local move(s)" in plan.solver.note
    assert nodes == {"long": "cheap", "short": "dear"}
    assert plan_violations(snap, plan) == []
    # Asked for greedy alone, the policy gets best-fit as it packed.
    alone = schedule(snap, replace(FAST, method="greedy"))
    assert {p.job_id: p.parts[0].node_id for p in alone.placements} == {"short": "cheap", "long": "dear"}


def test_a_node_a_newer_gang_took_goes_to_two_older_jobs_that_share_it():
    # One empty 8-GPU node; two 4-GPU jobs wait, older than the 8-GPU gang that took it. Two jobs
    # started cost less waiting (2 x 4.1) than one (8.1): the node changes hands.
    snap = snapshot([gpu_node("n0")], [job("old1", gpus=4, submitted_at=1.0), job("old2", gpus=4, submitted_at=2.0),
                                       job("gang", gpus=8, submitted_at=3.0)])
    problem = build_problem(snap, FAST)
    original = [cap.copy() for cap in problem.capacities]
    book = Book(problem)
    put(problem, book, "gang", "n0")
    before = evaluate(problem, book, original)
    assert hand_over(problem, book, original) == 1
    assert sorted(book.placements) == ["old1", "old2"]
    assert evaluate(problem, book, original) < before
    assert state(book) == recomputed_caps(problem, book)


def test_the_waiting_jobs_that_fill_the_node_best_take_it_not_merely_the_oldest():
    # The oldest waiting job needs 300 GiB and leaves too little memory for anything beside it;
    # the two younger ones fit together and save more waiting than the gang costs.
    node = gpu_node("n0", cpu_milli=96_000, memory=384 * 1024)
    snap = snapshot([node], [job("hungry", gpus=4, memory_mb=300 * 1024, submitted_at=1.0),
                             job("a", gpus=4, memory_mb=128 * 1024, submitted_at=2.0),
                             job("b", gpus=4, memory_mb=128 * 1024, submitted_at=3.0),
                             job("gang", gpus=8, memory_mb=256 * 1024, submitted_at=4.0)])
    problem = build_problem(snap, FAST)
    original = [cap.copy() for cap in problem.capacities]
    book = Book(problem)
    put(problem, book, "gang", "n0")
    assert hand_over(problem, book, original) == 1
    assert sorted(book.placements) == ["a", "b"]


def test_a_node_is_not_handed_over_for_less_than_it_holds():
    # One 4-GPU job waiting would save 4.1 against the gang's 8.1: the gang keeps the node.
    snap = snapshot([gpu_node("n0")], [job("old", gpus=4, submitted_at=1.0), job("gang", gpus=8, submitted_at=2.0)])
    problem = build_problem(snap, FAST)
    original = [cap.copy() for cap in problem.capacities]
    book = Book(problem)
    put(problem, book, "gang", "n0")
    assert hand_over(problem, book, original) == 0
    assert sorted(book.placements) == ["gang"]
    assert state(book) == recomputed_caps(problem, book)


def test_the_engine_starts_the_older_pair_when_greedy_answers_alone(monkeypatch):
    # Best fit packs biggest first: alone, it gives the node to the newer gang.
    import scheduling.engine as engine_module

    snap = snapshot([gpu_node("n0")], [job("old1", gpus=4, submitted_at=1.0), job("old2", gpus=4, submitted_at=2.0),
                                       job("gang", gpus=8, submitted_at=3.0)])
    assert [p.job_id for p in schedule(snap, replace(FAST, method="greedy")).placements] == ["gang"]
    monkeypatch.setattr(engine_module, "MAX_MILP_PAIRS", 0)
    plan = schedule(snap, FAST)
    assert sorted(p.job_id for p in plan.placements) == ["old1", "old2"]
    assert plan.pending["gang"].code.value == "CAPACITY_TAKEN"
    assert plan_violations(snap, plan) == []


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(snapshots())
def test_handing_over_never_raises_the_objective_nor_breaks_the_plan(snap):
    problem = build_problem(snap, Policy(time_limit_s=2.0))
    original = [cap.copy() for cap in problem.capacities]
    book = Book(problem)
    from scheduling.greedy import place_greedily
    place_greedily(problem, book, [j.job_id for j in snap.pending])
    before = evaluate(problem, book, original)
    hand_over(problem, book, original)
    assert evaluate(problem, book, original) <= before + 1e-6
    assert state(book) == recomputed_caps(problem, book)
