"""Celery tasks for agents: thin, safe to run twice at once (the service uses compare-and-set)."""
from __future__ import annotations

from celery import shared_task

from broker.agents.services import nodes_mark_lost


@shared_task(name="agents.mark_lost", ignore_result=True)
def mark_lost_nodes() -> int:
    """Periodic: nodes silent past WHALEZEN_NODE_LOST_AFTER_SECONDS become LOST; their jobs requeue."""
    # The sweep records its own run (ops.PeriodicRun, read by /healthz) before it judges any node.
    return len(nodes_mark_lost())


@shared_task(name="agents.prometheus_telemetry", ignore_result=True)
def prometheus_telemetry() -> int:
    """Periodic, when WHALEZEN_PROMETHEUS_URL is set: agentless nodes' GPU readings from dcgm-exporter."""
    from broker.agents.prometheus_telemetry import prometheus_telemetry_pull

    return len(prometheus_telemetry_pull())
