"""How much CPU an idle node agent uses, measured the way an operator would: from /proc.

Starts the whole service as `make run` does (`manage.py serve` with its seven demo agents: real
agent processes with fake GPUs, registered and heartbeating, no job running) in a temporary var
dir, waits until every demo node has heartbeated, then reads each agent process's user + system
CPU time from `/proc/<pid>/stat` at the start and end of `--windows` consecutive windows of
`--seconds` each.

    .venv/bin/python -m bench.agent_cpu [--seconds 60] [--windows 5] [--db sqlite|postgresql] [--json]

The last line with --json is one JSON object, in the shape issue 12 gives for its agent figure:
{"agent": {"idle_cpu_pct": P, "agents": N, "seconds": S, "windows": [{"median_pct", "max_pct"}]}}:
`idle_cpu_pct` is the median over the windows of the median over the agents, in percent of one core.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Sequence

from bench.backends import backend
from bench.migration import Api, service, wait_for
from bench.procs import cpu_seconds, live_processes


def agent_pids() -> dict[int, str]:
    """pid -> node name of every running node agent (`python -m agent ... --name NAME`)."""
    found = {}
    for pid, argv, _ in live_processes():
        if argv[1:3] == ["-m", "agent"] and "--name" in argv:
            found[pid] = argv[argv.index("--name") + 1]
    return found


def window(pids: dict[int, str], seconds: float) -> dict[str, float]:
    """Each agent's CPU over one window, in percent of a core."""
    before = {pid: cpu_seconds(pid) for pid in pids}
    started = time.monotonic()
    time.sleep(seconds)
    elapsed = time.monotonic() - started
    return {name: 100 * (cpu_seconds(pid) - before[pid]) / elapsed for pid, name in pids.items()}


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m bench.agent_cpu", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="length of one window (default 60)")
    parser.add_argument("--windows", type=int, default=5, help="windows measured one after another (default 5)")
    parser.add_argument("--db", default="sqlite", choices=("sqlite", "postgresql"))
    parser.add_argument("--redis-db", type=int, default=8)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    with backend(args.db, args.redis_db) as db_env, service(db_env) as svc:
        api = Api(svc.base, svc.token)
        wait_for(lambda: all(n["state"] == "ONLINE" and n["last_heartbeat_at"] for n in api.results("nodes/")),
                 120, "every demo node to heartbeat")
        pids = {pid: name for pid, name in agent_pids().items() if str(svc.var_dir) in
                " ".join(open(f"/proc/{pid}/cmdline").read().split("\0"))}
        if not pids:
            raise SystemExit("no demo agent found")
        windows = []
        for number in range(args.windows):
            per_agent = window(pids, args.seconds)
            windows.append({"median_pct": round(statistics.median(per_agent.values()), 3),
                            "max_pct": round(max(per_agent.values()), 3)})
            print(f"window {number + 1}/{args.windows}: " + ", ".join(
                f"{name} {pct:.2f}%" for name, pct in sorted(per_agent.items())), file=sys.stderr, flush=True)
    result = {"agent": {"idle_cpu_pct": round(statistics.median(w["median_pct"] for w in windows), 3),
                        "agents": len(pids), "seconds": args.seconds, "db": args.db, "windows": windows}}
    print(f"idle agent CPU: median {result['agent']['idle_cpu_pct']:.2f}% of a core over {len(pids)} agents "
          f"and {args.windows} windows of {args.seconds:g} s")
    if args.json:
        print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
