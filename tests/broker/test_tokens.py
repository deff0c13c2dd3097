"""API tokens: shown once, hashed at rest, revocable, expiring, scoped."""
from __future__ import annotations

from datetime import timedelta

from django.utils import timezone

from broker.tenancy.models import ApiToken

from .conftest import bearer


def test_create_shows_secret_once_and_stores_only_a_hash(acme):
    resp = acme.member_client.post("/api/v1/tokens/", {"name": "ci", "scopes": ["read"], "expires_in_days": 7},
                                   format="json")
    assert resp.status_code == 201, resp.content
    secret = resp.json()["token"]
    row = ApiToken.objects.get(pk=resp.json()["id"])
    assert secret not in (row.secret_hash, row.prefix) and row.prefix in secret
    assert row.expires_at > timezone.now() + timedelta(days=6)
    listed = acme.member_client.get("/api/v1/tokens/").json()["results"]
    assert all("token" not in t for t in listed)
    shown = acme.member_client.get(f"/api/v1/tokens/{row.pk}/").json()
    assert "token" not in shown and shown["prefix"] == row.prefix
    assert bearer(secret).get("/api/v1/jobs/").status_code == 200


def test_revoked_token_stops_working(acme):
    secret = acme.member_client.post("/api/v1/tokens/", {"name": "tmp"}, format="json").json()["token"]
    client = bearer(secret)
    assert client.get("/api/v1/jobs/").status_code == 200
    token_id = ApiToken.objects.get(name="tmp").pk
    resp = acme.member_client.post(f"/api/v1/tokens/{token_id}/revoke/")
    assert resp.status_code == 200 and resp.json()["active"] is False
    assert client.get("/api/v1/jobs/").status_code == 401


def test_delete_revokes_too(acme):
    secret = acme.member_client.post("/api/v1/tokens/", {"name": "tmp"}, format="json").json()["token"]
    token_id = ApiToken.objects.get(name="tmp").pk
    assert acme.member_client.delete(f"/api/v1/tokens/{token_id}/").status_code == 204
    assert bearer(secret).get("/api/v1/jobs/").status_code == 401
    assert ApiToken.objects.get(pk=token_id).revoked_at is not None, "kept for audit"


def test_expired_token_is_refused(acme):
    secret = acme.member_client.post("/api/v1/tokens/", {"name": "old"}, format="json").json()["token"]
    ApiToken.objects.filter(name="old").update(expires_at=timezone.now() - timedelta(seconds=1))
    assert bearer(secret).get("/api/v1/jobs/").status_code == 401


def test_members_see_only_their_tokens_admins_see_all(acme):
    acme.member_client.post("/api/v1/tokens/", {"name": "mine"}, format="json")
    member_view = {t["name"] for t in acme.member_client.get("/api/v1/tokens/").json()["results"]}
    admin_view = {(t["user"], t["name"]) for t in acme.client.get("/api/v1/tokens/").json()["results"]}
    assert member_view == {"t", "mine"}
    assert ("acme-member", "mine") in admin_view and ("acme-admin", "t") in admin_view
    admins_token = ApiToken.objects.get(user=acme.admin).pk
    assert acme.member_client.post(f"/api/v1/tokens/{admins_token}/revoke/").status_code == 404


def test_a_read_token_cannot_mint_a_write_token(acme):
    secret = acme.member_client.post("/api/v1/tokens/", {"name": "ro", "scopes": ["read"]}, format="json").json()["token"]
    # A read-only token cannot write at all, so it cannot create tokens.
    assert bearer(secret).post("/api/v1/tokens/", {"name": "x", "scopes": ["write"]}, format="json").status_code == 403


def test_bad_token_requests(acme):
    for body, field in [({}, "name"), ({"name": "x", "scopes": ["root"]}, "scopes"),
                        ({"name": "x", "expires_in_days": 0}, "expires_in_days"), ({"name": "x", "tenant": 2}, "tenant")]:
        resp = acme.member_client.post("/api/v1/tokens/", body, format="json")
        assert resp.status_code == 400 and field in resp.json(), (body, resp.content)
