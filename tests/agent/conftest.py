"""Shared fixtures for the node agent tests: a fake clock, a fake broker, an open work root."""
from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

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


@pytest.fixture
def open_dir():
    """A folder every user can traverse (pytest's tmp_path lies under 0700 /tmp/pytest-of-root).

    Jobs run as an unprivileged user and use absolute paths (WHALEZEN_WORK_DIR, the checkpoint
    request file); and a test that proves a job cannot read the agent's state dir must put that
    dir where only its own permissions keep the job out.
    """
    path = Path(tempfile.mkdtemp(prefix="wz-agent-test-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)
