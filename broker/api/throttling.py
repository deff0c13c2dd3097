"""Rate limits counted in two fixed windows: DRF's rates and keys, one cache round trip per request.

DRF's `SimpleRateThrottle` keeps every request's timestamp of the last period in one cache value, read
and written back whole on every request: two round trips to Redis and a list as long as the rate (a
submission rate raised to 10,000/min pickles 10,000 floats per request, both ways). Here each period
(`duration`, aligned to the epoch) has a counter, and a request is allowed while

    previous_count * (1 - elapsed_fraction_of_this_period) + this_period_count  <=  rate

(the "sliding window counter" of nginx-style and Cloudflare limiters: it assumes the previous period's
requests were spread evenly). On Redis the increment, its expiry and the previous count are one pipelined
round trip (broker/ops/cache.py); other caches (the embedded default's local memory) use add/incr/get. A
refused request does not count, as with DRF. The bound is the rate over each aligned period and on
average; a client that times a full burst at the end of one period can get up to twice the rate within
one rolling period, never more.
"""
from __future__ import annotations

from typing import Any

from rest_framework.throttling import SimpleRateThrottle


def window_hit(cache: Any, current: str, previous: str, timeout: int) -> tuple[int, int]:
    """Count one request in `current` (kept `timeout` seconds); the counts of `current` (this one
    included) and `previous`."""
    hit = getattr(cache, "window_hit", None)
    if hit is not None:
        return hit(current, previous, timeout)
    if cache.add(current, 1, timeout):
        count = 1
    else:
        try:
            count = cache.incr(current)
        except ValueError:  # expired between add and incr
            cache.add(current, 1, timeout)
            count = 1
    return count, int(cache.get(previous) or 0)


class WindowRateThrottle(SimpleRateThrottle):
    """A `SimpleRateThrottle` (same rates, scopes, keys and `get_cache_key`) counted as the module says."""

    def allow_request(self, request: Any, view: Any) -> bool:
        if self.rate is None:
            return True
        self.key = self.get_cache_key(request, view)
        if self.key is None:
            return True
        self.now = self.timer()
        window, into = divmod(self.now, self.duration)
        self._fraction = into / self.duration
        current_key = f"{self.key}:{int(window)}"
        self._current, self._previous = window_hit(self.cache, current_key, f"{self.key}:{int(window) - 1}",
                                                   2 * self.duration)
        if self._previous * (1 - self._fraction) + self._current <= self.num_requests:
            return True
        try:
            self.cache.decr(current_key)  # refused: not counted
        except ValueError:
            pass
        self._current -= 1
        return self.throttle_failure()

    def wait(self) -> float | None:
        """Seconds until a request would be allowed, if nobody else asks meanwhile."""
        if self.num_requests < 1:
            return None
        room = self.num_requests - self._current - 1  # what the previous period's share must fall to
        if room >= 0 and self._previous > 0:  # later in this period, as the previous period's share fades
            at = 1 - room / self._previous
            if at < 1:
                return max((at - self._fraction) * self.duration, 1e-3)
        # In the next period this one's count fades: allowed once current * (1 - g) + 1 <= rate.
        at_next = max(0.0, 1 - (self.num_requests - 1) / self._current) if self._current > 0 else 0.0
        return max((1 - self._fraction + at_next) * self.duration, 1e-3)
