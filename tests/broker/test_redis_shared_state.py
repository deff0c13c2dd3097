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
