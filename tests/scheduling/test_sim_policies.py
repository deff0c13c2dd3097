"""Each baseline's choice on a tiny cluster, and the array cluster's bookkeeping."""

from __future__ import annotations

import numpy as np
import pytest

from scheduling.fragmentation import TaskClass, normalise
from scheduling.sim.cluster import ArrayCluster, NodeSpec, TaskSpec
from scheduling.sim.registry import ONLINE_POLICIES, make_policy

NODES = [
    NodeSpec("a", 16_000, 64_000, 2, "P100"),
    NodeSpec("b", 96_000, 384_000, 8, "G2"),
    NodeSpec("c", 8_000, 32_000, 1, "V100"),
]
ONE_GPU = TaskSpec("one", 4_000, 8_000, 1, 1000)
HALF = TaskSpec("half", 2_000, 4_000, 1, 500)
WORKLOAD = normalise([TaskClass(4_000, 1000, 1, 1.0), TaskClass(2_000, 500, 1, 1.0)])


def decide(name: str, task: TaskSpec, setup: list[tuple[int, list[int], TaskSpec]] = ()) -> tuple[str, list[int]]:
    cluster = ArrayCluster(NODES)
    policy = make_policy(name, WORKLOAD)
    policy.start(cluster, np.random.default_rng(0))
    for node, gpus, t in setup:
        cluster.place(node, gpus, t)
        policy.observe(node, gpus, t)
    d = policy.choose(task)
    assert d is not None
    return cluster.names[d[0]], d[1]


def test_bestfit_takes_the_tightest_node() -> None:
    assert decide("bestfit", ONE_GPU) == ("c", [0])


def test_firstfit_takes_the_first_node_in_the_list() -> None:
    assert decide("firstfit", ONE_GPU) == ("a", [0])
    assert decide("firstfit", ONE_GPU, [(0, [0, 1], TaskSpec("x", 0, 0, 2, 1000))]) == ("b", [0])


def test_k8s_spread_takes_the_emptiest_node() -> None:
    # LeastAllocated on CPU and memory: b keeps (92/96 + 376/384)/2 free, the most.
    assert decide("k8s-spread", ONE_GPU) == ("b", [0])


def test_dotprod_prefers_the_smallest_alignment() -> None:
    # dot product of free (CPU, GPU) with the demand, normalised by the largest node: c is smallest.
    assert decide("dotprod", ONE_GPU) == ("c", [0])


def test_gpupacking_prefers_shared_gpus_then_used_nodes() -> None:
    # all idle: score max(33 - free GPUs, free GPUs): c (32) > a (31) > b (25)
    assert decide("gpupacking", HALF) == ("c", [0])
    # a half-used GPU on b beats every idle node for a shared task
    assert decide("gpupacking", HALF, [(1, [3], HALF)]) == ("b", [3])


def test_gpuclustering_keeps_the_same_kind_together() -> None:
    # b already runs a shared task: another shared task joins it (score > 75) rather than idle nodes
    assert decide("gpuclustering", HALF, [(1, [5], HALF)])[0] == "b"


def test_fgd_fills_the_half_free_gpu() -> None:
    # Filling the other half of b's GPU 5 removes a 500-milli fragment for the 1-GPU class.
    assert decide("fgd", HALF, [(1, [5], HALF)]) == ("b", [5])


def test_whalezen_online_fills_the_half_free_gpu_too() -> None:
    assert decide("whalezen-online", HALF, [(1, [5], HALF)]) == ("b", [5])


def test_whalezen_online_sends_cpu_only_work_to_cpu_rich_nodes() -> None:
    # FGD sees no difference for a CPU-only task (every node scores 50); whalezen avoids eating the
    # CPU of a node whose GPUs would then be stranded: c has 8 cores for 1 GPU, b 96 for 8.
    nodes = [NodeSpec("lean", 24_000, 64_000, 2, "T4"), NodeSpec("rich", 104_000, 512_000, 2, "T4")]
    cpu_task = TaskSpec("cpu", 12_000, 8_000, 0, 0)
    wl = normalise([TaskClass(11_000, 1000, 1, 1.0), TaskClass(12_000, 0, 0, 0.2)])
    for seed in range(5):  # whatever the tie-break priority
        cluster = ArrayCluster(nodes)
        p = make_policy("whalezen-online", wl)
        p.start(cluster, np.random.default_rng(seed))
        assert p.choose(cpu_task) == (1, [])


def test_random_only_picks_feasible_nodes() -> None:
    big = TaskSpec("big", 1_000, 1_000, 8, 1000)
    for seed in range(5):
        cluster = ArrayCluster(NODES)
        p = make_policy("random", WORKLOAD)
        p.start(cluster, np.random.default_rng(seed))
        assert p.choose(big) == (1, list(range(8)))


@pytest.mark.parametrize("name", ONLINE_POLICIES)
def test_every_policy_returns_none_when_nothing_fits(name: str) -> None:
    cluster = ArrayCluster(NODES)
    p = make_policy(name, WORKLOAD)
    p.start(cluster, np.random.default_rng(0))
    assert p.choose(TaskSpec("huge", 200_000, 1, 1, 1000)) is None
    assert p.choose(TaskSpec("model", 1, 1, 1, 1000, frozenset({"A100"}))) is None


def test_cluster_place_release_and_states() -> None:
    cluster = ArrayCluster(NODES)
    s0 = cluster.state.copy()
    cluster.place(1, [2], HALF)
    assert cluster.gpu_free[1].tolist() == [1000, 1000, 500, 1000, 1000, 1000, 1000, 1000]
    assert cluster.allocated_milli == 500
    assert cluster.state[1] != s0[1]
    cluster.release(1, [2], HALF)
    assert cluster.state.tolist() == s0.tolist()  # same row, same interned state
    with pytest.raises(ValueError):
        cluster.place(2, [0], TaskSpec("cpu-hog", 9_000, 1, 1, 1000))
    with pytest.raises(ValueError):
        cluster.place(0, [0, 0], TaskSpec("twice", 0, 0, 2, 1000))
    assert cluster.fits(TaskSpec("two", 0, 0, 2, 1000)).tolist() == [True, True, False]
