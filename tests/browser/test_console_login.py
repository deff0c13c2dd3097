"""In a real browser: the login form, the dashboard, logout; nothing fetched from another host, no
script error (the pages' CSP refuses inline scripts and styles: a violation shows as a console error)."""
from __future__ import annotations


def test_log_in_see_the_dashboard_log_out(open_session, passwords):
    session = open_session()
    session.page.goto("/")
    assert "/login/" in session.page.url
    session.shot("login")
    session.login("acme-admin")
    assert session.page.get_by_role("heading", name="Dashboard").is_visible()
    assert session.page.get_by_text("Acme", exact=True).first.is_visible()
    session.shot("dashboard")
    session.page.get_by_role("button", name="Log out").click()
    session.page.wait_for_url("**/login/")
    session.page.goto("/")
    assert "/login/" in session.page.url
    assert session.outside_requests == []
    assert session.console_errors == []


def test_a_wrong_password_is_said_on_the_form(open_session, passwords):
    session = open_session()
    session.page.goto("/login/")
    session.page.get_by_label("Username").fill("acme-admin")
    session.page.get_by_label("Password").fill("not the password")
    session.page.get_by_role("button", name="Log in").click()
    assert session.page.get_by_role("alert").inner_text().startswith("Please enter a correct username")
    assert "/login/" in session.page.url


def test_the_dashboard_on_a_phone(open_session, passwords):
    session = open_session(viewport={"width": 390, "height": 844})
    session.login("acme-viewer")
    width = session.page.evaluate("document.documentElement.scrollWidth")
    assert width <= 390, f"the page is {width}px wide on a 390px screen: it scrolls sideways"
    session.shot("dashboard-phone")
