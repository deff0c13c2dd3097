"""What the service's own health check reads: when each periodic sweep last ran.

In the database on purpose: the sweeps run in the worker, /healthz in the web process, and the
default cache is per-process memory, so only the database is shared by all of them.
"""
from __future__ import annotations

from django.db import models


class PeriodicRun(models.Model):
    """One row per periodic task (`scheduler.sweep`, `agents.mark_lost`), updated at each run.

    The lost-node sweep also keeps here when the broker last came back after being down (a gap
    between runs, or the web server not answering): broker.scheduler.outage reads it under a row
    lock so that a node's silence is never blamed for the broker's own.
    """

    name = models.CharField(max_length=100, unique=True, help_text="The Celery task name")
    last_run_at = models.DateTimeField()
    # The end of the latest outage seen (a gap between runs, or the web server not answering).
    resumed_at = models.DateTimeField(null=True, blank=True)
    outage_seconds = models.FloatField(default=0, help_text="Length of the latest outage seen")

    def __str__(self) -> str:
        return f"{self.name} @ {self.last_run_at:%Y-%m-%d %H:%M:%S}"
