"""Celery tasks for agents: thin, safe to run twice at once (the service uses compare-and-set)."""
from __future__ import annotations

from celery import shared_task

from broker.agents.services import nodes_mark_lost
from broker.ops.services import periodic_run_record


@shared_task(name="agents.mark_lost", ignore_result=True)
def mark_lost_nodes() -> int:
    """Periodic: nodes silent past WHALEZEN_NODE_LOST_AFTER_SECONDS become LOST; their jobs requeue."""
    lost = len(nodes_mark_lost())
    periodic_run_record(name="agents.mark_lost")  # /healthz: the lost-node sweep is alive
    return lost
