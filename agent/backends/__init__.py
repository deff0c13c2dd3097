"""GPU backends: real NVML (`NvmlBackend`) and a simulated node (`FakeBackend`)."""
from __future__ import annotations

from pathlib import Path

from agent.backends.base import GpuBackend, GpuBackendUnavailable
from agent.backends.fake_models import FakeSpecError


def open_backend(
    fake_gpus: str | None = None, *, faults_file: Path | None = None, node_name: str | None = None
) -> GpuBackend:
    """The fake backend when a spec is given, else real NVML. Not started yet."""
    if fake_gpus:
        from agent.backends.fake import FakeBackend

        return FakeBackend(fake_gpus, faults_file=faults_file, hostname=node_name)
    from agent.backends.nvml import NvmlBackend

    return NvmlBackend()


__all__ = ["GpuBackend", "GpuBackendUnavailable", "FakeSpecError", "open_backend"]
