"""GPU telemetry from a site's own Prometheus (dcgm-exporter's series), for nodes without our agent.

Sites that already run NVIDIA's dcgm-exporter and Prometheus can register their nodes without
running the WhaleZen agent's NVML readings and still have placement see each GPU's load and health:
every `WHALEZEN_PROMETHEUS_TELEMETRY_SECONDS` the broker asks `WHALEZEN_PROMETHEUS_URL`'s HTTP API
(`/api/v1/query`) for the latest dcgm-exporter series and maps them to our GPUs by their `UUID`
label. Only GPUs of nodes that no WhaleZen agent heartbeats for are updated: where our agent runs,
its own readings (every heartbeat) are the source, and two sources would overwrite each other.

Health from `DCGM_FI_DEV_XID_ERRORS` (the last Xid seen) only ever gets worse here, by the agent's
own table (agent/health.py): a fatal Xid marks the GPU FAILED, a degrading one DEGRADED. Clearing it
is an operator's call (or the node's own agent's), as a reset GPU reports no Xid either way.
"""
from __future__ import annotations

import logging
import urllib.error

from django.conf import settings
from django.utils import timezone

from agent.health import DEGRADING_XIDS, FATAL_XIDS
from agent.promql import instant_query
from broker.inventory.models import Gpu, GpuHealth

log = logging.getLogger(__name__)

# dcgm-exporter series -> our Gpu field
SERIES = {"DCGM_FI_DEV_GPU_UTIL": "utilization_pct", "DCGM_FI_DEV_FB_USED": "memory_used_mb",
          "DCGM_FI_DEV_GPU_TEMP": "temperature_c", "DCGM_FI_DEV_POWER_USAGE": "power_w",
          "DCGM_FI_DEV_XID_ERRORS": "xid"}
# What the columns can hold (a bad exporter must not make the update fail): field -> (low, high).
BOUNDS = {"utilization_pct": (0, 100), "memory_used_mb": (0, 2**31 - 1), "temperature_c": (-100, 300),
          "power_w": (0.0, 1e6)}
MAX_UUID = 64


def prometheus_url() -> str:
    return str(getattr(settings, "WHALEZEN_PROMETHEUS_URL", "") or "").rstrip("/")


def readings_by_uuid(base_url: str, *, timeout_s: float = 5.0) -> dict[str, dict[str, float]]:
    """UUID -> {our field: value} from the latest value of each dcgm-exporter series."""
    found: dict[str, dict[str, float]] = {}
    for series, field in SERIES.items():
        for row in instant_query(base_url, series, timeout_s):
            uuid = str((row.get("metric") or {}).get("UUID") or "")[:MAX_UUID]
            try:
                value = float(row["value"][1])
            except (KeyError, IndexError, TypeError, ValueError):
                continue
            if uuid and value == value:  # not NaN
                found.setdefault(uuid, {})[field] = value
    return found


def _health(current: str, xid: float | None) -> str:
    code = int(xid) if xid is not None else 0
    if code in FATAL_XIDS:
        return GpuHealth.FAILED
    if code in DEGRADING_XIDS and current == GpuHealth.HEALTHY:
        return GpuHealth.DEGRADED
    return current


def prometheus_telemetry_pull(*, base_url: str | None = None) -> list[int]:
    """Update the GPUs of agentless nodes from Prometheus; the ids updated ([] when it is off or down)."""
    base_url = base_url if base_url is not None else prometheus_url()
    if not base_url:
        return []
    try:
        readings = readings_by_uuid(base_url)
    except (OSError, ValueError, urllib.error.URLError) as err:  # down or not Prometheus: next run tries again
        log.warning("GPU telemetry from Prometheus at %s: %s", base_url, err)
        return []
    now = timezone.now()
    gpus = list(Gpu.objects.filter(uuid__in=list(readings), node__last_heartbeat_at__isnull=True))
    for gpu in gpus:
        values = readings[gpu.uuid]
        for field, (low, high) in BOUNDS.items():
            if field in values:
                setattr(gpu, field, min(high, max(low, values[field] if field == "power_w" else round(values[field]))))
        gpu.health = _health(gpu.health, values.get("xid"))
        gpu.last_seen_at = now
    Gpu.objects.bulk_update(gpus, ["utilization_pct", "memory_used_mb", "temperature_c", "power_w", "health",
                                   "last_seen_at"])
    return [gpu.pk for gpu in gpus]
