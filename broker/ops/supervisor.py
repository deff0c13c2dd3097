"""Supervise the service's processes (what `manage.py serve` starts): web, worker, beat.

Each child runs in its own process group, so a stop reaches everything it started (a Celery
worker's helpers, a shell's children) and a terminal's Ctrl-C reaches only `serve`, which then
stops the children in order. A child that dies is restarted with exponential backoff (1 s doubling
to 30 s; back to 1 s once it stayed up for a minute), and every exit and restart is logged. Each
child gets PR_SET_PDEATHSIG, so a `serve` killed with SIGKILL takes its children with it; the
pids are also written to a state file, so the next `serve` can stop whatever still survived.

Plain Python on purpose (no Django): it is the part that must keep working when the rest fails.
"""
from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Sequence

from providers.local.processes import is_alive, process_start_time

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


@dataclass(frozen=True)
class ChildSpec:
    name: str
    argv: Sequence[str]
    env: dict[str, str]
    log_path: Path
    cwd: Path | None = None
    # Started only once this file exists: a file another child writes (the demo cluster's kubeconfig, which
    # names the port it got, for its bridge). Started beside it, the child would fail and be restarted on
    # every start of the service.
    after_file: Path | None = None
    # Raised by this much (nice) at start: a background child then yields the cores to the others.
    niceness: int = 0


@dataclass(frozen=True)
class Backoff:
    """How long to wait before restarting a child that died. Defaults: 1 s doubling to 30 s, as
    systemd's and supervisord's restart delays do, and a clean slate after a minute of uptime."""

    initial_s: float = 1.0
    max_s: float = 30.0
    reset_after_s: float = 60.0

    def next_delay(self, previous: float | None) -> float:
        return self.initial_s if previous is None else min(self.max_s, previous * 2)


@dataclass
class _Child:
    spec: ChildSpec
    process: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    delay: float | None = None  # the last restart delay; None = next restart waits `initial_s`
    restart_at: float | None = None
    restarts: int = 0
    waiting: bool = False  # not started yet: its `after_file` does not exist


_libc = ctypes.CDLL(None, use_errno=True)


def signal_on_parent_death(sig: int, parent_pid: int) -> bool:
    """Ask the kernel to send `sig` to this process when its parent dies (Linux prctl). False when
    the parent is already gone (it may die before the call: hence the getppid check)."""
    _libc.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0)
    return os.getppid() == parent_pid


def _child_setup(parent_pid: int, niceness: int = 0) -> Callable[[], None]:
    """preexec_fn: the child gets SIGKILL when `serve` dies, however it dies, and starts at its niceness."""

    def setup() -> None:
        if not signal_on_parent_death(signal.SIGKILL, parent_pid):
            os._exit(1)
        if niceness > 0:
            os.nice(niceness)

    return setup


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exited with status {returncode}"


def signal_group(pgid: int, sig: int) -> bool:
    """Signal a whole process group; False when no process of it is left."""
    try:
        os.killpg(pgid, sig)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:  # not ours (the pid was reused by another user's process)
        return False


class Supervisor:
    def __init__(self, specs: Iterable[ChildSpec], *, log: Callable[[str], None], backoff: Backoff = Backoff(),
                 state_file: Path | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.children = {spec.name: _Child(spec) for spec in specs}
        self.log = log
        self.backoff = backoff
        self.state_file = state_file
        self._clock = clock

    # -- starting and restarting -----------------------------------------------------------------
    def start(self) -> None:
        for child in self.children.values():
            if self._ready(child):
                self._spawn(child)
            else:
                child.waiting = True
                self.log(f"{child.spec.name} starts once {child.spec.after_file} exists")

    @staticmethod
    def _ready(child: _Child) -> bool:
        return child.spec.after_file is None or child.spec.after_file.exists()

    def _spawn(self, child: _Child) -> None:
        spec = child.spec
        spec.log_path.parent.mkdir(parents=True, exist_ok=True)
        with spec.log_path.open("ab") as log:
            child.process = subprocess.Popen(
                list(spec.argv), cwd=spec.cwd, env=spec.env, stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT, process_group=0, preexec_fn=_child_setup(os.getpid(), spec.niceness))
        child.started_at, child.restart_at = self._clock(), None
        self.log(f"{spec.name} started (pid {child.process.pid}, log {spec.log_path})")
        self._write_state()

    def poll(self) -> None:
        """Notice children that exited, and restart those whose backoff has elapsed."""
        now = self._clock()
        for child in self.children.values():
            if child.waiting:
                if self._ready(child):  # its file is there: its first start
                    child.waiting = False
                    self._spawn(child)
                continue
            process = child.process
            if process is not None and process.poll() is not None:
                self._reap_group(process.pid)
                uptime = now - child.started_at
                if uptime >= self.backoff.reset_after_s:
                    child.delay = None  # it ran fine for a while: this is a new failure, not a crash loop
                child.delay = self.backoff.next_delay(child.delay)
                child.restart_at = now + child.delay
                child.process = None
                self.log(f"{child.spec.name} (pid {process.pid}) {describe_exit(process.returncode)} after "
                         f"{uptime:.0f} s; restarting in {child.delay:g} s")
            if child.process is None and child.restart_at is not None and now >= child.restart_at:
                child.restarts += 1
                self._spawn(child)
                self.log(f"{child.spec.name} restarted (restart {child.restarts})")

    def _reap_group(self, pgid: int) -> None:
        # The group leader is gone; whatever it left in its group (a prefork pool's children, a job
        # shell) must not keep running beside the replacement.
        signal_group(pgid, signal.SIGKILL)

    # -- stopping ----------------------------------------------------------------------------------
    def stop(self, names: Sequence[str] | None = None, *, grace_s: float = 10.0) -> None:
        """SIGTERM each child's process group, wait up to `grace_s`, then SIGKILL the groups."""
        chosen = [self.children[n] for n in (names or list(self.children)) if n in self.children]
        running = [c for c in chosen if c.process is not None]
        for child in chosen:
            child.restart_at = None  # no restart for a child we stop
        for child in running:
            # The group even when its leader already exited: what it started may still run.
            signal_group(child.process.pid, signal.SIGTERM)
        deadline = self._clock() + grace_s
        while self._clock() < deadline and any(c.process.poll() is None for c in running):
            time.sleep(0.1)
        for child in running:
            forced = child.process.poll() is None
            signal_group(child.process.pid, signal.SIGKILL)  # the leader and anything left in its group
            child.process.wait()
            how = f"SIGKILL after {grace_s:g} s" if forced else describe_exit(child.process.returncode)
            self.log(f"{child.spec.name} stopped ({how})")
            child.process = None
        self._write_state()

    # -- the state file: what a SIGKILLed serve may have left -----------------------------------
    def _write_state(self) -> None:
        if self.state_file is None:
            return
        rows = [{"name": c.spec.name, "pid": c.process.pid, "start": process_start_time(c.process.pid)}
                for c in self.children.values() if c.process is not None and c.process.poll() is None]
        tmp = self.state_file.with_name(f".{self.state_file.name}.tmp")
        tmp.write_text(json.dumps(rows))
        os.replace(tmp, self.state_file)


def stop_leftovers(state_file: Path, *, log: Callable[[str], None], grace_s: float = 5.0) -> int:
    """Stop the process groups a previous `serve` recorded and that still run (same pid AND start
    time, so a reused pid is never hit). Returns how many there were."""
    try:
        rows = json.loads(state_file.read_text())
    except (OSError, ValueError):
        return 0
    alive = [r for r in rows if isinstance(r, dict) and isinstance(r.get("pid"), int)
             and is_alive(r["pid"], r.get("start"))]
    for row in alive:
        log(f"stopping {row.get('name')} (pid {row['pid']}) left by a previous serve")
        signal_group(row["pid"], signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(is_alive(r["pid"], r.get("start")) for r in alive):
        time.sleep(0.1)
    for row in alive:
        if is_alive(row["pid"], row.get("start")):
            signal_group(row["pid"], signal.SIGKILL)
    state_file.unlink(missing_ok=True)
    return len(alive)
