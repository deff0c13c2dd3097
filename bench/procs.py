"""The machine's live processes, read from /proc: what the benchmarks and the end-to-end tests use to
find (and clean up after) the processes a service they started left running."""
from __future__ import annotations

import os
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
