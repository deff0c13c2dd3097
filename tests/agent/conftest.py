"""Shared fixtures for the node agent tests: a fake clock and a fake broker."""
from __future__ import annotations

import pytest

from tests.agent.clock import FakeClock
from tests.agent.fake_broker import FakeBroker


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def broker():
    fake = FakeBroker()
    yield fake
    fake.stop()
