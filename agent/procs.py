"""Find and stop job processes left behind by an agent that crashed (Linux /proc)."""
from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path

log = logging.getLogger(__name__)


def process_start_ticks(pid: int, proc: Path = Path("/proc")) -> int | None:
    """Start time of a process in clock ticks since boot (field 22 of /proc/<pid>/stat).

    A pid alone can be reused by an unrelated process after ours died; pid + start time cannot.
    """
    try:
        raw = (proc / str(pid) / "stat").read_text()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may contain spaces: split after it.
    fields = raw[raw.rfind(")") + 2 :].split()
    try:
        return int(fields[19])  # field 22 overall; fields[0] is field 3
    except (IndexError, ValueError):
        return None


def kill_orphan(pid: int | None, start_ticks: int | None, *, grace_s: float) -> bool:
    """SIGTERM then SIGKILL the process group of `pid` if it is still the process we started."""
    if pid is None or start_ticks is None or process_start_ticks(pid) != start_ticks:
        return False
    log.warning("stopping orphaned job process group %d left by a previous agent", pid)
    try:
        os.killpg(pid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        return False
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and process_start_ticks(pid) == start_ticks:
        time.sleep(0.05)
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    return True


def catches_signal(pid: int, signum: int, proc: Path = Path("/proc")) -> bool:
    """Whether the process has a handler for `signum` (SigCgt in /proc/<pid>/status).

    SIGUSR1's default action is to terminate: signalling a job that never installed a handler
    would kill the job we were asked to checkpoint.
    """
    try:
        for line in (proc / str(pid) / "status").read_text().splitlines():
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    except (OSError, ValueError, IndexError):
        return False
    return False
