"""The team page: members and roles, API tokens (own for members, all for admins; the secret once),
quotas read-only, the budget for admins. Another team's ids are 404, a viewer's posts 403, and a
refused change leaves the database as it was."""
from __future__ import annotations

from decimal import Decimal

import pytest

from broker.tenancy.models import ApiToken, Membership, Quota, Role, TeamQuota
from broker.tenancy.services import api_token_create
from tests.broker.conftest import bearer

from .conftest import Browser, text_of


def _membership(world, user) -> Membership:
    return Membership.objects.get(tenant=world.tenant, user=user)


def test_the_page_lists_members_roles_tokens_quotas_and_budget(acme, as_admin):
    Quota.objects.filter(tenant=acme.tenant).update(max_gpus=12, max_pending_jobs=77,
                                                    monthly_budget_usd=Decimal("500.00"))
    TeamQuota.objects.create(tenant=acme.tenant, flavor="A100-80GB", nominal=Decimal("8"))
    api_token_create(tenant=acme.tenant, user=acme.member, name="members-notebook")
    resp = as_admin.get("/team/")
    text = text_of(resp)
    assert resp.status_code == 200
    for name in ("acme-admin", "acme-member", "acme-viewer", "Admin", "Member", "Viewer"):
        assert name in text
    assert "members-notebook" in text and "acme-member" in text  # an admin sees every member's tokens
    assert "12" in text and "77" in text and "A100-80GB" in text and "$500.00" in text
    assert 'name="monthly_budget_usd"' in resp.content.decode() and 'name="role"' in resp.content.decode()


def test_a_member_sees_only_their_own_tokens_and_no_admin_forms(acme, as_member):
    api_token_create(tenant=acme.tenant, user=acme.admin, name="admins-ci-token")
    api_token_create(tenant=acme.tenant, user=acme.member, name="my-laptop")
    html = as_member.get("/team/").content.decode()
    assert "my-laptop" in html and "admins-ci-token" not in html
    assert 'name="role"' not in html and 'name="monthly_budget_usd"' not in html and 'name="name"' in html


def test_a_created_tokens_secret_is_shown_once_and_works_on_the_api(acme, as_member):
    resp = as_member.submit("/team/tokens/", {"name": "from-console", "scopes": ["read"], "expires_in_days": "30"})
    assert resp.status_code == 201
    token = ApiToken.objects.get(name="from-console")
    assert token.user == acme.member and token.tenant == acme.tenant and token.scopes == ["read"]
    assert token.expires_at is not None
    secret = resp.context["secret"]
    assert secret in resp.content.decode() and "shown only this once" in text_of(resp)
    api = bearer(secret).get("/api/v1/jobs/")
    assert api.status_code == 200
    # Read scope: the API refuses a submit with it.
    assert bearer(secret).post("/api/v1/jobs/", {}, format="json").status_code == 403
    # Never again: not on the team page.
    assert secret not in as_member.get("/team/").content.decode()


@pytest.mark.parametrize("data, field, words", [
    ({"name": "", "scopes": ["read"]}, "name", "may not be blank"),
    ({"name": "x", "scopes": ["read"], "expires_in_days": "0"}, "expires_in_days", "greater than or equal to 1"),
    ({"name": "x", "scopes": ["read"], "expires_in_days": "lots"}, "expires_in_days", "Must be an integer"),
    ({"name": "x", "scopes": ["root"]}, "scopes", "is not a valid choice"),
    ({"name": "x"}, "scopes", "at least 1"),
])
def test_a_bad_token_form_is_400_with_the_apis_words_next_to_the_field(acme, as_member, data, field, words):
    before = ApiToken.objects.count()
    resp = as_member.submit("/team/tokens/", data)
    assert resp.status_code == 400
    assert words in " ".join(resp.context["token_errors"][field]) and words in text_of(resp)
    assert ApiToken.objects.count() == before


def test_members_revoke_their_own_tokens_not_another_members_an_admin_revokes_any(acme, as_member, as_admin):
    mine = api_token_create(tenant=acme.tenant, user=acme.member, name="mine").token
    admins = api_token_create(tenant=acme.tenant, user=acme.admin, name="admins").token
    assert as_member.submit(f"/team/tokens/{admins.pk}/revoke/").status_code == 404
    admins.refresh_from_db()
    assert admins.revoked_at is None
    assert as_member.submit(f"/team/tokens/{mine.pk}/revoke/").status_code == 302
    mine.refresh_from_db()
    assert mine.revoked_at is not None
    other = api_token_create(tenant=acme.tenant, user=acme.member, name="other").token
    assert as_admin.submit(f"/team/tokens/{other.pk}/revoke/").status_code == 302
    other.refresh_from_db()
    assert other.revoked_at is not None
    assert "revoked" in text_of(as_admin.get("/team/"))


def test_another_teams_token_and_membership_ids_are_404_and_nothing_changes(acme, globex, as_admin):
    theirs = api_token_create(tenant=globex.tenant, user=globex.member, name="globex-token").token
    membership = _membership(globex, globex.admin)
    assert as_admin.submit(f"/team/tokens/{theirs.pk}/revoke/").status_code == 404
    assert as_admin.submit(f"/team/members/{membership.pk}/role/", {"role": "viewer"}).status_code == 404
    theirs.refresh_from_db()
    membership.refresh_from_db()
    assert theirs.revoked_at is None and membership.role == Role.ADMIN
    assert "globex" not in text_of(as_admin.get("/team/")).lower()


def test_a_viewer_posts_nothing(acme, as_viewer):
    own = api_token_create(tenant=acme.tenant, user=acme.viewer, name="viewer-token").token
    member = _membership(acme, acme.member)
    before = ApiToken.objects.count()
    for path, data in [("/team/tokens/", {"name": "x", "scopes": ["read"]}), (f"/team/tokens/{own.pk}/revoke/", {}),
                       (f"/team/members/{member.pk}/role/", {"role": "admin"}),
                       ("/team/budget/", {"monthly_budget_usd": "5"})]:
        assert as_viewer.submit(path, data).status_code == 403, path
    own.refresh_from_db()
    member.refresh_from_db()
    assert own.revoked_at is None and member.role == Role.MEMBER and ApiToken.objects.count() == before
    assert Quota.objects.get(tenant=acme.tenant).monthly_budget_usd is None
    assert "viewer-token" in text_of(as_viewer.get("/team/"))  # a viewer reads their own tokens


def test_an_admin_changes_roles_a_member_may_not(acme, as_admin, as_member):
    viewer = _membership(acme, acme.viewer)
    assert as_member.submit(f"/team/members/{viewer.pk}/role/", {"role": "admin"}).status_code == 403
    viewer.refresh_from_db()
    assert viewer.role == Role.VIEWER
    assert as_admin.submit(f"/team/members/{viewer.pk}/role/", {"role": "member"}).status_code == 302
    viewer.refresh_from_db()
    assert viewer.role == Role.MEMBER
    resp = as_admin.submit(f"/team/members/{viewer.pk}/role/", {"role": "owner"})
    assert resp.status_code == 400 and "is not a role" in text_of(resp)
    viewer.refresh_from_db()
    assert viewer.role == Role.MEMBER


def test_demoting_the_last_admin_is_refused(acme, as_admin):
    admin = _membership(acme, acme.admin)
    resp = as_admin.submit(f"/team/members/{admin.pk}/role/", {"role": "member"})
    assert resp.status_code == 400 and "last admin" in text_of(resp)
    admin.refresh_from_db()
    assert admin.role == Role.ADMIN
    # With a second admin, the first may step down.
    member = _membership(acme, acme.member)
    as_admin.submit(f"/team/members/{member.pk}/role/", {"role": "admin"})
    assert as_admin.submit(f"/team/members/{admin.pk}/role/", {"role": "member"}).status_code == 302
    admin.refresh_from_db()
    assert admin.role == Role.MEMBER
    assert as_admin.submit("/team/budget/", {"monthly_budget_usd": "5"}).status_code == 403  # not an admin now


def test_the_budget_is_an_admins_with_the_apis_validation(acme, as_admin, as_member):
    assert as_member.submit("/team/budget/", {"monthly_budget_usd": "10"}).status_code == 403
    assert Quota.objects.get(tenant=acme.tenant).monthly_budget_usd is None
    for bad, words in [("-5", "greater than or equal to 0"), ("lots", "A valid number is required")]:
        resp = as_admin.submit("/team/budget/", {"monthly_budget_usd": bad})
        assert resp.status_code == 400, bad
        html = resp.content.decode()
        assert words in html and 'id="err-budget"' in html and f'value="{bad}"' in html
        assert Quota.objects.get(tenant=acme.tenant).monthly_budget_usd is None
    assert as_admin.submit("/team/budget/", {"monthly_budget_usd": "1250.50"}).status_code == 302
    assert Quota.objects.get(tenant=acme.tenant).monthly_budget_usd == Decimal("1250.50")
    assert "$1250.50" in text_of(as_admin.get("/team/"))
    assert as_admin.submit("/team/budget/", {"monthly_budget_usd": ""}).status_code == 302
    assert Quota.objects.get(tenant=acme.tenant).monthly_budget_usd is None


def test_post_only_routes_refuse_a_get(acme, as_admin):
    assert as_admin.get("/team/budget/").status_code == 405
    assert as_admin.get("/team/tokens/").status_code == 405


def test_another_team_sees_its_own_team_only(acme, globex, as_other_team):
    text = text_of(as_other_team.get("/team/"))
    assert "globex-member" in text and "acme-member" not in text


def test_a_visitor_is_sent_to_log_in(db):
    assert Browser().get("/team/").status_code == 302
