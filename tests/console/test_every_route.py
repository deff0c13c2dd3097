"""Every console route, walked from broker/console/urls.py so a new page cannot slip past: a viewer's POST
to any of them changes nothing (403, or 405 where the route takes no POST), and a route naming one of the
team's objects answers another team with 404, for GET and POST alike."""
from __future__ import annotations

import pytest
from django.urls import URLPattern

from broker.console.urls import urlpatterns
from broker.tenancy.models import ApiToken, Membership
from tests.broker.test_api_tenancy import submit
from tests.security.conftest import db_digest

# Routes that change nothing and need no role: a viewer may log in, out and switch teams.
OPEN_TO_VIEWERS = {"login", "logout", "team-switch"}
ROUTES = [p for p in urlpatterns if isinstance(p, URLPattern)]


def _path(pattern: URLPattern, ids: dict[str, str]) -> str:
    route = str(pattern.pattern)
    for name, value in ids.items():
        route = route.replace(f"<int:{name}>", value).replace(f"<str:{name}>", value)
    return "/" + route


@pytest.fixture
def acme_ids(acme) -> dict[str, str]:
    job = submit(acme)
    token = ApiToken.objects.filter(tenant=acme.tenant).first()
    membership = Membership.objects.filter(tenant=acme.tenant).first()
    return {"pk": str(job.pk), "token_id": str(token.pk), "membership_id": str(membership.pk), "month": "2026-11"}


def test_the_walk_covers_every_route():
    assert {p.name for p in ROUTES} >= {"dashboard", "jobs", "job", "job-cancel", "job-checkpoint", "job-migrate",
                                        "submit", "submit-quote", "nodes", "costs", "costs-csv", "statement",
                                        "team", "team-token-create", "team-token-revoke", "team-member-role",
                                        "team-budget"}


@pytest.mark.parametrize("pattern", [p for p in ROUTES if p.name not in OPEN_TO_VIEWERS], ids=lambda p: p.name)
def test_a_viewer_cannot_post_to_any_route(acme, as_viewer, acme_ids, pattern):
    before = db_digest()
    resp = as_viewer.submit(_path(pattern, acme_ids), {"role": "admin", "name": "x", "monthly_budget_usd": "1",
                                                       "command": "python x.py", "gpus": "1"})
    assert resp.status_code in (403, 405), (pattern.name, resp.status_code)
    assert db_digest() == before, pattern.name


@pytest.mark.parametrize("pattern", [p for p in ROUTES if "<int:" in str(p.pattern)], ids=lambda p: p.name)
def test_another_team_gets_404_for_our_objects(acme, as_other_team, acme_ids, pattern):
    path = _path(pattern, acme_ids)
    before = db_digest()
    got = {as_other_team.get(path).status_code,
           as_other_team.submit(path, {"role": "viewer", "target": ""}).status_code}
    assert got <= {404, 405} and 404 in got, (path, got)  # 405 only for the method the route does not take
    assert db_digest() == before, path
