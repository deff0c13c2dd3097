"""What the broker keeps about node agents beyond the inventory rows (Node, Gpu)."""
from __future__ import annotations

from django.db import models

from broker.inventory.models import Node
from broker.jobs.models import Allocation


class JobIsolation(models.TextChoices):
    """How the agent runs its jobs, as it says at registration."""

    SEPARATE_USER = "separate-user", "Jobs run as a separate unprivileged user"
    # Jobs run as the agent's own user and could read its secrets (node token, join token).
    SHARED_USER = "shared-user", "Jobs share the agent's user"


class NodeAgent(models.Model):
    """The agent of one node: how it identifies itself and what it said last."""

    node = models.OneToOneField(Node, on_delete=models.CASCADE, related_name="agent")
    # Random id the agent keeps in its state directory: a repeated registration with the same key
    # (its first answer was lost, or its token was revoked) reuses the node instead of adding one.
    agent_key = models.CharField(max_length=64, db_index=True)
    backend = models.CharField(max_length=200, blank=True, help_text='"nvml" or "fake:<spec>"')
    driver_version = models.CharField(max_length=64, blank=True)
    cuda_driver_version = models.CharField(max_length=16, blank=True)
    job_isolation = models.CharField(max_length=16, choices=JobIsolation.choices, blank=True,
                                     help_text="Empty: the agent did not say (an agent older than this field)")
    # Where the agent serves its GPUs' DCGM-named metrics (agent/metrics.py), as it said at registration;
    # listed for Prometheus by GET /metrics/targets. Empty: it serves none.
    metrics_url = models.CharField(max_length=300, blank=True)
    registered_at = models.DateTimeField()
    last_telemetry = models.JSONField(default=list, blank=True, help_text="Latest readings, all fields")
    processes = models.JSONField(default=list, blank=True, help_text="Job processes in the latest heartbeat")
    missed_heartbeats = models.PositiveIntegerField(default=0)
    last_error = models.TextField(blank=True)

    def __str__(self) -> str:
        return f"agent of {self.node}"


class AssignmentReport(models.Model):
    """The latest state the agent reported for one allocation (an assignment, in agent terms)."""

    allocation = models.OneToOneField(Allocation, on_delete=models.CASCADE, related_name="agent_report")
    state = models.CharField(max_length=24)
    reason = models.CharField(max_length=24, blank=True)
    exit_code = models.IntegerField(null=True, blank=True)
    message = models.TextField(blank=True)
    pid = models.PositiveIntegerField(null=True, blank=True)
    updated_at = models.DateTimeField(auto_now=True)

    def __str__(self) -> str:
        return f"allocation {self.allocation_id}: {self.state}"
