"""Checkpoints on the broker: reported by the agent, re-read and committed (or refused), requested,
timed out, pruned, and handed to the next start as `restore_from`.

The checkpoints are real: written by the job author's helper (agent/checkpoint) into a checkpoint
root on disk, exactly as a job would write them.
"""
from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
from django.utils import timezone

from agent.checkpoint import Checkpointer
from broker.agents.models import AssignmentReport
from broker.jobs import checkpoints
from broker.jobs.models import Checkpoint, CheckpointState, Job, JobEvent
from broker.jobs.services import GpuRequest, allocation_commit, job_requeue, job_transition
from broker.jobs.states import JobState

from .test_agent_api import API, agent_client, registered, join_token  # noqa: F401 (fixtures)
from .test_api_tenancy import submit
from tests.providers.conftest import moto_endpoint  # noqa: F401 (fixture)


@pytest.fixture
def root(settings, tmp_path) -> Path:
    settings.WHALEZEN_CHECKPOINT_ROOTS = [str(tmp_path)]
    return tmp_path


@pytest.fixture
def verify_queue(monkeypatch) -> list[int]:
    """The ids the broker hands to the verify task (the task itself is `checkpoint_verify`)."""
    queued: list[int] = []
    monkeypatch.setattr(checkpoints, "_enqueue_verify", queued.append)
    return queued


def running_job(acme, node, root: Path, gpu: int = 0, **spec) -> tuple[Job, object]:
    job = submit(acme, resources={"gpus": 1}, checkpoint={"uri": str(root / "train"), **spec})
    (allocation,) = allocation_commit(job=job, requests=[GpuRequest(node=node, gpu_indices=(gpu,))])
    for to in (JobState.STARTING, JobState.RUNNING):
        job = job_transition(job=job, to=to)
    return job, allocation


def write(root: Path, step: int, payload: bytes = b"weights", request_id: str | None = None):
    """What the job does: save through the helper (files, then the manifest)."""
    saver = Checkpointer(str(root / "train"), env={})
    return saver.save(step, {"model.bin": payload * 100, "optimizer.bin": b"adam"})


def report_checkpoint(token, allocation, saved, request_id=None, **overrides):
    checkpoint = {"step": saved.step, "uri": saved.uri, "manifest_sha256": saved.manifest_sha256,
                  "request_id": request_id, **overrides}
    body = {"epoch": allocation.epoch, "state": "checkpoint_written", "message": f"checkpoint at step {saved.step}",
            "checkpoint": checkpoint}
    return agent_client(token).post(f"{API}/assignments/{allocation.pk}/status", body, format="json")


def test_a_reported_checkpoint_is_verified_committed_and_listed(acme, registered, root, verify_queue,
                                                                 django_capture_on_commit_callbacks):
    node, token = registered
    job, allocation = running_job(acme, node, root)
    saved = write(root, 40)
    with django_capture_on_commit_callbacks(execute=True):
        resp = report_checkpoint(token, allocation, saved)
        again = report_checkpoint(token, allocation, saved)  # the agent's outbox may send it twice
    assert resp.status_code == 200 and again.status_code == 200
    (checkpoint,) = Checkpoint.objects.filter(job=job)
    assert verify_queue == [checkpoint.pk] and checkpoint.state == CheckpointState.PENDING
    checkpoints.checkpoint_verify(checkpoint_id=checkpoint.pk)
    body = acme.client.get(f"/api/v1/jobs/{job.pk}/checkpoints/").json()["results"]
    assert [(c["step"], c["state"], c["written_on"]) for c in body] == [(40, "COMMITTED", node.name)]
    assert body[0]["size_bytes"] == len(b"weights") * 100 + len(b"adam")
    messages = list(JobEvent.objects.filter(job=job, kind="checkpoint").values_list("reason_code", "message"))
    assert messages[0] == ("CHECKPOINT_WRITTEN", "Checkpoint at step 40 written; verifying it.")
    assert messages[1][0] == "CHECKPOINT_COMMITTED" and "step 40" in messages[1][1]
    job.refresh_from_db()
    assert job.state == JobState.RUNNING


def test_a_checkpoint_report_leaves_the_process_state_as_reported(acme, registered, root, verify_queue):
    node, token = registered
    job, allocation = running_job(acme, node, root)
    body = {"epoch": allocation.epoch, "state": "running", "message": "running", "pid": 4242}
    assert agent_client(token).post(f"{API}/assignments/{allocation.pk}/status", body, format="json").status_code == 200
    assert report_checkpoint(token, allocation, write(root, 3)).status_code == 200
    assert AssignmentReport.objects.get(allocation=allocation).state == "running"


def test_a_flipped_byte_is_never_committed_and_the_previous_checkpoint_is_what_a_restart_gets(
        acme, registered, root, verify_queue):
    node, token = registered
    job, allocation = running_job(acme, node, root)
    good = write(root, 10)
    report_checkpoint(token, allocation, good)
    checkpoints.checkpoint_verify(checkpoint_id=Checkpoint.objects.get(step=10).pk)
    torn = write(root, 20)
    data = Path(torn.uri) / "model.bin"
    raw = bytearray(data.read_bytes())
    raw[7] ^= 0x01  # one bit of one byte, after the manifest was written
    data.write_bytes(bytes(raw))
    report_checkpoint(token, allocation, torn)
    bad = checkpoints.checkpoint_verify(checkpoint_id=Checkpoint.objects.get(step=20).pk)
    assert bad.state == CheckpointState.INVALID and "model.bin" in bad.problem
    event = JobEvent.objects.filter(job=job, reason_code="CHECKPOINT_INVALID").get()
    assert "never be restored" in event.message
    assert checkpoints.committed_checkpoint(job).step == 10
    # The node is lost and the job restarts: its next start is told to resume from step 10, not 20.
    job_requeue(job=job, reason_code="NODE_LOST", message="lost")
    (allocation2,) = allocation_commit(job=Job.objects.get(pk=job.pk),
                                       requests=[GpuRequest(node=node, gpu_indices=(1,))])
    (a,) = agent_client(token).get(f"{API}/assignments").json()["assignments"]
    assert a["id"] == str(allocation2.pk) and a["restore_from"] == good.uri


def test_a_torn_write_without_a_manifest_is_invalid(acme, registered, root, verify_queue):
    node, token = registered
    job, allocation = running_job(acme, node, root)
    saved = write(root, 5)
    (Path(saved.uri) / "manifest.json").unlink()
    report_checkpoint(token, allocation, saved)
    checkpoint = checkpoints.checkpoint_verify(checkpoint_id=Checkpoint.objects.get(job=job).pk)
    assert checkpoint.state == CheckpointState.INVALID and "manifest.json is missing" in checkpoint.problem
    assert checkpoints.committed_checkpoint(job) is None


def test_a_manifest_other_than_the_reported_one_is_refused(acme, registered, root, verify_queue):
    node, token = registered
    job, allocation = running_job(acme, node, root)
    saved = write(root, 5)
    report_checkpoint(token, allocation, saved, manifest_sha256="0" * 64)
    checkpoint = checkpoints.checkpoint_verify(checkpoint_id=Checkpoint.objects.get(job=job).pk)
    assert checkpoint.state == CheckpointState.INVALID and "not the one the job reported" in checkpoint.problem


@pytest.mark.parametrize("uri", ["/etc", "/etc/step-000000000001", "{root}/other/step-000000000001",
                                 "{root}/train/../../etc/step-000000000001", "{root}/train/notastep",
                                 "s3://someone-else/train/step-000000000001"])
def test_a_node_cannot_point_the_broker_at_paths_the_job_never_named(acme, registered, root, verify_queue, uri):
    node, token = registered
    job, allocation = running_job(acme, node, root)
    saved = write(root, 1)
    resp = report_checkpoint(token, allocation, saved, uri=uri.format(root=root))
    assert resp.status_code == 400, resp.content
    assert "checkpoint" in "".join(resp.json())
    assert not Checkpoint.objects.filter(job=job).exists() and verify_queue == []


@pytest.mark.parametrize("checkpoint", [
    {"step": -1}, {"step": "1"}, {"manifest_sha256": "ABC"}, {"uri": 5}, {"request_id": "x" * 200}, {"extra": 1}])
def test_malformed_checkpoint_reports_are_a_400_naming_the_field(acme, registered, root, checkpoint):
    node, token = registered
    job, allocation = running_job(acme, node, root)
    saved = write(root, 1)
    resp = report_checkpoint(token, allocation, saved, **checkpoint)
    assert resp.status_code == 400 and "checkpoint" in resp.json()
    assert not Checkpoint.objects.filter(job=job).exists()


def test_a_checkpoint_report_needs_its_checkpoint_and_only_that_state_carries_one(acme, registered, root):
    node, token = registered
    _, allocation = running_job(acme, node, root)
    client = agent_client(token)
    url = f"{API}/assignments/{allocation.pk}/status"
    assert client.post(url, {"epoch": allocation.epoch, "state": "checkpoint_written"}, format="json").status_code == 400
    bad = {"epoch": allocation.epoch, "state": "running",
           "checkpoint": {"step": 1, "uri": "/x/step-000000000001", "manifest_sha256": "a" * 64}}
    assert client.post(url, bad, format="json").status_code == 400


def test_only_the_newest_two_committed_checkpoints_are_kept_on_storage(acme, registered, root, verify_queue):
    node, token = registered
    job, allocation = running_job(acme, node, root)
    for step in (1, 2, 3, 4):
        saved = write(root, step)
        report_checkpoint(token, allocation, saved)
        checkpoints.checkpoint_verify(checkpoint_id=Checkpoint.objects.get(job=job, step=step).pk)
    states = dict(Checkpoint.objects.filter(job=job).values_list("step", "state"))
    assert states == {1: "DELETED", 2: "DELETED", 3: "COMMITTED", 4: "COMMITTED"}
    assert sorted(p.name for p in (root / "train").iterdir()) == ["step-000000000003", "step-000000000004"]


def test_checkpoint_on_request_moves_the_job_through_checkpointing_and_back(acme, registered, root,
                                                                            verify_queue):
    node, token = registered
    job, allocation = running_job(acme, node, root)
    resp = acme.client.post(f"/api/v1/jobs/{job.pk}/checkpoint/")
    assert resp.status_code == 202 and resp.json()["state"] == "CHECKPOINTING"
    (a,) = agent_client(token).get(f"{API}/assignments").json()["assignments"]
    assert a["action"] == "checkpoint" and a["checkpoint_request_id"]
    saved = write(root, 77)
    report_checkpoint(token, allocation, saved, request_id=a["checkpoint_request_id"])
    checkpoints.checkpoint_verify(checkpoint_id=Checkpoint.objects.get(job=job).pk)
    job.refresh_from_db()
    assert job.state == JobState.RUNNING
    last = JobEvent.objects.filter(job=job, kind="state").latest("id")
    assert last.reason_code == "CHECKPOINT_COMMITTED" and "step 77" in last.message


def test_a_request_nobody_answers_times_out_and_the_job_runs_on(acme, registered, root, settings):
    node, _ = registered
    settings.WHALEZEN_CHECKPOINT_TIMEOUT_SECONDS = 60
    job, _ = running_job(acme, node, root)
    checkpoints.checkpoint_request(job=job, reason_code="USER_CHECKPOINT", message="now")
    assert checkpoints.checkpoints_sweep(now=timezone.now() + timedelta(seconds=30)).timed_out == []
    outcome = checkpoints.checkpoints_sweep(now=timezone.now() + timedelta(seconds=61))
    assert outcome.timed_out == [job.pk]
    job.refresh_from_db()
    assert job.state == JobState.RUNNING
    assert JobEvent.objects.filter(job=job, reason_code="CHECKPOINT_TIMED_OUT").exists()


def test_the_sweep_asks_for_a_checkpoint_when_the_interval_has_passed(acme, registered, root):
    node, _ = registered
    job, _ = running_job(acme, node, root, interval_seconds=30)
    assert checkpoints.checkpoints_sweep(now=timezone.now() + timedelta(seconds=10)).requested == []
    assert checkpoints.checkpoints_sweep(now=timezone.now() + timedelta(seconds=31)).requested == [job.pk]
    job.refresh_from_db()
    assert job.state == JobState.CHECKPOINTING
    assert JobEvent.objects.filter(job=job, reason_code="CHECKPOINT_DUE").exists()


def test_a_job_without_checkpoint_uri_cannot_be_asked_and_viewers_cannot_ask(acme, registered, root):
    node, _ = registered
    job = submit(acme, resources={"gpus": 1})
    allocation_commit(job=job, requests=[GpuRequest(node=node, gpu_indices=(0,))])
    for to in (JobState.STARTING, JobState.RUNNING):
        job = job_transition(job=job, to=to)
    resp = acme.client.post(f"/api/v1/jobs/{job.pk}/checkpoint/")
    assert resp.status_code == 409 and "checkpoint" in resp.json()
    with_uri, _ = running_job(acme, node, root, gpu=1)
    assert acme.viewer_client.post(f"/api/v1/jobs/{with_uri.pk}/checkpoint/").status_code == 403


def test_another_tenants_checkpoints_are_not_found(acme, globex, registered, root):
    node, _ = registered
    job, _ = running_job(acme, node, root)
    assert globex.client.get(f"/api/v1/jobs/{job.pk}/checkpoints/").status_code == 404
    assert globex.client.post(f"/api/v1/jobs/{job.pk}/checkpoint/").status_code == 404


def test_a_pending_job_cannot_checkpoint(acme, root):
    job = submit(acme, resources={"gpus": 1}, checkpoint={"uri": str(root / "train")})
    resp = acme.client.post(f"/api/v1/jobs/{job.pk}/checkpoint/")
    assert resp.status_code == 409 and "state" in resp.json()


def test_interval_seconds_and_minutes_are_one_or_the_other(acme, root):
    resp = acme.client.post("/api/v1/jobs/", {"name": "j", "command": ["true"], "resources": {"gpus": 1},
                                              "checkpoint": {"uri": str(root / "t"), "interval_seconds": 5}},
                            format="json")
    assert resp.status_code == 400 and "checkpoint" in resp.json()
    resp = acme.client.post("/api/v1/jobs/", {"name": "j", "command": ["true"], "resources": {"gpus": 1},
                                              "checkpoint": {"uri": str(root / "t"), "interval_seconds": 60,
                                                             "interval_minutes": 1}}, format="json")
    assert resp.status_code == 400


def test_s3_checkpoints_are_verified_by_reading_them_back_from_s3(acme, registered, moto_endpoint, settings,
                                                                  verify_queue):
    """The broker re-reads S3 itself (moto's S3 server here): a good checkpoint commits, one whose
    object was overwritten after the manifest does not."""
    import boto3

    settings.WHALEZEN_CHECKPOINT_S3_ENDPOINT_URL = moto_endpoint
    client = boto3.client("s3", region_name="us-east-1", endpoint_url=moto_endpoint)
    client.create_bucket(Bucket="acme-ckpt")
    node, token = registered
    job = submit(acme, resources={"gpus": 1}, checkpoint={"uri": "s3://acme-ckpt/llama"})
    (allocation,) = allocation_commit(job=job, requests=[GpuRequest(node=node, gpu_indices=(2,))])
    saver = Checkpointer("s3://acme-ckpt/llama", env={}, s3_client=client)
    good, bad = saver.save(100, {"model.bin": b"w" * 4096}), saver.save(200, {"model.bin": b"w" * 4096})
    client.put_object(Bucket="acme-ckpt", Key="llama/step-000000000200/model.bin", Body=b"x" + b"w" * 4095)
    for saved in (good, bad):
        assert report_checkpoint(token, allocation, saved).status_code == 200
        checkpoints.checkpoint_verify(checkpoint_id=Checkpoint.objects.get(job=job, step=saved.step).pk)
    states = dict(Checkpoint.objects.filter(job=job).values_list("step", "state"))
    assert states == {100: "COMMITTED", 200: "INVALID"}
    assert checkpoints.committed_checkpoint(job).uri == "s3://acme-ckpt/llama/step-000000000100"


def test_a_checkpoint_the_job_already_pruned_is_marked_deleted(acme, registered, root, verify_queue):
    import shutil

    node, token = registered
    job, allocation = running_job(acme, node, root)
    saved = [write(root, step) for step in (1, 2, 3)]
    for one in saved:
        report_checkpoint(token, allocation, one)
        checkpoints.checkpoint_verify(checkpoint_id=Checkpoint.objects.get(job=job, step=one.step).pk)
        if one.step == 2:
            shutil.rmtree(saved[0].uri)  # the job's helper pruned it (keep=2) before the broker did
    states = dict(Checkpoint.objects.filter(job=job).values_list("step", "state"))
    assert states == {1: "DELETED", 2: "COMMITTED", 3: "COMMITTED"}
