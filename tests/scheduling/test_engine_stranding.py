"""CPU/memory stranding in the engine's objective: GPU capacity a node cannot sell once its CPU runs
out under the workload's average CPU per GPU (`patterns.STRANDING_ALPHA`, `objective.evaluate`,
the MILP's per-shape term, the exact model's per-node term, greedy's order, the packer)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from engine_factories import FAST, gpu_node, job, snapshot
from scheduling.book import Book
from scheduling.capacity import NodeCapacity, PartDemand
from scheduling.engine import schedule
from scheduling.exact import optimality_gap
from scheduling.fragmentation import TaskClass, mix_ratios, normalise, stranded_batch
from scheduling.model import Policy, WorkloadClass
from scheduling.objective import evaluate
from scheduling.packer import TargetPacker
from scheduling.problem import build_problem
from scheduling.validate import plan_violations

# The mix: 1-GPU tasks with 11 cores each (11 cores per GPU), and some CPU-only tasks.
MIX = (WorkloadClass(gpus=1, gpu_milli=1000, weight=3.0, cpu_milli=11_000),
       WorkloadClass(gpus=0, gpu_milli=0, weight=1.0, cpu_milli=8_000))
METHODS = ("auto", "milp", "greedy", "exact")


def dense(node_id: str, free_cpu: int = 96_000, used: dict[int, int] | None = None):
    """An 8-GPU node with 96 cores (12 per GPU: little CPU to spare)."""
    return gpu_node(node_id, gpus=8, cpu_milli=96_000, free_cpu=free_cpu, used=used)


def cpu_rich(node_id: str, free_cpu: int = 60_000):
    """A 2-GPU node with 104 cores whose GPUs are both taken."""
    return gpu_node(node_id, gpus=2, cpu_milli=104_000, free_cpu=free_cpu, used={0: 1000, 1: 1000})


def test_stranded_gpus_follow_the_mix_ratio():
    workload = normalise([TaskClass(11_000, 1000, 1, 3.0), TaskClass(8_000, 0, 0, 1.0)])
    cpu_per_gpu, mem_per_gpu = mix_ratios(workload)
    assert cpu_per_gpu == pytest.approx(11.0) and mem_per_gpu == 0.0  # CPU-only classes left out
    # 8 free GPUs, 44 free cores: 4 GPUs can still be sold, 4 are stranded; plenty of CPU: none.
    out = stranded_batch([[1000] * 8, [1000] * 8], [44_000, 200_000], cpu_per_gpu)
    assert out.tolist() == pytest.approx([4000.0, 0.0])


@pytest.mark.parametrize("method", METHODS)
def test_cpu_only_job_goes_where_its_cpu_strands_no_gpu(method):
    # 32 cores on the 8-GPU node leave 64 cores for 8 GPUs (5.8 GPUs' worth at 11 cores per GPU);
    # on the CPU-rich node whose GPUs are taken they strand nothing. Without the stranding term
    # both cost the same and the tie went to the first node.
    snap = snapshot([dense("a-dense"), cpu_rich("b-rich")], [job("cpu", gpus=0, cpu_milli=32_000)],
                    workload=MIX)
    plan = schedule(snap, replace(FAST, method=method))
    assert plan.placement_for("cpu").parts[0].node_id == "b-rich"
    assert plan_violations(snap, plan) == []


@pytest.mark.parametrize("method", METHODS)
def test_gpu_job_prefers_the_node_whose_leftover_cpu_matches_its_leftover_gpus(method):
    # Both nodes have 8 free GPUs. "a-fresh" has all 96 cores; "b-starved" has 24 cores left, so
    # only 2 of its 8 GPUs can still be sold. A 1-GPU job with 2 cores is the rare task that fits
    # the starved node's ratio: there it uses a GPU that would otherwise stay stranded.
    snap = snapshot([dense("a-fresh"), dense("b-starved", free_cpu=24_000)],
                    [job("small", gpus=1, cpu_milli=2_000)], workload=MIX)
    plan = schedule(snap, replace(FAST, method=method))
    assert plan.placement_for("small").parts[0].node_id == "b-starved"


def test_greedy_does_not_pile_a_class_onto_one_node():
    # Two 8-GPU nodes, one with a little more CPU. Alone, each 10-core job strands least on the
    # richer node; once one is there, the other node is the cheaper place for the second.
    snap = snapshot([dense("a", free_cpu=96_000), dense("b", free_cpu=100_000)],
                    [job("c1", gpus=0, cpu_milli=10_000), job("c2", gpus=0, cpu_milli=10_000)], workload=MIX)
    plan = schedule(snap, replace(FAST, method="greedy"))
    assert {plan.placement_for(j).parts[0].node_id for j in ("c1", "c2")} == {"a", "b"}


def test_packer_spreads_cpu_only_jobs_over_equal_nodes():
    caps = [NodeCapacity(dense(f"n{i}")) for i in range(3)]
    packer = TargetPacker(caps)
    part = PartDemand(gpus=0, milli=1000, min_gpu_memory_mb=0, nvlink=False, cpu_milli=10_000, memory_mb=0,
                      allowed_models=())
    chosen = []
    for _ in range(3):
        index, positions = packer.find(part)
        caps[index].free_cpu -= part.cpu_milli
        packer.touch(index, positions)
        chosen.append(index)
    assert sorted(chosen) == [0, 1, 2]


def test_evaluate_charges_the_stranding_change_of_each_node():
    snap = snapshot([dense("a")], [job("cpu", gpus=0, cpu_milli=32_000)], workload=MIX)
    problem = build_problem(snap, FAST)
    original = [cap.copy() for cap in problem.capacities]
    empty = evaluate(problem, Book(problem), original)
    book = Book(problem)
    candidate = problem.classes[0].candidates[0]
    assert book.place_job(problem.jobs_by_id["cpu"], candidate.target, candidate.part) is not None
    placed = evaluate(problem, book, original)
    # waiting cost gone, money of the job added, and 2 x (8 - 64/11) stranded GPUs x $0.5
    stranded = 8 - 64 / 11
    money = placed - empty + problem.classes[0].waiting_cost
    assert money == pytest.approx(candidate.money + 2 * stranded * 0.5 + 0.5 * candidate.host_cost, abs=1e-6)


def test_exact_model_optimises_the_same_objective_so_the_gap_is_not_negative():
    nodes = [dense("a"), dense("b", free_cpu=40_000), cpu_rich("c"), cpu_rich("d", free_cpu=20_000)]
    pending = [job(f"g{i}", gpus=1, cpu_milli=11_000) for i in range(4)] \
        + [job(f"c{i}", gpus=0, cpu_milli=16_000) for i in range(3)] \
        + [job("s", gpus=1, gpu_milli=500, cpu_milli=3_000)]
    snap = snapshot(nodes, pending, workload=MIX)
    result = optimality_gap(snap, Policy(time_limit_s=5.0))
    assert result["exact_proven"]
    assert result["gap_pct"] >= -1e-6


def test_gangs_within_a_shape_go_to_the_fullest_node_where_their_cpu_strands_nothing():
    # Three equal 8-GPU / 96-core nodes; 1-GPU jobs with 16 cores each (the mix has 11 per GPU).
    # One such job leaves a node 7 GPUs and 80 cores (enough for 7 x 11), a second would strand
    # part of a GPU. Plain best fit piles all four onto one node (4 GPUs left beside 32 cores);
    # with the stranding check each node takes one first.
    snap = snapshot([dense(f"n{i}") for i in range(3)], [job(f"j{i}", gpus=1, cpu_milli=16_000) for i in range(4)],
                    workload=MIX)
    plan = schedule(snap, replace(FAST, method="greedy"))
    nodes = [plan.placement_for(f"j{i}").parts[0].node_id for i in range(4)]
    assert sorted(nodes.count(n) for n in set(nodes)) == [1, 1, 2]
    assert plan_violations(snap, plan) == []
