"""Celery tasks for checkpoints: ids only, safe to run twice (the services compare and set)."""
from __future__ import annotations

from celery import shared_task

from broker.jobs.checkpoints import checkpoint_verify, checkpoints_sweep
from broker.jobs.migration import migrations_sweep


@shared_task(name="checkpoints.verify", ignore_result=True)
def verify_checkpoint(checkpoint_id: int) -> None:
    checkpoint_verify(checkpoint_id=checkpoint_id)


@shared_task(name="checkpoints.sweep", ignore_result=True)
def sweep_checkpoints() -> None:
    """Periodic: checkpoints due by interval, requests timed out, verifications whose task was lost;
    moves whose source never confirmed its stop, or whose job ended."""
    checkpoints_sweep()
    migrations_sweep()


@shared_task(name="uploads.expire", ignore_result=True)
def expire_uploads() -> None:
    """Periodic: delete uploads no unfinished job names once they are WHALEZEN_UPLOAD_EXPIRY_DAYS old."""
    from broker.jobs.uploads import uploads_expire

    uploads_expire()
