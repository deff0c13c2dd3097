#!/usr/bin/env python3
"""The smallest multi-node job: every node's process finds the others through the variables the
WhaleZen agent sets (docs/agent.md, "Multi-node jobs"), as torchrun does with MASTER_ADDR/PORT.

Rank 0 listens on MASTER_PORT; every other rank connects to MASTER_ADDR:MASTER_PORT and says its
rank, rank 0 answers with its own; each prints what it heard and exits 0 once all ranks checked in.
Standard library only. Submit it as a two-node job (nodes need a fast fabric: a `fabric` label of
infiniband, efa, roce or gpudirect-tcpx), with its absolute path (a job starts in its own folder):

    {"name": "rendezvous", "resources": {"gpus": 1, "nodes": 2},
     "command": ["/usr/bin/python3", "/path/to/whalezen/examples/gang_rendezvous.py"]}

`--fail-rank N --exit-code C`: rank N connects to rank 0 (so both are known to run), then exits with
code C instead: the job fails, its events name rank N, and the agent stops rank 0, which would
otherwise wait for it until --timeout.
"""
from __future__ import annotations

import argparse
import os
import socket
import sys
import time


def log(rank: int, text: str) -> None:
    print(f"rank {rank}: {text}", flush=True)


def gang() -> tuple[int, int, list[str], str, int]:
    rank, size = int(os.environ["WHALEZEN_NODE_RANK"]), int(os.environ["WHALEZEN_NUM_NODES"])
    ips = os.environ["WHALEZEN_NODE_IPS"].splitlines()
    master_addr, master_port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    if len(ips) != size or ips[0] != master_addr:
        raise SystemExit(f"inconsistent gang: {size} nodes, IPs {ips}, MASTER_ADDR {master_addr}")
    return rank, size, ips, master_addr, master_port


def serve(size: int, addr: str, port: int, timeout: float) -> None:
    """Rank 0: wait for every other rank to say its rank; answer each with ours."""
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    with socket.create_server(("", port), family=family, reuse_port=False) as server:
        server.settimeout(timeout)
        log(0, f"listening on port {port} for {size - 1} peer(s)")
        heard: set[int] = set()
        while len(heard) < size - 1:
            conn, peer = server.accept()
            with conn, conn.makefile("rw") as stream:
                words = stream.readline().split()
                if len(words) != 2 or words[0] != "rank" or not words[1].isdigit():
                    log(0, f"{peer[0]} hung up without saying its rank; still waiting")
                    continue
                heard.add(int(words[1]))
                stream.write("rank 0\n")
                stream.flush()
                log(0, f"heard from rank {words[1]} at {peer[0]}")
    log(0, f"all {size} ranks checked in")


def join(rank: int, addr: str, port: int, timeout: float, fail_with: int | None) -> None:
    """Rank > 0: connect to rank 0 (it may not listen yet: retry), say our rank, hear its."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            conn = socket.create_connection((addr, port), timeout=5)
            break
        except OSError as err:
            if time.monotonic() > deadline:
                raise SystemExit(f"rank {rank}: rank 0 at {addr}:{port} never answered: {err}")
            time.sleep(0.2)
    with conn, conn.makefile("rw") as stream:
        if fail_with is not None:
            log(rank, f"reached rank 0 at {addr}:{port}; failing on purpose with exit code {fail_with}")
            sys.exit(fail_with)
        stream.write(f"rank {rank}\n")
        stream.flush()
        log(rank, f"heard {stream.readline().strip()!r} from {addr}:{port}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the other ranks")
    parser.add_argument("--fail-rank", type=int, default=None, help="this rank exits with --exit-code instead")
    parser.add_argument("--exit-code", type=int, default=3)
    parser.add_argument("--tag", default="", help="ignored; lets a test find its processes")
    args = parser.parse_args()
    rank, size, ips, addr, port = gang()
    log(rank, f"{size} node(s) {ips}, master {addr}:{port}, "
              f"{os.environ.get('WHALEZEN_NUM_GPUS_PER_NODE', '?')} GPU(s) per node")
    if rank == 0 and args.fail_rank == 0:
        log(0, f"failing on purpose with exit code {args.exit_code}")
        return args.exit_code
    if rank == 0:
        serve(size, addr, port, args.timeout)
    else:
        join(rank, addr, port, args.timeout, args.exit_code if args.fail_rank == rank else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
