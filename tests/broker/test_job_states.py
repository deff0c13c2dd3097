"""The job state machine: legal edges work, every illegal one is refused, races have one winner."""
from __future__ import annotations

import itertools
import threading

import pytest
from django.db import close_old_connections, connection

from broker.jobs.models import Job, JobEvent
from broker.jobs.services import IllegalTransition, StaleState, job_cancel, job_transition
from broker.jobs.states import LEGAL_TRANSITIONS, TERMINAL_STATES, JobState

from .conftest import requires_postgres
from .test_api_tenancy import submit

ALL_STATES = [s.value for s in JobState]
ILLEGAL = [(a, b) for a, b in itertools.product(ALL_STATES, ALL_STATES) if b not in LEGAL_TRANSITIONS[a]]


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
