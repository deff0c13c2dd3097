"""The emulated Kubernetes API server's pytest fixtures (a plugin: `-p tests.kube_emulator` in pyproject.toml).

The server itself is providers/local/kube_emulator.py, which the `make run` demo cluster uses too.
"""
from __future__ import annotations

from collections.abc import Iterator

import pytest

from providers.local.kube_emulator import EVENTS, NODES, PODS, EmulatedCluster, references, write_kubeconfig

__all__ = ["EVENTS", "NODES", "PODS", "EmulatedCluster", "references", "write_kubeconfig"]


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
