"""broker/ops/cache.py SharedDiskCache: the counters of the rate limits count every process's requests."""
from __future__ import annotations

import multiprocessing

from broker.api.throttling import window_hit
from broker.ops.cache import SharedDiskCache

HITS = 300


def _hit_many(location: str, start) -> None:
    cache = SharedDiskCache(location, {})
    start.wait()
    for _ in range(HITS):
        cache.window_hit("submit:1:100", "submit:1:99", 120)


def test_two_processes_counting_at_once_lose_no_hit(tmp_path):
    ctx = multiprocessing.get_context("fork")
    start = ctx.Event()
    procs = [ctx.Process(target=_hit_many, args=(str(tmp_path), start)) for _ in range(2)]
    for proc in procs:
        proc.start()
    start.set()
    for proc in procs:
        proc.join(60)
        assert proc.exitcode == 0
    assert SharedDiskCache(str(tmp_path), {}).get("submit:1:100") == 2 * HITS


def test_a_period_counts_its_own_hits_and_reads_the_previous_ones(tmp_path):
    cache = SharedDiskCache(str(tmp_path), {})
    cache.set("w:99", 4, 120)
    assert window_hit(cache, "w:100", "w:99", 120) == (1, 4)
    assert window_hit(cache, "w:100", "w:99", 120) == (2, 4)
    cache.decr("w:100")  # a refused request does not count (broker/api/throttling.py)
    assert window_hit(cache, "w:100", "w:99", 120) == (2, 4)
    assert window_hit(cache, "w:101", "w:100", 120) == (1, 2)
