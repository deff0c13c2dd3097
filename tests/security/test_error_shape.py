"""Unhandled errors under /api/ answer the API's JSON shape with a request id, never Django's HTML page."""
from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
from django.db import OperationalError

from broker.api import jobs as jobs_api
from broker.jobs.models import Job

from .conftest import MINIMAL_SPEC

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(params=[True, False], ids=["DEBUG=1", "DEBUG=0"])
def debug(request, settings):
    """DEBUG=1 (`DJANGO_DEBUG=1`, a developer's opt-in): Django would answer its HTML debug page."""
    settings.DEBUG = request.param
    return request.param


def _boom(exc: Exception):
    def fail(**kwargs):
        raise exc
    return fail


def test_every_response_has_a_request_id_and_a_sane_incoming_one_is_kept(acme):
    first, second = acme.client.get("/api/v1/jobs/"), acme.client.get("/api/v1/jobs/")
    assert len(first["X-Request-ID"]) >= 16 and first["X-Request-ID"] != second["X-Request-ID"]
    kept = acme.client.get("/api/v1/jobs/", HTTP_X_REQUEST_ID="proxy-1234abcd")
    assert kept["X-Request-ID"] == "proxy-1234abcd"
    for insane in ("short", "x" * 500, "a b c d e f g h", "<script>alert(1)</script>"):
        replaced = acme.client.get("/api/v1/jobs/", HTTP_X_REQUEST_ID=insane)
        assert replaced["X-Request-ID"] != insane
    assert acme.client.get("/admin/login/")["X-Request-ID"]
    assert acme.client.get("/healthz")["X-Request-ID"]


def test_an_unhandled_error_is_a_json_500_with_the_request_id_logged(acme, debug, monkeypatch, caplog):
    monkeypatch.setattr(jobs_api.services, "job_submit", _boom(RuntimeError("secret internals")))
    with caplog.at_level(logging.ERROR, logger="broker.api"):
        resp = acme.client.post("/api/v1/jobs/", MINIMAL_SPEC, format="json",
                                HTTP_X_REQUEST_ID="req-0123456789")
    assert resp.status_code == 500
    assert resp["Content-Type"] == "application/json"
    assert resp.json() == {"detail": "Internal server error.", "request_id": "req-0123456789"}
    assert b"secret internals" not in resp.content and b"Traceback" not in resp.content
    (record,) = [r for r in caplog.records if "req-0123456789" in r.getMessage()]
    assert record.exc_info and "secret internals" in str(record.exc_info[1])
    assert Job.objects.count() == 0


def test_a_locked_database_is_a_503_to_retry(acme, debug, monkeypatch):
    monkeypatch.setattr(jobs_api.services, "job_submit", _boom(OperationalError("database is locked")))
    resp = acme.client.post("/api/v1/jobs/", MINIMAL_SPEC, format="json")
    assert resp.status_code == 503
    assert int(resp["Retry-After"]) > 0
    body = resp.json()
    assert body["request_id"] == resp["X-Request-ID"] and "retry" in body["detail"]


def test_other_database_errors_are_plain_500s(acme, monkeypatch):
    monkeypatch.setattr(jobs_api.services, "job_submit", _boom(OperationalError("no such table: jobs_job")))
    resp = acme.client.post("/api/v1/jobs/", MINIMAL_SPEC, format="json")
    assert resp.status_code == 500 and "Retry-After" not in resp
    assert "no such table" not in resp.content.decode()


def test_django_error_pages_under_api_are_json_even_with_debug(acme, debug):
    for url in ("/api/v1/nope/", "/api/v1/jobs/%C2%B2/", "/api/v1/jobs/1.5/"):
        resp = acme.client.get(url)
        assert resp.status_code == 404, url
        assert resp["Content-Type"] == "application/json", (url, resp.content[:100])
        assert "detail" in resp.json()


def test_pages_outside_api_keep_django_handling(acme, settings):
    settings.DEBUG = False
    resp = acme.client.get("/no-such-page/")
    assert resp.status_code == 404 and not resp["Content-Type"].startswith("application/json")


def test_drf_errors_keep_their_shape(acme, anon):
    assert anon.get("/api/v1/jobs/").json() == {"detail": "Authentication credentials were not provided."}
    assert acme.client.post("/api/v1/jobs/", {"name": "x"}, format="json").json()["resources"] == [
        "This field is required."]


@pytest.mark.parametrize(("given", "expected"), [(None, "False"), ("1", "True"), ("0", "False")])
def test_debug_pages_are_off_unless_a_developer_turns_them_on(tmp_path, given, expected):
    """`make run` runs without DJANGO_DEBUG or DJANGO_ENV: Django's debug pages (every URL pattern on a 404, a
    traceback with the settings on an error) must not reach the callers of the demo service."""
    env = {k: v for k, v in os.environ.items() if k not in ("DJANGO_DEBUG", "DJANGO_ENV", "DATABASE_URL", "REDIS_URL")}
    env.update(WHALEZEN_VAR_DIR=str(tmp_path), DJANGO_SETTINGS_MODULE="broker.settings")
    if given is not None:
        env["DJANGO_DEBUG"] = given
    shown = subprocess.run([sys.executable, "-c", "from django.conf import settings; print(settings.DEBUG)"],
                           cwd=ROOT, env=env, check=True, capture_output=True, text=True).stdout.strip()
    assert shown == expected
