"""Fewer garbage collections while a scheduling cycle runs.

A cycle builds about 150,000 objects that live until it ends (the snapshot's rows, the engine's
capacities and book, the plan, the commit's rows) and frees almost everything else by reference
counting. CPython's default first-generation threshold (700 allocations) then collects hundreds of
times a cycle, each time rescanning the survivors of the one before: 0.4 s of a 2.8 s whole-service
cycle with 5,000 pending jobs (bench.service, `gc.callbacks` timing 680-715 collections). With the
threshold at 100,000 it collects once or twice, for 0.02 s. Reference cycles made meanwhile are still
collected, later; memory grows by at most the garbage of 100,000 allocations.
"""
from __future__ import annotations

import gc
import threading
from contextlib import contextmanager
from typing import Iterator

CYCLE_GEN0_THRESHOLD = 100_000

_lock = threading.Lock()
_depth = 0
_saved: tuple[int, int, int] | None = None


@contextmanager
def fewer_collections(threshold: int = CYCLE_GEN0_THRESHOLD) -> Iterator[None]:
    """Raise the first-generation threshold for the block (the others are kept). Thresholds are
    per process: nested blocks and blocks in several threads share one raise, and the first
    threshold goes back to what it was when the last of them ends."""
    global _depth, _saved
    with _lock:
        if _depth == 0:
            _saved = gc.get_threshold()
            if threshold > _saved[0]:
                gc.set_threshold(threshold, *_saved[1:])
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _saved is not None:
                gc.set_threshold(*_saved)
                _saved = None
