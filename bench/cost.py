"""Cost benchmark: a simulated week of Philly jobs on an on-prem cluster plus AWS and GCP offers.

    python -m bench.cost --json [--out DIR]

Jobs (submission times, GPU counts, durations) come from ``philly/philly.csv``: one week of the
trace (``--start-day`` days after its first job), one job in ``--every`` kept so the run stays
short, jobs above 8 GPUs left out (multi-node gangs are not modelled here).  Durations are taken
as run times on the on-prem GPU (V100, speed 1.0); faster cloud GPUs finish sooner (assumed
speeds below).  Every job may run on a V100 or anything faster, is checkpointable (every 30 min)
and, unless ``--on-demand-only``, may run on spot.  The fleet: ``--onprem-nodes`` 8-GPU V100
nodes billed at ``--onprem-rate`` per GPU-hour used, plus the offers of ``catalog-excerpts/``
(an instance boots in ``--boot-s`` and is billed from launch to release, at its spot price when
launched as spot; the cloud takes a spot instance back after an exponential time with mean
``--spot-mtti-h`` hours, and its jobs restart from their last checkpoint).  Policies:

* ``whalezen``: the core engine (``scheduling.engine.schedule``) under the broker's move and cycle rules
  (``scheduling.moves``, at the broker's default settings); it may place jobs on
  free GPUs of instances it already rents, and keeps an empty instance ``--idle-release-s`` for
  reuse before releasing it;
* ``greedy-cheapest``: per job in arrival order, the cheapest hourly option that can start now
  (on-prem at its internal rate, or a fresh instance, released when the job ends): SkyPilot/dstack;
* ``onprem-fifo``: on-prem only, strict FIFO.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Sequence

import numpy as np

from bench.loaders import read_offers, read_philly
from bench.plots import pyplot, save
from scheduling.sim.events import SimNode, SimResult, Simulator
from scheduling.sim.fleet_policies import GreedyCheapest, OnPremFifo

DATA = Path(__file__).resolve().parent.parent.parent / "shared" / "data"
# Training speed relative to a V100 (assumed from public training benchmarks; see README).
SPEEDS = {"V100": 1.0, "L40S": 1.4, "A100": 1.8, "A100-80GB": 1.9, "H100": 3.0, "L4": 0.55, "T4": 0.3}
ALLOWED = ("V100", "L40S", "A100", "A100-80GB", "H100")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--philly", default=str(DATA / "philly" / "philly.csv"))
    p.add_argument("--catalog", default=str(DATA / "catalog-excerpts"))
    p.add_argument("--start-day", type=float, default=56.0)
    p.add_argument("--days", type=float, default=7.0)
    p.add_argument("--every", type=int, default=4, help="keep one job in N (submission order)")
    p.add_argument("--onprem-nodes", type=int, default=8)
    p.add_argument("--onprem-rate", type=float, default=1.50, help="internal $ per V100 GPU-hour")
    p.add_argument("--cycle-s", type=float, default=120.0)
    p.add_argument("--boot-s", type=float, default=180.0)
    p.add_argument("--idle-release-s", type=float, default=0.0,
                   help="whalezen keeps an empty instance this long for reuse (0 measured cheapest)")
    p.add_argument("--on-demand-only", action="store_true",
                   help="jobs may not run on spot (default: checkpointable jobs may, for both cloud policies)")
    p.add_argument("--spot-mtti-h", type=float, default=24.0, help="mean hours before a spot instance is taken back")
    p.add_argument("--seed", type=int, default=0, help="first spot-interruption seed")
    p.add_argument("--seeds", type=int, default=4,
                   help="runs with seeds seed..seed+N-1; figures are their means (one week is chaotic: a single "
                        "early decision changes every later spot interruption)")
    p.add_argument("--policies", default="whalezen,greedy-cheapest,onprem-fifo")
    p.add_argument("--json", action="store_true")
    p.add_argument("--out")
    return p.parse_args(argv)


def summary(res: SimResult) -> dict[str, float]:
    jct = np.array(res.jct_s) / 3600.0
    queue = np.array(res.queue_s) / 3600.0
    return {"dollars": round(res.dollars, 2), "cloud_dollars": round(res.cloud_dollars, 2),
            "onprem_dollars": round(res.onprem_dollars, 2),
            "jct_mean_h": round(float(jct.mean()), 3) if len(jct) else None,
            "jct_p95_h": round(float(np.percentile(jct, 95)), 3) if len(jct) else None,
            "queue_p95_h": round(float(np.percentile(queue, 95)), 3) if len(queue) else None,
            "queue_mean_h": round(float(queue.mean()), 3) if len(queue) else None,
            "finished": len(res.jct_s), "unfinished": res.unfinished, "launches": res.launches,
            "restarts": res.restarts, "spot_interruptions": res.interruptions}


def mean_summary(runs: list[dict]) -> dict:
    """Means over seeds of every numeric figure (engine method counts summed), and each seed's dollars."""
    out: dict = {}
    for key, value in runs[0].items():
        if isinstance(value, dict):
            merged: dict = {}
            for run in runs:
                for k, v in run[key].items():
                    merged[k] = merged.get(k, 0) + v
            out[key] = merged
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            values = [run[key] for run in runs if run[key] is not None]
            out[key] = round(float(np.mean(values)), 3) if values else None
        else:
            out[key] = value
    out["dollars_per_seed"] = [run["dollars"] for run in runs]
    return out


def make_policy(name: str, idle_release_s: float):
    if name == "greedy-cheapest":
        return GreedyCheapest()
    if name == "onprem-fifo":
        return OnPremFifo()
    if name == "whalezen":
        from scheduling.moves import MoveRules, move_policy
        from scheduling.sim.engine_policy import EnginePolicy

        # The broker's rules for moves and cycles (broker.scheduler.services.BROKER_POLICY at its defaults).
        rules = MoveRules()
        return EnginePolicy(policy=move_policy(rules), rules=rules, idle_release_s=idle_release_s)
    raise ValueError(f"unknown policy {name!r}")


def plot(out: str, result: dict) -> str:
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(6, 4.5))
    for name, s in result["policies"].items():
        ax.scatter(s["queue_p95_h"], s["dollars"], s=60)
        ax.annotate(name, (s["queue_p95_h"], s["dollars"]), textcoords="offset points", xytext=(5, 5))
    ax.set(xlabel="p95 queueing delay (h)", ylabel="total cost ($)", xscale="symlog",
           title="cost vs p95 queueing delay, one Philly week")
    return save(fig, out, "cost_vs_delay.png")


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    jobs, too_big = read_philly(args.philly, args.start_day, args.days, args.every)
    jobs = [j.__class__(j.id, j.submit_s, j.gpus, j.work_s, ALLOWED, spot_ok=not args.on_demand_only) for j in jobs]
    offers = read_offers(args.catalog)
    nodes = [SimNode(f"onprem-{i:02d}", "V100", 8, args.onprem_rate) for i in range(args.onprem_nodes)]
    result: dict = {"spot_allowed": not args.on_demand_only, "jobs": len(jobs), "left_out_over_8_gpus": too_big, "offers": len(offers),
                    "onprem_gpus": 8 * args.onprem_nodes, "policies": {}}
    seeds = [args.seed + k for k in range(max(1, args.seeds))]
    result["seeds"] = seeds
    for name in [p.strip() for p in args.policies.split(",") if p.strip()]:
        runs = []
        for seed in seeds:
            sim = Simulator(jobs, nodes, offers, SPEEDS, cycle_s=args.cycle_s, boot_s=args.boot_s,
                            spot_mtti_s=args.spot_mtti_h * 3600, seed=seed)
            pol = make_policy(name, args.idle_release_s)
            t0 = time.perf_counter()
            res = sim.run(pol)
            s = summary(res)
            s["wall_s"] = round(time.perf_counter() - t0, 1)
            if hasattr(pol, "methods"):
                s["engine_methods"] = dict(pol.methods)
                s["engine_cycle_median_s"] = (round(float(np.median(pol.cycle_seconds)), 4)
                                              if pol.cycle_seconds else None)
                s["moves"] = pol.moves
            runs.append(s)
            print(f"{name} seed {seed}: {s}", file=sys.stderr, flush=True)
        result["policies"][name] = mean_summary(runs)
    pol = result["policies"]
    if "whalezen" in pol and "greedy-cheapest" in pol and pol["greedy-cheapest"]["dollars"]:
        result["whalezen_saving_vs_greedy_pct"] = round(
            100 * (1 - pol["whalezen"]["dollars"] / pol["greedy-cheapest"]["dollars"]), 1)
        result["whalezen_saving_vs_greedy_pct_per_seed"] = [
            round(100 * (1 - w / g), 1) for w, g in zip(pol["whalezen"]["dollars_per_seed"],
                                                        pol["greedy-cheapest"]["dollars_per_seed"])]
    print(f"{'policy':<18}{'dollars':>10}{'JCT mean h':>12}{'JCT p95 h':>11}{'queue p95 h':>12}")
    for name, s in pol.items():
        print(f"{name:<18}{s['dollars']:>10.0f}{s['jct_mean_h']:>12.2f}{s['jct_p95_h']:>11.2f}{s['queue_p95_h']:>12.3f}")
    if args.out:
        print(f"plot: {plot(args.out, result)}")
    if args.json:
        print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
