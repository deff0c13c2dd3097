"""Checkpoints on the broker: a job's reported checkpoint is re-read and committed, or refused.

A job writes checkpoints with the helper in agent/checkpoint (files, then `manifest.json`, then a
notice in its work dir); its agent reports each one (`checkpoint_written`). The broker records it as
PENDING, then re-reads every file against the manifest (`checkpoint_verify`, a task carrying only the
id) and marks it COMMITTED or INVALID. Only a COMMITTED checkpoint is ever handed to a restart
(`restore_from` in the node's assignments); the newest two committed ones are kept and older ones are
deleted from storage.

A checkpoint request (`checkpoint_request`: the API, the periodic sweep) moves the job RUNNING ->
CHECKPOINTING; the agent delivers it to the process; the commit of a checkpoint written after the
request moves it back to RUNNING. A request that gets no committed checkpoint within
WHALEZEN_CHECKPOINT_TIMEOUT_SECONDS is given up: the job goes back to RUNNING where it was, and the
event says so.
"""
from __future__ import annotations

import hashlib
import logging
import os
import urllib.parse
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import IntegrityError, transaction
from django.utils import timezone

from broker.jobs.models import Allocation, Checkpoint, CheckpointState, Job, JobEvent
from broker.jobs.services import IllegalTransition, JobError, StaleState, event_append, job_transition
from broker.jobs.states import JobState

log = logging.getLogger(__name__)

KEEP_COMMITTED = 2
_VERIFY_SWEEP_AFTER = timedelta(seconds=60)  # a PENDING row older than this lost its verify task


def checkpoint_timeout_seconds() -> float:
    return float(getattr(settings, "WHALEZEN_CHECKPOINT_TIMEOUT_SECONDS", 300))


def checkpoint_interval_seconds(job: Job) -> float | None:
    """How often the broker asks this job for a checkpoint (its spec), or None when it never asks."""
    spec = (job.spec or {}).get("checkpoint") or {}
    if spec.get("interval_seconds"):
        return float(spec["interval_seconds"])
    if spec.get("interval_minutes"):
        return float(spec["interval_minutes"]) * 60
    return None


class CheckpointRefused(JobError):
    def __init__(self, message: str, *, field: str = "checkpoint"):
        super().__init__(message, field=field, code="invalid")


# -- where a job's checkpoints may be ---------------------------------------------------------------
def _local_path(uri: str) -> str | None:
    if uri.startswith("file://"):
        return os.path.normpath(urllib.parse.unquote(urllib.parse.urlsplit(uri).path))
    if uri.startswith("/"):
        return os.path.normpath(uri)
    return None


def checkpoint_dir_of(job: Job, reported_uri: str) -> str:
    """The reported checkpoint directory, if it is a `step-N` directory right under the job's own
    `checkpoint.uri`; anything else is refused, so a node cannot make the broker read (or later
    delete) a path the job's owner never named."""
    base = job.checkpoint_uri
    if not base:
        raise CheckpointRefused("This job has no checkpoint.uri in its spec.")
    if not reported_uri or "\x00" in reported_uri or ".." in reported_uri.split("/"):
        raise CheckpointRefused("Not a checkpoint directory URI.", field="checkpoint.uri")
    parent, _, name = reported_uri.rstrip("/").rpartition("/")
    if not name.startswith("step-") or not name[5:].isdigit() or not name[5:].isascii():
        raise CheckpointRefused("A checkpoint directory is named step-<number>.", field="checkpoint.uri")
    if base.startswith("s3://"):
        same = parent == base.rstrip("/")
    else:
        local_base, local_parent = _local_path(base), _local_path(parent)
        same = local_base is not None and local_parent == local_base
    if not same:
        raise CheckpointRefused("The checkpoint is not under this job's checkpoint.uri.", field="checkpoint.uri")
    return reported_uri.rstrip("/")


# -- reports from the agent -------------------------------------------------------------------------
def checkpoint_reported(*, allocation: Allocation, step: int, uri: str, manifest_sha256: str,
                        request_id: str | None) -> Checkpoint:
    """Record a checkpoint the job wrote, once (the same report twice is the same row), and have it
    verified. The job's state does not change until it is committed."""
    job = allocation.job
    directory = checkpoint_dir_of(job, uri)
    try:
        with transaction.atomic():
            checkpoint, created = Checkpoint.objects.get_or_create(
                job=job, uri=directory, manifest_sha256=manifest_sha256,
                defaults={"allocation": allocation, "step": step, "request_id": request_id or ""})
    except IntegrityError:  # the same report raced itself
        checkpoint, created = Checkpoint.objects.get(job=job, uri=directory, manifest_sha256=manifest_sha256), False
    if created:
        event_append(job=job, kind="checkpoint", reason_code="CHECKPOINT_WRITTEN",
                     message=f"Checkpoint at step {step} written; verifying it.",
                     data={"checkpoint": checkpoint.pk, "step": step, "uri": directory,
                           "request_id": request_id or None})
        transaction.on_commit(lambda: _enqueue_verify(checkpoint.pk))
    return checkpoint


def _enqueue_verify(checkpoint_id: int) -> None:
    from broker.jobs.tasks import verify_checkpoint

    verify_checkpoint.delay(checkpoint_id)


# -- verification and commit ------------------------------------------------------------------------
@dataclass(frozen=True)
class Verified:
    ok: bool
    problems: tuple[str, ...]
    manifest: dict[str, Any]
    size_bytes: int | None


def _s3_client() -> Any:
    import boto3

    return boto3.client("s3", endpoint_url=getattr(settings, "WHALEZEN_CHECKPOINT_S3_ENDPOINT_URL", None) or None)


def _storage_and_name(directory: str) -> tuple[Any, str]:
    from agent.checkpoint.storage import open_storage

    parent, _, name = directory.rpartition("/")
    client = _s3_client() if directory.startswith("s3://") else None
    return open_storage(parent, s3_client=client), name


def read_and_verify(directory: str, manifest_sha256: str) -> Verified:
    """Re-read the checkpoint: the manifest must be the one the agent reported (its sha256), and
    every file it lists must have its size and sha256."""
    from agent.checkpoint.checkpoints import verify_in
    from agent.checkpoint.manifest import MANIFEST_NAME

    try:
        storage, name = _storage_and_name(directory)
        raw = storage.read_bytes(f"{name}/{MANIFEST_NAME}")
    except FileNotFoundError:
        return Verified(False, (f"{MANIFEST_NAME} is missing",), {}, None)
    except Exception as exc:  # storage unreachable, no credentials: not the job's fault, say what
        return Verified(False, (f"cannot read the checkpoint: {type(exc).__name__}: {exc}"[:500],), {}, None)
    if hashlib.sha256(raw).hexdigest() != manifest_sha256:
        return Verified(False, (f"{MANIFEST_NAME} is not the one the job reported (sha256 differs)",), {}, None)
    result = verify_in(storage, name)
    manifest = result.manifest.to_json() if result.manifest is not None else {}
    size = sum(entry.size for entry in result.manifest.files) if result.manifest is not None else None
    return Verified(result.ok, tuple(result.problems), manifest, size)


def checkpoint_verify(*, checkpoint_id: int) -> Checkpoint | None:
    """Verify one PENDING checkpoint and commit it or mark it INVALID. Safe to run twice."""
    checkpoint = Checkpoint.objects.select_related("job").filter(pk=checkpoint_id).first()
    if checkpoint is None or checkpoint.state != CheckpointState.PENDING:
        return checkpoint
    verified = read_and_verify(checkpoint.uri, checkpoint.manifest_sha256)
    job = checkpoint.job
    with transaction.atomic():
        now = timezone.now()
        if verified.ok and _superseded(checkpoint):
            verified = Verified(ok=False, manifest={}, size_bytes=None, problems=(
                "written by a run the job has since left (it was moved or restarted before this checkpoint "
                "was verified): its new run resumes from an earlier committed checkpoint and writes these "
                "steps again",))
        if verified.ok:
            changed = Checkpoint.objects.filter(pk=checkpoint.pk, state=CheckpointState.PENDING).update(
                state=CheckpointState.COMMITTED, committed_at=now, manifest=verified.manifest,
                size_bytes=verified.size_bytes)
            if changed:
                event_append(job=job, kind="checkpoint", reason_code="CHECKPOINT_COMMITTED",
                             message=f"Checkpoint at step {checkpoint.step} verified and committed "
                                     f"({_size(verified.size_bytes)}).",
                             data={"checkpoint": checkpoint.pk, "step": checkpoint.step,
                                   "size_bytes": verified.size_bytes})
        else:
            problem = "; ".join(verified.problems)[:2000]
            changed = Checkpoint.objects.filter(pk=checkpoint.pk, state=CheckpointState.PENDING).update(
                state=CheckpointState.INVALID, problem=problem)
            if changed:
                event_append(job=job, kind="checkpoint", reason_code="CHECKPOINT_INVALID",
                             message=f"Checkpoint at step {checkpoint.step} failed verification and will "
                                     f"never be restored: {problem}",
                             data={"checkpoint": checkpoint.pk, "step": checkpoint.step, "problems": problem})
    checkpoint.refresh_from_db()
    if checkpoint.state == CheckpointState.COMMITTED:
        _answer_request(job=job, checkpoint=checkpoint)
        checkpoints_prune(job=job)
    return checkpoint


def _superseded(checkpoint: Checkpoint) -> bool:
    """Whether the run that wrote `checkpoint` has ended and another run of the job holds GPUs: that
    run was (or will be) handed the newest checkpoint committed before it, so committing this one now
    would name a later step than the one it resumed from, which it is about to write again."""
    if checkpoint.allocation_id is None:
        return False
    return (not Allocation.objects.filter(pk=checkpoint.allocation_id, active=True).exists()
            and Allocation.objects.filter(job_id=checkpoint.job_id, active=True).exists())


def _size(size: int | None) -> str:
    if size is None:
        return "size unknown"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:,.0f} {unit}" if unit == "B" else f"{size:,.1f} {unit}"
        size /= 1024  # type: ignore[assignment]
    return f"{size} B"


def _answer_request(*, job: Job, checkpoint: Checkpoint) -> None:
    """A committed checkpoint written after the job entered CHECKPOINTING answers that request."""
    job.refresh_from_db()
    if job.state != JobState.CHECKPOINTING:
        return
    entered = _checkpointing_since(job)
    if entered is not None and checkpoint.created_at < entered:
        return  # written before the request: not an answer to it
    from broker.jobs.migration import migration_checkpoint_committed

    if migration_checkpoint_committed(job=job, checkpoint=checkpoint):
        return
    try:
        job_transition(job=job, to=JobState.RUNNING, reason_code="CHECKPOINT_COMMITTED",
                       message=f"Checkpoint at step {checkpoint.step} committed; running on.",
                       data={"checkpoint": checkpoint.pk, "step": checkpoint.step})
    except (IllegalTransition, StaleState):
        pass  # someone else moved the job first (cancelled, node lost): they win


def checkpoint_request_event(job: Job) -> JobEvent | None:
    """The job's latest entry into CHECKPOINTING: its id names the request the agent delivers, its
    time says which checkpoints answer it."""
    return JobEvent.objects.filter(job=job, kind="state", data__to=JobState.CHECKPOINTING).order_by("-id").first()


def _checkpointing_since(job: Job) -> datetime | None:
    event = checkpoint_request_event(job)
    return event.created_at if event is not None else None


def checkpoints_prune(*, job: Job, keep: int = KEEP_COMMITTED) -> list[int]:
    """Keep the newest `keep` committed checkpoints; delete older committed ones from storage and
    mark them DELETED. INVALID ones are deleted too once something newer is committed."""
    committed = list(Checkpoint.objects.filter(job=job, state=CheckpointState.COMMITTED).order_by("-step", "-id"))
    if len(committed) <= keep:
        return []
    newest_kept = committed[keep - 1]
    doomed = committed[keep:] + list(Checkpoint.objects.filter(
        job=job, state=CheckpointState.INVALID, step__lt=newest_kept.step))
    deleted = []
    for checkpoint in doomed:
        try:
            storage, name = _storage_and_name(checkpoint.uri)
            storage.delete_dir(name)
        except FileNotFoundError:
            pass  # already gone: the job's own helper prunes too (agent/checkpoint prune)
        except Exception as exc:  # keep the row as it is and try again after the next commit
            log.warning("checkpoint %s: cannot delete %s: %s", checkpoint.pk, checkpoint.uri, exc)
            continue
        Checkpoint.objects.filter(pk=checkpoint.pk).update(state=CheckpointState.DELETED)
        deleted.append(checkpoint.pk)
    return deleted


def committed_checkpoint(job: Job) -> Checkpoint | None:
    """What a restart of `job` resumes from: its newest committed checkpoint."""
    return Checkpoint.objects.filter(job=job, state=CheckpointState.COMMITTED).order_by("-step", "-id").first()


# -- requests ---------------------------------------------------------------------------------------
def checkpoint_request(*, job: Job, reason_code: str, message: str) -> Job:
    """Ask the running job for a checkpoint now (RUNNING -> CHECKPOINTING); the agent delivers it."""
    if not job.checkpoint_uri:
        # 409, not 400: nothing in the request is wrong; the job (its spec) cannot do this.
        raise JobError("This job has no checkpoint.uri in its spec, so it cannot checkpoint.", field="checkpoint",
                       code="conflict")
    if job.state == JobState.CHECKPOINTING:
        return job  # one request at a time; this one is already on its way
    if job.state != JobState.RUNNING:
        raise IllegalTransition(job.state, JobState.CHECKPOINTING)
    return job_transition(job=job, to=JobState.CHECKPOINTING, reason_code=reason_code, message=message)


@dataclass(frozen=True)
class SweepOutcome:
    requested: list[int]
    timed_out: list[int]
    reverified: list[int]


def checkpoints_sweep(*, now: datetime | None = None) -> SweepOutcome:
    """Periodic: ask for checkpoints that are due by the job's interval, give up requests that got
    no committed checkpoint in time, and re-drive verifications whose task was lost."""
    now = now or timezone.now()
    requested, timed_out = [], []
    timeout = timedelta(seconds=checkpoint_timeout_seconds())
    from broker.jobs.models import Migration

    moving = set(Migration.objects.filter(state__in=Migration.OPEN_STATES).values_list("job_id", flat=True))
    for job in Job.objects.filter(state=JobState.CHECKPOINTING):
        # A checkpoint committed after the request that nothing acted on (the process that verified it
        # died before it could): act on it now.
        answer = committed_checkpoint(job)
        entered = _checkpointing_since(job) or job.updated_at
        if answer is not None and answer.created_at >= entered:
            _answer_request(job=job, checkpoint=answer)
            continue
        if job.pk in moving:
            continue  # a job being moved has its own deadline (broker.jobs.migration.migrations_sweep)
        if now - entered < timeout:
            continue
        try:
            job_transition(job=job, to=JobState.RUNNING, reason_code="CHECKPOINT_TIMED_OUT",
                           message=f"No checkpoint was committed within {timeout.total_seconds():.0f} s of "
                                   "the request; the job runs on where it was.")
            timed_out.append(job.pk)
        except (IllegalTransition, StaleState):
            continue
    for job in Job.objects.filter(state=JobState.RUNNING, spec__has_key="checkpoint"):
        interval = checkpoint_interval_seconds(job)
        if interval is None:
            continue
        latest = (Checkpoint.objects.filter(job=job).exclude(state=CheckpointState.INVALID)
                  .order_by("-created_at").values_list("created_at", flat=True).first())
        since = max(filter(None, [latest, job.started_at, _last_request_end(job)]), default=None)
        if since is not None and (now - since).total_seconds() < interval:
            continue
        try:
            checkpoint_request(job=job, reason_code="CHECKPOINT_DUE",
                               message=f"Checkpoint due (every {interval:.0f} s).")
            requested.append(job.pk)
        except (JobError, IllegalTransition, StaleState):
            pass
    stale = Checkpoint.objects.filter(state=CheckpointState.PENDING, created_at__lt=now - _VERIFY_SWEEP_AFTER)
    reverified = list(stale.values_list("pk", flat=True)[:100])
    for checkpoint_id in reverified:
        _enqueue_verify(checkpoint_id)
    return SweepOutcome(requested=requested, timed_out=timed_out, reverified=reverified)


def _last_request_end(job: Job) -> datetime | None:
    """When the job last left CHECKPOINTING (answered or timed out): the interval counts from there."""
    return (JobEvent.objects.filter(job=job, kind="state", data__from=JobState.CHECKPOINTING)
            .order_by("-id").values_list("created_at", flat=True).first())
