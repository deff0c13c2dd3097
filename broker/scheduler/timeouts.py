"""Every step of a job's start has a time limit, so nothing waits forever on a node that never answers.

- PLACED or STARTING for longer than `WHALEZEN_START_TIMEOUT_SECONDS`: the node's agent never picked the
  job up (or never said it started it); the job goes back to the queue.
- A cloud instance whose agent has not registered `WHALEZEN_BOOT_TIMEOUT_SECONDS` after it was requested:
  it is terminated (never marked gone before the provider confirms) and its waiting jobs are re-queued.
"""
from __future__ import annotations

import logging
from datetime import timedelta

from django.conf import settings
from django.utils import timezone

from broker.inventory.models import CloudInstance, InstanceState
from broker.jobs.models import Job
from broker.jobs.services import job_requeue
from broker.jobs.states import JobState
from providers.base import ProviderError

log = logging.getLogger(__name__)


def stalled_starts_requeue() -> list[int]:
    cutoff = timezone.now() - timedelta(seconds=settings.WHALEZEN_START_TIMEOUT_SECONDS)
    requeued = []
    for job in Job.objects.filter(state__in=[JobState.PLACED, JobState.STARTING], updated_at__lt=cutoff):
        # The node may have started it without managing to say so: its next start waits until that
        # is ruled out (broker.agents.fencing), like a job requeued from a LOST node.
        if job_requeue(job=job, reason_code="START_TIMEOUT", stop_unconfirmed=True,
                       message=f"The node did not start the job within {settings.WHALEZEN_START_TIMEOUT_SECONDS} s; "
                               "placing it again."):
            requeued.append(job.pk)
    return requeued


def stalled_boots_retire() -> list[int]:
    from broker.provisioning.services import instance_terminate

    cutoff = timezone.now() - timedelta(seconds=settings.WHALEZEN_BOOT_TIMEOUT_SECONDS)
    retired = []
    for instance in CloudInstance.objects.filter(
            state__in=[InstanceState.PENDING, InstanceState.RUNNING], node__isnull=True, created_at__lt=cutoff
    ).select_related("pool"):
        message = (f"Instance {instance.node_name} did not register within "
                   f"{settings.WHALEZEN_BOOT_TIMEOUT_SECONDS} s of its launch; trying again.")
        for job in Job.objects.filter(pk__in=[p["job_id"] for p in instance.placements], state=JobState.PROVISIONING):
            job_requeue(job=job, reason_code="BOOT_TIMEOUT", message=message)
        try:
            instance_terminate(instance=instance, reason="boot timeout")
        except ProviderError as exc:
            log.warning("terminating %s after its boot timeout failed (retried next sweep): %s", instance, exc)
        retired.append(instance.pk)
    return retired
