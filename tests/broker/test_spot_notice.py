"""Spot notices: the agent's heartbeat carries the cloud's notice; the broker drains the node and moves
its jobs off before the instance dies (a checkpointing job after its checkpoint is committed)."""
from __future__ import annotations

import time

import pytest

from broker.inventory.models import NodeState
from broker.jobs import checkpoints
from broker.jobs.models import Checkpoint, JobEvent
from broker.jobs.services import GpuRequest, allocation_commit, job_transition
from broker.jobs.states import JobState
from broker.scheduler.services import scheduling_cycle_run

from .test_agent_api import API, agent_client, registered, join_token  # noqa: F401 (fixtures)
from .test_api_tenancy import submit
from .test_checkpoints import report_checkpoint, root, running_job, verify_queue, write  # noqa: F401


def notice(seconds: float = 120.0, **overrides) -> dict:
    return {"kind": "spot", "action": "terminate", "deadline": time.time() + seconds, "source": "aws", **overrides}


def heartbeat(token, **body):
    return agent_client(token).post(f"{API}/heartbeat", {"processes": [], **body}, format="json")


def test_a_checkpointing_job_checkpoints_then_resumes_elsewhere(acme, registered, root, verify_queue):
    node, token = registered
    job, allocation = running_job(acme, node, root)
    assert heartbeat(token, interruption=notice()).status_code == 200
    node.refresh_from_db()
    assert node.state == NodeState.DRAINING and node.interruption["source"] == "aws"
    job.refresh_from_db()
    assert job.state == JobState.CHECKPOINTING
    event = JobEvent.objects.get(job=job, kind="node", reason_code="SPOT_NOTICE")
    assert "takes this spot instance back" in event.message and "terminate" in event.message
    (a,) = agent_client(token).get(f"{API}/assignments").json()["assignments"]
    assert a["action"] == "checkpoint"
    saved = write(root, 12)
    report_checkpoint(token, allocation, saved, request_id=a["checkpoint_request_id"])
    checkpoints.checkpoint_verify(checkpoint_id=Checkpoint.objects.get(job=job).pk)
    job.refresh_from_db()
    assert job.state == JobState.PENDING and job.pending_reason_code == "SPOT_INTERRUPTION"
    assert "step 12" in job.pending_reason
    allocation.refresh_from_db()
    assert not allocation.active and allocation.stop_unconfirmed  # the new start waits for the old stop
    # The drained node takes nothing new; the job goes to the other node and resumes from step 12.
    scheduling_cycle_run(tenant=acme.tenant)
    job.refresh_from_db()
    assert job.state == JobState.PLACED
    assert job.allocations.get(active=True).node_id != node.pk


def test_a_job_without_checkpoints_is_requeued_at_once_and_told_it_restarts(acme, registered):
    node, token = registered
    job = submit(acme, resources={"gpus": 1})
    allocation_commit(job=job, requests=[GpuRequest(node=node, gpu_indices=(0,))])
    for to in (JobState.STARTING, JobState.RUNNING):
        job = job_transition(job=job, to=to)
    heartbeat(token, interruption=notice(30, source="gcp"))
    job.refresh_from_db()
    assert job.state == JobState.PENDING and job.pending_reason_code == "SPOT_INTERRUPTION"
    assert "restarts from the beginning" in job.pending_reason


def test_the_answer_to_a_notice_carries_the_epoch_after_the_jobs_were_moved_off(acme, registered):
    node, token = registered
    job = submit(acme, resources={"gpus": 1})
    allocation_commit(job=job, requests=[GpuRequest(node=node, gpu_indices=(0,))])
    node.refresh_from_db()
    before = node.epoch
    resp = heartbeat(token, interruption=notice(30))
    assert resp.status_code == 200
    node.refresh_from_db()
    assert node.epoch > before, "the requeue released the job's GPUs"
    assert resp.json()["epoch"] == node.epoch, "the agent drops the old assignment at once"


def test_every_heartbeat_repeats_the_notice_but_it_acts_once(acme, registered, root, verify_queue):
    node, token = registered
    job, _ = running_job(acme, node, root)
    first = notice()
    for _ in range(3):
        assert heartbeat(token, interruption=first).status_code == 200
    assert JobEvent.objects.filter(job=job, kind="node", reason_code="SPOT_NOTICE").count() == 1
    assert JobEvent.objects.filter(job=job, kind="state", data__to="CHECKPOINTING").count() == 1


@pytest.mark.parametrize("bad", [{"kind": "maintenance"}, {"action": "explode"}, {"deadline": "soon"},
                                 {"source": "azure"}, {"extra": 1}])
def test_a_malformed_notice_is_a_400_and_changes_nothing(acme, registered, bad):
    node, token = registered
    resp = heartbeat(token, interruption=notice(**bad))
    assert resp.status_code == 400 and "interruption" in resp.json()
    node.refresh_from_db()
    assert node.state == NodeState.ONLINE and node.interruption == {}


def test_a_job_that_does_not_checkpoint_before_the_deadline_is_requeued_anyway(acme, registered, root,
                                                                               verify_queue):
    from datetime import timedelta

    from django.utils import timezone

    from broker.jobs.migration import migrations_sweep

    node, token = registered
    job, allocation = running_job(acme, node, root)
    earlier = write(root, 7)
    report_checkpoint(token, allocation, earlier)
    checkpoints.checkpoint_verify(checkpoint_id=Checkpoint.objects.get(job=job, step=7).pk)
    heartbeat(token, interruption=notice(60))
    assert migrations_sweep()["late"] == []
    assert len(migrations_sweep(now=timezone.now() + timedelta(seconds=50))["late"]) == 1  # 60 s minus the margin
    job.refresh_from_db()
    assert job.state == JobState.PENDING
    assert "resumes from step 7" in job.pending_reason and "loses the work since" in job.pending_reason
