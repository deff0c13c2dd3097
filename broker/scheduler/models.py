"""Bookkeeping of scheduling cycles: a lease so one cycle runs per tenant at a time, and a cycle log."""
from __future__ import annotations

from django.db import models

from broker.tenancy.models import Tenant


class CycleLease(models.Model):
    """Held by the worker running a tenant's cycle; expires so a killed worker cannot block scheduling."""

    tenant = models.OneToOneField(Tenant, on_delete=models.CASCADE, related_name="cycle_lease")
    holder = models.CharField(max_length=64, blank=True)
    expires_at = models.DateTimeField(null=True, blank=True)
    cycles = models.PositiveBigIntegerField(default=0)
    # The inputs of the last full cycle that found nothing to do (broker/scheduler/digest.py), and when it
    # ran: a cycle with the same inputs within WHALEZEN_CYCLE_REFRESH_SECONDS does not decide again.
    inputs_digest = models.CharField(max_length=64, blank=True)
    decided_at = models.DateTimeField(null=True, blank=True)


class CycleRecord(models.Model):
    """What one cycle saw and decided, for operators and for the explain-why views."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="cycles")
    started_at = models.DateTimeField(auto_now_add=True)
    pending_jobs = models.PositiveIntegerField(default=0)
    placed_jobs = models.PositiveIntegerField(default=0)
    preempted_jobs = models.PositiveIntegerField(default=0)
    conflicts = models.PositiveIntegerField(default=0)
    method = models.CharField(max_length=16, blank=True)
    proven_optimal = models.BooleanField(default=False)
    solve_seconds = models.FloatField(default=0)
    objective = models.FloatField(null=True, blank=True)
    note = models.TextField(blank=True)
    # Seconds per phase of the whole cycle: snapshot, solve, commit, reasons (scheduling_cycle_run).
    phases = models.JSONField(default=dict, blank=True)

    class Meta:
        ordering = ["-started_at"]
        indexes = [models.Index(fields=["tenant", "started_at"])]

