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


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on at this moment (the kernel's pick)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
