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


def group_members(pgid: int, proc: Path = Path("/proc")) -> list[int]:
    """Pids whose process group is `pgid` (field 5 of /proc/<pid>/stat)."""
    members = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            raw = (entry / "stat").read_text()
        except OSError:
            continue  # gone meanwhile
        fields = raw[raw.rfind(")") + 2 :].split()
        if len(fields) > 2 and fields[2] == str(pgid) and fields[0] not in ("Z", "X"):
            members.append(int(entry.name))
    return members


def kill_orphan(pid: int | None, start_ticks: int | None, *, grace_s: float) -> bool:
    """SIGTERM then SIGKILL the process group a previous agent started as `pid`, if it still exists.

    Two cases are ours: `pid` is alive with the recorded start time (the group's leader, the job
    shim), or `pid` is gone but processes remain in group `pid` (the leader died, its job's
    children did not). Linux never hands out a pid that is still some group's id, so a group
    `pid` without a live `pid` is the one we started. A live `pid` with another start time is an
    unrelated process that reused the number: left alone.
    """
    if pid is None or start_ticks is None:
        return False
    leader = process_start_ticks(pid)
    if leader is not None and leader != start_ticks:
        return False
    if leader is None and not group_members(pid):
        return False
    log.warning("stopping orphaned job process group %d left by a previous agent", pid)
    try:
        os.killpg(pid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        return False
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and group_members(pid):
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
