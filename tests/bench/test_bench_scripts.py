"""Smoke runs of the three benchmark scripts on tiny generated data (never the shared data sets)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest

from bench import cost, fragmentation, scale
from bench.loaders import read_nodes, read_offers, read_tasks
from scheduling.sim.cluster import ArrayCluster

MODELS = ["G2", "T4", "P100"]


def write_alibaba(tmp: Path, nodes: int = 8, pods: int = 40) -> tuple[Path, Path]:
    rng = np.random.default_rng(7)
    npath, ppath = tmp / "nodes.csv", tmp / "openb_pod_list_tiny.csv"
    with open(npath, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["sn", "cpu_milli", "memory_mib", "gpu", "model"])
        for i in range(nodes):
            w.writerow([f"node-{i}", 32000, 131072, [8, 2, 4][i % 3], MODELS[i % 3]])
    with open(ppath, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["name", "cpu_milli", "memory_mib", "num_gpu", "gpu_milli", "gpu_spec", "qos", "pod_phase",
                    "creation_time", "deletion_time", "scheduled_time"])
        for i in range(pods):
            kind = i % 5
            num, milli = [(1, 1000), (1, 500), (1, 300), (2, 1000), (0, 0)][kind]
            spec = "T4|P100" if i % 7 == 0 and num else ""
            w.writerow([f"pod-{i}", int(rng.integers(1, 8)) * 1000, 4096, num, milli, spec, "LS", "Running", 0, 1, 0])
    return npath, ppath


def last_json(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


def test_fragmentation_script_json_plot_and_placements(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    npath, ppath = write_alibaba(tmp_path)
    placements = tmp_path / "placements.csv"
    fragmentation.main(["--nodes", str(npath), "--pods", str(ppath), "--seeds", "2", "--json",
                        "--placements-out", str(placements), "--out", str(tmp_path / "plots"),
                        "--broker-every", "5"])
    result = last_json(capsys.readouterr().out)
    total = sum(n.num_gpu for n in read_nodes(npath))
    assert result["total_gpus"] == total and result["seeds"] == 2
    pols = result["policies"]
    for name in ("whalezen-online", "whalezen-broker", "whalezen-batch", "bestfit", "fgd", "random", "dotprod",
                 "gpupacking", "gpuclustering", "firstfit", "k8s-spread"):
        s = pols[name]
        assert 0 <= s["alloc_at_100"] <= 100 and 0 <= s["alloc_at_130"] <= 100
        assert s["unallocated_at_130"] == pytest.approx(total * (1 - s["alloc_at_130"] / 100), abs=0.06)
        # no policy leaves fewer GPUs unallocated than the LP bound allows
        assert s["unallocated_at_130"] >= result["upper_bound_unallocated_at_130"] - 0.06
    assert (tmp_path / "plots" / "fragmentation_alloc.png").stat().st_size > 1000

    # the placements replay on a fresh cluster without over-allocating anything
    nodes = read_nodes(npath)
    by_name = {n.name: i for i, n in enumerate(nodes)}
    tasks = {t.name: t for t in read_tasks(ppath)}
    cluster = ArrayCluster(nodes)
    with open(placements, newline="") as f:
        rows = list(csv.DictReader(f))
    assert rows and list(rows[0]) == ["name", "node", "gpus"]
    for r in rows:
        t = tasks[r["name"].split("#")[0]]
        gpus = [int(g) for g in r["gpus"].split(";")] if r["gpus"] else []
        cluster.place(by_name[r["node"]], gpus, t)  # raises on any over-allocation
    assert cluster.allocated_milli > 0


def write_fleet_data(tmp: Path) -> tuple[Path, Path]:
    philly = tmp / "philly.csv"
    with open(philly, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["timestamp", "duration", "num_gpus", "gpu_time", "cluster"])
        for i in range(30):
            w.writerow([f"2017-10-01 {i // 6:02d}:{(i * 7) % 60:02d}:00", 600 + 300 * (i % 4), [1, 1, 2, 4, 16][i % 5],
                        0, "c"])
    cat = tmp / "catalog"
    cat.mkdir()
    with open(cat / "aws_vms_v8_gpu_excerpt.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["InstanceType", "AcceleratorName", "AcceleratorCount", "vCPUs", "MemoryGiB", "GpuInfo", "Price",
                    "SpotPrice", "Region", "AvailabilityZone", "Arch"])
        w.writerow(["p3.2xlarge", "V100", "1.0", "8.0", "61.0", "", "3.06", "0.37", "us-east-1", "az1", "x86_64"])
        w.writerow(["p4d.24xlarge", "A100", "8.0", "96.0", "1152.0", "", "21.96", "", "us-east-1", "az1", "x86_64"])
        w.writerow(["mac1.metal", "", "", "12.0", "32.0", "", "", "", "us-east-1", "az4", "x86_64"])
    with open(cat / "gcp_vms_v8_gpu_excerpt.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["InstanceType", "vCPUs", "MemoryGiB", "AcceleratorName", "AcceleratorCount", "GpuInfo", "Region",
                    "AvailabilityZone", "Price", "SpotPrice"])
        w.writerow(["a2-highgpu-1g", "12.0", "85.0", "", "", "", "us-central1", "a", "0.74", "0.37"])
        w.writerow(["", "", "", "A100", "2", "", "us-central1", "a", "5.86", "2.86"])
    return philly, cat


def test_offers_loader_combines_gcp_host_and_gpu_rows(tmp_path: Path) -> None:
    _, cat = write_fleet_data(tmp_path)
    offers = {o.instance_type: o for o in read_offers(cat)}
    assert set(offers) == {"p3.2xlarge", "p4d.24xlarge", "a2-highgpu-1g"}
    assert offers["a2-highgpu-1g"].price_per_hour == pytest.approx(0.74 + 5.86 / 2)
    assert offers["p4d.24xlarge"].spot_price_per_hour is None


def test_cost_script_json_shape_and_consistency(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    philly, cat = write_fleet_data(tmp_path)
    cost.main(["--philly", str(philly), "--catalog", str(cat), "--start-day", "0", "--days", "7",
               "--every", "1", "--onprem-nodes", "1", "--seeds", "2", "--json", "--out", str(tmp_path / "plots")])
    result = last_json(capsys.readouterr().out)
    assert result["jobs"] == 24 and result["left_out_over_8_gpus"] == 6 and result["seeds"] == [0, 1]
    assert len(result["whalezen_saving_vs_greedy_pct_per_seed"]) == 2
    pols = result["policies"]
    assert set(pols) == {"whalezen", "greedy-cheapest", "onprem-fifo"}
    for s in pols.values():
        assert s["finished"] == 24 and s["unfinished"] == 0
        assert s["dollars"] == pytest.approx(s["cloud_dollars"] + s["onprem_dollars"], abs=0.02)
        assert s["jct_p95_h"] >= s["queue_p95_h"] >= 0 and s["jct_mean_h"] > 0
    assert pols["onprem-fifo"]["cloud_dollars"] == 0
    for s in pols.values():  # the figures are means over the seeds
        assert s["dollars"] == pytest.approx(sum(s["dollars_per_seed"]) / 2, abs=0.01)
    assert (tmp_path / "plots" / "cost_vs_delay.png").exists()


def test_scale_script_json_shape(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    npath, ppath = write_alibaba(tmp_path, nodes=6, pods=20)
    _, cat = write_fleet_data(tmp_path)
    scale.main(["--nodes", str(npath), "--pods", str(ppath), "--catalog", str(cat), "--jobs", "10,20",
                "--repeat", "2", "--gap-instances", "1", "--gap-nodes", "3", "--gap-jobs", "4", "--json"])
    result = last_json(capsys.readouterr().out)
    assert [c["jobs"] for c in result["cycles"]] == [10, 20]
    for c in result["cycles"]:
        assert c["max_s"] >= c["median_s"] > 0
        assert c["method"] in ("milp", "greedy") and isinstance(c["proven_optimal"], bool)
    assert "optimality_gap_pct" in result
