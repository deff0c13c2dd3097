"""The machine's live processes, read from /proc: what the benchmarks and the end-to-end tests use to
find (and clean up after) the processes a service they started left running; and a free loopback port to
start one on."""
from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Iterator


def live_processes() -> Iterator[tuple[int, list[str], bytes]]:
    """(pid, argv, raw environ) of every live process but this one; zombies and processes that end
    while being read are left out."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            stat = (proc / "stat").read_text()
            if stat[stat.rfind(")") + 2:].split()[0] in ("Z", "X"):
                continue
            argv = [a.decode(errors="replace") for a in (proc / "cmdline").read_bytes().split(b"\0") if a]
            environ = (proc / "environ").read_bytes()
        except OSError:
            continue
        yield int(proc.name), argv, environ


TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time a process has used so far (`/proc/<pid>/stat`)."""
    stat = open(f"/proc/{pid}/stat").read()
    fields = stat[stat.rfind(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / TICKS_PER_S  # utime + stime


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on at this moment (the kernel's pick)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def process_tree(roots: list[int]) -> dict[int, list[str]]:
    """pid -> argv of the live processes among `roots` and their descendants. By parentage, not by a
    marker in argv or environ: where setproctitle is installed, gunicorn renames its processes (it overwrites
    the memory that /proc/PID/cmdline and /proc/PID/environ show), so a var dir in their environment cannot
    be read back."""
    parents: dict[int, int] = {}
    argvs: dict[int, list[str]] = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            stat = (proc / "stat").read_text()
            fields = stat[stat.rfind(")") + 2:].split()
            if fields[0] in ("Z", "X"):
                continue
            parents[int(proc.name)] = int(fields[1])
            argvs[int(proc.name)] = [a.decode(errors="replace") for a in (proc / "cmdline").read_bytes().split(b"\0") if a]
        except (OSError, IndexError, ValueError):
            continue
    tree = {pid for pid in roots if pid in argvs}
    grew = True
    while grew:
        children = {pid for pid, parent in parents.items() if parent in tree and pid not in tree}
        tree |= children
        grew = bool(children)
    return {pid: argvs[pid] for pid in tree}


def process_role(argv: list[str]) -> str:
    """What a process of the service is, from its argv: web (gunicorn), worker, beat, or serve (the
    supervisor)."""
    line = " ".join(argv)
    if "gunicorn" in line:
        return "web"
    if "celery" in line:
        return "beat" if "beat" in argv else "worker"
    return "serve" if "serve" in argv else (argv[0].rsplit("/", 1)[-1] if argv else "?")


# The data servers a bench's service talks to, by the name the kernel gives their processes.
DATA_SERVERS = {"postgres": "postgres", "redis-server": "redis"}


def data_server_cpu() -> dict[int, tuple[str, float]]:
    """pid -> (server, CPU seconds) of every PostgreSQL and Redis process on the machine (connection
    backends included): what the service's queries cost the servers, which `process_tree` of the
    service does not see. On a machine that runs other work against the same servers it counts that too."""
    out = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            server = DATA_SERVERS.get((proc / "comm").read_text().strip())
            if server is not None:
                out[int(proc.name)] = (server, cpu_seconds(int(proc.name)))
        except OSError:
            continue
    return out
