"""Hostile input on every console route: odd ids in paths, odd values in every form field, GET filters.
Each answer is a page or a 4xx, never a 500, and a refused form changes nothing."""
from __future__ import annotations

import pytest

from broker.jobs.models import Job
from tests.broker.test_api_tenancy import submit
from tests.security.conftest import db_digest

ODD_IDS = ["0", "99999999999999999999", "9" * 40]
ODD_VALUES = ["", " ", "\x00", "a\x00b", "x" * 5000, "-1", "1e309", "NaN", "²", "<script>alert(1)</script>",
              "../../etc/passwd", "{{ 7*7 }}", "\ud800".encode("utf-8", "surrogatepass").decode("utf-8", "replace")]

GET_PATHS = ["/", "/jobs/", "/submit/", "/nodes/", "/costs/", "/team/", "/costs/export.csv"]
FILTERS = ["state", "name", "owner", "priority", "page", "from", "to", "group_by"]
FORMS = {
    "/submit/": ["mode", "name", "command", "image", "ask", "gpus", "compute_units", "gpu_models",
                 "min_gpu_memory_gb", "interconnect", "nodes", "cpu", "memory_gb", "spot", "priority",
                 "checkpoint_uri", "checkpoint_interval", "expected_duration_hours", "max_price", "spec"],
    "/submit/quote/": ["mode", "gpus", "gpu_models", "spec"],
    "/team/tokens/": ["name", "scopes", "expires_days"],
    "/team/budget/": ["monthly_budget_usd"],
    "/team/switch/": ["team"],
}


def test_odd_ids_in_paths_are_not_found(acme, as_admin):
    for odd in ODD_IDS:
        for path in (f"/jobs/{odd}/", f"/costs/statements/{odd}/"):
            assert as_admin.get(path).status_code == 404, path
        for path in (f"/jobs/{odd}/cancel/", f"/jobs/{odd}/checkpoint/", f"/jobs/{odd}/migrate/",
                     f"/team/tokens/{odd}/revoke/", f"/team/members/{odd}/role/"):
            assert as_admin.submit(path, {"role": "viewer"}).status_code == 404, path


@pytest.mark.parametrize("path", GET_PATHS)
def test_odd_filters_never_500(acme, as_admin, path):
    for name in FILTERS:
        for value in ODD_VALUES:
            resp = as_admin.get(path, {name: value})
            assert resp.status_code < 500 and resp.status_code != 404, (path, name, value[:20], resp.status_code)


@pytest.mark.parametrize("path", sorted(FORMS))
def test_odd_form_values_never_500_and_a_refusal_changes_nothing(acme, as_admin, path):
    job = submit(acme)
    for field in FORMS[path]:
        for value in ODD_VALUES:
            before = db_digest()
            resp = as_admin.submit(path, {"mode": "form", "command": "python x.py", field: value})
            assert resp.status_code < 500, (path, field, value[:20], resp.status_code)
            if 400 <= resp.status_code < 500:
                assert db_digest() == before, (path, field, value[:20])
    assert Job.objects.filter(pk=job.pk).exists()


def test_odd_action_values_on_a_real_job(acme, as_admin):
    job = submit(acme)
    for value in ODD_VALUES:
        resp = as_admin.submit(f"/jobs/{job.pk}/migrate/", {"target": value})
        assert resp.status_code < 500, (value[:20], resp.status_code)
    member = acme.admin.memberships.get(tenant=acme.tenant)
    for value in ODD_VALUES:
        assert as_admin.submit(f"/team/members/{member.pk}/role/", {"role": value}).status_code < 500
