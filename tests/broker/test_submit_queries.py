"""The submission path's cost in queries (issue 12): authentication reads the token and its membership
in one query, and a user in two teams gets the membership of the token's team, never the other's."""
from __future__ import annotations

from django.db import connection
from django.test.utils import CaptureQueriesContext
from rest_framework.test import APIRequestFactory

from broker.tenancy.authentication import BearerTokenAuthentication
from broker.tenancy.models import Membership, Role
from broker.tenancy.services import api_token_authenticate, api_token_create, membership_add

from .conftest import bearer


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
