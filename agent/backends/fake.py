"""Simulated node: `NvmlBackend` running on `FakeNvml`, plus fault injection for tests and demos."""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from agent import host
from agent.backends.fake_models import FakeSpecError, parse_spec
from agent.backends.fake_nvml import FakeNvml
from agent.backends.nvml import NvmlBackend

log = logging.getLogger(__name__)


class FakeBackend(NvmlBackend):
    """A node shaped by a spec such as `8xA100-80GB-SXM` or `4xT4,numa=1`.

    `faults_file`, when given, is read at every sample: each new line `xid GPU CODE`,
    `ecc GPU COUNT` or `lost GPU` is applied once, so a running agent process can be broken on
    purpose from outside (end-to-end tests, demos).
    """

    name = "fake"

    def __init__(
        self,
        spec: str,
        *,
        clock: Callable[[], float] = time.monotonic,
        faults_file: Path | None = None,
        hostname: str | None = None,
    ) -> None:
        self.spec = parse_spec(spec)
        # UUIDs are salted with the node name, so several simulated nodes on one machine (the
        # `local` provider) do not report the same GPU twice.
        self.nvml = FakeNvml(self.spec, clock=clock, node_salt=hostname or host.hostname())
        super().__init__(self.nvml, backend_label=f"fake:{spec}")
        self._faults_file = faults_file
        self._faults_applied = 0
        self._hostname = hostname

    def _host_facts(self) -> tuple[str, int, int | None]:
        return self._hostname or host.hostname(), self.spec.cpus, self.spec.memory_gb * 1024

    def _cpu_words(self) -> int:
        return -(-self.spec.cpus // 64)

    # Fault injection, forwarded so tests need not reach into the NVML double.
    def inject_xid(self, index: int, code: int) -> None:
        self.nvml.inject_xid(index, code)

    def inject_ecc(self, index: int, *, uncorrected: int = 0, corrected: int = 0) -> None:
        self.nvml.inject_ecc(index, uncorrected=uncorrected, corrected=corrected)

    def retire_pages(self, index: int, count: int) -> None:
        self.nvml.retire_pages(index, count)

    def fall_off_bus(self, index: int) -> None:
        self.nvml.fall_off_bus(index)

    def note_busy_gpus(self, indices: Iterable[int]) -> None:
        self.nvml.set_busy(set(indices))

    def sample(self):  # type: ignore[no-untyped-def]
        self._apply_fault_file()
        return super().sample()

    def _apply_fault_file(self) -> None:
        if self._faults_file is None or not os.path.exists(self._faults_file):
            return
        lines = [ln.split() for ln in self._faults_file.read_text().splitlines() if ln.strip()]
        for words in lines[self._faults_applied :]:
            self._faults_applied += 1
            try:
                kind, gpu = words[0].lower(), int(words[1])
                if kind == "xid":
                    self.inject_xid(gpu, int(words[2]))
                elif kind == "ecc":
                    self.inject_ecc(gpu, uncorrected=int(words[2]))
                elif kind == "lost":
                    self.fall_off_bus(gpu)
                else:
                    raise ValueError(kind)
            except (ValueError, IndexError):
                log.warning("fault file %s: ignoring line %r", self._faults_file, " ".join(words))


__all__ = ["FakeBackend", "FakeSpecError"]
