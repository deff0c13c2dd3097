"""Who may change what inside one tenant: admins any object, members their own, viewers nothing.

Issue 8, item 13: a member could cancel another user's job. The rule is docs/job-spec.md's "Who may
change a job"; it lives in broker/tenancy/permissions.py (`may_change`).
"""
from __future__ import annotations

import pytest
from django.contrib.auth import get_user_model
from rest_framework.test import APIClient

from broker.api.urls import router
from broker.jobs.models import Job, JobEvent, Upload
from broker.tenancy.models import ApiToken, Role
from broker.tenancy.services import api_token_create, membership_add

from .conftest import MINIMAL_SPEC, bearer
from .test_api_tenancy import db_fingerprint, submit


@pytest.fixture
def colleague(acme):
    """A second member of acme, with a write token, and a job of their own."""
    user = get_user_model().objects.create_user(username="acme-colleague")
    membership_add(tenant=acme.tenant, user=user, role=Role.MEMBER)
    client = bearer(api_token_create(tenant=acme.tenant, user=user, name="colleague").secret)
    resp = client.post("/api/v1/jobs/", MINIMAL_SPEC, format="json")
    assert resp.status_code == 201
    return {"user": user, "client": client, "job": Job.objects.get(pk=resp.json()["id"])}


def cancel(client: APIClient, job: Job):
    return client.post(f"/api/v1/jobs/{job.pk}/cancel/")


def test_member_cancels_own_job(acme, colleague):
    resp = cancel(colleague["client"], colleague["job"])
    assert resp.status_code == 200 and resp.json()["state"] == "CANCELLED"


def test_member_cannot_cancel_another_members_job(acme, colleague):
    job = colleague["job"]
    events = JobEvent.objects.filter(job=job).count()
    resp = cancel(acme.member_client, job)
    assert resp.status_code == 403
    detail = resp.json()["detail"]
    assert "another user's" in detail and "tenant admin" in detail
    job.refresh_from_db()
    assert job.state == "PENDING"
    assert JobEvent.objects.filter(job=job).count() == events  # nothing written, not even an event


def test_member_cannot_cancel_an_admins_job(acme):
    job = submit(acme)  # owned by acme's admin
    assert cancel(acme.member_client, job).status_code == 403
    job.refresh_from_db()
    assert job.state == "PENDING"


def test_tenant_admin_cancels_any_job_of_the_tenant(acme, colleague):
    resp = cancel(acme.client, colleague["job"])
    assert resp.status_code == 200 and resp.json()["state"] == "CANCELLED"


def test_viewer_cancels_nothing_not_even_what_they_submitted_before(acme):
    job = submit(acme)
    Job.objects.filter(pk=job.pk).update(owner=acme.viewer)  # e.g. a member later demoted to viewer
    assert cancel(acme.viewer_client, job).status_code == 403
    job.refresh_from_db()
    assert job.state == "PENDING"


def test_owner_with_a_read_only_token_cannot_cancel(acme, colleague):
    ro = bearer(api_token_create(tenant=acme.tenant, user=colleague["user"], name="ro", scopes=["read"]).secret)
    assert cancel(ro, colleague["job"]).status_code == 403


def test_another_tenants_job_stays_404_even_for_its_admin(acme, globex, colleague):
    before = db_fingerprint()
    assert cancel(globex.client, colleague["job"]).status_code == 404
    assert db_fingerprint() == before


def test_session_member_follows_the_same_rule(acme, colleague):
    client = APIClient()
    client.force_login(acme.member)
    assert cancel(client, colleague["job"]).status_code == 403
    own = APIClient()
    own.force_login(colleague["user"])
    assert cancel(own, colleague["job"]).status_code == 200


def test_member_cannot_revoke_or_delete_another_members_token(acme, colleague):
    theirs = ApiToken.objects.get(user=colleague["user"], name="colleague")
    # Members do not even see other members' tokens: it answers as a token that does not exist.
    assert acme.member_client.post(f"/api/v1/tokens/{theirs.pk}/revoke/").status_code == 404
    assert acme.member_client.delete(f"/api/v1/tokens/{theirs.pk}/").status_code == 404
    theirs.refresh_from_db()
    assert theirs.revoked_at is None
    assert colleague["client"].get("/api/v1/jobs/").status_code == 200  # still works


def test_member_revokes_own_token_and_admin_revokes_anyones(acme, colleague):
    own = ApiToken.objects.get(user=acme.member)
    resp = acme.member_client.post(f"/api/v1/tokens/{own.pk}/revoke/")
    assert resp.status_code == 200 and resp.json()["active"] is False
    theirs = ApiToken.objects.get(user=colleague["user"], name="colleague")
    assert acme.client.delete(f"/api/v1/tokens/{theirs.pk}/").status_code == 204
    assert colleague["client"].get("/api/v1/jobs/").status_code == 401


def _detail_writes() -> list[tuple[str, str, str]]:
    """(basename, method, url suffix) for every write on one object that the user API routes."""
    writes = []
    for _prefix, viewset, basename in router.registry:
        for action in viewset.get_extra_actions():
            if action.detail:
                writes += [(basename, m, f"{action.url_path}/") for m in action.mapping if m not in ("get", "head")]
        for method, name in (("put", "update"), ("patch", "partial_update"), ("delete", "destroy")):
            if hasattr(viewset, name):
                writes.append((basename, method, ""))
    return writes


def test_every_write_on_an_object_refuses_a_member_who_does_not_own_it(acme, colleague):
    """Walks the router, so a new action (migrate, checkpoint, ...) is covered the day it is added."""
    objects = {
        "job": ("jobs", colleague["job"].pk),
        "token": ("tokens", ApiToken.objects.get(user=colleague["user"], name="colleague").pk),
        "upload": ("uploads", Upload.objects.create(id="cd" * 16, tenant=acme.tenant, owner=colleague["user"],
                                                    sha256="0" * 64, size_bytes=1).pk),
    }
    writes = _detail_writes()
    assert {b for b, _, _ in writes} <= set(objects), "a new viewset with object writes: add it here"
    assert ("job", "post", "cancel/") in writes and ("token", "delete", "") in writes
    before = db_fingerprint()
    for basename, method, suffix in writes:
        prefix, pk = objects[basename]
        resp = getattr(acme.member_client, method)(f"/api/v1/{prefix}/{pk}/{suffix}", {}, format="json")
        # 403 for a job of the tenant; 404 where members do not see others' objects at all (tokens).
        assert resp.status_code in (403, 404), (basename, method, suffix, resp.status_code)
    assert db_fingerprint() == before
