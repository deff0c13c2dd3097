"""Spot interruptions: the cloud said it takes a node's instance back; move its jobs off in time.

The agent polls the instance metadata service (agent/spot.py) and sends the notice in its heartbeats.
The first one drains the node (nothing new is placed there) and, for each job on it:
- a running job with a checkpoint URI is moved (broker.jobs.migration, cause SPOT): asked for a
  checkpoint now; when it is committed, the job is requeued and resumes elsewhere from it, so it
  loses at most the work since the notice; without one by shortly before the deadline, it is
  requeued anyway and resumes from its last committed checkpoint;
- any other job is requeued at once: placed elsewhere before the instance dies (one without
  checkpoints restarts from the beginning, and its event says so).
If the instance dies first, the node goes LOST and its jobs restart from their last committed
checkpoint, as for any lost node. Requeued jobs' old copies are fenced: the new start waits until the
agent confirms the old process stopped (broker.agents.fencing).
"""
from __future__ import annotations

import logging
from datetime import datetime, timedelta, timezone as dt_timezone
from typing import Any

from django.db import transaction
from django.utils import timezone

from broker.inventory.models import Node, NodeState
from broker.jobs.models import Job
from broker.jobs.services import IllegalTransition, JobError, StaleState, event_append, job_requeue
from broker.jobs.states import JobState

log = logging.getLogger(__name__)

# Seconds before the cloud's deadline by which the checkpoint must be committed: the job is then
# stopped and requeued while the instance still runs (AWS gives 120 s, GCP about 30 s).
SPOT_STOP_MARGIN_S = 15.0


def _when(deadline: float) -> str:
    return datetime.fromtimestamp(deadline, tz=dt_timezone.utc).strftime("%H:%M:%S UTC")


def node_interruption_notice(*, node: Node, notice: dict[str, Any]) -> list[int]:
    """Record the notice once, drain the node, and start moving its jobs. Returns the jobs acted on."""
    from broker.jobs.migration import migration_request
    from broker.jobs.models import MigrationCause

    now = timezone.now()
    with transaction.atomic():
        locked = Node.objects.select_for_update().get(pk=node.pk)
        if locked.interruption:
            return []  # every heartbeat repeats the notice; the first one acted
        locked.interruption = {**notice, "received_at": now.timestamp()}
        if locked.state == NodeState.ONLINE:
            locked.state = NodeState.DRAINING
        locked.save(update_fields=["interruption", "state"])
    left = max(0.0, float(notice["deadline"]) - now.timestamp())
    log.warning("node %s: %s spot notice, %s at %s (in %.0f s)", node.name, notice["source"], notice["action"],
                _when(notice["deadline"]), left)
    acted = []
    jobs = Job.objects.filter(allocations__node=node, allocations__active=True).distinct()
    for job in jobs:
        event_append(job=job, kind="node", reason_code="SPOT_NOTICE",
                     message=f"{node.name}: the cloud takes this spot instance back at {_when(notice['deadline'])} "
                             f"(in {left:.0f} s, {notice['action']}).",
                     data={"node": node.name, **notice})
        has_checkpoints = bool(job.checkpoint_uri)
        try:
            if has_checkpoints and job.state in (JobState.RUNNING, JobState.CHECKPOINTING):
                # The checkpoint must be committed before the instance dies; a margin for the stop.
                deadline = now + timedelta(seconds=max(5.0, left - SPOT_STOP_MARGIN_S))
                migration_request(job=job, cause=MigrationCause.SPOT, deadline=deadline,
                                  message=f"Checkpoint now: {node.name} is reclaimed in {left:.0f} s.")
            else:
                how = ("restarts from the beginning (it has no checkpoints)" if job.state in
                       (JobState.RUNNING, JobState.CHECKPOINTING) else "is placed elsewhere")
                job_requeue(job=job, reason_code="SPOT_INTERRUPTION", stop_unconfirmed=True,
                            message=f"{node.name} is reclaimed in {left:.0f} s; the job {how}.")
            acted.append(job.pk)
        except (IllegalTransition, StaleState, JobError):
            continue  # the job moved on meanwhile (finished, cancelled): nothing to save
    return acted
