"""Request bodies of the agent protocol (docs/agent.md), built from backend dataclasses."""
from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from agent import AGENT_VERSION
from agent.jobs import RunningJob
from agent.model import GpuReading, NodeInventory


def registration_payload(
    *, inventory: NodeInventory, join_token: str, name: str, agent_key: str, labels: Mapping[str, str],
    job_isolation: str = "separate-user", metrics_url: str | None = None, address: str | None = None,
    container_runtimes: Sequence[str] = (),
) -> dict[str, Any]:
    topology_by_index = {t.index: t for t in inventory.topology}
    gpus = []
    for gpu in inventory.gpus:
        topo = topology_by_index.get(gpu.index)
        gpus.append(
            {
                "index": gpu.index,
                "uuid": gpu.uuid,
                "model": gpu.name,
                "memory_mb": gpu.memory_total_mb,
                "pci_bus_id": gpu.pci_bus_id,
                "numa_node": topo.numa_node if topo else None,
                "cpu_affinity": topo.cpu_affinity if topo else None,
                "nvlink_island": topo.nvlink_island if topo else None,
                "nvlink_peers": list(topo.nvlink_peers) if topo else [],
                "mig_mode": gpu.mig_mode.value,
                "power_limit_w": gpu.power_limit_w,
            }
        )
    inventory_json = inventory.to_json()
    extra = {"metrics_url": metrics_url} if metrics_url else {}
    if address:  # --advertise-address; without it the broker takes the address the request came from
        extra["address"] = address
    return {**extra,
        "join_token": join_token,
        "name": name,
        "hostname": inventory.hostname,
        "agent_key": agent_key,
        "agent_version": AGENT_VERSION,
        "cpu_milli": inventory.cpu_count * 1000,
        "memory_mb": inventory.memory_mb,
        "labels": dict(labels),
        # "shared-user": jobs run as the agent's own user and could read its secrets (isolation.py).
        "job_isolation": job_isolation,
        # podman | docker | apptainer | singularity (agent/runtimes.py): image jobs go only where one is.
        # Always sent, [] too: a runtime removed since the last registration must be forgotten.
        "container_runtimes": list(container_runtimes),
        "driver_version": inventory.driver_version,
        "cuda_driver_version": inventory.cuda_driver_version,
        "backend": inventory.backend,
        "gpus": gpus,
        "topology": {
            "pcie_common_ancestor": inventory_json["pcie_common_ancestor"],
            "p2p_nvlink": inventory_json["p2p_nvlink"],
            "p2p_read": inventory_json["p2p_read"],
            "gpus": inventory_json["topology"],
        },
    }


def heartbeat_payload(
    *,
    readings: tuple[GpuReading, ...],
    sampled_at: float | None,
    running: Mapping[str, RunningJob],
    max_epoch: int,
    missed_heartbeats: int,
    last_error: str | None,
    interruption: dict[str, Any] | None = None,
    metrics_url: str | None = None,
) -> dict[str, Any]:
    payload: dict[str, Any] = {
        "agent_version": AGENT_VERSION,
        "sent_at": time.time(),
        "sampled_at": sampled_at,
        "max_epoch_seen": max_epoch,
        "missed_heartbeats": missed_heartbeats,
        "last_error": last_error,
        "telemetry": [r.to_json() for r in readings],
        "processes": [
            {
                "assignment_id": job.assignment.id,
                "job_id": job.assignment.job_id,
                "epoch": job.assignment.epoch,
                "pid": job.pid,
                "gpu_indices": list(job.assignment.gpu_indices),
                "state": "stopping" if job.stop_reason else "running",
            }
            for job in running.values()
        ],
    }
    if interruption is not None:  # only then: a broker that predates the field must not see it
        payload["interruption"] = interruption
    if metrics_url:
        payload["metrics_url"] = metrics_url
    return payload
