"""Where the free GPU capacity sits at the end of a run (`bench.leftover`, `bench.fragmentation --leftover`)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from bench import fragmentation
from bench.leftover import leftover, mean_leftover
from bench.loaders import read_nodes, read_tasks
from scheduling.fragmentation import workload_from_tasks
from scheduling.sim.cluster import ArrayCluster, NodeSpec, TaskSpec
from scheduling.sim.protocol import build_arrivals, run_online
from scheduling.sim.registry import make_policy
from tests.bench.test_bench_derive import write_data

NODES = [NodeSpec("a", 16000, 65536, 2, "T4"), NodeSpec("b", 4000, 65536, 2, "T4"),
         NodeSpec("c", 32000, 65536, 2, "G2")]
BIG = TaskSpec("big", 2000, 1024, 1, 810)
SMALL = TaskSpec("small", 2000, 1024, 1, 160)
HALF = TaskSpec("half", 2000, 1024, 1, 500)
CPU_HUNGRY = TaskSpec("cpu", 4000, 1024, 1, 300)
T4_PAIR = TaskSpec("pair", 1000, 1024, 2, 1000, frozenset({"T4"}))


def test_gaps_are_grouped_by_what_occupies_the_gpu_and_priced_by_what_of_the_list_fits_them() -> None:
    tasks = [BIG, SMALL, HALF, HALF]
    # a: 0.81 on GPU 0, 0.5 on GPU 1; c: 0.81 on GPU 0, GPU 1 untouched
    out = leftover(NODES, tasks, [(BIG, 0, [0]), (HALF, 0, [1]), (BIG, 2, [0])])
    assert out["free_gpus"] == pytest.approx(0.19 + 0.5 + 2 + 0.19 + 1)  # b is empty
    assert out["whole_free_gpus"] == 3  # b's two and c's second
    assert out["whole_free_by_shape"] == {"T4x2": 2, "G2x2": 1}
    assert out["partly_used_gpus"] == 3
    beside_half, beside_big = out["gaps"]  # the largest free capacity first
    assert beside_half == {"occupants": [500], "gpus": 1, "free_gpus": 0.5, "list_fraction_that_fits": 0.75}
    # only the 0.16 task (one of four GPU tasks) fits beside a 0.81 task
    assert beside_big == {"occupants": [810], "gpus": 2, "free_gpus": pytest.approx(0.38),
                          "list_fraction_that_fits": 0.25}
    assert out["free_where_nothing_fits"] == 0
    # 0.5 free fits 3 of the 4 tasks; the 0.19 beside each 0.81 task fits one of the four
    assert out["gap_free_by_list_fraction_that_fits"] == {"under 1%": 0, "1-5%": 0,
                                                          "5% or more": pytest.approx(0.5 + 0.38)}


def test_a_gap_that_almost_nothing_of_the_list_fits_is_counted_as_such() -> None:
    # one 0.16 task among 200 of 0.81: the 0.19 beside a 0.81 task fits 0.5% of the list
    out = leftover(NODES, [BIG] * 199 + [SMALL], [(BIG, 0, [0]), (BIG, 0, [1])])
    assert out["gap_free_by_list_fraction_that_fits"] == {"under 1%": pytest.approx(0.38), "1-5%": 0,
                                                          "5% or more": 0}
    assert out["gaps"][0]["list_fraction_that_fits"] == 0.005


def test_a_node_whose_cpu_is_gone_strands_its_free_gpus() -> None:
    tasks = [CPU_HUNGRY, SMALL]
    # b has 4 cores: the 0.3 task takes them all, so its 1.7 free GPUs can take nothing of the list
    out = leftover(NODES, tasks, [(CPU_HUNGRY, 1, [0])])
    assert out["free_where_nothing_fits"] == pytest.approx(1.7)
    assert out["free_gpus"] == pytest.approx(2 + 1.7 + 2)


def test_a_model_constraint_and_a_gang_decide_what_still_fits() -> None:
    # only a 2-GPU T4 gang in the list: c (G2) never fits it, a with one GPU taken no longer does
    out = leftover(NODES, [T4_PAIR], [(TaskSpec("one", 1000, 1024, 1, 1000), 0, [0])])
    assert out["free_where_nothing_fits"] == pytest.approx(1 + 2)  # a's second GPU and both of c's
    assert out["whole_free_gpus"] == 5


def test_the_mean_over_seeds_merges_groups() -> None:
    one = leftover(NODES, [BIG, SMALL], [(BIG, 0, [0])])
    two = leftover(NODES, [BIG, SMALL], [(BIG, 0, [0]), (BIG, 0, [1]), (BIG, 2, [0])])
    mean = mean_leftover([one, two])
    assert mean["gaps"][0] == {"occupants": [810], "gpus": 2.0, "free_gpus": 0.4, "list_fraction_that_fits": 0.5}
    assert mean["gap_free_by_list_fraction_that_fits"]["5% or more"] == 0.4
    assert mean["whole_free_by_shape"] == {"T4x2": 2.5, "G2x2": 1.5}  # (3 + 2) / 2 and (2 + 1) / 2
    assert mean["free_gpus"] == pytest.approx((one["free_gpus"] + two["free_gpus"]) / 2, abs=0.05)


def test_fragmentation_reports_the_leftover_of_the_end_state(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    npath, ppath = write_data(tmp_path)
    fragmentation.main(["--nodes", str(npath), "--pods", str(ppath), "--seeds", "2", "--no-bound", "--json",
                        "--policies", "whalezen-broker,fgd", "--broker-every", "5", "--leftover",
                        "--target", "1.0"])
    out = capsys.readouterr().out
    result = json.loads(out.strip().splitlines()[-1])
    for name in ("whalezen-broker", "fgd"):
        s = result["policies"][name]
        part = s["leftover"]
        assert 0 < part["free_gpus"] <= result["total_gpus"]
        assert 0 <= part["whole_free_gpus"] <= part["free_gpus"]
        assert sum(g["free_gpus"] for g in part["gaps"]) <= part["free_gpus"] - part["whole_free_gpus"] + 0.1
        assert f"{name}: {part['free_gpus']:.1f} GPUs free at the end" in out


def test_the_free_capacity_is_what_the_run_leaves_unallocated(tmp_path: Path) -> None:
    npath, ppath = write_data(tmp_path)
    nodes, tasks = read_nodes(npath), read_tasks(ppath)
    cluster = ArrayCluster(nodes)
    arrivals = build_arrivals(tasks, cluster.total_gpu_milli, np.random.default_rng(3))
    run = run_online(cluster, arrivals, make_policy("fgd", workload_from_tasks(
        [(t.cpu_milli, t.memory_mib, t.gpu_milli, t.num_gpu, t.gpu_models) for t in tasks])),
        np.random.default_rng(4), record_placements=True)
    by_name = {t.name: t for t in arrivals}
    part = leftover(nodes, tasks, [(by_name[name], node, gpus) for name, node, gpus in run.placements])
    total = cluster.total_gpu_milli / 1000
    assert part["free_gpus"] == pytest.approx(total * (1 - run.alloc_pct[-1] / 100))
    assert part["free_gpus"] > 0 and part["partly_used_gpus"] > 0


def test_leftover_refuses_a_policy_that_records_no_placements(tmp_path: Path) -> None:
    npath, ppath = write_data(tmp_path)
    with pytest.raises(SystemExit, match="whalezen-batch"):
        fragmentation.main(["--nodes", str(npath), "--pods", str(ppath), "--seeds", "1", "--no-bound",
                            "--policies", "whalezen-batch", "--leftover"])
