"""A gang's parts reporting at the same moment, in real concurrent transactions (PostgreSQL; SQLite
serialises writers and ignores `select_for_update`, so there the race cannot happen).

`_apply_report` locks the job row while it applies a gang part's report: each part then sees the
reports committed before it, and the last "running" always moves the gang to RUNNING. Without the
lock (mutation testing: `_apply_report` 1 and 15) the interleaving forced here leaves the job in
STARTING for good, although every part runs.
"""
from __future__ import annotations

import threading
import time

import pytest
from django.db import close_old_connections, connection

from broker.agents import services
from broker.jobs.states import JobState

from .conftest import requires_postgres
from .test_agent_api import join_token, report  # noqa: F401 (fixture)
from .test_agent_services_more import _ranked, _steps
from .test_gang import gang_nodes, place_gang  # noqa: F401 (fixture)

WAIT = 20  # seconds: a bound on each wait, never a pace; every wait ends on an event or a lock seen


def _waiting_on_a_lock(pid: int) -> bool:
    with connection.cursor() as cursor:
        cursor.execute("SELECT EXISTS (SELECT 1 FROM pg_locks WHERE pid = %s AND NOT granted)", [pid])
        return cursor.fetchone()[0]


@requires_postgres
@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_two_parts_of_a_gang_reporting_running_at_once_start_the_gang(acme, gang_nodes, monkeypatch):
    """The first part has read which parts are still to start (the second, not yet reported) and
    holds there; the second part reports meanwhile. With the job row locked, the second waits for
    the first to commit, then sees both started: RUNNING. Unlocked, the second reads the job as
    PLACED beside the first's report, the first then moves it to STARTING, and the second's
    compare-and-set fails quietly: the gang would wait in STARTING for a part that runs."""
    job, parts = place_gang(acme, gang_nodes)
    first, second = _ranked(parts)
    first_read, second_read, first_done = threading.Event(), threading.Event(), threading.Event()
    second_connected, second_pid = threading.Event(), []
    role = threading.local()
    real = services._parts_not_started

    def parts_not_started(j):
        waiting = real(j)
        if getattr(role, "name", None) == "first":
            first_read.set()
            deadline = time.monotonic() + WAIT
            # Hold (the job row locked, if the code locks it) until the second part has read too,
            # or is blocked behind this transaction's lock.
            while not second_read.is_set() and not _waiting_on_a_lock(second_pid[0]):
                assert time.monotonic() < deadline, "the second report neither read nor waited on a lock"
                time.sleep(0.005)
        elif getattr(role, "name", None) == "second":
            second_read.set()
            assert first_done.wait(WAIT)
        return waiting

    monkeypatch.setattr(services, "_parts_not_started", parts_not_started)
    answers: dict[str, int] = {}

    def part(name: str, before=None, after=None) -> None:
        close_old_connections()
        role.name = "first" if name == first else "second"
        try:
            if before:
                before()
            answers[name] = report(gang_nodes[name][1], parts[name], "running", reason="started").status_code
        finally:
            if after:
                after.set()
            connection.close()  # each thread owns its connection; leave none open

    def second_starts() -> None:
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_backend_pid()")
            second_pid.append(cursor.fetchone()[0])
        second_connected.set()
        assert first_read.wait(WAIT)

    threads = [threading.Thread(target=part, args=(first,), kwargs={"after": first_done}),
               threading.Thread(target=part, args=(second,), kwargs={"before": second_starts})]
    threads[1].start()
    assert second_connected.wait(WAIT)  # the first may wait on the second's connection: know it first
    threads[0].start()
    for t in threads:
        t.join(timeout=2 * WAIT)
    assert answers == {first: 200, second: 200}
    job.refresh_from_db()
    assert job.state == JobState.RUNNING
    assert _steps(job)[-2:] == [
        (JobState.STARTING, "GANG_STARTING",
         f"rank 0 of 2 on {first} is running; waiting for rank 1 ({second}) to start."),
        (JobState.RUNNING, "AGENT_RUNNING", "Running on all 2 nodes."),
    ]
