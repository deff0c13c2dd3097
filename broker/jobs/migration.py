"""Moving a running job by checkpoint: a state machine with a way back at every step.

    CHECKPOINTING  the job is asked for a checkpoint (RUNNING -> CHECKPOINTING);
                   not committed in time -> ROLLED_BACK, the job runs on where it was
    STOPPING       committed: the source is told to stop (CHECKPOINTING -> MIGRATING, the agent's
                   action for it becomes `stop`); its agent confirms the stop
                   no confirmation in time -> the job is requeued with its old copy unconfirmed, and the
                   new start waits until that copy is fenced (broker.agents.fencing)
    PLACING        the source's GPUs are released and the engine places the job on the target
                   (MIGRATING -> PLACED); no room there any more -> PENDING, placed anywhere; the start
                   gets `restore_from` = the committed checkpoint; a failed start is retried elsewhere
                   from the same checkpoint by the usual requeue paths
    COMPLETED      the job reports running on another node; the move records how long it did not run
    ABANDONED      the job ended (finished, failed, cancelled) during the move

Every step is a compare-and-set on the job row (job_transition) and on the migration row, so running
one twice, or two workers at once, changes nothing more; `migrations_sweep` re-drives what is stuck.
"""
from __future__ import annotations

import logging
from datetime import datetime, timedelta

from django.conf import settings
from django.db import IntegrityError, transaction
from django.utils import timezone

from broker.jobs.models import (Allocation, Checkpoint, CheckpointState, Job, Migration, MigrationCause,
                                MigrationState)
from broker.jobs.services import (IllegalTransition, JobError, StaleState, allocation_commit, event_append,
                                  job_allocations_release, job_requeue, job_transition)
from broker.jobs.states import TERMINAL_STATES, JobState

log = logging.getLogger(__name__)


def stop_timeout_seconds() -> float:
    """How long the source's agent has to confirm the stop before the job is requeued fenced."""
    return float(getattr(settings, "WHALEZEN_MIGRATION_STOP_TIMEOUT_SECONDS", 120))


def open_migration(job: Job) -> Migration | None:
    return Migration.objects.filter(job=job, state__in=Migration.OPEN_STATES).first()


def _set(migration: Migration, expected: str, **changes) -> bool:
    """Compare-and-set on the migration row: only a caller that saw `expected` moves it."""
    return Migration.objects.filter(pk=migration.pk, state=expected).update(**changes) == 1


# -- 1. request --------------------------------------------------------------------------------------
def migration_request(*, job: Job, cause: str = MigrationCause.REQUESTED, target_node: str = "",
                      target_pool: str = "", message: str = "", deadline: datetime | None = None,
                      room_being_made: bool = False) -> Migration:
    """Start moving a RUNNING job. With a target, the target must have room now (or 409 says why),
    unless `room_being_made`: the engine's plan moves other jobs off the target node first (its
    consolidation brings a rented job home that way); the placement then waits for them
    (`_place`).

    A preemption or spot move (Migration.REQUEUE_CAUSES) has no target: once the checkpoint is
    committed, or at `deadline` without one, the job goes back to the queue.
    """
    from broker.jobs.checkpoints import checkpoint_request, checkpoint_timeout_seconds
    from broker.scheduler.moves import MoveTarget, move_plan

    requeue = cause in Migration.REQUEUE_CAUSES
    if not job.checkpoint_uri:
        raise JobError("This job has no checkpoint.uri in its spec, so it cannot be moved by checkpoint.",
                       field="checkpoint", code="conflict")
    if open_migration(job) is not None:
        raise JobError("This job is being moved already.", field="state", code="conflict")
    if job.state != JobState.RUNNING and not (requeue and job.state == JobState.CHECKPOINTING):
        raise IllegalTransition(job.state, JobState.MIGRATING)
    source = job.allocations.filter(active=True).select_related("node").first()
    if source is None:
        raise JobError("This job holds no GPUs to move from.", field="state", code="conflict")
    if not requeue and not room_being_made:
        plan = move_plan(job=job, target=MoveTarget(node=target_node, pool=target_pool),
                         leaving_node_id=source.node_id)
        if not plan.possible:
            field = "node" if target_node else "pool" if target_pool else "non_field_errors"
            raise JobError(f"There is no room for the job there: {plan.reason}", field=field, code="conflict")
    deadline = deadline or timezone.now() + timedelta(seconds=checkpoint_timeout_seconds())
    with transaction.atomic():
        try:
            migration = Migration.objects.create(job=job, cause=cause, source_allocation=source,
                                                 source_node=source.node.name, target_node=target_node,
                                                 target_pool=target_pool, deadline=deadline)
        except IntegrityError as exc:  # another request won the race (one open move per job)
            raise JobError("This job is being moved already.", field="state", code="conflict") from exc
        where = target_node or (f"pool {target_pool}" if target_pool else "another node")
        checkpoint_request(job=job, reason_code="MIGRATION_REQUESTED",
                           message=message or f"Moving from {source.node.name} to {where}: checkpoint requested.")
    return migration


# -- 2. the checkpoint is committed: stop the source -------------------------------------------------
def migration_checkpoint_committed(*, job: Job, checkpoint: Checkpoint) -> bool:
    """The committed checkpoint answers a move: tell the source to stop. False when no move waits."""
    migration = open_migration(job)
    if migration is None or migration.state != MigrationState.CHECKPOINTING:
        return False
    if migration.cause in Migration.REQUEUE_CAUSES:
        return _requeue(job=job, migration=migration, checkpoint=checkpoint)
    with transaction.atomic():
        if not _set(migration, MigrationState.CHECKPOINTING, state=MigrationState.STOPPING,
                    checkpoint=checkpoint, checkpointed_at=timezone.now()):
            return False
        try:
            job_transition(job=job, to=JobState.MIGRATING, reason_code="MIGRATION_CHECKPOINTED",
                           message=f"Checkpoint at step {checkpoint.step} committed; stopping the job on "
                                   f"{migration.source_node} to move it.",
                           data={"migration": migration.pk, "checkpoint": checkpoint.pk, "step": checkpoint.step})
        except (IllegalTransition, StaleState):
            transaction.set_rollback(True)  # the job moved on (cancelled, node lost): the move waits for that
            return False
    return True


_REQUEUE_WHY = {MigrationCause.PREEMPTION: "Preempted", MigrationCause.SPOT: "Its spot instance is being reclaimed"}


def _requeue(*, job: Job, migration: Migration, checkpoint: Checkpoint | None) -> bool:
    """A preemption or spot move: back to the queue, its old copy fenced (the new start waits for the
    agent's confirmed stop); it resumes from `checkpoint` (or the last committed one) wherever the
    scheduler places it."""
    from broker.jobs.checkpoints import committed_checkpoint

    resume = checkpoint or committed_checkpoint(job)
    why = _REQUEUE_WHY.get(migration.cause, "Moved")
    if checkpoint is not None:
        how = f"checkpoint at step {checkpoint.step} committed; it resumes from it elsewhere"
    elif resume is not None:
        how = (f"no checkpoint was committed in time; it resumes from step {resume.step}, its last committed "
               "checkpoint, and loses the work since")
    else:
        how = "no checkpoint was committed in time and it has none: it restarts from the beginning"
    reason_code = "PREEMPTED" if migration.cause == MigrationCause.PREEMPTION else "SPOT_INTERRUPTION"
    # One transaction: a process killed in between leaves neither a move that thinks the job was
    # requeued nor a requeued job whose move still waits for a checkpoint.
    with transaction.atomic():
        if not _set(migration, MigrationState.CHECKPOINTING, state=MigrationState.PLACING, checkpoint=resume,
                    checkpointed_at=timezone.now(), source_stopped_at=timezone.now()):
            return False
        if not job_requeue(job=job, reason_code=reason_code, stop_unconfirmed=True, message=f"{why}: {how}."):
            transaction.set_rollback(True)
            return False
    return True


# -- 3. the source stopped: place on the target -------------------------------------------------------
def migration_source_stopped(*, job: Job, allocation: Allocation) -> bool:
    """The source's agent confirmed the stop: release its GPUs and place the job on the target."""
    migration = open_migration(job)
    if (migration is None or migration.state != MigrationState.STOPPING
            or migration.source_allocation_id != allocation.pk):
        return False
    if not _set(migration, MigrationState.STOPPING, state=MigrationState.PLACING, source_stopped_at=timezone.now()):
        return False
    _place(job=job, migration=migration, leaving_node_id=allocation.node_id)
    return True


def _place(*, job: Job, migration: Migration, leaving_node_id: int | None) -> None:
    from broker.scheduler.moves import MoveTarget, move_plan

    job.refresh_from_db()
    if job.state != JobState.MIGRATING:
        return
    job_allocations_release(job=job)
    plan = move_plan(job=job, target=MoveTarget(node=migration.target_node, pool=migration.target_pool),
                     leaving_node_id=leaving_node_id)
    step = migration.checkpoint.step if migration.checkpoint_id else None
    if plan.possible:
        try:
            allocation_commit(job=job, requests=plan.requests, expected_state=JobState.MIGRATING)
            Migration.objects.filter(pk=migration.pk).update(
                placed_on=", ".join(r.node.name for r in plan.requests))
            _place_those_waiting_for(node_id=leaving_node_id)
            return
        except JobError as exc:  # taken in the meantime: fall through to the queue
            log.info("migration %s: target taken meanwhile (%s)", migration.pk, exc)
    if _target_being_vacated(migration):
        # Jobs moved off the target to make room are still leaving it: wait for them (their own
        # placement, or the sweep, places this one again); the job is not running meanwhile.
        log.info("migration %s: waiting for moves off %s", migration.pk, migration.target_node)  # pragma: no mutate
        return
    _place_those_waiting_for(node_id=leaving_node_id)
    try:
        job_transition(job=job, to=JobState.PENDING, reason_code="MIGRATING",
                       message=f"Being moved: waiting for room elsewhere; it resumes from step {step}."
                       if step is not None else "Being moved: waiting for room elsewhere.",
                       data={"migration": migration.pk})
    except (IllegalTransition, StaleState):
        pass


def _target_being_vacated(migration: Migration) -> bool:
    """Another job's move off this move's target node is still open (it leaves room for this one)."""
    return bool(migration.target_node) and Migration.objects.filter(
        state__in=Migration.OPEN_STATES, source_node=migration.target_node).exclude(pk=migration.pk).exclude(
        state=MigrationState.PLACING, source_stopped_at__isnull=False).exists()


def _place_those_waiting_for(*, node_id: int | None) -> None:
    """A job left node `node_id`: moves waiting for room there are placed now rather than at the sweep."""
    if node_id is None:
        return
    from broker.inventory.models import Node

    name = Node.objects.filter(pk=node_id).values_list("name", flat=True).first()
    for waiting in Migration.objects.filter(state=MigrationState.PLACING, target_node=name,
                                            job__state=JobState.MIGRATING).select_related("job"):
        _place(job=waiting.job, migration=waiting, leaving_node_id=_source_node_id(waiting))


# -- 4. running on the target: done -----------------------------------------------------------------
def migration_job_running(*, job: Job) -> Migration | None:
    """The job runs again: on another node than the source, that completes its move."""
    migration = open_migration(job)
    if migration is None or migration.state != MigrationState.PLACING:
        return None
    current = job.allocations.filter(active=True).select_related("node").first()
    if current is None or current.pk == migration.source_allocation_id:
        return None
    now = timezone.now()
    # What the new start was handed (restore_from, the newest committed checkpoint when its node asked):
    # the newest one an earlier run wrote, which may be newer than the one that began the move (the
    # source went on checkpointing until it stopped).
    restored = (Checkpoint.objects.filter(job=job, state__in=[CheckpointState.COMMITTED, CheckpointState.DELETED],
                                          committed_at__lte=now).exclude(allocation=current)
                .order_by("-step", "-id").first()) or migration.checkpoint
    if not _set(migration, MigrationState.PLACING, state=MigrationState.COMPLETED, running_at=now, finished_at=now,
                placed_on=current.node.name, checkpoint=restored):
        return None
    migration.refresh_from_db()
    phases = migration_phases(migration)
    migration.outcome = (f"Moved from {migration.source_node} to {current.node.name}; not running for "
                         f"{migration.downtime_seconds:.1f} s.")
    migration.save(update_fields=["outcome"])
    event_append(job=job, kind="migration", reason_code="MIGRATION_COMPLETED", message=migration.outcome,
                 data={"migration": migration.pk, "from": migration.source_node, "to": current.node.name,
                       "downtime_s": migration.downtime_seconds, "phases": phases,
                       "restored_step": migration.checkpoint.step if migration.checkpoint_id else None})
    return migration


def migration_phases(migration: Migration) -> dict[str, float | None]:
    """Seconds per step: checkpoint (request to commit), fence (commit to the source's confirmed stop),
    start (stop to running on the target: placement, start and the job's restore)."""
    def span(a: datetime | None, b: datetime | None) -> float | None:
        return None if a is None or b is None else round(max(0.0, (b - a).total_seconds()), 3)

    return {"checkpoint": span(migration.requested_at, migration.checkpointed_at),
            "fence": span(migration.checkpointed_at, migration.source_stopped_at),
            "start": span(migration.source_stopped_at, migration.running_at)}


# -- ways back ---------------------------------------------------------------------------------------
def migration_roll_back(*, job: Job, why: str) -> bool:
    """The checkpoint did not come (timed out): the move is called off, the job runs where it was."""
    migration = open_migration(job)
    if migration is None or migration.state != MigrationState.CHECKPOINTING:
        return False
    if not _set(migration, MigrationState.CHECKPOINTING, state=MigrationState.ROLLED_BACK,
                finished_at=timezone.now(), outcome=f"Called off: {why}; the job runs on {migration.source_node}."):
        return False
    event_append(job=job, kind="migration", reason_code="MIGRATION_ROLLED_BACK",
                 message=f"Move called off: {why}; the job runs on where it was.", data={"migration": migration.pk})
    return True


def migrations_sweep(*, now: datetime | None = None) -> dict[str, list[int]]:
    """Periodic: act on checkpoint deadlines (a user's move is called off, a preemption or spot move
    requeues anyway), requeue moves whose source never confirmed its stop (fenced), close moves whose
    job ended."""
    now = now or timezone.now()
    fenced, abandoned, late, redriven = [], [], [], []
    for migration in Migration.objects.filter(state__in=Migration.OPEN_STATES).select_related("job"):
        job = migration.job
        if job.state in TERMINAL_STATES:
            if _set(migration, migration.state, state=MigrationState.ABANDONED, finished_at=now,
                    outcome=f"The job ended ({job.state}) during the move."):
                abandoned.append(migration.pk)
            continue
        if migration.state == MigrationState.CHECKPOINTING and _source_run_ended(migration):
            # The run it was to checkpoint ended without it (its node was lost, or it was requeued):
            # the job goes elsewhere anyway, from its last committed checkpoint; the move completes
            # when it runs there.
            from broker.jobs.checkpoints import committed_checkpoint

            if _set(migration, MigrationState.CHECKPOINTING, state=MigrationState.PLACING,
                    checkpoint=committed_checkpoint(job), checkpointed_at=now, source_stopped_at=now,
                    outcome=f"The run on {migration.source_node} ended before its checkpoint (its node was "
                            "lost, or it was requeued); the job restarts elsewhere from its last committed "
                            "checkpoint."):
                redriven.append(migration.pk)
            continue
        if (migration.state == MigrationState.CHECKPOINTING and migration.deadline is not None
                and now >= migration.deadline):
            late.append(migration.pk)
            if migration.cause in Migration.REQUEUE_CAUSES:
                _requeue(job=job, migration=migration, checkpoint=None)
            else:
                _call_off_late(job=job, migration=migration)
            continue
        if migration.state == MigrationState.PLACING and job.state == JobState.MIGRATING:
            # The source's stop was recorded but the placement never happened (the process handling
            # it died in between): place it now.
            _place(job=job, migration=migration, leaving_node_id=_source_node_id(migration))
            redriven.append(migration.pk)
            continue
        if (migration.state == MigrationState.STOPPING and migration.checkpointed_at is not None
                and now - migration.checkpointed_at > timedelta(seconds=stop_timeout_seconds())):
            if not _set(migration, MigrationState.STOPPING, state=MigrationState.PLACING):
                continue
            job_requeue(job=job, reason_code="MIGRATION_SOURCE_UNREACHABLE", stop_unconfirmed=True,
                        message=f"{migration.source_node} did not confirm the stop within "
                                f"{stop_timeout_seconds():.0f} s; the job starts elsewhere once its copy "
                                "there is confirmed stopped or fenced.")
            fenced.append(migration.pk)
    return {"fenced": fenced, "abandoned": abandoned, "late": late, "redriven": redriven}


def _source_run_ended(migration: Migration) -> bool:
    return not Allocation.objects.filter(pk=migration.source_allocation_id, active=True).exists()


def _source_node_id(migration: Migration) -> int | None:
    return (Allocation.objects.filter(pk=migration.source_allocation_id).values_list("node_id", flat=True).first()
            if migration.source_allocation_id else None)


def _call_off_late(*, job: Job, migration: Migration) -> None:
    """A user's (or the engine's) move whose checkpoint never came: the job runs on where it was."""
    why = "no checkpoint was committed in time"
    if job.state == JobState.CHECKPOINTING:
        try:
            job_transition(job=job, to=JobState.RUNNING, reason_code="CHECKPOINT_TIMED_OUT",
                           message=f"Move called off: {why}; the job runs on where it was.")
        except (IllegalTransition, StaleState):
            return
    migration_roll_back(job=job, why=why)
