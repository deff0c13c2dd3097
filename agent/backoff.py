"""Exponential backoff with jitter for talking to a broker that is down.

"Equal jitter": half the delay is fixed, half random. Fully random delays (0..ceiling) can retry
almost at once; fixed ones make every agent of a fleet hit a restarting broker in the same second.
"""
from __future__ import annotations

import random


class Backoff:
    def __init__(self, *, base_s: float = 1.0, cap_s: float = 60.0, rng: random.Random | None = None) -> None:
        if base_s <= 0 or cap_s < base_s:
            raise ValueError("need 0 < base_s <= cap_s")
        self.base_s = base_s
        self.cap_s = cap_s
        self.failures = 0
        self._rng = rng or random.Random()

    def next_delay(self) -> float:
        """Delay before the next attempt, after one more failure."""
        self.failures += 1
        ceiling = min(self.cap_s, self.base_s * 2 ** min(self.failures - 1, 32))
        return ceiling / 2 + self._rng.uniform(0, ceiling / 2)

    def reset(self) -> None:
        self.failures = 0
