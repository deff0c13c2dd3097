"""What a GPU backend reports: frozen dataclasses, the same for real NVML and the fake.

`NodeInventory` is read once (identity and topology); `GpuReading` is sampled every heartbeat.
Fields a GPU or driver cannot report are None, never a made-up zero, so the broker can tell
"0 % busy" from "unknown".
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any


class Health(str, Enum):
    HEALTHY = "HEALTHY"
    DEGRADED = "DEGRADED"  # usable, but the broker should prefer other GPUs and an admin should look
    FAILED = "FAILED"  # do not place work here (fell off the bus, uncorrectable ECC, fatal Xid)


class MigMode(str, Enum):
    ENABLED = "enabled"
    DISABLED = "disabled"
    UNSUPPORTED = "unsupported"  # GPU without MIG (T4, V100, ...) or a driver that cannot tell


@dataclass(frozen=True)
class NvLinkInfo:
    """One NVLink of a GPU, as nvmlDeviceGetNvLinkState / GetNvLinkRemotePciInfo see it."""

    link: int
    active: bool
    remote_pci_bus_id: str | None  # a GPU (direct bridge) or an NVSwitch
    remote_device_type: str | None  # "gpu" | "switch" | "ibmnpu" | "unknown"
    remote_gpu_index: int | None  # set when the remote end is a GPU of this node


@dataclass(frozen=True)
class GpuInfo:
    """Static identity of one GPU (does not change while the node is up)."""

    index: int
    uuid: str | None
    name: str | None  # as NVML reports it, e.g. "NVIDIA A100-SXM4-80GB"
    memory_total_mb: int | None
    pci_bus_id: str | None  # "00000000:07:00.0", NVML's format
    power_limit_w: float | None
    mig_mode: MigMode
    mig_pending: bool | None  # MIG mode change waiting for a GPU reset


@dataclass(frozen=True)
class GpuTopology:
    """Where one GPU sits: NVLink links and peers, NVLink island, NUMA node, CPU affinity."""

    index: int
    numa_node: int | None
    cpu_affinity: str | None  # CPU list like "0-31,64-95"
    nvlinks: tuple[NvLinkInfo, ...]
    nvlink_peers: tuple[int, ...]  # GPU indices reachable over NVLink (direct or via NVSwitch)
    nvlink_island: int | None  # id of the set of GPUs joined by NVLink; None when it has no peer


@dataclass(frozen=True)
class NodeInventory:
    hostname: str
    driver_version: str | None
    cuda_driver_version: str | None
    cpu_count: int
    memory_mb: int | None
    gpus: tuple[GpuInfo, ...]
    topology: tuple[GpuTopology, ...]
    # [i][j]: PCIe common ancestor in nvidia-smi topo terms: "X" (self), "BOARD", "PIX", "PXB",
    # "PHB", "NODE", "SYS", or None where NVML could not tell.
    pcie_common_ancestor: tuple[tuple[str | None, ...], ...]
    # [i][j]: nvmlDeviceGetP2PStatus result names for the NVLink and the PCIe read capability.
    p2p_nvlink: tuple[tuple[str | None, ...], ...]
    p2p_read: tuple[tuple[str | None, ...], ...]
    backend: str  # "nvml" or "fake:<spec>"

    def to_json(self) -> dict[str, Any]:
        return _jsonable(asdict(self))


@dataclass(frozen=True)
class GpuReading:
    """One telemetry sample of one GPU."""

    index: int
    uuid: str | None
    utilization_pct: int | None
    memory_utilization_pct: int | None  # memory controller busy %, not capacity
    memory_used_mb: int | None
    memory_total_mb: int | None
    temperature_c: int | None
    power_w: float | None
    power_limit_w: float | None
    ecc_corrected: int | None  # volatile (since driver load)
    ecc_uncorrected: int | None  # volatile (since driver load)
    retired_pages: int | None  # pre-Ampere page retirement, both causes
    remapped_rows_pending: bool | None  # Ampere+ row remapping waiting for a reset
    remapped_rows_failed: bool | None
    xid_errors: tuple[int, ...]  # Xid codes seen since the agent started, oldest first (bounded)
    mig_mode: MigMode
    lost: bool  # fell off the bus / NVML_ERROR_GPU_IS_LOST
    health: Health
    health_reasons: tuple[str, ...] = field(default_factory=tuple)
    # Taken by work the broker did not place (the Kubernetes bridge: other pods' GPU requests).
    held_outside: bool = False

    def to_json(self) -> dict[str, Any]:
        data = _jsonable(asdict(self))
        if not self.held_outside:  # only when set: a broker from before the field refuses unknown keys
            data.pop("held_outside")
        return data


def _jsonable(value: Any) -> Any:
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value
