"""Hostile tenancy on shared nodes: a team sees the shared pools and nodes it may use and their GPUs'
occupancy, but another team's job on them shows only as "in use by another team": no id, name, user,
spec, event or telemetry of it, through any route. Another team's own pools and nodes stay 404."""
from __future__ import annotations

import json

import pytest

from broker.jobs.models import Job
from broker.jobs.services import GpuRequest, allocation_commit, job_transition
from broker.jobs.states import JobState
from broker.inventory.models import Gpu
from broker.inventory.services import pool_share
from broker.tenancy.services import team_quota_set

from .test_api_tenancy import db_fingerprint, submit
from .test_shared_pools import H100, make_platform

SECRET_NAME = "globex-secret-training-run"


def running(job: Job, node, indices: tuple[int, ...], milli: int = 1000) -> Job:
    allocation_commit(job=job, requests=[GpuRequest(node=node, gpu_indices=indices, milli=milli)])
    for to in (JobState.STARTING, JobState.RUNNING):
        job = job_transition(job=job, to=to)
    return job


@pytest.fixture
def shared(acme, globex, gpu_models):
    """A platform H100 node shared with both teams: acme's job on GPUs 0-3, globex's on 4-7."""
    platform = make_platform(gpu_models)
    for team in (acme, globex):
        pool_share(pool=platform.pool, tenant=team.tenant)
    acme_job = running(submit(acme, name="acme-run", resources=H100), platform.node, (0, 1, 2, 3))
    globex_job = running(submit(globex, name=SECRET_NAME, resources=H100,
                                env={"GLOBEX_SECRET": "s3cr3t-value"}), platform.node, (4, 5, 6, 7))
    Gpu.objects.filter(node=platform.node).update(utilization_pct=97, memory_used_mb=70000, power_w=650.0,
                                                  temperature_c=61)
    return platform, acme_job, globex_job


def test_a_team_sees_the_shared_node_and_its_own_jobs_gpus_but_not_the_other_teams_job(acme, globex, shared):
    platform, acme_job, globex_job = shared
    body = acme.client.get("/api/v1/nodes/").json()
    node = next(n for n in body["results"] if n["id"] == platform.node.pk)
    assert node["shared"] is True and node["owned"] is False and node["pool"] == platform.pool.name
    held = {g["index"]: g["held_by"] for g in node["gpus"]}
    for index in (0, 1, 2, 3):
        assert held[index] == [{"job": acme_job.pk, "share": 1.0, "holder": "your team"}]
    for index in (4, 5, 6, 7):
        assert held[index] == [{"job": None, "share": 1.0, "holder": "in use by another team"}]
    gpus = {g["index"]: g for g in node["gpus"]}
    assert gpus[0]["utilization_pct"] == 97 and gpus[0]["power_w"] == 650.0  # its own job's GPU
    # Another team's job's load, memory and power are not shown (temperature is the machine's, not the job's).
    assert gpus[4]["utilization_pct"] is None and gpus[4]["memory_used_mb"] is None and gpus[4]["power_w"] is None
    assert gpus[4]["temperature_c"] == 61 and gpus[4]["in_use"] == 1.0
    # Nothing of globex's job anywhere in acme's node list; globex's own nodes not listed at all.
    text = json.dumps(body)
    for leak in (SECRET_NAME, "s3cr3t-value", "globex-admin", f'"job": {globex_job.pk}'):
        assert leak not in text
    assert {n["id"] for n in body["results"]} == {n.pk for n in acme.nodes} | {platform.node.pk}
    # And the same node, from globex's side, the other way round.
    theirs = globex.client.get(f"/api/v1/nodes/{platform.node.pk}/").json()
    held = {g["index"]: g["held_by"] for g in theirs["gpus"]}
    assert held[4] == [{"job": globex_job.pk, "share": 1.0, "holder": "your team"}]
    assert held[0] == [{"job": None, "share": 1.0, "holder": "in use by another team"}]
    assert "acme-run" not in json.dumps(theirs)


def test_the_pool_owner_sees_every_teams_job_as_another_teams(acme, globex, shared):
    platform, _, _ = shared
    from .conftest import bearer
    from broker.tenancy.services import api_token_create, membership_add
    from django.contrib.auth import get_user_model

    admin = get_user_model().objects.create_user(username="platform-admin")
    membership_add(tenant=platform.tenant, user=admin, role="admin")
    client = bearer(api_token_create(tenant=platform.tenant, user=admin, name="t").secret)
    node = client.get(f"/api/v1/nodes/{platform.node.pk}/").json()
    assert node["owned"] is True and node["shared"] is True
    assert all(g["held_by"] == [{"job": None, "share": 1.0, "holder": "in use by another team"}]
               for g in node["gpus"])
    assert client.get("/api/v1/jobs/").json()["count"] == 0


def test_a_fractional_gpu_shared_by_two_teams_shows_both_shares(acme, globex, shared, gpu_models):
    platform = make_platform(gpu_models, name="shared-t4", model="T4", gpus=1)
    for team in (acme, globex):
        pool_share(pool=platform.pool, tenant=team.tenant)
    mine = running(submit(acme, name="a-frac", resources={"gpu_fraction": 0.5, "gpu_models": ["T4"]}),
                   platform.node, (0,), milli=500)
    other = submit(globex, name="g-frac", resources={"gpu_fraction": 0.3, "gpu_models": ["T4"]})
    allocation_commit(job=other, requests=[GpuRequest(node=platform.node, gpu_indices=(0,), milli=300)])
    (gpu,) = acme.client.get(f"/api/v1/nodes/{platform.node.pk}/").json()["gpus"]
    assert gpu["held_by"] == [{"job": mine.pk, "share": 0.5, "holder": "your team"},
                              {"job": None, "share": 0.3, "holder": "in use by another team"}]
    assert gpu["in_use"] == 0.8 and gpu["utilization_pct"] is None


def test_pools_list_own_and_shared_pools_without_other_grantees(acme, globex, shared):
    platform, _, _ = shared
    pools = {p["id"]: p for p in acme.client.get("/api/v1/pools/").json()["results"]}
    assert set(pools) == {acme.pool.pk, platform.pool.pk}
    assert pools[acme.pool.pk]["shared"] is False and pools[acme.pool.pk]["owned"] is True
    mine = pools[platform.pool.pk]
    assert mine["shared"] is True and mine["owned"] is False and mine["owner"] == "platform"
    assert mine["node_count"] == 1
    assert "globex" not in json.dumps(pools), "who else the pool is shared with is not shown"
    assert acme.client.get(f"/api/v1/pools/{platform.pool.pk}/").status_code == 200
    assert acme.client.get(f"/api/v1/nodes/?pool={platform.pool.pk}").json()["count"] == 1


def test_another_teams_job_on_a_shared_node_is_404_through_every_route(acme, globex, shared):
    platform, _, globex_job = shared
    before = db_fingerprint()
    g = globex_job.pk
    for method, url in [("get", f"/api/v1/jobs/{g}/"), ("get", f"/api/v1/jobs/{g}/events/"),
                        ("get", f"/api/v1/jobs/{g}/checkpoints/"), ("get", f"/api/v1/jobs/{g}/migrations/"),
                        ("post", f"/api/v1/jobs/{g}/cancel/"), ("post", f"/api/v1/jobs/{g}/checkpoint/"),
                        ("post", f"/api/v1/jobs/{g}/migrate/"),
                        ("get", f"/api/v1/pools/{globex.pool.pk}/"), ("get", f"/api/v1/nodes/{globex.nodes[0].pk}/")]:
        resp = getattr(acme.client, method)(url, format="json")
        assert resp.status_code == 404, (method, url, resp.status_code)
    jobs = acme.client.get("/api/v1/jobs/").json()
    assert [j["name"] for j in jobs["results"]] == ["acme-run"]
    assert acme.client.get(f"/api/v1/jobs/?name={SECRET_NAME}").json()["count"] == 0
    assert acme.client.get(f"/api/v1/nodes/?pool={globex.pool.pk}").status_code == 400
    # Its own job's detail names the shared node, and nothing of the neighbour.
    own = acme.client.get(f"/api/v1/jobs/{jobs['results'][0]['id']}/").json()
    assert SECRET_NAME not in json.dumps(own)
    assert db_fingerprint() == before


def test_quota_shows_per_flavor_quotas_use_and_borrowing_of_the_caller_only(acme, globex, shared):
    team_quota_set(tenant=acme.tenant, flavor="H100-80GB", nominal=2, borrowing_limit=4, lending_limit=1)
    team_quota_set(tenant=globex.tenant, flavor="H100-80GB", nominal=6)
    body = acme.client.get("/api/v1/quota/").json()
    (quota,) = body["quotas"]
    assert quota == {"flavor": "H100-80GB", "nominal": 2.0, "borrowing_limit": 4.0, "lending_limit": 1.0,
                     "in_use": 4.0, "borrowed": 2.0, "decayed_usage_hours": 0.0}
    assert 0.0 < body["fair_share_factor"] <= 1.0
    assert "globex" not in json.dumps(body)
    theirs = globex.client.get("/api/v1/quota/").json()["quotas"]
    assert theirs[0]["nominal"] == 6.0 and theirs[0]["in_use"] == 4.0 and theirs[0]["borrowed"] == 0.0


def test_quota_of_a_team_without_a_row_for_a_managed_flavor_is_nominal_zero(acme, globex, shared):
    team_quota_set(tenant=globex.tenant, flavor="H100-80GB", nominal=8)
    (quota,) = acme.client.get("/api/v1/quota/").json()["quotas"]
    assert quota["nominal"] == 0.0 and quota["lending_limit"] == 0.0 and quota["borrowing_limit"] is None
    assert quota["in_use"] == 4.0 and quota["borrowed"] == 4.0


def test_quota_without_any_team_quota_has_no_quotas(acme):
    body = acme.client.get("/api/v1/quota/").json()
    assert body["quotas"] == [] and body["fair_share_factor"] is None


def test_a_reason_naming_another_teams_jobs_shows_only_how_many(acme, globex, shared):
    """The engine's RECLAIMING (or defragmentation) reason lists the jobs it stops or moves; on a shared
    node some are another team's. The team reads its own ids and a count of the others."""
    from broker.scheduler.services import plan_commit
    from scheduling import model as sm

    platform, acme_job, globex_job = shared
    waiting = submit(acme, name="acme-waits", resources=H100)
    ids = [str(acme_job.pk), str(globex_job.pk)]
    plan = sm.Plan(pending={str(waiting.pk): sm.Reason(
        sm.ReasonCode.RECLAIMING,
        f"RECLAIMING: 2 borrowed job(s) of acme, globex on {platform.node.pk} are checkpointing ({', '.join(ids)})",
        {"victims": ids, "victim_teams": ["acme", "globex"], "node_id": str(platform.node.pk)})})
    plan_commit(tenant=acme.tenant, plan=plan)
    reason = acme.client.get(f"/api/v1/jobs/{waiting.pk}/").json()["pending_reason"]
    assert reason["code"] == "RECLAIMING"
    assert reason["data"]["victims"] == [str(acme_job.pk)] and reason["data"]["victims_of_other_teams"] == 1
    assert f"({acme_job.pk}, 1 of another team)" in reason["message"]
    events = json.dumps(acme.client.get(f"/api/v1/jobs/{waiting.pk}/events/").json())
    assert f'"{globex_job.pk}"' not in events and f", {globex_job.pk})" not in events


def test_a_job_moved_for_another_teams_job_is_not_told_that_jobs_id(acme, globex, shared, tmp_path, settings):
    from broker.scheduler.services import plan_commit
    from scheduling import model as sm

    settings.WHALEZEN_CHECKPOINT_ROOTS = [str(tmp_path)]
    platform, _, _ = shared
    mover = running(submit(globex, name="g-mover", resources={"gpus": 1, "gpu_models": ["A100-80GB"]},
                           preemptible=True, checkpoint={"uri": str(tmp_path / "g")}), globex.nodes[0], (0,))
    waiting = submit(acme, name="acme-big", resources=H100)
    plan = sm.Plan(migrations=(sm.Migration(job_id=str(mover.pk), from_node_id=str(globex.nodes[0].pk),
                                            to=sm.PlacementPart(node_id=str(globex.nodes[1].pk), gpu_indices=(0,)),
                                            reason="defragmentation", for_job_id=str(waiting.pk)),))
    assert plan_commit(tenant=globex.tenant, plan=plan).moved == [mover.pk]
    events = globex.client.get(f"/api/v1/jobs/{mover.pk}/events/").json()["results"]
    moving = [e["message"] for e in events if "Moving to" in e["message"]]
    assert moving and "another team's job" in moving[0] and f"job {waiting.pk}" not in json.dumps(events)
