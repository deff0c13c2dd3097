"""Exclusive locks between processes on a file (`flock`), for the embedded SQLite's writers
(broker/sqlite/base.py) and the web processes' shared counters (broker/ops/cache.py).

A `flock` belongs to the open file, not to the process: a forked child that kept its parent's descriptor
would share its parent's lock, and neither would exclude the other. So each process opens its own
descriptor of a lock file once, and a forked child drops the ones it inherited (the parent keeps its copy,
and with it any lock it holds). The kernel releases a lock when its holder dies.
"""
from __future__ import annotations

import fcntl
import os
import time

# How often a bounded wait asks again for a lock another process holds.
POLL_S = 0.0005

_descriptors: dict[str, int] = {}  # lock file -> this process's descriptor


def lock_descriptor(path: str) -> int:
    """This process's descriptor of the lock file `path`, opened (created 0600) on first use; OSError where
    it cannot be. Callers serialise their own threads: a descriptor is one lock, not one per thread."""
    fd = _descriptors.get(path)
    if fd is None:
        fd = _descriptors[path] = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    return fd


def take(fd: int, timeout: float | None = None) -> bool:
    """Hold the lock: wait for it (None), or poll every POLL_S for at most `timeout` seconds and say
    whether it was taken."""
    if timeout is None:
        fcntl.flock(fd, fcntl.LOCK_EX)
        return True
    deadline = time.monotonic() + timeout
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(POLL_S)


def give_back(fd: int) -> None:
    fcntl.flock(fd, fcntl.LOCK_UN)


def _fresh_in_child() -> None:
    for fd in _descriptors.values():
        os.close(fd)
    _descriptors.clear()


os.register_at_fork(after_in_child=_fresh_in_child)
