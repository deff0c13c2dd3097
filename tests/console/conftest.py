"""Fixtures for console tests: the broker's two teams (acme, globex), and Django test clients logged in
by session (force_login: no password hashing) as each role, with CSRF checks on as in a browser."""
from __future__ import annotations

import re

import pytest
from django.test import Client

from tests.broker.conftest import _fresh_cache, acme, globex, gpu_models  # noqa: F401  (fixtures)


class Browser(Client):
    """A test client that enforces CSRF like a browser, and posts forms with the token it was given."""

    def __init__(self, user=None) -> None:
        super().__init__(enforce_csrf_checks=True)
        if user is not None:
            self.force_login(user)

    def csrf(self) -> str:
        for page in ("/login/", "/"):  # the login page, or (logged in: it redirects) the dashboard
            if "csrftoken" not in self.cookies:
                self.get(page)
        return self.cookies["csrftoken"].value

    def submit(self, path: str, data: dict | None = None, **extra):
        """POST a form as the page would: with the CSRF token (the form field and htmx's header)."""
        token = self.csrf()
        return self.post(path, {**(data or {}), "csrfmiddlewaretoken": token}, HTTP_X_CSRFTOKEN=token, **extra)


@pytest.fixture
def as_admin(acme) -> Browser:
    return Browser(acme.admin)


@pytest.fixture
def as_member(acme) -> Browser:
    return Browser(acme.member)


@pytest.fixture
def as_viewer(acme) -> Browser:
    return Browser(acme.viewer)


@pytest.fixture
def as_other_team(globex) -> Browser:
    return Browser(globex.admin)


def text_of(response) -> str:
    """The page's visible text, roughly: tags dropped, whitespace collapsed (for 'the user reads X')."""
    html = response.content.decode()
    html = re.sub(r"<(script|style)\b.*?</\1>", " ", html, flags=re.S)
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", html)).strip()
