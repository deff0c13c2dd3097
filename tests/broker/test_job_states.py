"""The job state machine: legal edges work, every illegal one is refused, races have one winner."""
from __future__ import annotations

import itertools
import re
import threading
from pathlib import Path

import pytest
from django.db import close_old_connections, connection

from broker.jobs.models import Job, JobEvent
from broker.jobs.services import IllegalTransition, StaleState, job_cancel, job_transition
from broker.jobs.states import LEGAL_TRANSITIONS, TERMINAL_STATES, JobState

from .conftest import requires_postgres
from .test_api_tenancy import submit

# The legal edges, written out by hand. Not derived from LEGAL_TRANSITIONS: a test that reads its
# expectation from the code under test passes whatever the code says. docs/job-spec.md carries the same
# table for users, and `test_the_state_table_is_the_documented_one` holds all three to each other.
EXPECTED_EDGES: dict[str, set[str]] = {
    "PENDING": {"PLACED", "CANCELLED", "FAILED"},
    "PLACED": {"PROVISIONING", "STARTING", "PENDING", "CANCELLED", "FAILED"},
    "PROVISIONING": {"STARTING", "PENDING", "CANCELLED", "FAILED"},
    "STARTING": {"RUNNING", "PENDING", "SUCCEEDED", "FAILED", "CANCELLED"},
    "RUNNING": {"CHECKPOINTING", "PREEMPTED", "PENDING", "SUCCEEDED", "FAILED", "CANCELLED"},
    "CHECKPOINTING": {"RUNNING", "MIGRATING", "PREEMPTED", "SUCCEEDED", "FAILED", "CANCELLED"},
    "MIGRATING": {"PLACED", "PENDING", "SUCCEEDED", "FAILED", "CANCELLED"},
    "PREEMPTED": {"PENDING", "CANCELLED", "FAILED"},
    "SUCCEEDED": set(),
    "FAILED": set(),
    "CANCELLED": set(),
}
ALL_STATES = sorted(EXPECTED_EDGES)
LEGAL = [(a, b) for a in ALL_STATES for b in sorted(EXPECTED_EDGES[a])]
ILLEGAL = [(a, b) for a, b in itertools.product(ALL_STATES, ALL_STATES) if b not in EXPECTED_EDGES[a]]
DOCS = Path(__file__).resolve().parents[2] / "docs" / "job-spec.md"


def documented_edges() -> dict[str, set[str]]:
    """The "from | may go to" table of docs/job-spec.md's States section."""
    section = DOCS.read_text().split("## States", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([A-Z]+)` \| (.*) \|$", section, flags=re.MULTILINE)
    return {old: set(re.findall(r"`([A-Z]+)`", targets)) for old, targets in rows}


def test_the_state_table_is_the_documented_one():
    assert documented_edges() == EXPECTED_EDGES
    assert {old: set(new) for old, new in LEGAL_TRANSITIONS.items()} == EXPECTED_EDGES
    assert set(ALL_STATES) == {s.value for s in JobState}
    assert TERMINAL_STATES == {old for old, new in EXPECTED_EDGES.items() if not new}


def force_state(job: Job, state: str) -> Job:
    Job.objects.filter(pk=job.pk).update(state=state)
    job.refresh_from_db()
    return job


@pytest.mark.parametrize("old,new", ILLEGAL, ids=[f"{a}->{b}" for a, b in ILLEGAL])
def test_illegal_transition_is_refused_and_changes_nothing(acme, old, new):
    job = force_state(submit(acme), old)
    events = JobEvent.objects.filter(job=job).count()
    with pytest.raises(IllegalTransition):
        job_transition(job=job, to=new)
    job.refresh_from_db()
    assert job.state == old
    assert JobEvent.objects.filter(job=job).count() == events


@pytest.mark.parametrize("old,new", LEGAL, ids=[f"{a}->{b}" for a, b in LEGAL])
def test_each_legal_transition_is_taken_and_logged(acme, old, new):
    job = force_state(submit(acme), old)
    job = job_transition(job=job, to=new)
    assert job.state == new
    event = JobEvent.objects.filter(job=job, kind="state").latest("id")
    assert event.data["from"] == old and event.data["to"] == new
    assert (job.finished_at is not None) == (new in {"SUCCEEDED", "FAILED", "CANCELLED"})


def test_a_full_life_appends_one_event_per_step(acme):
    job = submit(acme)
    for state in [JobState.PLACED, JobState.STARTING, JobState.RUNNING, JobState.CHECKPOINTING,
                  JobState.MIGRATING, JobState.PLACED, JobState.STARTING, JobState.RUNNING, JobState.SUCCEEDED]:
        job = job_transition(job=job, to=state)
    kinds = list(JobEvent.objects.filter(job=job).values_list("kind", "data__to"))
    assert kinds[0] == ("submitted", None)
    assert [k for k in kinds[1:]] == [("state", s) for s in
                                      ["PLACED", "STARTING", "RUNNING", "CHECKPOINTING", "MIGRATING", "PLACED",
                                       "STARTING", "RUNNING", "SUCCEEDED"]]
    assert job.finished_at is not None and job.started_at is not None


def test_stale_caller_loses(acme):
    job = submit(acme)
    stale_copy = Job.objects.get(pk=job.pk)
    job_transition(job=job, to=JobState.PLACED)
    with pytest.raises(StaleState):
        job_transition(job=stale_copy, to=JobState.CANCELLED, expected=JobState.PENDING)


def test_a_caller_acting_on_a_stale_view_loses_without_naming_the_state(acme):
    """The state the caller loaded is the one compared: reading it afresh would let the stale caller win."""
    job = force_state(submit(acme), JobState.RUNNING)
    stale_copy = Job.objects.get(pk=job.pk)  # e.g. the agent's report handler, loaded before the node was lost
    job_transition(job=job, to=JobState.PENDING, reason_code="NODE_LOST")  # legal from RUNNING...
    with pytest.raises(StaleState) as caught:
        job_transition(job=stale_copy, to=JobState.CANCELLED)  # ...and so is RUNNING/PENDING -> CANCELLED
    assert (caught.value.expected, caught.value.actual) == ("RUNNING", "PENDING")
    job.refresh_from_db()
    assert job.state == JobState.PENDING
    assert not JobEvent.objects.filter(job=job, data__to="CANCELLED").exists()


def test_a_stale_success_report_cannot_finish_a_requeued_job(acme):
    job = force_state(submit(acme), JobState.RUNNING)
    stale_copy = Job.objects.get(pk=job.pk)
    job_transition(job=job, to=JobState.PENDING, reason_code="NODE_LOST")
    with pytest.raises(StaleState):
        job_transition(job=stale_copy, to=JobState.SUCCEEDED)
    job.refresh_from_db()
    assert job.state == JobState.PENDING and job.finished_at is None


def test_cancel_through_api_then_cancel_again_is_409(acme):
    job = submit(acme)
    resp = acme.client.post(f"/api/v1/jobs/{job.pk}/cancel/")
    assert resp.status_code == 200 and resp.json()["state"] == "CANCELLED"
    again = acme.client.post(f"/api/v1/jobs/{job.pk}/cancel/")
    assert again.status_code == 409 and "state" in again.json()
    events = acme.client.get(f"/api/v1/jobs/{job.pk}/events/").json()["results"]
    assert [e["reason_code"] for e in events if e["kind"] == "state"] == ["USER_CANCELLED"]


@pytest.mark.parametrize("state", sorted(TERMINAL_STATES))
def test_finished_jobs_cannot_be_cancelled(acme, state):
    job = force_state(submit(acme), state)
    with pytest.raises(IllegalTransition):
        job_cancel(job=job)


@requires_postgres
@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_concurrent_cancel_and_start_have_exactly_one_winner(acme):
    """Two threads, two connections: one cancels while the other moves the job on. One wins, one loses."""
    for round_ in range(5):
        job = force_state(submit(acme, name=f"race-{round_}"), JobState.STARTING)
        barrier = threading.Barrier(2)
        outcomes: dict[str, str] = {}

        def run(label: str, action) -> None:
            close_old_connections()
            try:
                mine = Job.objects.get(pk=job.pk)
                barrier.wait()
                action(mine)
                outcomes[label] = "won"
            except (StaleState, IllegalTransition):
                outcomes[label] = "lost"
            finally:
                connection.close()  # each thread owns its connection; leave none open

        threads = [
            threading.Thread(target=run, args=("cancel", lambda j: job_transition(
                job=j, to=JobState.CANCELLED, expected=JobState.STARTING))),
            threading.Thread(target=run, args=("start", lambda j: job_transition(
                job=j, to=JobState.RUNNING, expected=JobState.STARTING))),
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(outcomes.values()) == ["lost", "won"], outcomes
        job.refresh_from_db()
        winner = "cancel" if outcomes["cancel"] == "won" else "start"
        assert job.state == {"cancel": JobState.CANCELLED, "start": JobState.RUNNING}[winner]
        state_events = JobEvent.objects.filter(job=job, kind="state").count()
        assert state_events == 1
