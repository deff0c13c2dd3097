"""Shared fixtures for the node agent tests: a fake clock and a fake broker."""
from __future__ import annotations

import pytest

from tests.agent.fake_broker import FakeBroker


class FakeClock:
    """Monotonic clock the test moves by hand, so schedules are checked without real waiting."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def broker():
    fake = FakeBroker()
    yield fake
    fake.stop()
