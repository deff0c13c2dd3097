"""Moving a running job by checkpoint, through the API and the agent protocol: checkpoint, commit,
stop (fence) the source, place and start on the target with the committed checkpoint; and every way
back (the checkpoint never comes, the source never confirms, the target is full, the job ends)."""
from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from broker.agents.selectors import node_assignments
from broker.inventory.models import Node
from broker.jobs import checkpoints
from broker.jobs.migration import migrations_sweep
from broker.jobs.models import Checkpoint, JobEvent, Migration, MigrationState
from broker.jobs.states import JobState

from .test_agent_api import API, agent_client, register_body, registered, join_token  # noqa: F401 (fixtures)
from .test_checkpoints import report_checkpoint, root, running_job, verify_queue, write  # noqa: F401


@pytest.fixture
def second(acme, join_token):
    """Another registered 4xA100 node: (node, node token)."""
    resp = APIClient().post(f"{API}/register", register_body(join_token, name="gpu-node-2", agent_key="key-bbbbbbbb"),
                            format="json")
    assert resp.status_code == 201, resp.content
    return Node.objects.get(pk=resp.json()["node_id"]), resp.json()["node_token"]


def status(token, allocation_id, epoch, state, **extra):
    body = {"epoch": epoch, "state": state, "message": state, **extra}
    return agent_client(token).post(f"{API}/assignments/{allocation_id}/status", body, format="json")


def only_assignment(token) -> dict:
    (a,) = agent_client(token).get(f"{API}/assignments").json()["assignments"]
    return a


def commit_checkpoint(token, allocation, root, job, step, request_id=None):
    saved = write(root, step)
    assert report_checkpoint(token, allocation, saved, request_id=request_id).status_code == 200
    checkpoints.checkpoint_verify(checkpoint_id=Checkpoint.objects.get(job=job, step=step).pk)
    return saved


def test_a_requested_move_checkpoints_fences_places_and_resumes_on_the_target(
        acme, registered, second, root, verify_queue):
    (source, source_token), (target, target_token) = registered, second
    job, allocation = running_job(acme, source, root)
    resp = acme.client.post(f"/api/v1/jobs/{job.pk}/migrate/", {"node": "gpu-node-2"}, format="json")
    assert resp.status_code == 202, resp.content
    assert resp.json()["state"] == "CHECKPOINTING" and resp.json()["target"] == "gpu-node-2"
    request = only_assignment(source_token)
    assert request["action"] == "checkpoint"

    saved = commit_checkpoint(source_token, allocation, root, job, 250, request["checkpoint_request_id"])
    job.refresh_from_db()
    assert job.state == JobState.MIGRATING
    assert only_assignment(source_token)["action"] == "stop"
    assert agent_client(target_token).get(f"{API}/assignments").json()["assignments"] == []  # not before the stop

    assert status(source_token, allocation.pk, allocation.epoch, "stopped", reason="withdrawn").status_code == 200
    job.refresh_from_db()
    assert job.state == JobState.PLACED
    assert agent_client(source_token).get(f"{API}/assignments").json()["assignments"] == []
    start = only_assignment(target_token)
    assert start["action"] == "start" and start["restore_from"] == saved.uri

    assert status(target_token, start["id"], start["epoch"], "running", pid=99).status_code == 200
    job.refresh_from_db()
    assert job.state == JobState.RUNNING
    (move,) = acme.client.get(f"/api/v1/jobs/{job.pk}/migrations/").json()["results"]
    assert (move["cause"], move["state"], move["source"], move["to"], move["restored_step"]) == (
        "REQUESTED", "COMPLETED", "gpu-node-1", "gpu-node-2", 250)
    assert move["downtime_s"] is not None and move["downtime_s"] >= 0
    assert set(move["phases"]) == {"checkpoint", "fence", "start"} and None not in move["phases"].values()
    kinds = [e.reason_code for e in JobEvent.objects.filter(job=job).order_by("id")]
    steps = ["MIGRATION_REQUESTED", "CHECKPOINT_WRITTEN", "CHECKPOINT_COMMITTED", "MIGRATION_CHECKPOINTED",
             "PLACED", "AGENT_RUNNING", "MIGRATION_COMPLETED"]
    seen = [k for k in kinds[kinds.index("MIGRATION_REQUESTED"):] if k in steps]
    assert [k for i, k in enumerate(seen) if i == 0 or k != seen[i - 1]] == steps, " ".join(kinds)
    completed = JobEvent.objects.get(job=job, reason_code="MIGRATION_COMPLETED")
    assert "gpu-node-1 to gpu-node-2" in completed.message and "not running for" in completed.message
    assert target.pk == job.allocations.get(active=True).node_id


def test_a_checkpoint_that_never_comes_calls_the_move_off(acme, registered, second, root, settings):
    settings.WHALEZEN_CHECKPOINT_TIMEOUT_SECONDS = 30
    (source, _), _ = registered, second
    job, allocation = running_job(acme, source, root)
    assert acme.client.post(f"/api/v1/jobs/{job.pk}/migrate/", {}, format="json").status_code == 202
    later = timezone.now() + timedelta(seconds=31)
    assert checkpoints.checkpoints_sweep(now=later).timed_out == []  # a move has its own deadline
    assert migrations_sweep(now=later)["late"] == [Migration.objects.get(job=job).pk]
    job.refresh_from_db()
    assert job.state == JobState.RUNNING and job.allocations.get(active=True).pk == allocation.pk
    move = Migration.objects.get(job=job)
    assert move.state == MigrationState.ROLLED_BACK and "runs on gpu-node-1" in move.outcome
    # And a new move may be asked for afterwards.
    assert acme.client.post(f"/api/v1/jobs/{job.pk}/migrate/", {}, format="json").status_code == 202


def test_a_source_that_never_confirms_is_fenced_before_the_target_starts(acme, registered, second, root,
                                                                           verify_queue, settings):
    settings.WHALEZEN_MIGRATION_STOP_TIMEOUT_SECONDS = 60
    (source, source_token), (target, target_token) = registered, second
    job, allocation = running_job(acme, source, root)
    acme.client.post(f"/api/v1/jobs/{job.pk}/migrate/", {"node": "gpu-node-2"}, format="json")
    commit_checkpoint(source_token, allocation, root, job, 10, only_assignment(source_token)["checkpoint_request_id"])
    # The source's agent is cut off: no stop report. The sweep gives up on it and requeues, fenced.
    result = migrations_sweep(now=timezone.now() + timedelta(seconds=61))
    assert result["fenced"] == [Migration.objects.get(job=job).pk]
    job.refresh_from_db()
    assert job.state == JobState.PENDING and job.pending_reason_code == "MIGRATION_SOURCE_UNREACHABLE"
    allocation.refresh_from_db()
    assert not allocation.active and allocation.stop_unconfirmed
    from broker.scheduler.services import scheduling_cycle_run

    scheduling_cycle_run(tenant=acme.tenant)
    job.refresh_from_db()
    assert job.state == JobState.PLACED
    placed_on = job.allocations.get(active=True).node
    # Wherever it was placed, that node is not told to start it while the old copy may run.
    assert node_assignments(node=placed_on)["assignments"] == []
    # The source's agent comes back, finds the allocation gone and reports the stop: now it may start.
    status(source_token, allocation.pk, allocation.epoch, "stopped", reason="withdrawn")
    (start,) = node_assignments(node=placed_on)["assignments"]
    assert start["action"] == "start" and start["restore_from"].endswith("step-000000000010")


def test_a_full_target_is_refused_with_the_engines_reason(acme, registered, second, root):
    (source, _), (target, _) = registered, second
    job, _ = running_job(acme, source, root)
    resp = acme.client.post(f"/api/v1/jobs/{job.pk}/migrate/", {"node": "gpu-node-2"}, format="json")
    assert resp.status_code == 202
    other, _ = running_job(acme, source, root, gpu=1)
    for gpu in range(4):  # fill the target
        filler = running_job(acme, target, root, gpu=gpu)
    resp = acme.client.post(f"/api/v1/jobs/{other.pk}/migrate/", {"node": "gpu-node-2"}, format="json")
    assert resp.status_code == 409 and "no room" in resp.json()["node"][0]
    assert filler


@pytest.mark.parametrize("body,field", [({"node": "nope"}, "node"), ({"pool": "nope"}, "pool"),
                                        ({"zone": "x"}, "zone"), ({"node": 5}, "node")])
def test_bad_targets_are_refused_naming_the_field(acme, registered, second, root, body, field):
    (source, _), _ = registered, second
    job, _ = running_job(acme, source, root)
    resp = acme.client.post(f"/api/v1/jobs/{job.pk}/migrate/", body, format="json")
    assert resp.status_code in (400, 409) and field in resp.json(), resp.content
    job.refresh_from_db()
    assert job.state == JobState.RUNNING and not Migration.objects.filter(job=job).exists()


def test_only_running_jobs_with_checkpoints_move_and_one_move_at_a_time(acme, registered, second, root):
    (source, _), _ = registered, second
    job, _ = running_job(acme, source, root)
    assert acme.client.post(f"/api/v1/jobs/{job.pk}/migrate/", {}, format="json").status_code == 202
    again = acme.client.post(f"/api/v1/jobs/{job.pk}/migrate/", {}, format="json")
    assert again.status_code == 409 and "state" in again.json()
    from .test_api_tenancy import submit

    pending = submit(acme, resources={"gpus": 1}, checkpoint={"uri": str(root / "p")})
    assert acme.client.post(f"/api/v1/jobs/{pending.pk}/migrate/", {}, format="json").status_code == 409


def test_who_may_move_a_job(acme, globex, registered, second, root):
    (source, _), _ = registered, second
    job, _ = running_job(acme, source, root)
    assert acme.viewer_client.post(f"/api/v1/jobs/{job.pk}/migrate/", {}, format="json").status_code == 403
    assert acme.member_client.post(f"/api/v1/jobs/{job.pk}/migrate/", {}, format="json").status_code == 403
    assert globex.client.post(f"/api/v1/jobs/{job.pk}/migrate/", {}, format="json").status_code == 404
    assert globex.client.get(f"/api/v1/jobs/{job.pk}/migrations/").status_code == 404
    assert not Migration.objects.exists()


def test_a_job_that_finishes_while_being_stopped_succeeds_and_the_move_is_closed(
        acme, registered, second, root, verify_queue):
    (source, source_token), _ = registered, second
    job, allocation = running_job(acme, source, root)
    acme.client.post(f"/api/v1/jobs/{job.pk}/migrate/", {}, format="json")
    commit_checkpoint(source_token, allocation, root, job, 3, only_assignment(source_token)["checkpoint_request_id"])
    status(source_token, allocation.pk, allocation.epoch, "exited", exit_code=0)
    job.refresh_from_db()
    assert job.state == JobState.SUCCEEDED
    migrations_sweep()
    assert Migration.objects.get(job=job).state == MigrationState.ABANDONED


def test_the_move_records_the_newest_checkpoint_the_target_was_handed(acme, registered, second, root,
                                                                       verify_queue):
    """The source goes on checkpointing until it stops: the target gets (and the move reports) the
    newest committed checkpoint, not only the one that began the move."""
    (source, source_token), (_, target_token) = registered, second
    job, allocation = running_job(acme, source, root)
    acme.client.post(f"/api/v1/jobs/{job.pk}/migrate/", {"node": "gpu-node-2"}, format="json")
    commit_checkpoint(source_token, allocation, root, job, 60, only_assignment(source_token)["checkpoint_request_id"])
    commit_checkpoint(source_token, allocation, root, job, 80)  # a periodic save before the stop landed
    status(source_token, allocation.pk, allocation.epoch, "stopped", reason="withdrawn")
    start = only_assignment(target_token)
    assert start["restore_from"].endswith("step-000000000080")
    status(target_token, start["id"], start["epoch"], "running", pid=7)
    (move,) = acme.client.get(f"/api/v1/jobs/{job.pk}/migrations/").json()["results"]
    assert move["restored_step"] == 80


def test_a_checkpoint_verified_only_after_the_job_moved_on_is_never_committed(acme, registered, second, root,
                                                                              verify_queue):
    """The source saved step 100 just before it stopped, but the worker verifying checkpoints was
    down (or slow) until the job had started on the target from step 80: committing 100 then would
    hand a later restart a step the new run is about to write again (into the same directory)."""
    (source, source_token), (_, target_token) = registered, second
    job, allocation = running_job(acme, source, root)
    acme.client.post(f"/api/v1/jobs/{job.pk}/migrate/", {"node": "gpu-node-2"}, format="json")
    commit_checkpoint(source_token, allocation, root, job, 80, only_assignment(source_token)["checkpoint_request_id"])
    late = write(root, 100)
    assert report_checkpoint(source_token, allocation, late).status_code == 200  # reported, not yet verified
    status(source_token, allocation.pk, allocation.epoch, "stopped", reason="withdrawn")
    start = only_assignment(target_token)
    assert start["restore_from"].endswith("step-000000000080")

    checkpoints.checkpoint_verify(checkpoint_id=Checkpoint.objects.get(job=job, step=100).pk)
    stale = Checkpoint.objects.get(job=job, step=100)
    assert stale.state == "INVALID" and "a run the job has since left" in stale.problem
    assert only_assignment(target_token)["restore_from"].endswith("step-000000000080")
    assert checkpoints.committed_checkpoint(job).step == 80
