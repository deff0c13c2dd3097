"""Django's Redis cache with one client object per server instead of one per call.

`django.core.cache.backends.redis.RedisCacheClient.get_client` builds a new `redis.Redis` around the
pooled connections on every cache call, and building one (its response-callback tables) cost more CPU
than the round trip: the submission throttle's get and set were 7% of a submission's CPU (cProfile,
bench.service). A `redis.Redis` is safe to share between threads (each command borrows a connection from
the pool) and its pool reconnects after a fork, so one per server and process does the same work.
"""
from __future__ import annotations

from typing import Any

from django.core.cache.backends.redis import RedisCache, RedisCacheClient


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
