"""Independent check of a placements CSV (`name,node,gpus`) written by `bench.fragmentation`.

    python -m bench.placement_check --nodes NODES.csv --pods PODS.csv [--derive KIND --seed 42] \
        --placements /tmp/placements.csv

Replays every row on an empty cluster with its own plain-dict accounting (not the simulator's
ArrayCluster, so a bug there cannot hide here): each task (clones `<task>#clone<k>` resolve to
`<task>`) is placed at most once, on a node that exists, on distinct GPUs of that node, as many
as it asks, on a GPU model it allows, never past any GPU's 1000 milli, the node's CPU or memory.
With `--derive`, the task's demand (its model constraint) is that of the derived list of `--seed`.
"""

from __future__ import annotations

import argparse
import csv
import sys
from typing import Iterable, Sequence

import numpy as np

from bench.derive import DERIVATIONS, derive
from bench.loaders import read_nodes, read_tasks
from scheduling.sim.cluster import MILLI, NodeSpec, TaskSpec


def check(nodes: Sequence[NodeSpec], tasks: Sequence[TaskSpec], rows: Iterable[dict[str, str]]) -> int:
    """Number of rows checked; raises ValueError on the first row that breaks a rule."""
    by_node = {n.name: n for n in nodes}
    by_task = {t.name: t for t in tasks}
    gpu_used = {n.name: [0] * n.num_gpu for n in nodes}
    cpu_used = {n.name: 0 for n in nodes}
    mem_used = {n.name: 0 for n in nodes}
    seen: set[str] = set()
    count = 0
    for r in rows:
        name, node_name = r["name"], r["node"]
        if name in seen:
            raise ValueError(f"{name} placed twice")
        seen.add(name)
        task = by_task.get(name.split("#")[0])
        node = by_node.get(node_name)
        if task is None or node is None:
            raise ValueError(f"{name} on {node_name}: unknown task or node")
        gpus = [int(g) for g in r["gpus"].split(";")] if r["gpus"] else []
        if len(gpus) != task.num_gpu or len(set(gpus)) != len(gpus) or any(not 0 <= g < node.num_gpu for g in gpus):
            raise ValueError(f"{name} on {node_name}: GPUs {gpus} for a task of {task.num_gpu}")
        if task.num_gpu and task.gpu_models and node.model not in task.gpu_models:
            raise ValueError(f"{name} on {node_name}: model {node.model} not in {sorted(task.gpu_models)}")
        for g in gpus:
            gpu_used[node_name][g] += task.gpu_milli
            if gpu_used[node_name][g] > MILLI:
                raise ValueError(f"{name} on {node_name}: GPU {g} over-allocated")
        cpu_used[node_name] += task.cpu_milli
        mem_used[node_name] += task.memory_mib
        if cpu_used[node_name] > node.cpu_milli or mem_used[node_name] > node.memory_mib:
            raise ValueError(f"{name} on {node_name}: CPU or memory over-allocated")
        count += 1
    return count


def allocated_milli(tasks: Sequence[TaskSpec], rows: Iterable[dict[str, str]]) -> int:
    """GPU milli the rows hold (each task's share times its GPU count), to compare with a run's own figure."""
    by_task = {t.name: t for t in tasks}
    return sum(by_task[r["name"].split("#")[0]].total_milli for r in rows)


def load_list(nodes_path: str, pods_path: str, kind: str | None,
              seed: int) -> tuple[list[NodeSpec], list[TaskSpec]]:
    """The cluster and the task list of ``seed`` read afresh from the CSVs (derived as bench.derive does)."""
    nodes = read_nodes(nodes_path)
    tasks = read_tasks(pods_path)
    if kind:
        tasks = derive(tasks, kind, nodes, np.random.default_rng([seed, 2]))
    return list(nodes), list(tasks)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.placement_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", required=True)
    p.add_argument("--pods", required=True)
    p.add_argument("--derive", choices=DERIVATIONS)
    p.add_argument("--seed", type=int, default=42, help="the seed the placements are of (the run's first seed)")
    p.add_argument("--placements", required=True)
    args = p.parse_args(argv)
    nodes, tasks = load_list(args.nodes, args.pods, args.derive, args.seed)
    with open(args.placements, newline="") as f:
        n = check(nodes, tasks, csv.DictReader(f))
    print(f"{n} placements: no over-allocation, every model constraint kept")
    return n


if __name__ == "__main__":
    try:
        main()
    except ValueError as e:
        print(f"placement check failed: {e}", file=sys.stderr)
        sys.exit(1)
