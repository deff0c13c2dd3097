"""Job states and the transitions between them. Anything not listed here is refused."""
from __future__ import annotations

from django.db import models


class JobState(models.TextChoices):
    PENDING = "PENDING", "Pending"
    PLACED = "PLACED", "Placed"
    PROVISIONING = "PROVISIONING", "Provisioning"
    STARTING = "STARTING", "Starting"
    RUNNING = "RUNNING", "Running"
    CHECKPOINTING = "CHECKPOINTING", "Checkpointing"
    MIGRATING = "MIGRATING", "Migrating"
    SUCCEEDED = "SUCCEEDED", "Succeeded"
    FAILED = "FAILED", "Failed"
    CANCELLED = "CANCELLED", "Cancelled"
    PREEMPTED = "PREEMPTED", "Preempted"


S = JobState
TERMINAL_STATES: frozenset[str] = frozenset({S.SUCCEEDED, S.FAILED, S.CANCELLED})

# Why each edge exists:
#  PLACED/PROVISIONING/STARTING -> PENDING: the placement fell through (cloud capacity, node lost) and the
#    job goes back to the queue. RUNNING -> PENDING: its node was lost; it restarts from its last checkpoint.
#  RUNNING -> CHECKPOINTING -> MIGRATING -> PLACED: a move (defragmentation, cheaper capacity, spot notice).
#  CHECKPOINTING -> RUNNING: a checkpoint was taken in place (periodic, or a move that was called off).
#  MIGRATING -> SUCCEEDED: the job finished while its source was being stopped for a move.
#  PREEMPTED -> PENDING: a preempted job is re-queued once its GPUs were handed over.
LEGAL_TRANSITIONS: dict[str, frozenset[str]] = {
    S.PENDING: frozenset({S.PLACED, S.CANCELLED, S.FAILED}),
    S.PLACED: frozenset({S.PROVISIONING, S.STARTING, S.PENDING, S.CANCELLED, S.FAILED}),
    S.PROVISIONING: frozenset({S.STARTING, S.PENDING, S.CANCELLED, S.FAILED}),
    S.STARTING: frozenset({S.RUNNING, S.PENDING, S.SUCCEEDED, S.FAILED, S.CANCELLED}),
    S.RUNNING: frozenset({S.CHECKPOINTING, S.PREEMPTED, S.PENDING, S.SUCCEEDED, S.FAILED, S.CANCELLED}),
    S.CHECKPOINTING: frozenset({S.RUNNING, S.MIGRATING, S.PREEMPTED, S.SUCCEEDED, S.FAILED, S.CANCELLED}),
    S.MIGRATING: frozenset({S.PLACED, S.PENDING, S.SUCCEEDED, S.FAILED, S.CANCELLED}),
    S.PREEMPTED: frozenset({S.PENDING, S.CANCELLED, S.FAILED}),
    S.SUCCEEDED: frozenset(),
    S.FAILED: frozenset(),
    S.CANCELLED: frozenset(),
}

# States in which a job holds (or is about to hold) GPUs.
ACTIVE_STATES: frozenset[str] = frozenset(
    {S.PLACED, S.PROVISIONING, S.STARTING, S.RUNNING, S.CHECKPOINTING, S.MIGRATING}
)


def is_legal(old: str, new: str) -> bool:
    return new in LEGAL_TRANSITIONS.get(old, frozenset())
