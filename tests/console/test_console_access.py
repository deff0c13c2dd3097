"""Login, logout, teams and roles on the console: what every page relies on."""
from __future__ import annotations

import re

import pytest
from django.contrib.auth import get_user_model

from broker.tenancy.models import Role
from broker.tenancy.services import membership_add, tenant_create

from .conftest import Browser, text_of


def test_a_visitor_who_is_not_logged_in_goes_to_the_login_page(db):
    resp = Browser().get("/")
    assert resp.status_code == 302 and resp.url.startswith("/login/?next=/")
    page = Browser().get(resp.url)
    assert page.status_code == 200
    assert b'name="username"' in page.content and b'name="password"' in page.content


def test_login_with_a_password_then_logout(acme):
    acme.admin.set_password("correct horse battery")
    acme.admin.save()
    browser = Browser()
    wrong = browser.submit("/login/", {"username": "acme-admin", "password": "nope"})
    assert wrong.status_code == 200 and "enter a correct username and password" in text_of(wrong)
    resp = browser.submit("/login/", {"username": "acme-admin", "password": "correct horse battery", "next": "/"})
    assert resp.status_code == 302 and resp.url == "/"
    assert "Dashboard" in text_of(browser.get("/"))
    out = browser.submit("/logout/")
    assert out.status_code == 302 and out.url == "/login/"
    assert browser.get("/").status_code == 302


def test_login_refuses_a_post_without_csrf(acme):
    resp = Browser().post("/login/", {"username": "acme-admin", "password": "x"})
    assert resp.status_code == 403


def test_logout_is_not_a_get(as_admin):
    assert as_admin.get("/logout/").status_code == 405
    assert as_admin.get("/").status_code == 200


def test_login_does_not_redirect_to_another_host(acme):
    acme.admin.set_password("correct horse battery")
    acme.admin.save()
    resp = Browser().submit("/login/", {"username": "acme-admin", "password": "correct horse battery",
                                        "next": "https://evil.example/"})
    assert resp.status_code == 302 and resp.url == "/"


def test_dashboard_shows_the_team_and_the_role(as_viewer):
    resp = as_viewer.get("/")
    text = text_of(resp)
    assert resp.status_code == 200 and "Acme" in text and "Viewer" in text
    assert "default-src 'self'" in resp["Content-Security-Policy"]


def test_a_user_without_a_team_is_told_so(db):
    user = get_user_model().objects.create_user(username="loner")
    resp = Browser(user).get("/")
    assert resp.status_code == 403 and "do not belong to a team" in text_of(resp)


def test_a_user_of_two_teams_switches_between_them_and_not_into_a_third(acme, globex):
    membership_add(tenant=globex.tenant, user=acme.viewer, role=Role.VIEWER)
    third = tenant_create(slug="initech", name="Initech")
    browser = Browser(acme.viewer)
    assert "Acme" in text_of(browser.get("/"))
    browser.submit("/team/switch/", {"team": str(globex.tenant.pk)})
    assert "Globex" in text_of(browser.get("/")).split("Dashboard", 2)[-1]
    browser.submit("/team/switch/", {"team": str(third.pk)})
    page = text_of(browser.get("/"))
    assert "Initech" not in page


@pytest.mark.parametrize("odd", ["", "x", "²", "9" * 40, "-1"])
def test_team_switch_ignores_odd_values(as_admin, odd):
    resp = as_admin.submit("/team/switch/", {"team": odd})
    assert resp.status_code == 302
    assert as_admin.get("/").status_code == 200


def test_every_console_asset_is_served_by_the_console_itself(as_admin):
    page = as_admin.get("/").content.decode()
    refs = [r for r in re.findall(r'(?:src|href|action)="([^"]+)"', page) if not r.startswith("#")]
    assert refs and all(ref.startswith("/") and not ref.startswith("//") for ref in refs), refs
    for ref in refs:
        if ref.startswith("/static/"):
            assert as_admin.get(ref).status_code == 200, ref


def test_a_form_larger_than_the_service_takes_is_a_400_page_not_a_500(as_member, settings):
    resp = as_member.submit("/submit/", {"mode": "paste", "spec": "x" * (settings.WHALEZEN_MAX_BODY_BYTES + 10)})
    assert resp.status_code == 400
    assert "larger than the service accepts" in text_of(resp)


@pytest.mark.parametrize("path", ["/", "/jobs/", "/submit/", "/nodes/", "/costs/", "/team/"])
def test_no_template_syntax_reaches_the_page(as_admin, path):
    """A comment or tag the template engine did not take (a multi-line {# #}) shows as text to users."""
    text = text_of(as_admin.get(path))
    assert not re.search(r"\{[#%{]|[#%}]\}", text), re.search(r".{0,60}(\{[#%{]|[#%}]\}).{0,60}", text).group(0)
