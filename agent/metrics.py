"""The node's GPU readings for Prometheus, under the names NVIDIA's DCGM exporter uses.

Dashboards and alerts written for dcgm-exporter (Grafana's NVIDIA DCGM dashboard, for one) work
unchanged on a WhaleZen node: the same metric names, units and labels (`gpu`, `UUID`, `device`,
`modelName`, `pci_bus_id`, `Hostname`, and `hostname` for setups that relabel on it). The values
are the agent's own latest sample (the one its heartbeat sends), so a scrape never touches NVML.
`--metrics-listen HOST:PORT` (default 127.0.0.1:0, any free port on loopback; `off` disables it)
says where; the agent reports the address at registration so the broker can list it for
Prometheus service discovery.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from agent.model import GpuInfo, GpuReading

LABELS = ["gpu", "UUID", "device", "modelName", "pci_bus_id", "Hostname", "hostname"]


@dataclass(frozen=True)
class Field:
    name: str
    help: str
    value: Callable[[GpuReading], float | None]


def _fb_free(reading: GpuReading) -> float | None:
    if reading.memory_total_mb is None or reading.memory_used_mb is None:
        return None
    return max(0, reading.memory_total_mb - reading.memory_used_mb)


# dcgm-exporter's default counters (etc/default-counters.csv): name, its help text, our reading.
FIELDS = (
    Field("DCGM_FI_DEV_GPU_UTIL", "GPU utilization (in %).", lambda r: r.utilization_pct),
    Field("DCGM_FI_DEV_MEM_COPY_UTIL", "Memory utilization (in %).", lambda r: r.memory_utilization_pct),
    Field("DCGM_FI_DEV_FB_USED", "Framebuffer memory used (in MiB).", lambda r: r.memory_used_mb),
    Field("DCGM_FI_DEV_FB_FREE", "Framebuffer memory free (in MiB).", _fb_free),
    Field("DCGM_FI_DEV_GPU_TEMP", "GPU temperature (in C).", lambda r: r.temperature_c),
    Field("DCGM_FI_DEV_POWER_USAGE", "Power draw (in W).", lambda r: r.power_w),
    Field("DCGM_FI_DEV_XID_ERRORS", "Value of the last XID error encountered.",
          lambda r: r.xid_errors[-1] if r.xid_errors else 0),
    Field("DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", "Total number of single-bit volatile ECC errors.",
          lambda r: r.ecc_corrected),
    Field("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "Total number of double-bit volatile ECC errors.",
          lambda r: r.ecc_uncorrected),
)


class GpuCollector(Collector):
    """Yields one gauge family per DCGM field from the latest readings handed to `update()`."""

    def __init__(self, hostname: str, gpus: tuple[GpuInfo, ...]):
        self.hostname = hostname
        self.gpus = {gpu.index: gpu for gpu in gpus}
        self._readings: tuple[GpuReading, ...] = ()

    def update(self, readings: tuple[GpuReading, ...]) -> None:
        self._readings = readings  # one reference swap: a scrape sees the old sample or the new one

    def collect(self) -> Iterator[GaugeMetricFamily]:
        readings = self._readings
        for field in FIELDS:
            family = GaugeMetricFamily(field.name, field.help, labels=LABELS)
            for reading in readings:
                value = field.value(reading)
                if value is not None and not reading.lost:
                    family.add_metric(self._labels(reading), float(value))
            yield family

    def _labels(self, reading: GpuReading) -> list[str]:
        info = self.gpus.get(reading.index)
        return [str(reading.index), reading.uuid or (info.uuid if info else "") or "", f"nvidia{reading.index}",
                (info.name if info else "") or "", (info.pci_bus_id if info else "") or "", self.hostname,
                self.hostname]


class MetricsServer:
    """The exporter's HTTP server on its own thread (prometheus_client's), stopped with the agent."""

    def __init__(self, collector: GpuCollector, host: str, port: int):
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(collector)
        self._server, self._thread = start_http_server(port, addr=host, registry=self.registry)
        self.host, self.port = host, self._server.server_address[1]

    def url(self, advertised_host: str) -> str:
        """The scrape URL for Prometheus: the listen address, or `advertised_host` when it listens on
        every address (0.0.0.0 / ::)."""
        host = advertised_host if self.host in ("0.0.0.0", "::") else self.host
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{self.port}/metrics"

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


__all__ = ["FIELDS", "GpuCollector", "MetricsServer"]
