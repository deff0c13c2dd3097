"""A simulated NVML library with the same call signatures and errors as `pynvml`.

`NvmlBackend` runs on it unchanged, so simulated nodes exercise the real backend code. It answers
like a real driver does: NVLink calls raise NotSupported on PCIe parts, MIG calls raise
NotSupported on GPUs without MIG, retired pages are NotSupported on Ampere and newer (they remap
rows), HGX boards show NVSwitches at the far end of their links, and a GPU that fell off the bus
raises GPU_IS_LOST from every call.

Telemetry is a pure function of (seed, node name, GPU, whole second of the injected clock, busy or
not), so two runs with the same seed and clock give the same numbers, and two simulated nodes
differ.
"""
from __future__ import annotations

import random
import threading
import time
import uuid as uuid_lib
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pynvml  # only for its error classes and constants: nothing here loads libnvidia-ml

from agent.backends.fake_models import FakeNodeSpec, GpuModelSpec

NVMLError = pynvml.NVMLError
NVML_NVLINK_MAX_LINKS = 18  # enough for Hopper; the real constant (36) would only add NotSupported calls
_MIB = 1024 * 1024
_SWITCH_DOMAIN = 0x1  # NVSwitches get their own PCI domain so their bus ids never clash with GPUs
_XID_EVENT = 0x8
_GPU_DEVICE_TYPE = 0
_SWITCH_DEVICE_TYPE = 2


def _error(code: int) -> Exception:
    return NVMLError(code)


@dataclass
class FakeGpu:
    index: int
    model: GpuModelSpec
    uuid: str
    pci_bus_id: str
    numa_node: int
    pcie_switch: int
    island: int | None
    links: list[tuple[str, int]]  # (remote bus id, remote device type) per link
    mig: bool
    ecc_corrected: int = 0
    ecc_uncorrected: int = 0
    retired_pages: list[int] = field(default_factory=list)
    lost: bool = False
    busy: bool = False
    pending_xids: list[int] = field(default_factory=list)


class FakeNvml:
    """Module-like object: `FakeNvml(spec).nvmlDeviceGetCount()` etc."""

    NVMLError = NVMLError
    NVML_NVLINK_MAX_LINKS = NVML_NVLINK_MAX_LINKS

    def __init__(
        self, spec: FakeNodeSpec, *, clock: Callable[[], float] = time.monotonic, node_salt: str = ""
    ) -> None:
        self.spec = spec
        self._node_salt = node_salt
        self._clock = clock
        self._t0 = clock()
        self._lock = threading.Lock()  # faults may be injected from another thread (tests, fault file)
        self._initialized = 0
        self.gpus = self._build_gpus(spec, node_salt)
        for index, code in spec.xids:
            self.inject_xid(index, code)
        for index, count in spec.ecc:
            self.inject_ecc(index, uncorrected=count)
        for index in spec.lost:
            self.fall_off_bus(index)

    # -- node shape ----------------------------------------------------------------------------
    @staticmethod
    def _build_gpus(spec: FakeNodeSpec, node_salt: str) -> list[FakeGpu]:
        total = len(spec.models)
        per_numa = -(-total // spec.numa_nodes)
        gpus: list[FakeGpu] = []
        for index, model in enumerate(spec.models):
            numa = index // per_numa
            bus = 0x10 + index * 0x08
            gpus.append(
                FakeGpu(
                    index=index,
                    model=model,
                    uuid="GPU-" + str(uuid_lib.uuid5(uuid_lib.NAMESPACE_OID, f"whalezen-fake:{node_salt}:{spec.seed}:{index}")),
                    pci_bus_id=f"{index // 30:08X}:{bus % 256:02X}:00.0",
                    numa_node=numa,
                    pcie_switch=index // 2,  # two GPUs per PCIe switch, as on DGX/HGX boards
                    island=spec.islands[index],
                    links=[],
                    mig=spec.mig and model.mig_capable,
                )
            )
        islands: dict[int, list[FakeGpu]] = {}
        for gpu in gpus:
            if gpu.island is not None:
                islands.setdefault(gpu.island, []).append(gpu)
        for island, members in islands.items():
            for position, gpu in enumerate(members):
                others = members[position + 1 :] + members[:position]
                for link in range(gpu.model.nvlink_links):
                    if gpu.model.fabric == "nvswitch":
                        # HGX: links spread evenly over the island's NVSwitches.
                        switch = link % gpu.model.nvswitches
                        gpu.links.append((f"{_SWITCH_DOMAIN:08X}:{island * 8 + switch:02X}:00.0", _SWITCH_DEVICE_TYPE))
                    else:
                        peer = others[link % len(others)]
                        gpu.links.append((peer.pci_bus_id, _GPU_DEVICE_TYPE))
        return gpus

    # -- fault injection -------------------------------------------------------------------
    def inject_xid(self, index: int, code: int) -> None:
        with self._lock:
            gpu = self.gpus[index]
            gpu.pending_xids.append(code)
            if code == 48:  # a double-bit ECC error is also counted as an uncorrectable ECC error
                gpu.ecc_uncorrected += 1
            if code == 79:
                gpu.lost = True

    def inject_ecc(self, index: int, *, uncorrected: int = 0, corrected: int = 0) -> None:
        with self._lock:
            self.gpus[index].ecc_uncorrected += uncorrected
            self.gpus[index].ecc_corrected += corrected

    def retire_pages(self, index: int, count: int) -> None:
        with self._lock:
            pages = self.gpus[index].retired_pages
            pages.extend(0x1000 * (len(pages) + k) for k in range(count))

    def fall_off_bus(self, index: int) -> None:
        self.inject_xid(index, 79)

    def set_busy(self, indices: set[int]) -> None:
        with self._lock:
            for gpu in self.gpus:
                gpu.busy = gpu.index in indices

    # -- helpers ------------------------------------------------------------------------------
    def _gpu(self, handle: Any) -> FakeGpu:
        if self._initialized <= 0:
            raise _error(pynvml.NVML_ERROR_UNINITIALIZED)
        if not isinstance(handle, FakeGpu):
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if handle.lost:
            raise _error(pynvml.NVML_ERROR_GPU_IS_LOST)
        return handle

    def _noise(self, gpu: FakeGpu, channel: str) -> float:
        second = int(self._clock() - self._t0)
        return random.Random(f"{self.spec.seed}:{self._node_salt}:{gpu.index}:{second}:{channel}").random()

    def _utilization(self, gpu: FakeGpu) -> int:
        if gpu.busy:
            return 55 + int(44 * self._noise(gpu, "util"))
        return int(4 * self._noise(gpu, "util"))

    # -- system -------------------------------------------------------------------------------
    def nvmlInit(self) -> None:
        self._initialized += 1

    def nvmlShutdown(self) -> None:
        if self._initialized <= 0:
            raise _error(pynvml.NVML_ERROR_UNINITIALIZED)
        self._initialized -= 1

    def nvmlSystemGetDriverVersion(self) -> str:
        return "550.90.07"

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        return 12040

    def nvmlDeviceGetCount(self) -> int:
        if self._initialized <= 0:
            raise _error(pynvml.NVML_ERROR_UNINITIALIZED)
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeGpu:
        if not 0 <= index < len(self.gpus):
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return self._gpu(self.gpus[index])

    # -- identity ------------------------------------------------------------------------------
    def nvmlDeviceGetName(self, handle: Any) -> str:
        return self._gpu(handle).model.nvml_name

    def nvmlDeviceGetUUID(self, handle: Any) -> str:
        return self._gpu(handle).uuid

    def nvmlDeviceGetPciInfo(self, handle: Any) -> SimpleNamespace:
        return SimpleNamespace(busId=self._gpu(handle).pci_bus_id.encode())

    def nvmlDeviceGetEnforcedPowerLimit(self, handle: Any) -> int:
        return self._gpu(handle).model.tdp_w * 1000

    def nvmlDeviceGetMigMode(self, handle: Any) -> list[int]:
        gpu = self._gpu(handle)
        if not gpu.model.mig_capable:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return [int(gpu.mig), int(gpu.mig)]

    def nvmlDeviceGetNumaNodeId(self, handle: Any) -> int:
        return self._gpu(handle).numa_node

    def nvmlDeviceGetCpuAffinity(self, handle: Any, cpu_set_size: int) -> list[int]:
        gpu = self._gpu(handle)
        per_numa = self.spec.cpus // self.spec.numa_nodes
        first = gpu.numa_node * per_numa
        mask = ((1 << per_numa) - 1) << first
        return [(mask >> (64 * word)) & 0xFFFFFFFFFFFFFFFF for word in range(cpu_set_size)]

    # -- topology -----------------------------------------------------------------------------
    def _link(self, handle: Any, link: int) -> tuple[FakeGpu, tuple[str, int]]:
        gpu = self._gpu(handle)
        if gpu.model.fabric == "none":
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if not 0 <= link < len(gpu.links):
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return gpu, gpu.links[link]

    def nvmlDeviceGetNvLinkState(self, handle: Any, link: int) -> int:
        self._link(handle, link)
        return 1

    def nvmlDeviceGetNvLinkRemotePciInfo(self, handle: Any, link: int) -> SimpleNamespace:
        _, (bus_id, _) = self._link(handle, link)
        return SimpleNamespace(busId=bus_id.encode())

    def nvmlDeviceGetNvLinkRemoteDeviceType(self, handle: Any, link: int) -> int:
        _, (_, device_type) = self._link(handle, link)
        return device_type

    def nvmlDeviceGetTopologyCommonAncestor(self, handle1: Any, handle2: Any) -> int:
        a, b = self._gpu(handle1), self._gpu(handle2)
        if a.pcie_switch == b.pcie_switch:
            return pynvml.NVML_TOPOLOGY_SINGLE
        if a.numa_node == b.numa_node:
            return pynvml.NVML_TOPOLOGY_NODE
        return pynvml.NVML_TOPOLOGY_SYSTEM

    def nvmlDeviceGetP2PStatus(self, handle1: Any, handle2: Any, index: int) -> int:
        a, b = self._gpu(handle1), self._gpu(handle2)
        if index == 2:  # NVLink
            same_island = a.island is not None and a.island == b.island
            return pynvml.NVML_P2P_STATUS_OK if same_island else pynvml.NVML_P2P_STATUS_NOT_SUPPORTED
        if a.numa_node == b.numa_node:
            return pynvml.NVML_P2P_STATUS_OK
        return pynvml.NVML_P2P_STATUS_CHIPSET_NOT_SUPPORTED

    # -- telemetry ---------------------------------------------------------------------------
    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> SimpleNamespace:
        gpu = self._gpu(handle)
        if gpu.mig:  # NVML does not report whole-GPU utilisation in MIG mode
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        util = self._utilization(gpu)
        return SimpleNamespace(gpu=util, memory=util // 2)

    def nvmlDeviceGetMemoryInfo(self, handle: Any) -> SimpleNamespace:
        gpu = self._gpu(handle)
        total = gpu.model.memory_mb * _MIB
        share = 0.45 + 0.5 * self._noise(gpu, "mem") if gpu.busy else 0.0
        used = int(total * share) + 4 * _MIB  # the driver keeps a few MiB even when idle
        return SimpleNamespace(total=total, used=used, free=total - used)

    def nvmlDeviceGetTemperature(self, handle: Any, sensor: int) -> int:
        gpu = self._gpu(handle)
        return 30 + self._utilization(gpu) * 45 // 100 + int(4 * self._noise(gpu, "temp"))

    def nvmlDeviceGetPowerUsage(self, handle: Any) -> int:
        gpu = self._gpu(handle)
        idle_w = gpu.model.tdp_w * 0.12
        watts = idle_w + (gpu.model.tdp_w - idle_w) * self._utilization(gpu) / 100
        return int(watts * 1000 * (0.97 + 0.03 * self._noise(gpu, "power")))

    def nvmlDeviceGetTotalEccErrors(self, handle: Any, error_type: int, counter_type: int) -> int:
        gpu = self._gpu(handle)
        return gpu.ecc_uncorrected if error_type == 1 else gpu.ecc_corrected

    def nvmlDeviceGetRetiredPages(self, handle: Any, cause: int) -> list[int]:
        gpu = self._gpu(handle)
        if gpu.model.row_remapping:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        # cause 1 = double-bit ECC; we file every simulated retirement under it
        return list(gpu.retired_pages) if cause == 1 else []

    def nvmlDeviceGetRemappedRows(self, handle: Any) -> tuple[int, int, int, int]:
        gpu = self._gpu(handle)
        if not gpu.model.row_remapping:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        pending = int(gpu.ecc_uncorrected > 0)  # an uncorrectable error schedules a remap at next reset
        return (0, gpu.ecc_uncorrected, pending, 0)

    # -- events -------------------------------------------------------------------------------
    def nvmlEventSetCreate(self) -> SimpleNamespace:
        return SimpleNamespace(gpus=[])

    def nvmlDeviceRegisterEvents(self, handle: Any, event_types: int, event_set: SimpleNamespace) -> None:
        event_set.gpus.append(self._gpu(handle))

    def nvmlEventSetWait(self, event_set: SimpleNamespace, timeout_ms: int) -> SimpleNamespace:
        with self._lock:
            for gpu in event_set.gpus:
                if gpu.pending_xids:
                    code = gpu.pending_xids.pop(0)
                    return SimpleNamespace(device=gpu, eventType=_XID_EVENT, eventData=code)
        raise _error(pynvml.NVML_ERROR_TIMEOUT)

    def nvmlEventSetFree(self, event_set: SimpleNamespace) -> None:
        event_set.gpus.clear()
