"""GPU readings for a Kubernetes cluster's nodes from the site's own Prometheus (dcgm-exporter's series).

The device plugin, not the broker, picks which of a node's GPUs a Pod gets, so the broker's GPUs of such a node
are a count (indices 0..N-1 with no UUID). The exporter's series of a node (its `Hostname` label, which
dcgm-exporter sets to the node's name in Kubernetes) are matched to them by position, in the exporter's `gpu`
order: per GPU the numbers are not the same physical GPU's, but what placement uses of them is right: how many
of the node's GPUs are healthy (a fatal Xid takes one out), how loaded the node is.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from agent.health import DEGRADING_XIDS, FATAL_XIDS
from agent.model import Health
from agent.promql import instant_query

log = logging.getLogger(__name__)

SERIES = {"DCGM_FI_DEV_GPU_UTIL": "utilization_pct", "DCGM_FI_DEV_FB_USED": "memory_used_mb",
          "DCGM_FI_DEV_GPU_TEMP": "temperature_c", "DCGM_FI_DEV_POWER_USAGE": "power_w",
          "DCGM_FI_DEV_XID_ERRORS": "xid"}
BOUNDS = {"utilization_pct": (0, 100), "memory_used_mb": (0, 2**31 - 1), "temperature_c": (-100, 300),
          "power_w": (0, 100_000), "xid": (0, 2**31 - 1)}
HOST_LABELS = ("Hostname", "hostname", "kubernetes_node", "node")


@dataclass(frozen=True)
class DcgmReading:
    utilization_pct: int | None = None
    memory_used_mb: int | None = None
    temperature_c: int | None = None
    power_w: float | None = None
    xid: int = 0

    @property
    def health(self) -> tuple[Health, tuple[str, ...]]:
        if self.xid in FATAL_XIDS:
            return Health.FAILED, (f"Xid {self.xid}: {FATAL_XIDS[self.xid]} (dcgm-exporter)",)
        if self.xid in DEGRADING_XIDS:
            return Health.DEGRADED, (f"Xid {self.xid}: {DEGRADING_XIDS[self.xid]} (dcgm-exporter)",)
        return Health.HEALTHY, ()


def dcgm_by_node(base_url: str, *, timeout_s: float = 5.0) -> dict[str, tuple[DcgmReading, ...]]:
    """Node name -> its GPUs' latest readings, in the exporter's GPU order. Raises OSError / ValueError."""
    values: dict[tuple[str, int], dict[str, float]] = {}
    for series, field in SERIES.items():
        for row in instant_query(base_url, series, timeout_s):
            metric = row.get("metric") or {}
            host = next((str(metric[k]) for k in HOST_LABELS if metric.get(k)), "")
            try:
                gpu, value = int(metric.get("gpu", "")), float(row["value"][1])
            except (KeyError, IndexError, TypeError, ValueError):
                continue
            if host and value == value:  # not NaN
                low, high = BOUNDS[field]
                values.setdefault((host[:253], gpu), {})[field] = min(high, max(low, value))
    nodes: dict[str, list[tuple[int, DcgmReading]]] = {}
    for (host, gpu), fields in values.items():
        reading = DcgmReading(**{k: (v if k == "power_w" else int(round(v))) for k, v in fields.items()})
        nodes.setdefault(host, []).append((gpu, reading))
    return {host: tuple(r for _, r in sorted(rows, key=lambda pair: pair[0])) for host, rows in nodes.items()}
