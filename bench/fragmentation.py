"""Fragmentation benchmark: the FGD paper's protocol on the Alibaba GPU cluster.

    python -m bench.fragmentation --nodes ../shared/data/alibaba-gpu-v2023/openb_node_list_gpu_node.csv \
        --pods ../shared/data/alibaba-gpu-v2023/openb_pod_list_default.csv --seeds 10 --json

Per seed (42, 43, ...): shuffle the task list, append random clones until the next one would pass
130% of GPU capacity, place tasks one by one (a task that fits nowhere is dropped but its demand
counts as arrived), record allocation after every arrival.  Reports, mean over seeds, the
allocation at 100% and 130% arrived demand and the GPUs left unallocated at 130%, for
whalezen-online, whalezen-broker (the engine), whalezen-batch and every baseline, plus LP upper bounds (the fewest GPUs any
placement could leave unallocated given the tasks arrived by 130%, and by 100%).  Every policy sees
the same arrivals for a seed; the per-node tie-break priority is drawn from the seed too.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import time
from pathlib import Path
from typing import Sequence

import numpy as np

from bench import placement_check
from bench.derive import DERIVATIONS, derive
from bench.leftover import leftover, leftover_table, mean_leftover
from bench.loaders import read_nodes, read_tasks
from bench.plots import pyplot, save
from scheduling.fragmentation import workload_from_tasks
from scheduling.sim.broker import run_broker
from scheduling.sim.cluster import MILLI, ArrayCluster, NodeSpec, TaskSpec
from scheduling.sim.protocol import ProtocolRun, build_arrivals, run_online
from scheduling.sim.registry import ONLINE_POLICIES, make_policy
from scheduling.sim.upper_bound import allocation_upper_bound

# WhaleZen as the broker runs it: a cycle of scheduling.engine.schedule every N arrivals on a full
# snapshot, its placements and defragmentation moves applied (100 s per seed on 2026-11-29; 200-215 s on the share list on 2026-12-04).
BROKER = "whalezen-broker"
# The same cycles decided by the whalezen-online score in the simulator's arrays (seconds per
# seed): a quick stand-in, not the engine.
BATCH = "whalezen-batch"
ALL_POLICIES = (ONLINE_POLICIES[0], BROKER, BATCH) + ONLINE_POLICIES[1:]


def _positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a number above 0, not {text}")
    return value


def _powers(text: str) -> tuple[float, ...]:
    return tuple(_positive(part) for part in text.split(","))


def _non_negative(text: str) -> float:
    value = float(text)
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of 0 or more, not {text}")
    return value


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.fragmentation", description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", required=True, help="node list CSV (sn,cpu_milli,memory_mib,gpu,model)")
    p.add_argument("--pods", required=True, help="task list CSV (openb_pod_list_*.csv)")
    p.add_argument("--derive", choices=DERIVATIONS,
                   help="run on a list derived per seed from --pods (bench/derive.py): share, multigpu, constrained")
    p.add_argument("--seeds", type=int, default=10)
    p.add_argument("--first-seed", type=int, default=42, help="the published runs use 42..51")
    p.add_argument("--target", type=float, default=1.3, help="arrived demand to stop at (1.3 = 130%%)")
    p.add_argument("--policies", default=",".join(ALL_POLICIES), help="comma-separated names")
    p.add_argument("--broker-every", type=int, default=64,
                   help="whalezen-broker and whalezen-batch: arrivals per cycle")
    p.add_argument("--broker-moves", type=int, default=8, help="whalezen-batch: migrations per cycle")
    p.add_argument("--broker-defrag", action=argparse.BooleanOptionalAction, default=True,
                   help="whalezen-broker: placed tasks carry their demand, so the engine's defragmentation "
                        "may move them, as the broker does (default); --no-broker-defrag keeps every task "
                        "where it was placed (the figures before 2026-12-07, bench/README.md)")
    p.add_argument("--lookahead-power", type=_powers, default=None,
                   help="whalezen-online's look-ahead powers n in (1 - q)^n, comma-separated (the measure is "
                        "their mean; default: the policy's own, 2,10); for sweeps. 1 is FGD's measure")
    p.add_argument("--home-weight", type=_non_negative, default=None,
                   help="whalezen-online's weight of the scarce-homes term (default: the policy's own, 1; "
                        "0 turns it off); for sweeps")
    p.add_argument("--stranding-alpha", type=_non_negative, default=None,
                   help="whalezen-online's weight of the CPU/memory stranding term (default: the policy's own, 2; "
                        "0 turns it off); for sweeps")
    p.add_argument("--no-bound", action="store_true", help="skip the LP upper bound")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.add_argument("--placements-out", help="CSV of one policy's placements for the first seed")
    p.add_argument("--placements-policy", default="whalezen-online",
                   help="whose placements --placements-out writes: an online policy or whalezen-broker "
                        "(its final positions, after migrations)")
    p.add_argument("--check-placements", action="store_true",
                   help="replay every seed's final placements of every policy but whalezen-batch with "
                        "bench.placement_check (the list read afresh from the CSVs) and check that they hold "
                        "the run's final allocation; stops with an error on the first that fails")
    p.add_argument("--curve", action="store_true",
                   help="print the mean allocation at every integer point from --curve-from to the target")
    p.add_argument("--curve-from", type=int, default=50)
    p.add_argument("--leftover", action="store_true",
                   help="split each policy's free GPU capacity at the end (whole GPUs, nodes where nothing of the "
                        "list fits, gaps by what occupies the GPU; bench/leftover.py); mean over seeds")
    p.add_argument("--out", help="folder for the allocation-curve PNG")
    p.add_argument("--published", help="fgd_allo.csv to overlay the published curves on the plot")
    return p.parse_args(argv)


def summarise(runs: list[ProtocolRun], total_gpus: float, target_pct: int) -> dict[str, float]:
    a100 = float(np.mean([r.alloc_at(100) for r in runs]))
    a130 = float(np.mean([r.alloc_at(target_pct) for r in runs]))
    return {"alloc_at_100": round(a100, 2), "alloc_at_130": round(a130, 2),
            "unallocated_at_130": round(total_gpus * (1 - a130 / 100), 1),
            "dropped_tasks": round(float(np.mean([r.dropped for r in runs])), 1),
            "migrations": round(float(np.mean([r.migrations for r in runs])), 1)}


def mean_curve(runs: list[ProtocolRun]) -> dict[int, float]:
    curves = [r.curve() for r in runs]
    keys = sorted(set().union(*curves))
    return {k: float(np.mean([c[k] for c in curves if k in c])) for k in keys}


def behind(curve: dict[int, float], ref: dict[int, float], points: range) -> list[int]:
    """Integer points where ``curve`` allocates less than ``ref`` (both means over seeds)."""
    return [k for k in points if k in curve and k in ref and curve[k] < ref[k]]


def curve_table(curves: dict[str, dict[int, float]], names: list[str], points: range) -> str:
    """One row per integer point of arrived demand, one column per policy, then where each trails FGD."""
    width = max(10, *(len(n) + 1 for n in names))
    lines = ["arrived" + "".join(f"{n:>{width}}" for n in names)]
    for k in points:
        lines.append(f"{k:>6}%" + "".join(
            f"{curves[n][k]:>{width}.2f}" if k in curves[n] else " " * (width - 1) + "-" for n in names))
    if "fgd" in curves:
        for n in names:
            if n != "fgd":
                pts = behind(curves[n], curves["fgd"], points)
                lines.append(f"{n} behind fgd at {len(pts)} points" + (f": {pts}" if pts else ""))
    return "\n".join(lines)


def placement_rows(run: ProtocolRun, names: list[str]) -> list[dict[str, str]]:
    """``run``'s placements as the rows of the CSV that bench.placement_check reads (name, node, gpus)."""
    return [{"name": task, "node": names[node], "gpus": ";".join(str(g) for g in gpus)}
            for task, node, gpus in run.placements]


def write_placements(path: str, run: ProtocolRun, names: list[str]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["name", "node", "gpus"])
        w.writeheader()
        w.writerows(placement_rows(run, names))


def check_placements(listed: tuple[list[NodeSpec], list[TaskSpec]], seed: int, run: ProtocolRun,
                     names: list[str], total_gpu_milli: int) -> int:
    """Rows of ``run``'s final placements that bench.placement_check accepted against ``listed`` (the
    seed's cluster and list as placement_check.load_list reads them); SystemExit when it refuses them or
    when they hold another allocation than the run reports at its end."""
    nodes, tasks = listed
    rows = placement_rows(run, names)
    try:
        count = placement_check.check(nodes, tasks, rows)
    except ValueError as e:
        raise SystemExit(f"placement check failed (seed {seed}): {e}") from e
    held = placement_check.allocated_milli(tasks, rows)
    reported = float(run.alloc_pct[-1]) * total_gpu_milli / 100
    if abs(held - reported) > 0.5:
        raise SystemExit(f"placement check failed (seed {seed}): the placements hold {held} GPU milli, "
                         f"the run reports {reported:.0f} at its end")
    return count


def published_curves(path: str, pods: str) -> dict[str, dict[int, float]]:
    """Mean published curve per policy for the task list named like ``pods``."""
    workload = Path(pods).stem
    rows: dict[str, list[list[float]]] = {}
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            if r["workload"] == workload:
                rows.setdefault(r["sc_policy"], []).append([float(r[str(i)]) for i in range(131)])
    return {k: dict(enumerate(np.mean(v, axis=0).tolist())) for k, v in rows.items()}


def plot(out: str, curves: dict[str, dict[int, float]], published: dict[str, dict[int, float]],
         title: str) -> str:
    plt = pyplot()

    fig, (ax, zoom) = plt.subplots(1, 2, figsize=(13, 5))
    for name, c in curves.items():
        xs = sorted(c)
        for a in (ax, zoom):
            a.plot(xs, [c[x] for x in xs], label=name, lw=2 if name.startswith("whalezen") else 1)
    for name, c in published.items():
        if name.endswith(("BestFit", "FGD")):
            xs = sorted(c)
            for a in (ax, zoom):
                a.plot(xs, [c[x] for x in xs], ls="--", color="grey", label=f"published {name}")
    ax.plot([0, 130], [0, 130], ls=":", color="black", lw=0.8)
    ax.set(xlabel="arrived GPU demand (% of capacity)", ylabel="GPU allocation (%)", title=title)
    zoom.set(xlim=(85, 131), ylim=(84, 100), xlabel="arrived GPU demand (%)", title="zoom")
    zoom.legend(fontsize=7, loc="lower right")
    return save(fig, out, "fragmentation_alloc.png")


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.placements_out and args.placements_policy == BATCH:
        raise SystemExit("--placements-policy: whalezen-batch does not record its placements")
    names = [p.strip() for p in args.policies.split(",") if p.strip()]
    if args.leftover and BATCH in names:
        raise SystemExit("--leftover: whalezen-batch does not record its placements; leave it out of --policies")
    nodes = read_nodes(args.nodes)
    tasks = read_tasks(args.pods)
    cluster = ArrayCluster(nodes)
    total_gpus = cluster.total_gpu_milli / MILLI
    target_pct = int(round(args.target * 100))
    runs: dict[str, list[ProtocolRun]] = {n: [] for n in names}
    seconds: dict[str, float] = {n: 0.0 for n in names}
    bounds: list[float] = []
    bounds100: list[float] = []
    leftovers: dict[str, list[dict]] = {n: [] for n in names}
    checked_rows: dict[str, int] = {n: 0 for n in names if n != BATCH}
    for i in range(args.seeds):
        seed = args.first_seed + i
        # A derived list is drawn per seed (only `constrained` on a list naming no model uses the
        # draw); the typical-task workload is always that of the list actually run.
        seed_tasks = derive(tasks, args.derive, nodes, np.random.default_rng([seed, 2])) if args.derive else tasks
        workload = workload_from_tasks(
            [(t.cpu_milli, t.memory_mib, t.gpu_milli, t.num_gpu, t.gpu_models) for t in seed_tasks])
        arrivals: list[TaskSpec] = build_arrivals(seed_tasks, cluster.total_gpu_milli,
                                                  np.random.default_rng(seed), args.target)
        by_name = {t.name: t for t in arrivals} if args.leftover else {}  # --leftover: each placed task's demand
        # --check-placements: the seed's list read afresh from the CSVs, once for all the policies
        listed = (placement_check.load_list(args.nodes, args.pods, args.derive, seed)
                  if args.check_placements else None)
        for name in names:
            rng = np.random.default_rng([seed, 1])
            t0 = time.perf_counter()
            record = bool(args.placements_out) and i == 0 and name == args.placements_policy
            if name == BROKER:
                from scheduling.sim.engine_broker import run_engine_broker

                run = run_engine_broker(cluster, arrivals, workload, every=args.broker_every, seed=seed,
                                        tasks=seed_tasks, movable=args.broker_defrag)
            elif name == BATCH:
                run = run_broker(cluster, arrivals, workload, rng, every=args.broker_every,
                                 max_moves=args.broker_moves)
            else:
                policy = make_policy(name, workload, lookahead_powers=args.lookahead_power,
                                     tasks=seed_tasks, home_weight=args.home_weight,
                                     stranding_alpha=args.stranding_alpha)
                run = run_online(cluster, arrivals, policy, rng,
                                 record or args.leftover or args.check_placements)
            seconds[name] += time.perf_counter() - t0
            runs[name].append(run)
            if args.leftover:
                leftovers[name].append(leftover(nodes, seed_tasks, (
                    (by_name[task], node, gpus) for task, node, gpus in run.placements)))
            if record:
                write_placements(args.placements_out, run, cluster.names)
            if listed is not None and name in checked_rows:
                checked_rows[name] += check_placements(listed, seed, run, cluster.names,
                                                       cluster.total_gpu_milli)
        if not args.no_bound:
            bounds.append(allocation_upper_bound(nodes, arrivals))
            demand = np.cumsum([t.total_milli for t in arrivals])
            bounds100.append(allocation_upper_bound(
                nodes, arrivals[: int(np.searchsorted(demand, cluster.total_gpu_milli, side="right"))]))
        print(f"seed {seed}: " + ", ".join(
            f"{n} {runs[n][-1].alloc_at(target_pct):.2f}%" for n in names), file=sys.stderr, flush=True)
    result: dict = {"total_gpus": int(total_gpus), "seeds": args.seeds,
                    "pods": Path(args.pods).name, "derive": args.derive,
                    # null: whalezen-online's own
                    "lookahead_power": list(args.lookahead_power) if args.lookahead_power else None,
                    "home_weight": args.home_weight,  # null: whalezen-online's own
                    "stranding_alpha": args.stranding_alpha,  # null: whalezen-online's own
                    "broker_defrag": args.broker_defrag,
                    "upper_bound_unallocated_at_130": (
                        round(total_gpus - float(np.mean(bounds)) / MILLI, 1) if bounds else None),
                    "upper_bound_unallocated_at_100": (
                        round(total_gpus - float(np.mean(bounds100)) / MILLI, 1) if bounds100 else None),
                    "policies": {n: summarise(runs[n], total_gpus, target_pct) for n in names}}
    curves = {n: mean_curve(runs[n]) for n in names}
    points = range(args.curve_from, target_pct + 1)
    for n in names:
        result["policies"][n]["seconds_per_seed"] = round(seconds[n] / max(args.seeds, 1), 2)
        result["policies"][n]["curve"] = {str(k): round(curves[n][k], 3) for k in points if k in curves[n]}
        if "fgd" in curves and n != "fgd":
            result["policies"][n]["behind_fgd_at"] = behind(curves[n], curves["fgd"], points)
        if args.leftover:
            result["policies"][n]["leftover"] = mean_leftover(leftovers[n])
        if args.check_placements and n in checked_rows:
            # every seed's end state passed bench.placement_check; rows summed over the seeds
            result["policies"][n]["placements_checked"] = {"seeds": args.seeds, "rows": checked_rows[n]}
    print(f"{'policy':<18}{'alloc@100':>10}{'alloc@130':>10}{'unalloc GPUs':>14}{'s/seed':>8}")
    for n in names:
        s = result["policies"][n]
        print(f"{n:<18}{s['alloc_at_100']:>10.2f}{s['alloc_at_130']:>10.2f}"
              f"{s['unallocated_at_130']:>14.1f}{s['seconds_per_seed']:>8.2f}")
    if bounds:
        print(f"LP upper bound: at least {result['upper_bound_unallocated_at_130']} GPUs unallocated at 130% "
              f"(any policy choosing freely among all arrived tasks), {result['upper_bound_unallocated_at_100']} "
              f"at 100% (only the tasks arrived by then)")
    if args.curve:
        print(curve_table(curves, names, points))
    if args.leftover:
        print(leftover_table({n: result["policies"][n]["leftover"] for n in names}))
    if args.out:
        # the published curves are of the published lists, not of a derived one
        pub = published_curves(args.published, args.pods) if args.published and not args.derive else {}
        label = Path(args.pods).stem + (f" --derive {args.derive}" if args.derive else "")
        path = plot(args.out, curves, pub, f"{label}, mean of {args.seeds} seeds")
        print(f"plot: {path}")
    if args.json:
        print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
