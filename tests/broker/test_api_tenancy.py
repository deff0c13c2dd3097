"""Every route: anonymous callers get 401; another tenant sees none of our rows and changes nothing."""
from __future__ import annotations

import pytest
from django.core import serializers as dj_serializers

from broker.jobs.models import Job, JobEvent
from broker.jobs.services import job_submit
from broker.jobs.spec import JobSpecSerializer
from broker.jobs.selectors import gpu_catalog
from broker.tenancy.models import ApiToken

from .conftest import MINIMAL_SPEC


def submit(world, **overrides) -> Job:
    body = {**MINIMAL_SPEC, **overrides}
    ser = JobSpecSerializer(data=body, context={"gpu_catalog": gpu_catalog()})
    ser.is_valid(raise_exception=True)
    return job_submit(tenant=world.tenant, owner=world.admin, validated=ser.validated_data)


def db_fingerprint() -> str:
    """Everything a cross-tenant call could have changed (the caller's own token use time aside)."""
    from broker.inventory.models import Gpu, Node, Pool

    rows = [*Job.objects.all(), *JobEvent.objects.all(), *Pool.objects.all(), *Node.objects.all(),
            *Gpu.objects.all()]
    tokens = list(ApiToken.objects.order_by("pk").values_list("pk", "prefix", "revoked_at", "expires_at", "scopes"))
    return dj_serializers.serialize("json", rows) + repr(tokens)


LIST_ROUTES = ["/api/v1/jobs/", "/api/v1/pools/", "/api/v1/nodes/", "/api/v1/tokens/", "/api/v1/gpu-models/",
               "/api/v1/quota/"]


@pytest.fixture
def acme_objects(acme):
    job = submit(acme)
    token = ApiToken.objects.filter(tenant=acme.tenant).first()
    return {"job": job, "pool": acme.pool, "node": acme.nodes[0], "token": token}


def object_routes(objs) -> list[tuple[str, str]]:
    j, p, n, t = objs["job"].pk, objs["pool"].pk, objs["node"].pk, objs["token"].pk
    return [
        ("get", f"/api/v1/jobs/{j}/"), ("get", f"/api/v1/jobs/{j}/events/"), ("post", f"/api/v1/jobs/{j}/cancel/"),
        ("get", f"/api/v1/pools/{p}/"), ("get", f"/api/v1/nodes/{n}/"), ("get", f"/api/v1/tokens/{t}/"),
        ("post", f"/api/v1/tokens/{t}/revoke/"), ("delete", f"/api/v1/tokens/{t}/"),
    ]


def test_anonymous_gets_401_everywhere(anon, acme_objects):
    before = db_fingerprint()
    routes = [("get", r) for r in LIST_ROUTES] + [("post", "/api/v1/jobs/"), ("post", "/api/v1/tokens/")]
    routes += object_routes(acme_objects)
    for method, url in routes:
        resp = getattr(anon, method)(url, MINIMAL_SPEC if method == "post" else None, format="json")
        assert resp.status_code == 401, (method, url, resp.status_code)
        assert resp.headers.get("WWW-Authenticate", "").startswith("Bearer")
    assert db_fingerprint() == before


def test_bad_token_gets_401(acme_objects):
    from .conftest import bearer

    for secret in ["nonsense", "wz_00000000_" + "x" * 43, acme_objects["token"].prefix]:
        resp = bearer(secret).get("/api/v1/jobs/")
        assert resp.status_code == 401


def test_other_tenant_gets_404_on_objects_and_changes_nothing(acme_objects, globex):
    before = db_fingerprint()
    for method, url in object_routes(acme_objects):
        resp = getattr(globex.client, method)(url, format="json")
        assert resp.status_code == 404, (method, url, resp.status_code)
    assert db_fingerprint() == before


def test_other_tenant_lists_show_none_of_our_rows(acme_objects, globex):
    submit(globex, name="globex-job")
    acme_job = acme_objects["job"]
    jobs = globex.client.get("/api/v1/jobs/").json()["results"]
    assert [j["name"] for j in jobs] == ["globex-job"]
    assert acme_job.pk not in {j["id"] for j in jobs}
    pools = globex.client.get("/api/v1/pools/").json()["results"]
    assert {p["id"] for p in pools} == {globex.pool.pk}
    nodes = globex.client.get("/api/v1/nodes/").json()["results"]
    assert {n["name"] for n in nodes} == {n.name for n in globex.nodes}
    tokens = globex.client.get("/api/v1/tokens/").json()["results"]
    assert all(t["prefix"] != acme_objects["token"].prefix for t in tokens)
    assert globex.client.get("/api/v1/quota/").json()["tenant"] == "globex"
    # Filters cannot reach across tenants either.
    assert globex.client.get(f"/api/v1/jobs/?name={acme_job.name}").json()["count"] == 0


def test_tenant_and_owner_are_not_writable(acme, globex):
    body = {**MINIMAL_SPEC, "tenant": globex.tenant.pk, "owner": globex.admin.pk}
    resp = acme.client.post("/api/v1/jobs/", body, format="json")
    assert resp.status_code == 400 and {"tenant", "owner"} <= set(resp.json())
    assert Job.objects.count() == 0


def test_viewer_can_read_but_not_write(acme):
    job = submit(acme)
    assert acme.viewer_client.get("/api/v1/jobs/").status_code == 200
    assert acme.viewer_client.post("/api/v1/jobs/", MINIMAL_SPEC, format="json").status_code == 403
    assert acme.viewer_client.post(f"/api/v1/jobs/{job.pk}/cancel/").status_code == 403
    assert acme.viewer_client.post("/api/v1/tokens/", {"name": "x"}, format="json").status_code == 403
    job.refresh_from_db()
    assert job.state == "PENDING"


def test_read_only_token_cannot_write(acme):
    from broker.tenancy.services import api_token_create

    from .conftest import bearer

    ro = bearer(api_token_create(tenant=acme.tenant, user=acme.member, name="ro", scopes=["read"]).secret)
    assert ro.get("/api/v1/jobs/").status_code == 200
    assert ro.post("/api/v1/jobs/", MINIMAL_SPEC, format="json").status_code == 403
    assert Job.objects.count() == 0


def test_session_user_uses_their_tenant(acme, globex):
    from rest_framework.test import APIClient

    submit(acme)
    client = APIClient(enforce_csrf_checks=True)
    client.force_login(globex.member)
    assert client.get("/api/v1/jobs/").json()["count"] == 0
    # Writes through a session need the CSRF token.
    resp = client.post("/api/v1/jobs/", MINIMAL_SPEC, format="json")
    assert resp.status_code == 403 and "CSRF" in resp.json()["detail"]


def test_node_pool_filter_does_not_reveal_other_tenants_pools(acme, globex):
    own = acme.client.get(f"/api/v1/nodes/?pool={acme.pool.pk}")
    assert own.status_code == 200 and own.json()["count"] == 2
    theirs = acme.client.get(f"/api/v1/nodes/?pool={globex.pool.pk}")
    missing = acme.client.get("/api/v1/nodes/?pool=999999")
    assert theirs.status_code == missing.status_code == 400
    assert "pool" in theirs.json() and "pool" in missing.json()


def test_unroutable_api_paths_answer_json_404(acme, settings):
    settings.DEBUG = False
    for url in ("/api/v1/jobs/1.5/", "/api/v1/jobs/a/b/", "/api/v1/nope/"):
        resp = acme.client.get(url)
        assert resp.status_code == 404 and resp.json() == {"detail": "Not found."}, url
