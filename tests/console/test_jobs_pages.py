"""The jobs list and the job page: the team's jobs only, live state, why a job waits, and the cancel /
checkpoint / migrate buttons with the API's rules (404 for another team, 403 for a viewer or another
member's job, the API's refusal shown on the page)."""
from __future__ import annotations

import re

import pytest

from broker.jobs.models import Job, JobEvent, Migration
from broker.jobs.services import GpuRequest, allocation_commit, event_append, job_transition
from broker.jobs.selectors import gpu_catalog
from broker.jobs.services import job_submit
from broker.jobs.spec import JobSpecSerializer
from broker.jobs.states import JobState
from broker.scheduler.services import scheduling_cycle_run

from .conftest import Browser, text_of

HX = {"HTTP_HX_REQUEST": "true"}


def make_job(world, *, owner=None, **spec) -> Job:
    body = {"name": "train", "command": ["python", "train.py"], "resources": {"gpus": 1}, **spec}
    ser = JobSpecSerializer(data=body, context={"gpu_catalog": gpu_catalog()})
    ser.is_valid(raise_exception=True)
    return job_submit(tenant=world.tenant, owner=owner or world.admin, validated=ser.validated_data)


def running(world, *, owner=None, name="trainer") -> Job:
    """A RUNNING job on the world's first node, with a checkpoint URI (so it may checkpoint and move)."""
    job = make_job(world, owner=owner, name=name, checkpoint={"uri": "s3://acme-ckpt/run1"})
    allocation_commit(job=job, requests=[GpuRequest(node=world.nodes[0], gpu_indices=(0,))])
    for state in (JobState.STARTING, JobState.RUNNING):
        job = job_transition(job=job, to=state)
    return job


def state_of(job: Job) -> str:
    return Job.objects.values_list("state", flat=True).get(pk=job.pk)


# -- the list ---------------------------------------------------------------------------------------
def test_the_list_shows_the_own_teams_jobs_only(acme, globex, as_member):
    make_job(acme, name="acme-train")
    make_job(globex, name="globex-secret")
    text = text_of(as_member.get("/jobs/"))
    assert "acme-train" in text and "globex-secret" not in text
    assert "1 job" in text


def test_the_list_filters_by_state_name_and_owner(acme, as_member):
    mine = make_job(acme, owner=acme.member, name="member-run")
    theirs = make_job(acme, name="admin-run")
    job_transition(job=theirs, to=JobState.CANCELLED)
    assert "admin-run" in text_of(as_member.get("/jobs/?state=CANCELLED"))
    assert "member-run" not in text_of(as_member.get("/jobs/?state=CANCELLED"))
    both = text_of(as_member.get("/jobs/?state=CANCELLED&state=PENDING"))
    assert "admin-run" in both and "member-run" in both
    assert "admin-run" not in text_of(as_member.get("/jobs/?owner=mine"))
    assert "member-run" in text_of(as_member.get("/jobs/?owner=mine"))
    named = text_of(as_member.get("/jobs/?name=ADMIN"))
    assert "admin-run" in named and "member-run" not in named
    assert mine.pk != theirs.pk


@pytest.mark.parametrize("query, field", [("state=SLEEPING", "f-state-error"), ("priority=high%21", "f-priority-error")])
def test_a_bad_filter_answers_400_with_the_error_next_to_it(acme, as_admin, query, field):
    make_job(acme, name="visible")
    resp = as_admin.get(f"/jobs/?{query}")
    assert resp.status_code == 400
    html = resp.content.decode()
    assert re.search(rf'id="{field}">[^<]*(valid choice|Enter a number)', html), html[:3000]
    assert "visible" not in text_of(resp)


def test_the_list_is_paginated_newest_first(acme, as_admin):
    for i in range(27):
        make_job(acme, name=f"job-{i:02d}")
    first = text_of(as_admin.get("/jobs/"))
    assert "job-26" in first and "job-02" in first and "job-01" not in first
    assert "page 1 of 2" in first
    second = text_of(as_admin.get("/jobs/?page=2"))
    assert "job-01" in second and "job-00" in second and "job-26" not in second


def test_the_table_body_polls_and_answers_204_while_nothing_changed(acme, as_admin):
    job = make_job(acme, name="watched")
    page = as_admin.get("/jobs/").content.decode()
    tbody = re.search(r'<tbody id="jobs-rows"[^>]*>', page).group(0)
    assert 'hx-trigger="every 5s"' in tbody
    digest = re.search(r'"digest": "([0-9a-f]+)"', tbody).group(1)
    fragment = as_admin.get("/jobs/", {"digest": "stale"}, HTTP_HX_TARGET="jobs-rows", **HX)
    body = fragment.content.decode()
    assert fragment.status_code == 200 and body.startswith("<tbody") and "<html" not in body and "watched" in body
    assert as_admin.get("/jobs/", {"digest": digest}, HTTP_HX_TARGET="jobs-rows", **HX).status_code == 204
    job_transition(job=job, to=JobState.CANCELLED)
    changed = as_admin.get("/jobs/", {"digest": digest}, HTTP_HX_TARGET="jobs-rows", **HX)
    assert changed.status_code == 200 and "Cancelled" in text_of(changed)


def test_the_list_shows_where_a_job_runs_and_its_gpus(acme, as_admin):
    job = running(acme, name="placed-one")
    make_job(acme, name="gang", resources={"gpus": 4, "nodes": 2, "gpu_models": ["A100-80GB"]})
    text = text_of(as_admin.get("/jobs/"))
    assert f"{job.pk} placed-one Running" in text and acme.nodes[0].name in text
    assert "4 GPUs × 2 nodes A100-80GB" in text


# -- the job page -----------------------------------------------------------------------------------
def test_the_job_page_shows_why_it_waits_after_a_cycle_and_the_timeline(acme, as_member):
    job = make_job(acme, name="too-big", resources={"gpus": 16})
    before = text_of(as_member.get(f"/jobs/{job.pk}/"))
    assert "NOT_YET_SCHEDULED" in before
    scheduling_cycle_run(tenant=acme.tenant)
    text = text_of(as_member.get(f"/jobs/{job.pk}/"))
    assert "Pending" in text and "INSUFFICIENT_GPUS" in text
    assert "fewer than 16 free GPUs" in text  # the engine's sentence
    assert "Nodes total 2" in text and "Nodes fit 0" in text  # its numbers, as a table
    timeline = text.split("Timeline", 1)[1]
    assert timeline.index("submitted") < timeline.index("pending_reason INSUFFICIENT_GPUS")


def test_the_job_page_shows_where_it_runs_and_the_output_tail(acme, as_admin):
    job = running(acme)
    event_append(job=job, kind="run", message="exited", data={"output_tail": "epoch 3 loss 0.12\ndone"})
    text = text_of(as_admin.get(f"/jobs/{job.pk}/"))
    where = text.split("Where it runs", 1)[1].split("Why it waits", 1)[0]
    assert acme.nodes[0].name in where and "0 A100-80GB" in where and "onprem" in where
    assert "epoch 3 loss 0.12" in text
    assert "Cost so far $0.00" in text


def test_a_finished_jobs_live_part_stops_polling(acme, as_admin):
    job = make_job(acme)
    page = as_admin.get(f"/jobs/{job.pk}/").content.decode()
    assert 'id="job-live" hx-get' in page and 'hx-trigger="every 5s"' in page
    job_transition(job=job, to=JobState.CANCELLED)
    poll = as_admin.get(f"/jobs/{job.pk}/", {"digest": "old"}, HTTP_HX_TARGET="job-live", **HX)
    assert poll.status_code == 286  # htmx: swap this, then stop polling
    assert "Cancelled" in text_of(poll) and "hx-trigger" not in poll.content.decode()
    assert "hx-trigger" not in as_admin.get(f"/jobs/{job.pk}/").content.decode().split('id="job-live"')[1][:200]


def test_another_teams_job_is_404_on_the_page_and_every_action(acme, globex, as_other_team):
    job = running(acme)
    assert as_other_team.get(f"/jobs/{job.pk}/").status_code == 404
    for action in ("cancel", "checkpoint", "migrate"):
        assert as_other_team.submit(f"/jobs/{job.pk}/{action}/", {"target": ""}).status_code == 404
    assert state_of(job) == JobState.RUNNING and not Migration.objects.exists()
    assert as_other_team.get("/jobs/99999999999999999999999/").status_code == 404
    assert "trainer" not in text_of(as_other_team.get("/jobs/"))


def test_a_viewer_sees_no_buttons_and_cannot_post_any_action(acme, as_viewer):
    job = running(acme)
    page = as_viewer.get(f"/jobs/{job.pk}/")
    assert "Cancel job" not in text_of(page) and "role in this team is viewer" in text_of(page)
    events = JobEvent.objects.count()
    for action in ("cancel", "checkpoint", "migrate"):
        assert as_viewer.submit(f"/jobs/{job.pk}/{action}/", {"target": ""}).status_code == 403
    assert state_of(job) == JobState.RUNNING and JobEvent.objects.count() == events
    assert not Migration.objects.exists()


def test_a_member_cannot_cancel_another_members_job_but_the_admin_can(acme, as_member, as_admin):
    admins = make_job(acme, name="admins-job")
    page = text_of(as_member.get(f"/jobs/{admins.pk}/"))
    assert "Cancel job" not in page and "Members change only their own jobs" in page
    refused = as_member.submit(f"/jobs/{admins.pk}/cancel/")
    assert refused.status_code == 403 and "own jobs" in text_of(refused)
    assert state_of(admins) == JobState.PENDING

    members = make_job(acme, owner=acme.member, name="members-job")
    resp = as_admin.submit(f"/jobs/{members.pk}/cancel/")
    assert resp.status_code == 302 and resp.url == f"/jobs/{members.pk}/"
    assert state_of(members) == JobState.CANCELLED


def test_cancel_from_the_page_changes_the_state_and_a_second_cancel_says_why_not(acme, as_member):
    job = make_job(acme, owner=acme.member)
    assert "Cancel job" in text_of(as_member.get(f"/jobs/{job.pk}/"))
    resp = as_member.submit(f"/jobs/{job.pk}/cancel/")
    assert resp.status_code == 302
    page = text_of(as_member.get(resp.url))
    assert f"Job {job.pk} cancelled." in page and "Cancelled" in page
    assert state_of(job) == JobState.CANCELLED
    again = as_member.submit(f"/jobs/{job.pk}/cancel/")
    assert again.status_code == 409
    assert "A job cannot go from CANCELLED to CANCELLED." in text_of(again)


def test_checkpoint_now_and_its_refusal_for_a_job_without_a_checkpoint_uri(acme, as_admin):
    job = running(acme)
    resp = as_admin.submit(f"/jobs/{job.pk}/checkpoint/")
    assert resp.status_code == 302 and state_of(job) == JobState.CHECKPOINTING
    assert JobEvent.objects.filter(job=job, reason_code="USER_CHECKPOINT").exists()

    plain = make_job(acme)
    page = text_of(as_admin.get(f"/jobs/{plain.pk}/"))
    assert "The spec has no checkpoint.uri." in page
    refused = as_admin.submit(f"/jobs/{plain.pk}/checkpoint/")
    assert refused.status_code == 409
    assert "no checkpoint.uri in its spec" in text_of(refused) and state_of(plain) == JobState.PENDING


def test_migrate_to_a_chosen_node_starts_a_move(acme, as_admin):
    job = running(acme)
    page = as_admin.get(f"/jobs/{job.pk}/").content.decode()
    assert f'value="node:{acme.nodes[1].name}"' in page and 'value="pool:onprem"' in page
    resp = as_admin.submit(f"/jobs/{job.pk}/migrate/", {"target": f"node:{acme.nodes[1].name}"})
    assert resp.status_code == 302, text_of(resp)
    move = Migration.objects.get(job=job)
    assert move.target_node == acme.nodes[1].name and move.source_node == acme.nodes[0].name
    assert state_of(job) == JobState.CHECKPOINTING
    text = text_of(as_admin.get(f"/jobs/{job.pk}/"))
    assert "A move is under way." in text and f"{acme.nodes[0].name} → {acme.nodes[1].name}" in text
    again = as_admin.submit(f"/jobs/{job.pk}/migrate/", {"target": ""})
    assert again.status_code == 409 and "being moved already" in text_of(again)


@pytest.mark.parametrize("target, words", [("bogus", "Choose a node, a pool"), ("node:" + "n" * 300, "200 characters"),
                                           ("node:no-such-node", "no room for the job there")])
def test_a_bad_migrate_target_is_refused_on_the_page(acme, as_admin, target, words):
    job = running(acme)
    resp = as_admin.submit(f"/jobs/{job.pk}/migrate/", {"target": target})
    assert resp.status_code in (400, 409) and words in text_of(resp)
    assert state_of(job) == JobState.RUNNING and not Migration.objects.exists()


def test_actions_are_posts(acme, as_admin):
    job = make_job(acme)
    assert as_admin.get(f"/jobs/{job.pk}/cancel/").status_code == 405
    assert state_of(job) == JobState.PENDING


def test_the_buttons_follow_the_job_without_a_reload(acme, as_admin):
    job = make_job(acme, name="soon-running", checkpoint={"uri": "s3://acme-ckpt/run2"})
    allocation_commit(job=job, requests=[GpuRequest(node=acme.nodes[0], gpu_indices=(0,))])
    page = as_admin.get(f"/jobs/{job.pk}/").content.decode()
    actions = re.search(r'<div id="job-actions"[^>]*>', page).group(0)
    digest = re.search(r'"digest": "([0-9a-f]+)"', actions).group(1)
    assert re.search(r"<button type=\"submit\" disabled[^>]*>Migrate</button>", page)  # placed, not running yet
    poll = {"digest": digest}
    assert as_admin.get(f"/jobs/{job.pk}/", poll, HTTP_HX_TARGET="job-actions", **HX).status_code == 204
    for state in (JobState.STARTING, JobState.RUNNING):
        job = job_transition(job=job, to=state)
    fresh = as_admin.get(f"/jobs/{job.pk}/", poll, HTTP_HX_TARGET="job-actions", **HX)
    html = fresh.content.decode()
    assert fresh.status_code == 200 and html.startswith('<div id="job-actions"') and "Timeline" not in html
    assert re.search(r'<button type="submit">Migrate</button>', html)


def test_the_priority_filter_keeps_a_number_that_has_no_name(acme, as_admin):
    make_job(acme, name="custom", priority=75)
    make_job(acme, name="plain")
    resp = as_admin.get("/jobs/?priority=75")
    assert "custom" in text_of(resp) and "plain" not in text_of(resp)
    assert '<option value="75" selected>75</option>' in resp.content.decode()
