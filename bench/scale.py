"""Scale benchmark: one scheduling cycle of the core engine on the Alibaba cluster plus cloud offers.

    python -m bench.scale --jobs 1000,5000,20000 --json [--out DIR]

Pending jobs are sampled (with replacement, seeded) from the Alibaba task list's GPU tasks (CPU,
memory, GPU count, fraction and allowed models as listed); the 1,213 GPU nodes are idle; the
offers are every launchable AWS/GCP row of ``catalog-excerpts/``.  Each size is timed ``--repeat``
times (median and max of the wall time of ``scheduling.engine.schedule``), with the method the
engine used and whether its answer was proven optimal.  The optimality gap compares the engine's
default answer with the exact per-node model (``Policy(method="exact")``) on small random
instances that the exact model solves to proven optimality.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Sequence

import numpy as np

from bench.loaders import read_nodes, read_offers, read_tasks
from bench.plots import pyplot, save
from scheduling.model import CloudOffer, GpuModelInfo, GpuState, JobDemand, NodeState, Policy, Snapshot
from scheduling.sim.cluster import NodeSpec, TaskSpec
from scheduling.sim.events import SimOffer

DATA = Path(__file__).resolve().parent.parent.parent / "shared" / "data"
ALIBABA = DATA / "alibaba-gpu-v2023"
GPU_MEMORY_MB = {"P100": 16384, "T4": 16384, "V100M16": 16384, "V100M32": 32768, "A10": 24576,
                 "G1": 32768, "G2": 32768, "G3": 32768}
ONPREM_RATE = 1.0  # internal $ per GPU-hour (any model; the benchmark times the solver, not prices)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.scale", description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", default=str(ALIBABA / "openb_node_list_gpu_node.csv"))
    p.add_argument("--pods", default=str(ALIBABA / "openb_pod_list_default.csv"))
    p.add_argument("--catalog", default=str(DATA / "catalog-excerpts"))
    p.add_argument("--jobs", default="1000,5000,20000", help="comma-separated pending-job counts")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--gap-instances", type=int, default=10, help="small instances for the optimality gap")
    p.add_argument("--gap-nodes", type=int, default=12)
    p.add_argument("--gap-jobs", type=int, default=30)
    p.add_argument("--json", action="store_true")
    p.add_argument("--out")
    return p.parse_args(argv)


def node_state(n: NodeSpec, price: float = ONPREM_RATE) -> NodeState:
    mem = GPU_MEMORY_MB.get(n.model, 16384)
    gpus = tuple(GpuState(i, f"{n.name}-gpu{i}", n.model, mem, mem) for i in range(n.num_gpu))
    return NodeState(n.name, n.name, gpus, n.cpu_milli, n.memory_mib, n.cpu_milli, n.memory_mib,
                     price_per_gpu_hour=price)


def job_demand(i: int, t: TaskSpec, rng: np.random.Generator) -> JobDemand:
    return JobDemand(f"job-{i:06d}", gpus=t.num_gpu, gpu_milli=t.gpu_milli if t.num_gpu else 1000,
                     allowed_models=tuple(sorted(t.gpu_models)) if t.gpu_models else (),
                     cpu_milli=t.cpu_milli, memory_mb=t.memory_mib,
                     expected_duration_hours=float(rng.choice([0.5, 1.0, 2.0, 4.0])), submitted_at=float(i))


def cloud_offer(o: SimOffer) -> CloudOffer:
    return CloudOffer(o.id, o.provider, o.region, o.zone, o.instance_type, o.model, o.gpus, 40960,
                      o.price_per_hour, o.spot_price_per_hour, 16, vcpus=o.vcpus,
                      memory_mb=int(o.memory_gib * 1024))


def snapshot(nodes: Sequence[NodeSpec], tasks: Sequence[TaskSpec], offers: Sequence[SimOffer], jobs: int,
             seed: int) -> Snapshot:
    rng = np.random.default_rng(seed)
    gpu_tasks = [t for t in tasks if t.num_gpu > 0]
    picks = rng.integers(len(gpu_tasks), size=jobs)
    models = sorted({n.model for n in nodes} | {o.model for o in offers})
    return Snapshot(now=0.0, nodes=tuple(node_state(n) for n in nodes),
                    pending=tuple(job_demand(i, gpu_tasks[int(k)], rng) for i, k in enumerate(picks)),
                    offers=tuple(cloud_offer(o) for o in offers),
                    gpu_models=tuple(GpuModelInfo(m) for m in models), seed=seed)


def time_cycles(snap: Snapshot, repeat: int) -> dict:
    from scheduling.engine import schedule

    times, plan = [], None
    for _ in range(repeat):
        t0 = time.perf_counter()
        plan = schedule(snap)
        times.append(time.perf_counter() - t0)
    assert plan is not None
    return {"jobs": len(snap.pending), "median_s": round(float(np.median(times)), 4),
            "max_s": round(float(np.max(times)), 4), "method": plan.solver.method,
            "proven_optimal": bool(plan.solver.proven_optimal), "placed": len(plan.placements),
            "launches": sum(launch.count for launch in plan.launches)}


def optimality_gap(nodes: Sequence[NodeSpec], tasks: Sequence[TaskSpec], offers: Sequence[SimOffer],
                   args: argparse.Namespace) -> tuple[float | None, list[dict]]:
    """Mean relative objective gap of the default engine to the exact per-node optimum (percent)."""
    from scheduling.engine import schedule

    rows = []
    for k in range(args.gap_instances):
        rng = np.random.default_rng(1000 + k)
        sub = [nodes[int(i)] for i in sorted(rng.choice(len(nodes), size=args.gap_nodes, replace=False))]
        snap = snapshot(sub, tasks, offers[:4], args.gap_jobs, 1000 + k)
        exact = schedule(snap, Policy(method="exact", time_limit_s=60.0))
        auto = schedule(snap)
        if not exact.solver.proven_optimal or exact.solver.objective is None or auto.solver.objective is None:
            rows.append({"instance": k, "skipped": "exact model not proven optimal"})
            continue
        gap = 100.0 * (auto.solver.objective - exact.solver.objective) / max(abs(exact.solver.objective), 1e-9)
        rows.append({"instance": k, "exact": round(exact.solver.objective, 4),
                     "engine": round(auto.solver.objective, 4), "gap_pct": round(gap, 3) + 0.0,  # never "-0.0"
                     "engine_method": auto.solver.method})
    gaps = [r["gap_pct"] for r in rows if "gap_pct" in r]
    return (round(float(np.mean(gaps)), 3) if gaps else None), rows


def plot(out: str, cycles: list[dict]) -> str:
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [c["jobs"] for c in cycles]
    ax.plot(xs, [c["median_s"] for c in cycles], marker="o", label="median")
    ax.plot(xs, [c["max_s"] for c in cycles], marker="x", ls="--", label="max")
    ax.set(xscale="log", xlabel="pending jobs", ylabel="cycle time (s)",
           title="engine cycle time, 1,213 nodes + cloud offers")
    ax.legend()
    return save(fig, out, "scale_cycle_time.png")


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    nodes = read_nodes(args.nodes)
    tasks = read_tasks(args.pods)
    offers = read_offers(args.catalog)
    cycles = []
    for n in [int(x) for x in args.jobs.split(",") if x.strip()]:
        c = time_cycles(snapshot(nodes, tasks, offers, n, args.seed), args.repeat)
        cycles.append(c)
        print(f"{n} jobs: {c}", file=sys.stderr, flush=True)
    gap, rows = optimality_gap(nodes, tasks, offers, args) if args.gap_instances else (None, [])
    result = {"nodes": len(nodes), "offers": len(offers), "cycles": cycles, "optimality_gap_pct": gap,
              "gap_instances": rows}
    print(f"{'jobs':>7}{'median s':>10}{'max s':>9}  method  proven")
    for c in cycles:
        print(f"{c['jobs']:>7}{c['median_s']:>10.3f}{c['max_s']:>9.3f}  {c['method']:<6}  {c['proven_optimal']}")
    print(f"optimality gap vs exact per-node model: {gap}%")
    if args.out:
        print(f"plot: {plot(args.out, cycles)}")
    if args.json:
        print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
