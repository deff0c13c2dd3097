"""The dashboard shows what the team holds, what waits and why, what runs, and warns of lost nodes."""
from __future__ import annotations

from broker.inventory.models import NodeState
from broker.jobs.models import Job
from broker.jobs.services import job_transition
from broker.jobs.states import JobState
from broker.scheduler.services import scheduling_cycle_run
from tests.broker.test_api_tenancy import submit

from .conftest import text_of


def test_the_dashboard_counts_what_the_team_holds_waits_for_and_runs(acme, globex, as_viewer):
    placed = submit(acme, name="fits", resources={"gpus": 4, "gpu_models": ["A100-80GB"]})
    submit(acme, name="too-big", resources={"gpus": 16})
    submit(globex, name="theirs", resources={"gpus": 8})
    scheduling_cycle_run(tenant=acme.tenant)
    placed.refresh_from_db()
    job = job_transition(job=placed, to=JobState.STARTING)
    job_transition(job=job, to=JobState.RUNNING)
    waiting = Job.objects.get(name="too-big")

    resp = as_viewer.get("/")
    text = text_of(resp)
    assert "GPUs in use 4 of 16 GPUs" in text
    assert "Queue 1 pending jobs" in text and "Running 1 jobs running now" in text
    assert waiting.pending_reason_code and waiting.pending_reason_code in text
    assert "fits" in text and "theirs" not in text
    assert "A100-80GB" in text  # the by-model table under the chart


def test_a_checkpointing_job_still_counts_as_running(acme, as_viewer):
    job = submit(acme, name="ckpt", resources={"gpus": 1}, checkpoint={"uri": "s3://acme-ckpt/run1"})
    scheduling_cycle_run(tenant=acme.tenant)
    job.refresh_from_db()
    for state in (JobState.STARTING, JobState.RUNNING, JobState.CHECKPOINTING):
        job = job_transition(job=job, to=state)
    text = text_of(as_viewer.get("/"))
    assert "Running 1 jobs running now" in text and "Checkpointing" in text


def test_the_dashboard_warns_of_a_lost_node(acme, as_viewer):
    assert "lost" not in text_of(as_viewer.get("/")).lower()
    node = acme.nodes[1]
    node.state = NodeState.LOST
    node.save(update_fields=["state"])
    text = text_of(as_viewer.get("/"))
    assert f"1 node lost: {node.name}" in text


def test_the_htmx_refresh_answers_only_the_body(as_viewer):
    resp = as_viewer.get("/", HTTP_HX_REQUEST="true")
    assert resp.status_code == 200
    assert b"<html" not in resp.content and b"Queue" in resp.content
