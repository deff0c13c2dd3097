"""The submission path's cost in queries (issue 12): authentication reads the token and its membership
in one query, and a user in two teams gets the membership of the token's team, never the other's."""
from __future__ import annotations

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from rest_framework.test import APIRequestFactory

from broker.tenancy.authentication import BearerTokenAuthentication
from broker.tenancy.models import Membership, Role
from broker.tenancy.services import api_token_authenticate, api_token_create, membership_add

from .conftest import bearer, requires_postgres
from .test_api_tenancy import submit


def _authenticate(secret: str):
    request = APIRequestFactory().get("/api/v1/jobs/", HTTP_AUTHORIZATION=f"Bearer {secret}")
    return BearerTokenAuthentication().authenticate(request)


def test_a_token_and_its_membership_are_one_query(acme):
    _authenticate(acme.token_secret)  # the last-use write happens here, not below
    with CaptureQueriesContext(connection) as queries:
        user, ctx = _authenticate(acme.token_secret)
    assert len(queries) == 1, [q["sql"] for q in queries]
    assert "ORDER BY" not in queries[0]["sql"]
    expected = Membership.objects.get(tenant=acme.tenant, user=acme.admin)
    assert user == acme.admin and ctx.tenant == acme.tenant and ctx.token.user == acme.admin
    assert (ctx.membership.pk, ctx.membership.role, ctx.membership.created_at) == (
        expected.pk, expected.role, expected.created_at)
    assert ctx.membership.tenant_id == acme.tenant.pk and ctx.membership.user_id == acme.admin.pk
    assert ctx.is_admin and ctx.can_write


def test_a_user_in_two_teams_gets_the_tokens_team_membership(acme, globex):
    membership_add(tenant=globex.tenant, user=acme.admin, role=Role.VIEWER)  # admin of acme, viewer of globex
    secret = api_token_create(tenant=globex.tenant, user=acme.admin, name="g").secret
    _, ctx = _authenticate(secret)
    assert ctx.tenant == globex.tenant and ctx.membership.tenant_id == globex.tenant.pk
    assert ctx.membership.role == Role.VIEWER and not ctx.can_write
    assert bearer(secret).post("/api/v1/jobs/", {"name": "x", "command": ["true"], "resources": {"gpus": 1}},
                               format="json").status_code == 403
    _, ctx = _authenticate(acme.token_secret)
    assert ctx.tenant == acme.tenant and ctx.membership.role == Role.ADMIN


def test_a_token_whose_user_left_its_team_is_refused(acme, globex):
    secret = api_token_create(tenant=globex.tenant, user=acme.admin, name="g").secret  # never a member
    assert api_token_authenticate(presented=secret) is not None  # the token itself is valid
    assert bearer(secret).get("/api/v1/jobs/").status_code == 401
    Membership.objects.filter(tenant=acme.tenant, user=acme.member).delete()
    assert acme.member_client.get("/api/v1/jobs/").status_code == 401
    assert acme.client.get("/api/v1/jobs/").status_code == 200


def test_the_submission_answer_is_what_reading_the_job_says(acme):
    """The 201 is built from the row job_submit wrote, not read back: it must say what a GET says."""
    spec = {"name": "answer", "command": ["python", "t.py"], "priority": 70,
            "resources": {"gpus": 2, "gpu_models": ["A100-80GB"]}}
    with CaptureQueriesContext(connection) as submitted:
        created = acme.client.post("/api/v1/jobs/", spec, format="json")
    assert created.status_code == 201, created.content[:300]
    body = created.json()
    read = acme.client.get(f"/api/v1/jobs/{body['id']}/").json()
    assert {k: v for k, v in body.items() if k not in ("format", "warnings")} == read
    assert body["owner"] == "acme-admin" and body["allocations"] == [] and body["state"] == "PENDING"
    job_reads = [q["sql"] for q in submitted.captured_queries
                 if q["sql"].lstrip().upper().startswith("SELECT") and 'FROM "jobs_job"' in q["sql"]
                 and "COUNT(" not in q["sql"].upper()]
    assert job_reads == []  # nothing read back


def test_the_pending_jobs_limit_counts_this_tenants_pending_jobs_only(acme, globex):
    """The quota's pending-jobs limit (read by SQL compiled once per database, broker/rows.py): the tenant's
    own pending jobs count, another tenant's and its own finished ones do not; at the limit a 429 says so."""
    from broker.jobs.models import Job
    from broker.tenancy.models import Quota

    spec = {"name": "q", "command": ["true"], "resources": {"gpus": 1}}
    Quota.objects.update_or_create(tenant=acme.tenant, defaults={"max_pending_jobs": 2})
    for _ in range(3):
        assert globex.client.post("/api/v1/jobs/", spec, format="json").status_code == 201
    first = acme.client.post("/api/v1/jobs/", spec, format="json")
    assert first.status_code == 201
    Job.objects.filter(pk=first.json()["id"]).update(state="SUCCEEDED")  # finished: no longer pending
    assert acme.client.post("/api/v1/jobs/", spec, format="json").status_code == 201
    assert acme.client.post("/api/v1/jobs/", spec, format="json").status_code == 201
    refused = acme.client.post("/api/v1/jobs/", spec, format="json")
    assert refused.status_code == 429, refused.content
    assert "already has 2 pending jobs (limit 2)" in refused.json()["non_field_errors"][0]
    assert Job.objects.filter(tenant=acme.tenant, state="PENDING").count() == 2


def _written(queries) -> list[str]:
    return [q["sql"] for q in queries.captured_queries if q["sql"].lstrip().upper().startswith(("INSERT", "WITH"))]


def test_a_job_and_its_submitted_event_are_written_together_and_read_back_alike(acme):
    """On PostgreSQL the job and its "submitted" event are one statement (no BEGIN or COMMIT around it);
    on SQLite two in one transaction. What was written is what the ORM reads: the spec, the demand
    columns, the timestamps the answer gave, and the event pointing at the job."""
    from broker.jobs.models import Job, JobEvent

    spec = {"name": "pair", "command": ["python", "t.py"], "priority": 61,
            "expected_duration_hours": 2.5,
            "resources": {"gpus": 2, "gpu_models": ["A100-80GB"]}}
    with CaptureQueriesContext(connection) as submitted:
        answer = acme.client.post("/api/v1/jobs/", spec, format="json")
    assert answer.status_code == 201, answer.content[:300]
    writes = _written(submitted)
    if connection.vendor == "postgresql":
        assert len(writes) == 1 and '"jobs_job"' in writes[0] and '"jobs_jobevent"' in writes[0], writes
    else:
        assert len(writes) == 2, writes
    body = answer.json()
    job = Job.objects.get(pk=body["id"])
    assert (job.tenant_id, job.owner_id, job.state, job.priority, job.gpu_count, job.gpu_models) == (
        acme.tenant.pk, acme.admin.pk, "PENDING", 61, 2, ["A100-80GB"])
    assert job.expected_duration_hours == 2.5 and job.spec["name"] == "pair"
    assert job.created_at.isoformat().replace("+00:00", "Z") == body["created_at"]
    events = list(JobEvent.objects.filter(job=job).values_list("kind", "message", "data__demand"))
    assert [(kind, message) for kind, message, _ in events] == [("submitted", "Submitted by acme-admin.")]
    demand = events[0][2]
    assert {k: demand[k] for k in ("gpus_per_node", "gpu_models", "total_gpus")} == {
        k: body["demand"][k] for k in ("gpus_per_node", "gpu_models", "total_gpus")}


@pytest.mark.django_db(transaction=True)  # no test transaction around it: what the failure leaves is committed
def test_a_job_is_never_written_without_its_event(acme):
    """Both or neither: when the event's INSERT fails, the job's is undone with it."""
    from django.db import IntegrityError

    from broker.jobs.models import Job, JobEvent
    from broker.rows import instance_with_child_insert

    before = Job.objects.count()
    job = Job(tenant=acme.tenant, owner=acme.admin, name="orphan", spec={}, gpu_count=1)
    event = JobEvent(job=job, kind=None)  # NOT NULL column: the database refuses the event row
    with pytest.raises(IntegrityError):
        instance_with_child_insert(job, event, "job")
    assert Job.objects.count() == before and job._state.adding


def test_a_spec_naming_no_model_reads_no_catalogue_and_one_naming_a_model_reads_it_once(acme):
    from broker.inventory.models import GpuModel

    table = f'"{GpuModel._meta.db_table}"'

    def catalogue_reads(spec) -> int:
        with CaptureQueriesContext(connection) as queries:
            assert acme.client.post("/api/v1/jobs/", spec, format="json").status_code == 201
        # The catalogue's read (names, memory, aliases), not the check of what the team's pools offer.
        return sum(1 for q in queries.captured_queries if table in q["sql"] and '"aliases"' in q["sql"])

    assert catalogue_reads({"name": "any", "command": ["true"], "resources": {"gpus": 1}}) == 0
    assert catalogue_reads({"name": "named", "command": ["true"],
                            "resources": {"gpus": 1, "gpu_models": ["a100-80gb"]}}) == 1
    unknown = acme.client.post("/api/v1/jobs/", {"name": "x", "command": ["true"],
                                                 "resources": {"gpus": 1, "gpu_models": ["Z9000"]}}, format="json")
    assert unknown.status_code == 400 and "A100-80GB" in str(unknown.json())  # the error lists the catalogue


def test_the_pending_jobs_are_counted_only_when_they_may_have_reached_the_limit(acme, globex):
    """Far from the limit a submission counts nothing (its pending jobs lie between its oldest pending job's id
    and the newest job's); near it, the count decides, other tenants' jobs in between included; a limit of
    0 refuses every submission."""
    from broker.jobs.models import Job
    from broker.tenancy.models import Quota

    spec = {"name": "q", "command": ["true"], "resources": {"gpus": 1}}

    def submit() -> tuple[int, int]:
        with CaptureQueriesContext(connection) as queries:
            status = acme.client.post("/api/v1/jobs/", spec, format="json").status_code
        return status, sum(1 for q in queries.captured_queries if "COUNT(" in q["sql"].upper())

    Quota.objects.update_or_create(tenant=acme.tenant, defaults={"max_pending_jobs": 4})
    assert [submit() for _ in range(3)] == [(201, 0), (201, 0), (201, 0)]  # bounds 1, 2, 3: under 4
    for _ in range(5):
        assert globex.client.post("/api/v1/jobs/", spec, format="json").status_code == 201
    Job.objects.filter(tenant=acme.tenant).order_by("id").filter(
        pk=Job.objects.filter(tenant=acme.tenant).order_by("id").values("pk")[:1]).update(state="CANCELLED")
    # Two of acme's pending, globex's five among them: the bound (7) reaches 4, the count (2) decides.
    assert submit() == (201, 1)
    assert submit() == (201, 1)
    refused = acme.client.post("/api/v1/jobs/", spec, format="json")
    assert refused.status_code == 429 and "already has 4 pending jobs (limit 4)" in str(refused.json())
    Quota.objects.filter(tenant=acme.tenant).update(max_pending_jobs=0)
    Job.objects.filter(tenant=acme.tenant).update(state="CANCELLED")
    assert submit() == (429, 1)


@requires_postgres
@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)  # two connections: the cycle's thread and the submitter
def test_a_submission_does_not_wait_for_a_scheduling_cycles_commit(acme, monkeypatch):
    """A cycle's commit locks the team's row for its quota checks. A job submitted meanwhile refers to the
    team, and while that lock was FOR UPDATE the new row's foreign-key check (FOR KEY SHARE) waited for the
    commit to end: every submission stalled behind each chunk of a busy cycle."""
    import threading

    from django.db import connections

    import broker.jobs.batch as batch
    from broker.jobs.models import Job
    from broker.jobs.states import JobState
    from broker.scheduler.services import scheduling_cycle_run

    placed = submit(acme, name="to-place")
    locked, release = threading.Event(), threading.Event()
    real_held_slots = batch.held_slots

    def held_slots_after_a_pause(*args, **kwargs):  # called with the chunk's locks taken
        locked.set()
        release.wait(30)
        return real_held_slots(*args, **kwargs)

    monkeypatch.setattr(batch, "held_slots", held_slots_after_a_pause)

    def cycle() -> None:
        try:
            scheduling_cycle_run(tenant=acme.tenant)
        finally:
            connections.close_all()

    thread = threading.Thread(target=cycle)
    thread.start()
    try:
        assert locked.wait(30), "the cycle never reached its commit"
        with connection.cursor() as cursor:
            cursor.execute("SET lock_timeout = '3s'")  # a blocked submission fails instead of hanging
        meanwhile = submit(acme, name="meanwhile")
        assert thread.is_alive()  # answered while the cycle still held its locks
    finally:
        release.set()
        thread.join(60)
        with connection.cursor() as cursor:
            cursor.execute("RESET lock_timeout")
    assert Job.objects.get(pk=meanwhile.pk).state == JobState.PENDING
    assert Job.objects.get(pk=placed.pk).state != JobState.PENDING  # the cycle went on and placed it
