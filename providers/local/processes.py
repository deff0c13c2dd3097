"""Process bookkeeping for the local provider: start in its own session, check liveness by
pid AND start time (pids are reused), stop the whole process group."""
from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Mapping, Sequence


def process_start_time(pid: int) -> int | None:
    """Kernel start time of `pid` in clock ticks (/proc/PID/stat field 22); None if gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # The command name (field 2) may contain spaces and ')': split after the last ')'.
    fields = stat[stat.rfind(")") + 2:].split()
    if fields[0] in ("Z", "X"):  # zombie/dead: exited, waiting to be reaped
        return None
    return int(fields[19])


def is_alive(pid: int, start_time: int | None) -> bool:
    current = process_start_time(pid)
    if current is None:
        return False
    return start_time is None or current == start_time


def spawn(command: Sequence[str], *, log_path: Path, env: Mapping[str, str] | None = None,
          stdin_data: bytes | None = None, pass_fds: Sequence[int] = ()) -> subprocess.Popen[bytes]:
    """Start `command` in its own session. `stdin_data` (the agent's join token) is all its stdin
    will ever read: written to a pipe that is closed at once (it fits the pipe's buffer).
    `pass_fds` stay open in it (the instance's metadata socket)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as log:
        # Own session: terminate() can signal the agent and everything it started (jobs).
        process = subprocess.Popen(
            list(command), stdin=subprocess.DEVNULL if stdin_data is None else subprocess.PIPE, stdout=log,
            stderr=subprocess.STDOUT, start_new_session=True, env=dict(env) if env is not None else None,
            pass_fds=tuple(pass_fds),
        )
    if stdin_data is not None:
        assert process.stdin is not None
        try:
            process.stdin.write(stdin_data)
        except BrokenPipeError:
            pass  # the command exited at once; describe() will say so
        finally:
            try:
                process.stdin.close()
            except BrokenPipeError:
                pass
    return process


def stop(pid: int, start_time: int | None, *, timeout_s: float, children: dict[int, subprocess.Popen[bytes]]) -> bool:
    """SIGTERM the process group, then SIGKILL after `timeout_s`. True once it is gone."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if not is_alive(pid, start_time):
            return True
        try:
            os.killpg(pid, sig)  # pid == pgid: spawned with start_new_session
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            reap(children)
            if not is_alive(pid, start_time):
                return True
            time.sleep(0.02)
    reap(children)
    return not is_alive(pid, start_time)


def reap(children: dict[int, subprocess.Popen[bytes]]) -> None:
    """Collect exit status of processes this Python process started (else they stay zombies)."""
    for pid, child in list(children.items()):
        if child.poll() is not None:
            del children[pid]
