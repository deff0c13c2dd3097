"""The caches the web server's processes share: Redis (with REDIS_URL), or SQLite files (the embedded default).

Django's Redis cache, with one client object per server instead of one per call:

`django.core.cache.backends.redis.RedisCacheClient.get_client` builds a new `redis.Redis` around the
pooled connections on every cache call, and building one (its response-callback tables) cost more CPU
than the round trip: the submission throttle's get and set were 7% of a submission's CPU (cProfile,
bench.service). A `redis.Redis` is safe to share between threads (each command borrows a connection from
the pool) and its pool reconnects after a fork, so one per server and process does the same work.
"""
from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from typing import Any

from diskcache import DjangoCache
from django.core.cache.backends.redis import RedisCache, RedisCacheClient

from broker import file_locks


class SharedClientRedisCacheClient(RedisCacheClient):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._clients: dict[int, Any] = {}

    def get_client(self, key: Any = None, *, write: bool = False) -> Any:
        index = self._get_connection_pool_index(write)
        client = self._clients.get(index)
        if client is None:  # two threads may both build one; either serves
            client = self._clients[index] = self._client(connection_pool=self._get_connection_pool(write))
        return client


class SharedClientRedisCache(RedisCache):
    def __init__(self, server: str, params: dict[str, Any]) -> None:
        super().__init__(server, params)
        self._class = SharedClientRedisCacheClient

    def window_hit(self, current: str, previous: str, timeout: int) -> tuple[int, int]:
        """broker/api/throttling.py's counting in one round trip: INCR the current period's counter, set
        its expiry, read the previous period's. Integers are stored as plain numbers (Django's Redis
        serializer), so `get`/`decr` read and change the same values."""
        current_key = self.make_and_validate_key(current)
        previous_key = self.make_and_validate_key(previous)
        with self._cache.get_client(current_key, write=True).pipeline(transaction=False) as pipe:
            pipe.incr(current_key)
            pipe.expire(current_key, timeout)
            pipe.get(previous_key)
            count, _, before = pipe.execute()
        return int(count), int(before or 0)


class SharedDiskCache(DjangoCache):
    """diskcache's Django cache (SQLite files, safe between processes and threads), with the rate limits'
    counting: `make run`'s web server runs several processes (broker/ops/web.py), and a process's local
    memory would give each its own limit. diskcache increments in one SQLite transaction, so two processes
    never both write N + 1 (Django's own file cache reads and writes back a counter in two steps, and cost
    0.6 ms per request against 0.05 ms here). Every request increments the same few keys, though, and
    SQLite makes a writer that finds another's lock sleep 1, 2, 5... ms: the processes' threads take
    turns on a lock of the process and an exclusive `flock` of the directory's lock file instead (the
    kernel wakes the next as soon as one is done, and drops a dead holder's lock)."""

    def __init__(self, directory: str, params: dict[str, Any]) -> None:
        super().__init__(directory, params)
        self._lock_path = os.path.join(directory, "counters.lock")

    @contextlib.contextmanager
    def _counting(self) -> Iterator[None]:
        with _COUNTING:
            fd = file_locks.lock_descriptor(self._lock_path)
            file_locks.take(fd)
            try:
                yield
            finally:
                file_locks.give_back(fd)

    def window_hit(self, current: str, previous: str, timeout: int) -> tuple[int, int]:
        """broker/api/throttling.py's counting: one more in `current` (kept `timeout` seconds from its
        first), and the counts of both periods."""
        with self._counting():
            count = self.incr(current, 1, default=0)
            if count == 1:
                self.touch(current, timeout)
            before = self.get(previous)
        return int(count), int(before or 0)

    def decr(self, key: Any, delta: int = 1, version: Any = None) -> int:  # a refused request's hit
        with self._counting():
            return super().decr(key, delta, version)

    def close(self, **kwargs: Any) -> None:
        """Keep the thread's SQLite connections open: Django closes every cache after each request, and
        opening diskcache's files again made a submission 2-3 ms slower than the request itself. A
        connection to a local file holds nothing another process waits for between requests."""


_COUNTING = threading.Lock()  # one thread of the process at a time holds the lock file


def _fresh_in_child() -> None:
    global _COUNTING
    _COUNTING = threading.Lock()


os.register_at_fork(after_in_child=_fresh_in_child)
