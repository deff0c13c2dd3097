"""With REDIS_URL set, submission throttling lives in Redis, so every web worker shares one budget."""
from __future__ import annotations

import os

import pytest
import redis
from django.core.cache import cache

from .conftest import MINIMAL_SPEC, requires_redis


@requires_redis
@pytest.mark.redis
def test_throttle_budget_is_shared_through_redis(acme):
    from rest_framework.settings import api_settings
    from rest_framework.throttling import SimpleRateThrottle

    cache.clear()
    old = SimpleRateThrottle.THROTTLE_RATES
    SimpleRateThrottle.THROTTLE_RATES = {**api_settings.DEFAULT_THROTTLE_RATES, "job_submit": "2/min"}
    try:
        assert [acme.client.post("/api/v1/jobs/", MINIMAL_SPEC, format="json").status_code
                for _ in range(2)] == [201, 201]
        # What another web worker would see: the history is in Redis, not in this process.
        raw = redis.Redis.from_url(os.environ["REDIS_URL"])
        keys = [k for k in raw.keys("*throttle_job_submit*")]
        assert keys, "throttle history is stored in Redis"
        # Clearing this process's view changes nothing: the next request is still refused.
        assert acme.client.post("/api/v1/jobs/", MINIMAL_SPEC, format="json").status_code == 429
    finally:
        SimpleRateThrottle.THROTTLE_RATES = old
        cache.clear()


@requires_redis
@pytest.mark.redis
def test_the_redis_cache_shares_one_client_across_calls_and_threads():
    """broker/ops/cache.py: one `redis.Redis` per server instead of one per cache call, and the shared one
    serves concurrent threads without losing an increment or mixing up answers."""
    from concurrent.futures import ThreadPoolExecutor

    from django.core.cache import caches

    from broker.ops.cache import SharedClientRedisCache

    assert isinstance(caches["default"], SharedClientRedisCache)
    assert cache._cache.get_client("a") is cache._cache.get_client("b", write=True)
    cache.clear()
    cache.set("counter", 0)

    def work(thread: int) -> bool:
        mine = True
        for i in range(50):
            cache.incr("counter")
            cache.set(f"own:{thread}", i)
            mine = mine and cache.get(f"own:{thread}") == i
        return mine

    with ThreadPoolExecutor(max_workers=16) as pool:
        answers = list(pool.map(work, range(16)))
    assert all(answers) and cache.get("counter") == 800
    cache.clear()
