"""Health check, demo seeding, production settings and submission throttling."""
from __future__ import annotations

import io
import os
import secrets
import subprocess
import sys
from pathlib import Path

from django.core.cache import cache
from django.core.management import call_command

from broker.inventory.models import Gpu, Node
from broker.tenancy.models import ApiToken, Tenant

from .conftest import MINIMAL_SPEC, bearer

ROOT = Path(__file__).resolve().parents[2]


def test_healthz_answers_when_database_answers(client, db):
    from broker.ops.services import periodic_run_record  # /healthz also wants fresh sweeps (tests/broker/test_health.py)

    for task in ("scheduler.sweep", "agents.mark_lost"):
        periodic_run_record(name=task)
    resp = client.get("/healthz")
    assert resp.status_code == 200 and resp.json()["checks"]["database"] == "ok"


def test_seed_demo_is_idempotent_and_prints_working_tokens(db, settings, tmp_path):
    settings.VAR_DIR = tmp_path  # seed_demo keeps its tokens there: not in the repository's var/
    out1, out2 = io.StringIO(), io.StringIO()
    call_command("seed_demo", stdout=out1)
    counts = (Tenant.objects.count(), Node.objects.count(), Gpu.objects.count())
    call_command("seed_demo", stdout=out2)
    assert (Tenant.objects.count(), Node.objects.count(), Gpu.objects.count()) == counts
    assert ApiToken.objects.filter(name="demo").count() == 2
    lines = [line.split() for line in out2.getvalue().splitlines() if line.startswith("TOKEN ")]
    assert [line[1] for line in lines] == ["acme", "globex"]
    tokens = dict((slug, secret) for _, slug, secret in lines)
    acme_jobs = bearer(tokens["acme"]).get("/api/v1/nodes/")
    assert acme_jobs.status_code == 200 and all(n["name"].startswith("acme") for n in acme_jobs.json()["results"])
    old = [line.split()[2] for line in out1.getvalue().splitlines() if line.startswith("TOKEN acme")][0]
    assert old == tokens["acme"], "a re-seed keeps the demo token (`make run` twice gives the same demo)"


def test_check_deploy_passes_with_production_settings(tmp_path):
    env = {**os.environ, "DJANGO_ENV": "production", "DJANGO_SECRET_KEY": secrets.token_urlsafe(50),
           "DJANGO_ALLOWED_HOSTS": "broker.example.com", "WHALEZEN_VAR_DIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, "manage.py", "check", "--deploy", "--fail-level", "WARNING"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_production_refuses_to_start_without_a_secret_key(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "DJANGO_SECRET_KEY"}
    env.update(DJANGO_ENV="production", WHALEZEN_VAR_DIR=str(tmp_path))
    proc = subprocess.run([sys.executable, "manage.py", "check"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode != 0 and "DJANGO_SECRET_KEY" in proc.stderr


def test_job_submission_is_throttled_per_token(acme, settings):
    from rest_framework.settings import api_settings
    from rest_framework.throttling import SimpleRateThrottle

    cache.clear()
    old_rates = SimpleRateThrottle.THROTTLE_RATES
    SimpleRateThrottle.THROTTLE_RATES = {**api_settings.DEFAULT_THROTTLE_RATES, "job_submit": "3/min"}
    try:
        codes = [acme.client.post("/api/v1/jobs/", MINIMAL_SPEC, format="json").status_code for _ in range(5)]
        assert codes == [201, 201, 201, 429, 429]
        # Another token of the same tenant has its own budget; reads are not throttled.
        assert acme.member_client.post("/api/v1/jobs/", MINIMAL_SPEC, format="json").status_code == 201
        assert acme.client.get("/api/v1/jobs/").status_code == 200
    finally:
        SimpleRateThrottle.THROTTLE_RATES = old_rates
        cache.clear()


def test_job_list_filters(acme):
    from .test_api_tenancy import submit
    from broker.jobs.services import job_cancel

    a = submit(acme, name="alpha", priority="high")
    submit(acme, name="beta", priority="low")
    job_cancel(job=a)
    get = lambda q: [j["name"] for j in acme.client.get(f"/api/v1/jobs/?{q}").json()["results"]]  # noqa: E731
    assert get("state=CANCELLED") == ["alpha"]
    assert get("state=PENDING") == ["beta"]
    assert get("name=alp") == ["alpha"]
    assert get("priority_min=50") == ["alpha"]
    assert sorted(get("created_after=2000-01-01T00:00:00Z")) == ["alpha", "beta"]
    assert get("created_before=2000-01-01T00:00:00Z") == []
    page = acme.client.get("/api/v1/jobs/?page_size=1").json()
    assert page["count"] == 2 and len(page["results"]) == 1 and page["next"]
    assert acme.client.get("/api/v1/jobs/?state=NOPE").status_code == 400


def test_issue_join_token_command(acme):
    from django.core.management.base import CommandError

    from broker.inventory.models import Pool
    from broker.tenancy import tokens

    out = io.StringIO()
    call_command("issue_join_token", "--tenant", "acme", "--pool", "onprem", stdout=out)
    secret = out.getvalue().strip()
    pool = Pool.objects.get(tenant=acme.tenant, name="onprem")
    assert tokens.matches(secret, pool.join_token_hash) and secret not in pool.join_token_hash
    import pytest

    with pytest.raises(CommandError, match="no pool"):
        call_command("issue_join_token", "--tenant", "acme", "--pool", "nope", stdout=io.StringIO())
    call_command("issue_join_token", "--tenant", "acme", "--pool", "rack2", "--create", stdout=io.StringIO())
    assert Pool.objects.filter(tenant=acme.tenant, name="rack2", kind="onprem").exists()
