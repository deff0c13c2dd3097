"""Browser tests: Playwright driving Debian's Chromium (`/usr/bin/chromium`, installed by .ci/run; no
browser download) against pytest-django's live server. Each page a test visits is saved as a screenshot
under var/screenshots/ (CI keeps them as artefacts; README "Web console" says how to look at them).

Without Chromium (a fresh laptop) these tests are skipped with that reason; .ci/run installs it and fails
the run if any test was skipped, so in CI they always run."""
from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest
from django.db import connections

from tests.broker.conftest import _fresh_cache, acme, globex, gpu_models  # noqa: F401  (fixtures)

CHROMIUM = os.environ.get("WHALEZEN_CHROMIUM", "/usr/bin/chromium")
SCREENSHOTS = Path(__file__).resolve().parents[2] / "var" / "screenshots"
PASSWORD = "console-test-pass"
ASSET_TYPES = {"script", "stylesheet", "image", "font", "media", "manifest", "other"}


@pytest.fixture
def chromium(monkeypatch):
    """A headless Chromium for one test. Per test, not per session: while Playwright's sync API runs, an
    event loop is running in this thread, so Django refuses ORM calls (SynchronousOnlyOperation) unless
    DJANGO_ALLOW_ASYNC_UNSAFE is set, as Playwright's Django guide does. pytest-django runs other
    live-server tests after these, and a session-long loop and variable leaked into them (a subprocess's
    `check --deploy` refused the variable): both end with the test."""
    if not shutil.which(CHROMIUM):
        pytest.skip(f"no Chromium at {CHROMIUM} (apt-get install chromium; .ci/run does)")
    playwright_sync = pytest.importorskip("playwright.sync_api")
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    with playwright_sync.sync_playwright() as pw:
        # --no-sandbox: CI runs as root, where Chromium's sandbox refuses to start.
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        yield browser
        browser.close()
        # While the loop runs, Django keeps this thread's connections apart from the usual ones (asgiref's
        # storage per running loop): a fixture's query then (the users' passwords) opened one that nothing
        # closed, and on PostgreSQL the test database could not be dropped at the end of the run ("being
        # accessed by other users"). Closed here, with the loop still running, so it is that storage's.
        connections.close_all()


class Session:
    """One user's browser context on the live server: log in through the form, visit, screenshot."""

    def __init__(self, browser, base_url: str, *, viewport: dict | None = None) -> None:
        self.base_url = base_url
        self.context = browser.new_context(base_url=base_url, viewport=viewport or {"width": 1366, "height": 900},
                                           accept_downloads=True)
        self.context.set_default_timeout(10_000)
        self.page = self.context.new_page()
        self.console_errors: list[str] = []
        self.page.on("console", self._console)
        self.page.on("pageerror", lambda exc: self.console_errors.append(str(exc)))
        self.outside_requests: list[str] = []
        self.page.on("request", self._watch)
        # A page's or an htmx request's 4xx is an answer (a form's errors); an asset that fails is a fault.
        self.page.on("response", lambda r: r.status >= 400 and r.request.resource_type in ASSET_TYPES
                     and self.console_errors.append(f"{r.status} {r.url}"))

    def _console(self, msg) -> None:
        # A 4xx page is the console's answer to a bad form (a 400 with the errors next to the fields);
        # Chromium logs each as "Failed to load resource". Anything else an error logs is a fault.
        if msg.type == "error" and not re.match(r"Failed to load resource: the server responded with a status of 4\d\d",
                                                msg.text):
            self.console_errors.append(msg.text)

    def _watch(self, request) -> None:
        if not (request.url.startswith(self.base_url) or request.url.startswith("data:")
                or request.url.startswith("blob:")):
            self.outside_requests.append(request.url)

    def login(self, username: str, password: str = PASSWORD) -> None:
        self.page.goto("/login/")
        self.page.get_by_label("Username").fill(username)
        self.page.get_by_label("Password").fill(password)
        self.page.get_by_role("button", name="Log in").click()
        self.page.wait_for_url(f"{self.base_url}/")

    def shot(self, name: str, *, full_page: bool = True) -> Path:
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        path = SCREENSHOTS / f"{name}.png"
        self.page.screenshot(path=str(path), full_page=full_page)
        return path

    def close(self) -> None:
        self.context.close()


@pytest.fixture
def open_session(chromium, live_server):
    sessions: list[Session] = []

    def start(**kwargs) -> Session:
        session = Session(chromium, live_server.url, **kwargs)
        sessions.append(session)
        return session

    yield start
    for session in sessions:
        session.close()


@pytest.fixture
def passwords(acme, globex):
    """The fixtures' users get a password (the broker fixtures skip hashing; a browser logs in by form)."""
    for world in (acme, globex):
        for user in (world.admin, world.member, world.viewer):
            user.set_password(PASSWORD)
            user.save(update_fields=["password"])
