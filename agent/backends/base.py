"""The GPU backend contract: one inventory at start, one reading per GPU per sample."""
from __future__ import annotations

import abc
from collections.abc import Iterable

from agent.model import GpuReading, NodeInventory


class GpuBackendUnavailable(RuntimeError):
    """The GPUs cannot be read at all (no driver, driver not loaded, no permission).

    The message is one line meant for an operator; the CLI prints it without a traceback.
    """


class GpuBackend(abc.ABC):
    """Reads one node's GPUs. Not thread-safe: the agent loop is its only caller."""

    name: str = "abstract"

    @abc.abstractmethod
    def start(self) -> None:
        """Open the driver. Raises GpuBackendUnavailable with a one-line reason."""

    @abc.abstractmethod
    def inventory(self) -> NodeInventory:
        """Identity and topology of every GPU (read once, then cached)."""

    @abc.abstractmethod
    def sample(self) -> tuple[GpuReading, ...]:
        """One telemetry reading per GPU, in index order. A broken GPU gives a FAILED reading."""

    def note_busy_gpus(self, indices: Iterable[int]) -> None:
        """Told which GPUs run a job now. Real GPUs show it by themselves; the fake uses it."""

    def close(self) -> None:
        """Release the driver."""

    def __enter__(self) -> "GpuBackend":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
