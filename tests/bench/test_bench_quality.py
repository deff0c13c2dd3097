"""Placement quality, not just output shape: the FGD protocol (one seed) on generated Alibaba-like clusters.

Each cluster and task mix is drawn (fixed seeds) from the proportions of the Alibaba GPU trace: node kinds
G2x8, T4x2, P100x2, G3x8, V100x4/x8; tasks 48% one whole GPU, 38% a share of one GPU (the trace's common
shares), 13% CPU only, 1% 2-8 GPUs; the trace's common CPU requests. No shared data set is read, so the
check runs the same on every machine. One cluster is noisy (on some draws whalezen-online trails FGD),
so the check sums four. Measured on 2026-12-03 (after the scarce-homes term and the two look-ahead
horizons), GPUs left unallocated at 130% arrived, summed over the four: whalezen-online 63.0, FGD 88.5,
BestFit 160.9; mean allocated at 100%: 96.8%, 96.1%, 93.2% (before that change: 59.7 and 95.3%, behind
FGD at 100%). The asserts keep about half of each lead, so a change that gives most of it away fails.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest

from bench import fragmentation

NODE_KINDS = [  # model, GPUs, CPU milli, memory MiB, weight (share of the trace's GPU nodes, %)
    ("G2", 8, 96000, 393216, 45), ("T4", 2, 104000, 524288, 32), ("P100", 2, 16000, 122880, 9),
    ("G3", 8, 128000, 786432, 4), ("V100M16", 4, 32000, 131072, 3), ("V100M32", 8, 96000, 786432, 2),
    ("T4", 4, 96000, 393216, 2), ("P100", 2, 64000, 262144, 3)]
CPU_REQUESTS = [3152, 11300, 8000, 11908, 4000, 11400, 12500, 12000]
GPU_SHARES = [810, 470, 320, 650, 230, 460, 590, 160]


def write_trace_like(tmp: Path, *, nodes: int, tasks: int, seed: int) -> tuple[Path, Path]:
    rng = np.random.default_rng(seed)
    weights = np.array([kind[4] for kind in NODE_KINDS], float)
    weights /= weights.sum()
    npath, ppath = tmp / "nodes.csv", tmp / "openb_pod_list_tracelike.csv"
    with open(npath, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["sn", "cpu_milli", "memory_mib", "gpu", "model"])
        for i in range(nodes):
            model, gpus, cpu, memory, _ = NODE_KINDS[rng.choice(len(NODE_KINDS), p=weights)]
            w.writerow([f"node-{i}", cpu, memory, gpus, model])
    with open(ppath, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["name", "cpu_milli", "memory_mib", "num_gpu", "gpu_milli", "gpu_spec", "qos", "pod_phase",
                    "creation_time", "deletion_time", "scheduled_time"])
        for i in range(tasks):
            r = rng.random()
            num, milli = ((1, 1000) if r < 0.48 else (1, int(rng.choice(GPU_SHARES))) if r < 0.86
                          else (0, 0) if r < 0.99 else (int(rng.choice([2, 4, 8])), 1000))
            w.writerow([f"pod-{i}", int(rng.choice(CPU_REQUESTS)), int(rng.choice([8192, 16384, 32768])),
                        num, milli, "", "LS", "Running", 0, 1, 0])
    return npath, ppath


def test_whalezen_online_packs_better_than_fgd_and_bestfit(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    unallocated = {"whalezen-online": 0.0, "fgd": 0.0, "bestfit": 0.0}
    allocated_at_100 = dict.fromkeys(unallocated, 0.0)
    for seed in range(1, 5):
        npath, ppath = write_trace_like(tmp_path, nodes=120, tasks=1200, seed=seed)
        fragmentation.main(["--nodes", str(npath), "--pods", str(ppath), "--seeds", "1", "--json", "--no-bound",
                            "--policies", ",".join(unallocated)])
        result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        for name in unallocated:
            unallocated[name] += result["policies"][name]["unallocated_at_130"]
            allocated_at_100[name] += result["policies"][name]["alloc_at_100"] / 4
    assert unallocated["whalezen-online"] <= unallocated["fgd"] - 14.0, unallocated
    assert unallocated["whalezen-online"] <= unallocated["bestfit"] - 50.0, unallocated
    assert allocated_at_100["whalezen-online"] >= allocated_at_100["bestfit"] + 1.0, allocated_at_100
    assert allocated_at_100["whalezen-online"] >= allocated_at_100["fgd"] + 0.35, allocated_at_100
