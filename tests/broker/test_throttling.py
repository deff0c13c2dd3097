"""broker/api/throttling.py: rates counted in two fixed windows, on the embedded default's local memory
and on Redis (one pipelined round trip), with a clock the test moves."""
from __future__ import annotations

import os
import uuid

import pytest
from django.core.cache.backends.locmem import LocMemCache

from broker.api.throttling import WindowRateThrottle


def _caches():
    yield pytest.param(LocMemCache(f"throttle-{uuid.uuid4()}", {}), id="locmem")
    if os.environ.get("REDIS_URL"):
        from broker.ops.cache import SharedClientRedisCache

        yield pytest.param(SharedClientRedisCache(os.environ["REDIS_URL"], {"KEY_PREFIX": str(uuid.uuid4())}),
                           id="redis", marks=pytest.mark.redis)


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _throttle(cache, clock: Clock, rate: str = "4/min") -> WindowRateThrottle:
    class Four(WindowRateThrottle):
        def get_rate(self) -> str:
            return rate

        def get_cache_key(self, request, view) -> str:
            return "throttle_test_key"

    throttle = Four()
    throttle.cache, throttle.timer = cache, clock
    return throttle


@pytest.fixture(params=list(_caches()))
def cache(request):
    yield request.param
    request.param.clear()


PERIOD_START = 60 * 29_000_000  # an aligned minute


def test_the_rate_is_allowed_then_refused_and_refusals_do_not_count(cache):
    clock = Clock(PERIOD_START + 1)
    throttle = _throttle(cache, clock)
    assert [throttle.allow_request(None, None) for _ in range(6)] == [True] * 4 + [False] * 2
    clock.now = PERIOD_START + 59.9  # still the same minute: refused however often it asks
    assert not any(throttle.allow_request(None, None) for _ in range(20))
    # The next minute: this one's 4 fade out as the minute passes, so the first request waits until a
    # quarter of it has gone (4 * 3/4 + 1 = 4): had the refusals counted, it would wait a whole minute more.
    clock.now = PERIOD_START + 60 + 14
    assert not throttle.allow_request(None, None)
    assert 0.9 < throttle.wait() <= 1.01
    clock.now = PERIOD_START + 60 + 15.01
    assert throttle.allow_request(None, None)


def test_wait_says_when_the_next_request_is_allowed(cache):
    clock = Clock(PERIOD_START + 50)
    throttle = _throttle(cache, clock, rate="3/min")
    assert [throttle.allow_request(None, None) for _ in range(4)] == [True, True, True, False]
    wait = throttle.wait()  # 10 s to the next minute, then a third of it (3 * 2/3 + 1 = 3): 30 s
    assert 29.9 < wait < 30.1
    clock.now += wait - 0.5
    assert not throttle.allow_request(None, None)
    clock.now += 0.6
    assert throttle.allow_request(None, None)


def test_two_periods_later_the_full_rate_is_back(cache):
    clock = Clock(PERIOD_START + 30)
    throttle = _throttle(cache, clock)
    assert all(throttle.allow_request(None, None) for _ in range(4))
    clock.now = PERIOD_START + 120.5
    assert [throttle.allow_request(None, None) for _ in range(5)] == [True] * 4 + [False]


def test_a_zero_rate_refuses_and_names_no_time(cache):
    throttle = _throttle(cache, Clock(PERIOD_START), rate="0/min")
    assert not throttle.allow_request(None, None) and throttle.wait() is None
