"""GPU backend over NVML through `pynvml` (package nvidia-ml-py).

Every NVML call goes through `_call`, which turns "this GPU/driver cannot tell" errors
(NotSupported, NoPermission, FunctionNotFound, ...) into None, so one missing counter never hides
the rest. Only GPU_IS_LOST / RESET_REQUIRED escape as `_GpuLost`, because they mean the GPU itself
is gone and its reading must say so.

The NVML module is injected: `pynvml` in production, `agent.backends.fake_nvml.FakeNvml` for
simulated nodes and tests, so the simulated nodes exercise this same code.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

from agent import host
from agent.backends.base import GpuBackend, GpuBackendUnavailable
from agent.health import classify
from agent.model import GpuInfo, GpuReading, GpuTopology, MigMode, NodeInventory, NvLinkInfo
from agent.topology import (
    NVLINK_DEVICE_TYPE_NAMES,
    P2P_STATUS_NAMES,
    TOPOLOGY_LEVEL_NAMES,
    cpu_list,
    normalize_pci_bus_id,
    nvlink_islands,
)

log = logging.getLogger(__name__)

MIB = 1024 * 1024
# Literal values on purpose: in nvidia-ml-py 13.x `NVML_P2P_CAPS_INDEX_READ = 0,` is a tuple (a
# trailing comma), which ctypes would reject.
P2P_CAPS_INDEX_READ = 0
P2P_CAPS_INDEX_NVLINK = 2
NVML_TEMPERATURE_GPU = 0
NVML_MEMORY_ERROR_TYPE_CORRECTED = 0
NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
NVML_VOLATILE_ECC = 0
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_RESET_REQUIRED = 16
NVML_EVENT_TYPE_XID_CRITICAL_ERROR = 0x8
MAX_XIDS_KEPT = 16
MAX_EVENTS_PER_SAMPLE = 64


class _GpuLost(Exception):
    pass


def explain_init_error(err: Exception) -> str:
    """One line an operator can act on, for each way nvmlInit fails."""
    name = type(err).__name__
    if name == "NVMLError_LibraryNotFound":
        return (
            "NVIDIA driver not found: NVML (libnvidia-ml.so.1) could not be loaded. Install the NVIDIA "
            "driver on this node, or run with --fake-gpus SPEC to simulate GPUs."
        )
    if name == "NVMLError_DriverNotLoaded":
        return "NVIDIA driver is installed but not loaded (nvmlInit: Driver Not Loaded); check `nvidia-smi`."
    if name == "NVMLError_NoPermission":
        return "No permission to open the NVIDIA driver (nvmlInit: Insufficient Permissions)."
    if name == "NVMLError_LibRmVersionMismatch":
        return "NVML library and kernel driver versions differ; reboot or reload the NVIDIA driver."
    return f"NVML could not start: {err} ({name})."


class NvmlBackend(GpuBackend):
    name = "nvml"

    def __init__(self, nvml: Any | None = None, *, backend_label: str = "nvml") -> None:
        if nvml is None:
            import pynvml  # imported late so `--fake-gpus` never needs the real library to load

            nvml = pynvml
        self._nvml = nvml
        self._label = backend_label
        self._handles: list[Any | None] = []
        self._event_sets: dict[int, Any] = {}
        self._xids: dict[int, list[int]] = {}
        self._inventory: NodeInventory | None = None
        self._started = False

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        if self._started:
            return
        nvml = self._nvml
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as err:
            raise GpuBackendUnavailable(explain_init_error(err)) from None
        except OSError as err:  # a broken libnvidia-ml that the loader finds but cannot map
            raise GpuBackendUnavailable(f"NVML could not be loaded: {err}") from None
        self._started = True
        try:
            count = nvml.nvmlDeviceGetCount()
        except nvml.NVMLError as err:
            self.close()
            raise GpuBackendUnavailable(f"NVML cannot count GPUs: {err}") from None
        self._handles = []
        for index in range(count):
            try:
                self._handles.append(nvml.nvmlDeviceGetHandleByIndex(index))
            except nvml.NVMLError as err:
                # Keep the slot: a GPU that is there but broken must still be reported, as FAILED.
                log.warning("GPU %d: no NVML handle (%s)", index, err)
                self._handles.append(None)
            self._xids[index] = []
        self._register_xid_events()

    def close(self) -> None:
        if not self._started:
            return
        for event_set in self._event_sets.values():
            self._call(self._nvml.nvmlEventSetFree, event_set, lost_ok=True)
        self._event_sets.clear()
        self._call(self._nvml.nvmlShutdown, lost_ok=True)
        self._started = False

    # -- guarded calls -----------------------------------------------------------------------
    def _call(self, fn: Callable[..., Any], *args: Any, lost_ok: bool = False) -> Any:
        try:
            return fn(*args)
        except self._nvml.NVMLError as err:
            if getattr(err, "value", None) in (NVML_ERROR_GPU_IS_LOST, NVML_ERROR_RESET_REQUIRED) and not lost_ok:
                raise _GpuLost(str(err)) from None
            return None

    # -- inventory ---------------------------------------------------------------------------
    def inventory(self) -> NodeInventory:
        if self._inventory is None:
            self.start()
            self._inventory = self._read_inventory()
        return self._inventory

    def _host_facts(self) -> tuple[str, int, int | None]:
        return host.hostname(), host.cpu_count(), host.memory_mb()

    def _cpu_words(self) -> int:
        """Width of the CPU affinity bitmask NVML fills, in 64-bit words."""
        return max(1, math.ceil(host.cpu_count_total() / 64))

    def _read_inventory(self) -> NodeInventory:
        nvml = self._nvml
        gpus = tuple(self._read_gpu_info(i, h) for i, h in enumerate(self._handles))
        bus_to_index = {g.pci_bus_id: g.index for g in gpus if g.pci_bus_id}
        numa_and_affinity = [self._read_numa(i, h, gpus[i].pci_bus_id) for i, h in enumerate(self._handles)]
        links = [self._read_nvlinks(h, bus_to_index) for h in self._handles]
        n = len(self._handles)
        ancestor: list[list[str | None]] = [[None] * n for _ in range(n)]
        p2p_nvlink: list[list[str | None]] = [[None] * n for _ in range(n)]
        p2p_read: list[list[str | None]] = [[None] * n for _ in range(n)]
        for i, hi in enumerate(self._handles):
            for j, hj in enumerate(self._handles):
                if i == j:
                    ancestor[i][j] = p2p_nvlink[i][j] = p2p_read[i][j] = "X"
                    continue
                if hi is None or hj is None:
                    continue
                try:
                    level = self._call(nvml.nvmlDeviceGetTopologyCommonAncestor, hi, hj)
                    nv = self._call(nvml.nvmlDeviceGetP2PStatus, hi, hj, P2P_CAPS_INDEX_NVLINK)
                    rd = self._call(nvml.nvmlDeviceGetP2PStatus, hi, hj, P2P_CAPS_INDEX_READ)
                except _GpuLost:
                    continue
                ancestor[i][j] = None if level is None else TOPOLOGY_LEVEL_NAMES.get(level, f"LEVEL_{level}")
                p2p_nvlink[i][j] = None if nv is None else P2P_STATUS_NAMES.get(nv, f"STATUS_{nv}")
                p2p_read[i][j] = None if rd is None else P2P_STATUS_NAMES.get(rd, f"STATUS_{rd}")
        peers = self._nvlink_peers(links, p2p_nvlink)
        islands = nvlink_islands(peers, list(range(n)))
        topology = tuple(
            GpuTopology(
                index=i,
                numa_node=numa_and_affinity[i][0],
                cpu_affinity=numa_and_affinity[i][1],
                nvlinks=links[i],
                nvlink_peers=tuple(sorted(peers[i])),
                nvlink_island=islands[i],
            )
            for i in range(n)
        )
        hostname, cpus, memory = self._host_facts()
        driver = self._call(nvml.nvmlSystemGetDriverVersion, lost_ok=True)
        cuda = self._call(nvml.nvmlSystemGetCudaDriverVersion, lost_ok=True)
        return NodeInventory(
            hostname=hostname,
            driver_version=driver,
            cuda_driver_version=None if cuda is None else f"{cuda // 1000}.{cuda % 1000 // 10}",
            cpu_count=cpus,
            memory_mb=memory,
            gpus=gpus,
            topology=topology,
            pcie_common_ancestor=tuple(tuple(row) for row in ancestor),
            p2p_nvlink=tuple(tuple(row) for row in p2p_nvlink),
            p2p_read=tuple(tuple(row) for row in p2p_read),
            backend=self._label,
        )

    def _read_gpu_info(self, index: int, handle: Any | None) -> GpuInfo:
        nvml = self._nvml
        unknown = GpuInfo(index, None, None, None, None, None, MigMode.UNSUPPORTED, None)
        if handle is None:
            return unknown
        try:
            name = self._call(nvml.nvmlDeviceGetName, handle)
            uuid = self._call(nvml.nvmlDeviceGetUUID, handle)
            memory = self._call(nvml.nvmlDeviceGetMemoryInfo, handle)
            pci = self._call(nvml.nvmlDeviceGetPciInfo, handle)
            limit_mw = self._call(nvml.nvmlDeviceGetEnforcedPowerLimit, handle)
            mig = self._call(nvml.nvmlDeviceGetMigMode, handle)
        except _GpuLost:
            return unknown
        mig_mode, mig_pending = _mig(mig)
        return GpuInfo(
            index=index,
            uuid=uuid,
            name=name,
            memory_total_mb=None if memory is None else int(memory.total // MIB),
            pci_bus_id=None if pci is None else normalize_pci_bus_id(pci.busId),
            power_limit_w=None if limit_mw is None else round(limit_mw / 1000.0, 1),
            mig_mode=mig_mode,
            mig_pending=mig_pending,
        )

    def _read_numa(self, index: int, handle: Any | None, pci_bus_id: str | None) -> tuple[int | None, str | None]:
        if handle is None:
            return host.sysfs_numa_node(pci_bus_id), None
        try:
            numa = self._call(self._nvml.nvmlDeviceGetNumaNodeId, handle)
            words = self._cpu_words()
            mask = self._call(self._nvml.nvmlDeviceGetCpuAffinity, handle, words)
        except _GpuLost:
            return host.sysfs_numa_node(pci_bus_id), None
        if numa is None or numa < 0:
            numa = host.sysfs_numa_node(pci_bus_id)
        return numa, None if mask is None else cpu_list(list(mask))

    def _read_nvlinks(self, handle: Any | None, bus_to_index: dict[str, int]) -> tuple[NvLinkInfo, ...]:
        if handle is None:
            return ()
        nvml = self._nvml
        links: list[NvLinkInfo] = []
        max_links = int(getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18))
        try:
            for link in range(max_links):
                state = self._call(nvml.nvmlDeviceGetNvLinkState, handle, link)
                if state is None:  # no such link, or no NVLink on this GPU at all
                    continue
                remote_bus = remote_type = None
                if state:
                    pci = self._call(nvml.nvmlDeviceGetNvLinkRemotePciInfo, handle, link)
                    remote_bus = None if pci is None else normalize_pci_bus_id(pci.busId)
                    rtype = self._call(nvml.nvmlDeviceGetNvLinkRemoteDeviceType, handle, link)
                    remote_type = None if rtype is None else NVLINK_DEVICE_TYPE_NAMES.get(rtype, "unknown")
                links.append(
                    NvLinkInfo(
                        link=link,
                        active=bool(state),
                        remote_pci_bus_id=remote_bus,
                        remote_device_type=remote_type,
                        remote_gpu_index=bus_to_index.get(remote_bus) if remote_bus else None,
                    )
                )
        except _GpuLost:
            pass
        return tuple(links)

    @staticmethod
    def _nvlink_peers(
        links: list[tuple[NvLinkInfo, ...]], p2p_nvlink: list[list[str | None]]
    ) -> dict[int, set[int]]:
        """Peers by three signals, because each misses a case on some systems:
        a link whose far end is another GPU (bridges, V100 cube mesh); two GPUs wired to the same
        NVSwitch (HGX boards: the far end of every link is a switch); P2P-over-NVLink status OK.
        """
        n = len(links)
        peers: dict[int, set[int]] = {i: set() for i in range(n)}
        switches: dict[str, set[int]] = {}
        for i, gpu_links in enumerate(links):
            for link in gpu_links:
                if not link.active:
                    continue
                if link.remote_gpu_index is not None and link.remote_gpu_index != i:
                    peers[i].add(link.remote_gpu_index)
                    peers[link.remote_gpu_index].add(i)
                elif link.remote_device_type == "switch" and link.remote_pci_bus_id:
                    switches.setdefault(link.remote_pci_bus_id, set()).add(i)
        for members in switches.values():
            for i in members:
                peers[i].update(members - {i})
        for i in range(n):
            for j in range(n):
                if i != j and p2p_nvlink[i][j] == "OK":
                    peers[i].add(j)
                    peers[j].add(i)
        return peers

    # -- telemetry ---------------------------------------------------------------------------
    def _register_xid_events(self) -> None:
        """One event set per GPU, so an event's GPU is known without comparing handle pointers."""
        nvml = self._nvml
        for index, handle in enumerate(self._handles):
            if handle is None:
                continue
            try:
                event_set = self._call(nvml.nvmlEventSetCreate)
                if event_set is None:
                    continue
                try:
                    nvml.nvmlDeviceRegisterEvents(handle, NVML_EVENT_TYPE_XID_CRITICAL_ERROR, event_set)
                except nvml.NVMLError as err:
                    # Unsupported on some vGPU / consumer setups: no Xids then, other readings go on.
                    log.info("GPU %d: Xid events unavailable (%s)", index, err)
                    self._call(nvml.nvmlEventSetFree, event_set, lost_ok=True)
                    continue
                self._event_sets[index] = event_set
            except _GpuLost:
                continue

    def _drain_xids(self) -> None:
        nvml = self._nvml
        for index, event_set in self._event_sets.items():
            for _ in range(MAX_EVENTS_PER_SAMPLE):
                try:
                    event = nvml.nvmlEventSetWait(event_set, 0)
                except nvml.NVMLError:  # NVML_ERROR_TIMEOUT: nothing pending (or any failure)
                    break
                if int(event.eventType) & NVML_EVENT_TYPE_XID_CRITICAL_ERROR:
                    kept = self._xids[index]
                    kept.append(int(event.eventData))
                    del kept[:-MAX_XIDS_KEPT]

    def sample(self) -> tuple[GpuReading, ...]:
        inventory = self.inventory()
        self._drain_xids()
        return tuple(self._sample_gpu(info, self._handles[info.index]) for info in inventory.gpus)

    def _sample_gpu(self, info: GpuInfo, handle: Any | None) -> GpuReading:
        nvml = self._nvml
        values: dict[str, Any] = {}
        lost = handle is None
        if not lost:
            try:
                values["util"] = self._call(nvml.nvmlDeviceGetUtilizationRates, handle)
                values["memory"] = self._call(nvml.nvmlDeviceGetMemoryInfo, handle)
                values["temperature"] = self._call(nvml.nvmlDeviceGetTemperature, handle, NVML_TEMPERATURE_GPU)
                values["power_mw"] = self._call(nvml.nvmlDeviceGetPowerUsage, handle)
                values["ecc_corrected"] = self._call(
                    nvml.nvmlDeviceGetTotalEccErrors, handle, NVML_MEMORY_ERROR_TYPE_CORRECTED, NVML_VOLATILE_ECC
                )
                values["ecc_uncorrected"] = self._call(
                    nvml.nvmlDeviceGetTotalEccErrors, handle, NVML_MEMORY_ERROR_TYPE_UNCORRECTED, NVML_VOLATILE_ECC
                )
                values["retired"] = self._retired_pages(handle)
                values["remapped"] = self._call(nvml.nvmlDeviceGetRemappedRows, handle)
                values["mig"] = self._call(nvml.nvmlDeviceGetMigMode, handle)
            except _GpuLost:
                lost = True
        util = values.get("util")
        memory = values.get("memory")
        remapped = values.get("remapped")
        power_mw = values.get("power_mw")
        mig_mode, _ = _mig(values.get("mig")) if "mig" in values else (info.mig_mode, None)
        xids = tuple(self._xids.get(info.index, ()))
        reading = dict(
            lost=lost,
            ecc_uncorrected=values.get("ecc_uncorrected"),
            retired_pages=values.get("retired"),
            remapped_rows_pending=None if remapped is None else bool(remapped[2]),
            remapped_rows_failed=None if remapped is None else bool(remapped[3]),
            xid_errors=xids,
            temperature_c=values.get("temperature"),
        )
        health, reasons = classify(**reading)
        return GpuReading(
            index=info.index,
            uuid=info.uuid,
            utilization_pct=None if util is None else int(util.gpu),
            memory_utilization_pct=None if util is None else int(util.memory),
            memory_used_mb=None if memory is None else int(memory.used // MIB),
            memory_total_mb=None if memory is None else int(memory.total // MIB),
            power_w=None if power_mw is None else round(power_mw / 1000.0, 1),
            power_limit_w=info.power_limit_w,
            ecc_corrected=values.get("ecc_corrected"),
            mig_mode=mig_mode,
            health=health,
            health_reasons=reasons,
            **reading,
        )

    def _retired_pages(self, handle: Any) -> int | None:
        nvml = self._nvml
        counts = [
            self._call(nvml.nvmlDeviceGetRetiredPages, handle, cause)
            for cause in (0, 1)  # multiple single-bit errors, double-bit error
        ]
        if all(c is None for c in counts):
            return None  # Ampere and newer remap rows instead of retiring pages
        return sum(len(c) for c in counts if c is not None)


def _mig(mig: Any) -> tuple[MigMode, bool | None]:
    if mig is None:
        return MigMode.UNSUPPORTED, None
    current, pending = mig[0], mig[1]
    return (MigMode.ENABLED if current else MigMode.DISABLED), bool(pending != current)
