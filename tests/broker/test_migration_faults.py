"""A move survives the process that drives it dying at any step: each step is a compare-and-set, and
the sweeps (checkpoints_sweep, migrations_sweep, run by beat every 5 s) pick up whatever a killed
web thread or worker left half done. "Killed" is simulated by making the next step not happen."""
from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from broker.agents.services import lost_after_seconds, nodes_mark_lost
from broker.inventory.models import Node
from broker.jobs import checkpoints, migration
from broker.jobs.models import Checkpoint, CheckpointState, Migration, MigrationState
from broker.jobs.services import GpuRequest, allocation_commit
from broker.jobs.states import JobState

from .test_agent_api import API, agent_client, registered, join_token  # noqa: F401 (fixtures)
from .test_checkpoints import root, running_job, verify_queue  # noqa: F401 (fixtures)
from .test_migration import commit_checkpoint, only_assignment, second, status  # noqa: F401 (fixtures)


def begin_move(acme, source, source_token, root):
    job, allocation = running_job(acme, source, root)
    assert acme.client.post(f"/api/v1/jobs/{job.pk}/migrate/", {"node": "gpu-node-2"}, format="json").status_code == 202
    return job, allocation, only_assignment(source_token)["checkpoint_request_id"]


def test_killed_after_the_commit_before_acting_on_it(acme, registered, second, root, verify_queue, monkeypatch):
    (source, source_token), _ = registered, second
    job, allocation, request_id = begin_move(acme, source, source_token, root)
    with monkeypatch.context() as m:
        m.setattr(checkpoints, "_answer_request", lambda **kw: None)  # the process dies right after the commit
        commit_checkpoint(source_token, allocation, root, job, 30, request_id)
    job.refresh_from_db()
    assert job.state == JobState.CHECKPOINTING
    checkpoints.checkpoints_sweep()
    job.refresh_from_db()
    assert job.state == JobState.MIGRATING and Migration.objects.get(job=job).state == MigrationState.STOPPING


def test_killed_after_the_stop_was_recorded_before_placing(acme, registered, second, root, verify_queue,
                                                           monkeypatch):
    (source, source_token), (target, target_token) = registered, second
    job, allocation, request_id = begin_move(acme, source, source_token, root)
    commit_checkpoint(source_token, allocation, root, job, 30, request_id)
    with monkeypatch.context() as m:
        m.setattr(migration, "_place", lambda **kw: None)
        status(source_token, allocation.pk, allocation.epoch, "stopped", reason="withdrawn")
    job.refresh_from_db()
    assert job.state == JobState.MIGRATING and Migration.objects.get(job=job).state == MigrationState.PLACING
    assert migration.migrations_sweep()["redriven"] == [Migration.objects.get(job=job).pk]
    job.refresh_from_db()
    assert job.state == JobState.PLACED and job.allocations.get(active=True).node_id == target.pk
    assert only_assignment(target_token)["restore_from"].endswith("step-000000000030")
    assert migration.migrations_sweep()["redriven"] == []  # nothing more to do, nothing done twice


def test_a_requeue_cut_short_changes_nothing_and_the_deadline_still_acts(acme, registered, root, monkeypatch,
                                                                         settings):
    from broker.jobs.models import MigrationCause

    node, _ = registered
    job, allocation = running_job(acme, node, root)
    move = migration.migration_request(job=job, cause=MigrationCause.PREEMPTION,
                                       deadline=timezone.now() + timedelta(seconds=30))
    with monkeypatch.context() as m:
        def dies(**kw):
            raise RuntimeError("killed")
        m.setattr(migration, "job_requeue", dies)
        with pytest.raises(RuntimeError):
            migration.migrations_sweep(now=timezone.now() + timedelta(seconds=31))
    move.refresh_from_db()
    job.refresh_from_db()
    assert move.state == MigrationState.CHECKPOINTING and job.state == JobState.CHECKPOINTING  # both or neither
    assert len(migration.migrations_sweep(now=timezone.now() + timedelta(seconds=31))["late"]) == 1
    job.refresh_from_db()
    assert job.state == JobState.PENDING and not job.allocations.filter(active=True).exists()


def test_a_lost_verification_is_run_again(acme, registered, root, verify_queue):
    from .test_checkpoints import report_checkpoint, write

    node, token = registered
    job, allocation = running_job(acme, node, root)
    report_checkpoint(token, allocation, write(root, 5))  # the verify task is lost with its worker
    checkpoint = Checkpoint.objects.get(job=job)
    assert checkpoint.state == CheckpointState.PENDING
    assert checkpoints.checkpoints_sweep().reverified == []  # too early to call it lost
    later = checkpoints.checkpoints_sweep(now=timezone.now() + timedelta(seconds=61))
    assert later.reverified == [checkpoint.pk]
    checkpoints.checkpoint_verify(checkpoint_id=checkpoint.pk)
    checkpoints.checkpoint_verify(checkpoint_id=checkpoint.pk)  # run twice: once committed, once a no-op
    assert Checkpoint.objects.get(pk=checkpoint.pk).state == CheckpointState.COMMITTED
    assert job.events.filter(reason_code="CHECKPOINT_COMMITTED").count() == 1


def test_every_step_run_twice_moves_once(acme, registered, second, root, verify_queue):
    (source, source_token), (target, target_token) = registered, second
    job, allocation, request_id = begin_move(acme, source, source_token, root)
    commit_checkpoint(source_token, allocation, root, job, 30, request_id)
    for _ in range(2):
        status(source_token, allocation.pk, allocation.epoch, "stopped", reason="withdrawn")
        migration.migrations_sweep()
    start = only_assignment(target_token)
    for _ in range(2):
        status(target_token, start["id"], start["epoch"], "running", pid=5)
    move = Migration.objects.get(job=job)
    assert move.state == MigrationState.COMPLETED
    assert job.allocations.filter(active=True).count() == 1
    assert job.events.filter(reason_code="MIGRATION_COMPLETED").count() == 1


def test_a_move_whose_source_node_is_lost_before_its_checkpoint_completes_elsewhere(
        acme, registered, second, root, verify_queue):
    """The source goes silent as the move begins: its node is LOST and the job requeued from its last
    committed checkpoint. The move does not sit in CHECKPOINTING until its deadline (and then claim
    the job runs on where it was): it completes when the job runs on another node."""
    (source, source_token), (target, target_token) = registered, second
    job, allocation = running_job(acme, source, root)
    commit_checkpoint(source_token, allocation, root, job, 40)
    assert acme.client.post(f"/api/v1/jobs/{job.pk}/migrate/", {}, format="json").status_code == 202
    source.refresh_from_db()
    heard = source.last_heartbeat_at
    Node.objects.filter(pk=target.pk).update(last_heartbeat_at=heard + timedelta(seconds=lost_after_seconds() + 5))
    (lost,) = nodes_mark_lost(now=heard + timedelta(seconds=lost_after_seconds() + 1))
    assert lost.pk == source.pk
    job.refresh_from_db()
    assert job.state == JobState.PENDING and job.pending_reason_code == "NODE_LOST"

    assert migration.migrations_sweep()["redriven"] == [Migration.objects.get(job=job).pk]
    move = Migration.objects.get(job=job)
    assert move.state == MigrationState.PLACING and move.checkpoint.step == 40
    (new,) = allocation_commit(job=job, requests=[GpuRequest(node=target, gpu_indices=(0,))])
    status(target_token, new.pk, new.epoch, "running", pid=5)
    move.refresh_from_db()
    assert move.state == MigrationState.COMPLETED and move.placed_on == target.name
    assert move.checkpoint.step == 40
    assert migration.migrations_sweep() == {"fenced": [], "abandoned": [], "late": [], "redriven": []}
