"""Readers for the shared data sets (I/O lives here, never in `scheduling/`)."""

from __future__ import annotations

import csv
from pathlib import Path

from scheduling.sim.cluster import NodeSpec, TaskSpec


def read_nodes(path: str | Path) -> list[NodeSpec]:
    """Alibaba `openb_node_list_*.csv`: sn,cpu_milli,memory_mib,gpu,model."""
    with open(path, newline="") as f:
        return [NodeSpec(r["sn"], int(r["cpu_milli"]), int(r["memory_mib"]), int(r["gpu"]), r["model"])
                for r in csv.DictReader(f)]


def read_tasks(path: str | Path) -> list[TaskSpec]:
    """Alibaba `openb_pod_list_*.csv`; `gpu_spec` like `V100M16|V100M32` lists allowed models."""
    out: list[TaskSpec] = []
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            num = int(r["num_gpu"])
            milli = int(r["gpu_milli"]) if num > 0 else 0
            spec = (r.get("gpu_spec") or "").strip()
            models = frozenset(s for s in spec.split("|") if s) if spec else None
            out.append(TaskSpec(r["name"], int(r["cpu_milli"]), int(r["memory_mib"]), num, milli, models))
    return out
