"""Property-based fuzzing of the REST API, driven by its own OpenAPI document (schemathesis 4.x).

The schema is loaded from the in-process WSGI application (`broker.wsgi.application`, no server) and
every documented operation is called with generated valid and invalid input, authenticated as a real
tenant (acme's admin token), while a second tenant (globex) owns jobs, tokens, pools and nodes whose ids
the generated path parameters are steered towards. Each response must:

- not be a 5xx, and match the document (status code, content type, headers, body schema); a 2xx must
  stop being one without the token (schemathesis' `ignored_auth` probe);
- if it is a 400, be a non-empty JSON object whose keys name fields of the request;
- never show another tenant's objects: lists hold only the caller's ids, another tenant's id answers
  404, and nothing of the other tenant changes;
- leave no half-written job: a job exists after a submission exactly when it answered 201, with its
  `submitted` event.

Reproducible: Hypothesis is derandomized and has no example database or deadline; examples per operation
are bounded (FUZZ_EXAMPLES). Runs on SQLite, and on PostgreSQL when DATABASE_URL is set.
"""
from __future__ import annotations

import gzip
import io
import re
import tarfile
from dataclasses import dataclass, field
from datetime import timedelta
from datetime import timezone as dt_timezone
from typing import Any

import pytest
import schemathesis
from django.core.signals import request_finished, request_started
from django.db import close_old_connections
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    ignored_auth,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from broker.api.throttles import JobSubmitThrottle
from broker.inventory.models import Node, Pool
from broker.jobs.models import Job, JobEvent
from broker.jobs.states import JobState
from broker.tenancy.models import ApiToken, Tenant
from broker.wsgi import application

from .conftest import MINIMAL_SPEC, TenantWorld, bearer

FUZZ_EXAMPLES = 25  # per operation; 17 operations

schema = schemathesis.openapi.from_wsgi("/api/schema/", application)
# The coverage phase enumerates boundary values without a bound (~1,500 calls for POST /jobs/ alone);
# schema examples plus a bounded, derandomized fuzzing phase keep the run reproducible and short.
schema.config.phases.update(phases=["examples", "fuzzing"])
# POST /api/v1/uploads/ takes a raw tar.gz: random bytes, and a real archive now and then.
def _tar_gz() -> bytes:
    buffer = io.BytesIO()
    with gzip.GzipFile(fileobj=buffer, mode="wb", mtime=0) as zipped, tarfile.open(fileobj=zipped, mode="w") as tar:
        info = tarfile.TarInfo("train.py")
        info.size = 9
        tar.addfile(info, io.BytesIO(b"print(1)\n"))
    return buffer.getvalue()


schemathesis.openapi.media_type("application/gzip", st.one_of(st.binary(max_size=512), st.just(_tar_gz())))

# Not used: `positive_data_acceptance` / `negative_data_rejection`. They flag valid-but-unknown references
# (e.g. `?pool=0` answers 400 "Select a valid choice") and DRF's documented leniency on pagination
# parameters (`?page_size=abc` falls back to the default page size) -- behaviour, not schema drift.
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    ignored_auth,
]

# Collections whose rows belong to a tenant (the GPU catalogue, /gpu-models/, is shared by design).
OWNED = {
    "jobs": lambda tenant: Job.objects.filter(tenant=tenant),
    "tokens": lambda tenant: ApiToken.objects.filter(tenant=tenant),
    "pools": lambda tenant: Pool.objects.filter(tenant=tenant),
    "nodes": lambda tenant: Node.objects.filter(pool__tenant=tenant),
}
# Keys a 400 body may hold besides the request's own fields.
GENERIC_ERROR_KEYS = {"body", "non_field_errors"}


def collection_of(path: str) -> str:
    return path.split("/")[3]  # /api/v1/<collection>/...


def owned_ids(tenant: Tenant) -> dict[str, set[int]]:
    return {name: set(query(tenant).values_list("pk", flat=True)) for name, query in OWNED.items()}


def tenant_snapshot(tenant: Tenant) -> dict[str, Any]:
    """Everything another tenant's requests must never change."""
    return {
        "jobs": sorted(Job.objects.filter(tenant=tenant).values_list("pk", "state", "priority", "updated_at")),
        "events": JobEvent.objects.filter(job__tenant=tenant).count(),
        "tokens": sorted(ApiToken.objects.filter(tenant=tenant).values_list("pk", "name", "revoked_at")),
        "pools": sorted(Pool.objects.filter(tenant=tenant).values_list("pk", "name", "enabled")),
        "nodes": sorted(Node.objects.filter(pool__tenant=tenant).values_list("pk", "name", "state")),
    }


def submit_jobs(world: TenantWorld, count: int) -> list[int]:
    ids = []
    for i in range(count):
        resp = world.client.post("/api/v1/jobs/", {**MINIMAL_SPEC, "name": f"seed-{i}"}, format="json")
        assert resp.status_code == 201, resp.content
        ids.append(resp.json()["id"])
    return ids


@dataclass
class FuzzWorld:
    caller: TenantWorld
    other: TenantWorld
    auth_token_pk: int
    headers: dict[str, str] = field(default_factory=dict)


# Path ids worth trying, by collection: the caller's own objects and the other tenant's. Filled by the
# `fuzz_world` fixture; read by the hook below when Hypothesis draws an operation's path parameters.
INTERESTING_IDS: dict[str, list[int]] = {}


ROUTABLE_ID = re.compile(r"[^/.]+")  # DRF's router: a lookup value holds no '/' and no '.'


def routable(path_parameters: dict[str, Any]) -> dict[str, Any]:
    """Keep a generated (possibly invalid) id inside the API's routes.

    An id such as `1.5`, `a/b` or `` matches no route at all, so Django's own HTML 404 page answers
    instead of the API (there is no JSON `handler404`); that is URL routing, not the API under test.
    """
    value = path_parameters.get("id")
    if value is None or isinstance(value, int) or ROUTABLE_ID.fullmatch(str(value)):
        return path_parameters
    return {**path_parameters, "id": re.sub(r"[/.]", "_", str(value)) or "_"}


@schema.hook
def flatmap_path_parameters(context, path_parameters):
    """Besides schemathesis' own ids, try real ones (of both tenants), so ownership checks bite."""
    if not path_parameters or "id" not in path_parameters:
        return st.just(path_parameters)
    known = INTERESTING_IDS.get(collection_of(context.operation.path))
    generated = st.just(routable(path_parameters))
    if not known:
        return generated
    return st.one_of(generated, st.sampled_from(known).map(lambda pk: {**path_parameters, "id": pk}))


def forget_submissions(*tenants: Tenant) -> None:
    """Drop the submit throttle's history for these tenants' tokens.

    Token ids are reused after a rolled-back test on SQLite, and the throttle's cache outlives the
    transaction; without this, the fuzz run's submissions would count against other tests (and theirs
    against it).
    """
    throttle = JobSubmitThrottle()
    pks = ApiToken.objects.filter(tenant__in=tenants).values_list("pk", flat=True)
    throttle.cache.delete_many([throttle.cache_format % {"scope": throttle.scope, "ident": f"token:{pk}"}
                                for pk in pks])


@pytest.fixture
def fuzz_world(acme: TenantWorld, globex: TenantWorld, settings, tmp_path):
    settings.WHALEZEN_UPLOAD_DIR = tmp_path / "uploads"  # uploads the run makes are not kept in var/
    forget_submissions(acme.tenant, globex.tenant)
    # Seed through the real API before the WSGI calls start (the Django test client re-enables the signal
    # handler we switch off below after each of its requests).
    acme_jobs = submit_jobs(acme, 3)
    assert acme.client.post(f"/api/v1/jobs/{acme_jobs[0]}/cancel/").status_code == 200  # a finished job: 409s
    submit_jobs(globex, 2)
    assert globex.client.post("/api/v1/tokens/", {"name": "ci", "scopes": ["read"]}, format="json").status_code == 201

    auth = ApiToken.objects.get(tenant=acme.tenant, user=acme.admin)
    INTERESTING_IDS.clear()
    for name, ids in owned_ids(acme.tenant).items():
        INTERESTING_IDS[name] = sorted(ids | owned_ids(globex.tenant)[name])

    # In-process WSGI calls run in this test's transaction; Django would otherwise close the connection
    # at the end of each request (as it does between real requests), breaking that transaction.
    request_started.disconnect(close_old_connections)
    request_finished.disconnect(close_old_connections)
    try:
        yield FuzzWorld(caller=acme, other=globex, auth_token_pk=auth.pk,
                        headers={"Authorization": f"Bearer {acme.token_secret}"})
    finally:
        request_started.connect(close_old_connections)
        request_finished.connect(close_old_connections)
        INTERESTING_IDS.clear()
        forget_submissions(acme.tenant, globex.tenant)


FOREIGN_FORMAT_FIELDS = {"kubernetes": {"apiVersion", "kind", "metadata", "spec"},
                         "skypilot": {"run", "setup", "resources", "envs", "secrets", "num_nodes", "name"}}


def request_fields(case) -> set[str]:
    """Names a 400 body may use for this request: the documented body properties, what was sent."""
    names = set(GENERIC_ERROR_KEYS)
    names |= set(case.query or {})
    names |= set(case.headers or {})  # a header the route reads is named as itself (X-Content-SHA256)
    if isinstance(case.body, dict):
        names |= set(case.body)
    # A body declared as another format (?spec_format=) is answered in that format's fields.
    names |= FOREIGN_FORMAT_FIELDS.get((case.query or {}).get("spec_format"), set())
    body = case.operation.definition.raw.get("requestBody")
    if body:
        for media in body.get("content", {}).values():
            ref = media.get("schema", {}).get("$ref", "")
            component = schema.raw_schema["components"]["schemas"].get(ref.rsplit("/", 1)[-1], {})
            names |= set(component.get("properties", {}))
    return names


def as_pk(value: Any) -> int | None:
    """The primary key the server looks up for a path id: Django's IntegerField uses int(), so `" 7"` and
    `0_07` are 7 as well."""
    try:
        return int(str(value))
    except ValueError:
        return None


def assert_field_errors(case, body: Any) -> None:
    assert isinstance(body, dict) and body, f"400 body must be a non-empty JSON object, got {body!r}"
    # A top-level "code" is the error's code (a string, broker/api/errors.py) unless the request had a field
    # named "code": then it is that field's list of reasons, and names it like any other.
    keys = {key for key in body if not (key == "code" and isinstance(body[key], str))}
    assert keys, f"400 body names no field: {body!r}"
    fields = request_fields(case)
    # Error bodies cut a long key to an excerpt ending in "…" (broker/api/errors.py), and "…" alone counts
    # the fields left out: such a key names the request field(s) it begins.
    unknown = {key for key in keys if key not in fields
               and not (key.endswith("…") and any(str(f).startswith(key[:-1]) for f in fields))}
    assert not unknown, f"400 body keys {sorted(unknown)} name no field of the request: {body!r}"
    for key in keys:
        assert body[key], f"400 body gives no reason for {key!r}: {body!r}"


@schema.parametrize()
@settings(max_examples=FUZZ_EXAMPLES, deadline=None, derandomize=True, database=None, print_blob=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.filter_too_much, HealthCheck.data_too_large])
def test_api_conforms_to_its_schema(case, fuzz_world: FuzzWorld):
    caller, other = fuzz_world.caller.tenant, fuzz_world.other.tenant
    # Deleting or revoking one's own token is legal; undo it so the rest of the run stays authenticated.
    ApiToken.objects.filter(pk=fuzz_world.auth_token_pk).update(revoked_at=None)
    other_before = tenant_snapshot(other)
    jobs_before = Job.objects.filter(tenant=caller).count()

    response = case.call_and_validate(headers=fuzz_world.headers, checks=CHECKS)

    status = response.status_code
    method, path = case.method.upper(), case.operation.path
    collection = collection_of(path)
    assert status < 500, (method, path, status, response.text)
    if status == 400:
        assert_field_errors(case, response.json())

    # Tenancy: nothing of the other tenant is visible or changed.
    assert tenant_snapshot(other) == other_before, f"{method} {case.formatted_path} changed another tenant's data"
    if collection in OWNED:
        mine, theirs = owned_ids(caller)[collection], owned_ids(other)[collection]
        raw_id = (case.path_parameters or {}).get("id")
        path_id = as_pk(raw_id)
        if path_id in theirs:
            assert status == 404, f"{method} {case.formatted_path} on another tenant's object: {status}"
        if 200 <= status < 300 and raw_id is not None:
            assert path_id in mine, f"{method} {case.formatted_path} answered {status} for an object not ours"
        if method == "GET" and status == 200 and "{id}" not in path:
            body = response.json()
            assert isinstance(body, dict) and "results" in body, (case.formatted_path, case.query, body)
            listed = {row["id"] for row in body["results"]}
            assert listed <= mine, f"listed {sorted(listed - mine)} that belong to another tenant"

    # No half-written jobs: one more job exactly when a submission answered 201, with its event.
    created = 1 if (method, path, status) == ("POST", "/api/v1/jobs/", 201) else 0
    assert Job.objects.filter(tenant=caller).count() == jobs_before + created, (method, path, status)
    if created:
        job = Job.objects.get(pk=response.json()["id"])
        assert job.tenant_id == caller.pk and job.state == JobState.PENDING
        assert job.events.filter(kind="submitted").exists(), "a job was stored without its submitted event"


def test_second_tenant_sees_and_changes_nothing_of_the_first(acme: TenantWorld, globex: TenantWorld):
    """Every documented operation, called with globex's token on acme's objects: empty lists and 404s.

    Driven by the OpenAPI document, so a new route is covered as soon as it is documented.
    """
    acme_jobs = submit_jobs(acme, 2)
    acme.client.post("/api/v1/tokens/", {"name": "ci"}, format="json")
    submit_jobs(globex, 1)
    theirs = owned_ids(acme.tenant)
    assert all(theirs.values()), theirs  # something of acme's in every owned collection
    before = tenant_snapshot(acme.tenant)
    client = bearer(globex.token_secret)

    probed = set()
    for path, operations in schema.raw_schema["paths"].items():
        collection = collection_of(path)
        for method in operations:
            if method not in ("get", "post", "put", "patch", "delete"):
                continue
            if "{id}" not in path:
                if method != "get":
                    continue
                resp = client.get(path, {"page_size": 500})
                assert resp.status_code == 200, (path, resp.status_code)
                body = resp.json()
                rows = body.get("results", []) if isinstance(body, dict) else body
                if collection in OWNED:
                    leaked = {row["id"] for row in rows} & theirs[collection]
                    assert not leaked, f"GET {path} shows acme's {collection} {sorted(leaked)} to globex"
                assert acme.tenant.slug not in resp.content.decode(), f"GET {path} mentions acme"
                probed.add((method, path))
                continue
            if collection not in OWNED:
                continue
            for pk in sorted(theirs[collection]):
                url = path.replace("{id}", str(pk))
                resp = getattr(client, method)(url, {}, format="json") if method != "get" else client.get(url)
                assert resp.status_code == 404, f"{method.upper()} {url} (acme's) answered globex {resp.status_code}"
                probed.add((method, path))
    assert tenant_snapshot(acme.tenant) == before, "globex changed acme's data"
    assert Job.objects.get(pk=acme_jobs[0]).state == JobState.PENDING
    # The document was walked: every owned detail route and every list route was tried.
    assert {("post", "/api/v1/jobs/{id}/cancel/"), ("delete", "/api/v1/tokens/{id}/"),
            ("get", "/api/v1/jobs/"), ("get", "/api/v1/jobs/{id}/events/")} <= probed, probed


def test_every_operation_documents_its_errors():
    """The error responses the fuzz test relies on are in the document (401 and 403 everywhere, ...)."""
    for path, operations in schema.raw_schema["paths"].items():
        for method, operation in operations.items():
            codes = set(operation["responses"])
            assert {"401", "403"} <= codes, (method, path, codes)
            if "{id}" in path:
                assert "404" in codes, (method, path, codes)
            if method in ("post", "put", "patch") and "requestBody" in operation:
                assert "400" in codes, (method, path, codes)
    assert "409" in schema.raw_schema["paths"]["/api/v1/jobs/{id}/cancel/"]["post"]["responses"]
    assert "429" in schema.raw_schema["paths"]["/api/v1/jobs/"]["post"]["responses"]


# --- Regressions for what fuzzing the API found -------------------------------------------------------------


@pytest.mark.parametrize("limits", [
    {"nvidia.com/gpu": 1, "cpu": "9" * 30},             # cpu_milli overflowed the database column: 500
    {"nvidia.com/gpu": 1, "cpu": "9" * 400},            # float('999...') is inf: int(inf) raised: 500
    {"nvidia.com/gpu": 1, "cpu": "9" * 30 + "m"},
    {"nvidia.com/gpu": 1, "memory": "9" * 30 + "Ti"},   # memory_mb overflowed the database column: 500
    {"nvidia.com/gpu": 1, "memory": "9" * 400},         # math.ceil(inf) raised: 500
    {"nvidia.com/gpu": 1, "cpu": "4097"},
    {"nvidia.com/gpu": 1, "memory": "65537Gi"},
])
def test_kubernetes_limits_beyond_a_node_are_a_400_naming_the_field(acme: TenantWorld, limits):
    spec = {**MINIMAL_SPEC, "resources": {"limits": limits}}
    resp = acme.client.post("/api/v1/jobs/", spec, format="json")
    assert resp.status_code == 400, resp.content
    assert set(resp.json()) == {"resources"} and set(resp.json()["resources"]) == {"limits"}, resp.json()
    assert not Job.objects.filter(tenant=acme.tenant).exists()


def test_kubernetes_limits_at_the_node_bounds_are_accepted(acme: TenantWorld):
    spec = {**MINIMAL_SPEC, "resources": {"limits": {"nvidia.com/gpu": 1, "cpu": "4096", "memory": "65536Gi"}}}
    resp = acme.client.post("/api/v1/jobs/", spec, format="json")
    assert resp.status_code == 201, resp.content
    assert resp.json()["demand"]["cpu_milli"] == 4096 * 1000
    assert resp.json()["demand"]["memory_mb"] == 65536 * 1024


@pytest.mark.parametrize("query", [
    {"created_after": "9999-12-31T23:59:59-14:00"},     # past year 9999 in UTC: OverflowError on SQLite, 500
    {"created_before": "0001-01-01T00:00:00+01:00"},    # before year 1 in UTC
])
def test_job_list_time_filters_outside_utc_are_a_400_naming_the_field(acme: TenantWorld, query):
    resp = acme.client.get("/api/v1/jobs/", query)
    assert resp.status_code == 400, resp.content
    assert set(resp.json()) == set(query), resp.json()


def test_job_list_time_filters_with_offsets_still_filter(acme: TenantWorld):
    (job_id,) = submit_jobs(acme, 1)
    created = Job.objects.get(pk=job_id).created_at
    hour_before_in_plus_two = (created - timedelta(hours=1)).astimezone(dt_timezone(timedelta(hours=2)))
    resp = acme.client.get("/api/v1/jobs/", {"created_after": hour_before_in_plus_two.isoformat()})
    assert [row["id"] for row in resp.json()["results"]] == [job_id]
    resp = acme.client.get("/api/v1/jobs/", {"created_before": hour_before_in_plus_two.isoformat()})
    assert resp.json()["results"] == []
