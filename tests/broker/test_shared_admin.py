"""Platform admin for shared capacity: `pool_share` and `quota_set` (clear errors, non-zero exit on bad
input), the TeamQuota rules in the model and the database, the admin pages, and fair-share usage decay."""
from __future__ import annotations

import subprocess
import sys
from datetime import timedelta
from decimal import Decimal
from io import StringIO
from pathlib import Path

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import IntegrityError, transaction
from django.utils import timezone

from broker.inventory.models import Pool, PoolGrant, PoolKind
from broker.inventory.services import node_create_simulated, pool_share
from broker.jobs.services import GpuRequest, allocation_commit
from broker.tenancy.models import FairShareUsage, TeamQuota
from broker.tenancy.services import decayed_usage, fair_share_usage_update

from .test_api_tenancy import submit
from .test_shared_pools import H100, make_platform


def run(command: str, *args: str) -> str:
    out = StringIO()
    call_command(command, *args, stdout=out)
    return out.getvalue()


# ------------------------------------------------------------------------------------ pool_share


def test_pool_share_grants_is_idempotent_and_revokes(acme, gpu_models):
    platform = make_platform(gpu_models)
    assert "now shared with acme" in run("pool_share", "--pool", "platform/shared-h100", "--tenant", "acme")
    assert "already shared with acme" in run("pool_share", "--pool", "platform/shared-h100", "--tenant", "acme")
    assert list(PoolGrant.objects.values_list("pool", "tenant")) == [(platform.pool.pk, acme.tenant.pk)]
    assert "no longer shared" in run("pool_share", "--pool", "platform/shared-h100", "--tenant", "acme", "--revoke")
    assert not PoolGrant.objects.exists()


@pytest.mark.parametrize("pool, tenant, revoke, message", [
    ("shared-h100", "acme", False, "OWNER_SLUG/POOL_NAME"),
    ("nobody/shared-h100", "acme", False, "No tenant 'nobody'"),
    ("platform/missing", "acme", False, "has no pool 'missing' (its pools: shared-h100)"),
    ("platform/shared-h100", "ghost", False, "No tenant 'ghost'"),
    ("platform/shared-h100", "platform", False, "owner always may use its pool"),
    ("platform/shared-h100", "acme", True, "not shared with acme: nothing to revoke"),
])
def test_pool_share_refuses_bad_input_with_a_clear_error(acme, gpu_models, pool, tenant, revoke, message):
    make_platform(gpu_models)
    args = ["--pool", pool, "--tenant", tenant] + (["--revoke"] if revoke else [])
    with pytest.raises(CommandError, match=message.replace("(", r"\(").replace(")", r"\)")):
        run("pool_share", *args)
    assert not PoolGrant.objects.exists()


# ------------------------------------------------------------------------------------- quota_set


def test_quota_set_creates_replaces_and_deletes(acme):
    out = run("quota_set", "--tenant", "acme", "--flavor", "A100-80GB", "--nominal", "8", "--borrowing-limit", "4",
              "--lending-limit", "8")
    assert "acme A100-80GB: nominal 8, borrowing limit 4, lending limit 8" in out
    run("quota_set", "--tenant", "acme", "--flavor", "a100-80gb", "--nominal", "6")  # any case: the same flavor
    (quota,) = TeamQuota.objects.all()
    assert (quota.flavor, quota.nominal, quota.borrowing_limit, quota.lending_limit) == \
        ("A100-80GB", Decimal("6"), None, None), "setting a flavor again replaces all three"
    run("quota_set", "--tenant", "acme", "--flavor", "cu", "--nominal", "12.5")
    assert TeamQuota.objects.get(flavor="CU").nominal == Decimal("12.5")
    assert "Deleted" in run("quota_set", "--tenant", "acme", "--flavor", "A100-80GB", "--delete")
    assert list(TeamQuota.objects.values_list("flavor", flat=True)) == ["CU"]


@pytest.mark.parametrize("args, message", [
    (["--tenant", "ghost", "--flavor", "A100-80GB", "--nominal", "1"], "No tenant 'ghost'"),
    (["--tenant", "acme", "--flavor", "Z9000", "--nominal", "1"], "flavor: Unknown flavor 'Z9000'"),
    (["--tenant", "acme", "--flavor", "A100-80GB"], "nominal: --nominal is required"),
    (["--tenant", "acme", "--flavor", "A100-80GB", "--nominal", "-1"], "nominal:"),
    (["--tenant", "acme", "--flavor", "A100-80GB", "--nominal", "eight"], "nominal must be a number"),
    (["--tenant", "acme", "--flavor", "A100-80GB", "--nominal", "nan"], "nominal must be a finite number"),
    (["--tenant", "acme", "--flavor", "A100-80GB", "--nominal", "4", "--lending-limit", "5"],
     "lending_limit: The lending limit \\(5\\) cannot exceed the nominal quota \\(4\\)"),
    (["--tenant", "acme", "--flavor", "A100-80GB", "--nominal", "4", "--borrowing-limit", "-2"], "borrowing_limit:"),
    (["--tenant", "acme", "--flavor", "A100-80GB", "--delete"], "acme has no quota of A100-80GB"),
    (["--tenant", "acme", "--flavor", "A100-80GB", "--delete", "--nominal", "1"], "--delete takes no"),
])
def test_quota_set_refuses_bad_input_with_the_field_and_reason(acme, args, message):
    with pytest.raises(CommandError, match=message):
        run("quota_set", *args)
    assert not TeamQuota.objects.exists()


def test_a_bad_command_exits_non_zero_with_the_error_on_stderr(tmp_path):
    """Through manage.py, as an admin runs it (its own SQLite database, migrated first)."""
    env = {"WHALEZEN_VAR_DIR": str(tmp_path), "PATH": "/usr/bin:/bin", "DATABASE_URL": ""}
    root = Path(__file__).resolve().parents[2]
    manage = [sys.executable, str(root / "manage.py")]
    subprocess.run(manage + ["migrate", "-v0"], env=env, cwd=root, check=True, timeout=120)
    done = subprocess.run(manage + ["quota_set", "--tenant", "ghost", "--flavor", "CU", "--nominal", "1"],
                          env=env, cwd=root, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "No tenant 'ghost'" in done.stderr


def test_the_database_refuses_a_lending_limit_above_nominal(acme):
    with pytest.raises(IntegrityError), transaction.atomic():
        TeamQuota.objects.create(tenant=acme.tenant, flavor="CU", nominal=Decimal("2"), lending_limit=Decimal("3"))
    with pytest.raises(IntegrityError), transaction.atomic():
        TeamQuota.objects.create(tenant=acme.tenant, flavor="CU", nominal=Decimal("-1"))
    TeamQuota.objects.create(tenant=acme.tenant, flavor="CU", nominal=Decimal("2"), lending_limit=Decimal("2"))


def test_the_admin_lists_grants_quotas_and_usage(acme, gpu_models, admin_client):
    platform = make_platform(gpu_models)
    pool_share(pool=platform.pool, tenant=acme.tenant)
    TeamQuota.objects.create(tenant=acme.tenant, flavor="H100-80GB", nominal=Decimal("8"))
    FairShareUsage.objects.create(tenant=acme.tenant, flavor="H100-80GB", decayed_hours=3.5,
                                  updated_at=timezone.now())
    for url, text in [("/admin/inventory/poolgrant/", "shared-h100"), ("/admin/tenancy/teamquota/", "H100-80GB"),
                      ("/admin/tenancy/fairshareusage/", "3.5"),
                      (f"/admin/inventory/pool/{platform.pool.pk}/change/", "acme")]:
        resp = admin_client.get(url)
        assert resp.status_code == 200 and text in resp.content.decode(), url
    # The admin's form runs the model's rules: an unknown flavor is refused, nothing saved.
    resp = admin_client.post("/admin/tenancy/teamquota/add/", {"tenant": acme.tenant.pk, "flavor": "Z9000",
                                                                "nominal": "1"})
    assert resp.status_code == 200 and "Unknown flavor" in resp.content.decode()
    assert TeamQuota.objects.count() == 1


# ------------------------------------------------------------------------------------ fair share


def test_decay_halves_usage_every_half_life_and_adds_what_was_held():
    assert decayed_usage(previous=10.0, held=0.0, seconds=168 * 3600, half_life_hours=168) == pytest.approx(5.0)
    assert decayed_usage(previous=10.0, held=0.0, seconds=2 * 24 * 3600, half_life_hours=24) == pytest.approx(2.5)
    assert decayed_usage(previous=0.0, held=8.0, seconds=3600, half_life_hours=168) == pytest.approx(8.0)
    assert decayed_usage(previous=4.0, held=2.0, seconds=1800, half_life_hours=0.5) == pytest.approx(2.0 + 1.0)
    assert decayed_usage(previous=4.0, held=2.0, seconds=-60, half_life_hours=1) == pytest.approx(4.0)


def test_usage_counts_owned_gpus_per_model_and_compute_units_and_decays(acme, gpu_models):
    """4 H100s held on an owned node for an hour: 4 GPU-hours of H100-80GB and 4 x its CU rating of CU;
    then nothing held for one half-life: half of each. A rented node's GPUs are not counted."""
    platform = make_platform(gpu_models)
    pool_share(pool=platform.pool, tenant=acme.tenant)
    cloud = Pool.objects.create(tenant=acme.tenant, name="rented", kind=PoolKind.AWS, region="us-east-1")
    rented = node_create_simulated(pool=cloud, name="i-1", gpu_model=gpu_models["H100-80GB"], gpu_count=8,
                                   nvlink_island_size=8, cpu_milli=96000, memory_mb=1024 * 1024)
    job = submit(acme, resources=H100)
    allocation_commit(job=job, requests=[GpuRequest(node=platform.node, gpu_indices=(0, 1, 2, 3))])
    other = submit(acme, name="rented", resources=H100)
    allocation_commit(job=other, requests=[GpuRequest(node=rented, gpu_indices=(0, 1, 2, 3))])
    t0 = timezone.now()
    assert fair_share_usage_update(tenants=[acme.tenant], now=t0, half_life_hours=24) == {
        ("acme", "H100-80GB"): 0.0, ("acme", "CU"): 0.0}  # first sight: nothing to charge yet
    after_hour = fair_share_usage_update(tenants=[acme.tenant], now=t0 + timedelta(hours=1), half_life_hours=24)
    cu = float(gpu_models["H100-80GB"].compute_units)
    assert after_hour[("acme", "H100-80GB")] == pytest.approx(4.0)
    assert after_hour[("acme", "CU")] == pytest.approx(4 * cu)
    job.allocations.update(active=False)
    from broker.jobs.models import AllocationSlice

    AllocationSlice.objects.filter(allocation__job=job).update(active=False)
    later = fair_share_usage_update(tenants=[acme.tenant], now=t0 + timedelta(hours=25), half_life_hours=24)
    assert later[("acme", "H100-80GB")] == pytest.approx(2.0)
    assert later[("acme", "CU")] == pytest.approx(2 * cu)
    row = FairShareUsage.objects.get(tenant=acme.tenant, flavor="H100-80GB")
    assert row.updated_at == t0 + timedelta(hours=25)


def test_every_cycle_updates_the_components_usage_with_the_configured_half_life(acme, gpu_models, settings):
    from broker.scheduler.services import scheduling_cycle_run

    settings.WHALEZEN_FAIR_SHARE_HALF_LIFE_HOURS = 1.0
    FairShareUsage.objects.create(tenant=acme.tenant, flavor="A100-80GB", decayed_hours=8.0,
                                  updated_at=timezone.now() - timedelta(hours=2))
    scheduling_cycle_run(tenant=acme.tenant)  # nothing pending: the decay happens all the same
    assert FairShareUsage.objects.get(tenant=acme.tenant).decayed_hours == pytest.approx(2.0, rel=1e-3)


def test_the_sweep_charges_running_jobs_even_when_no_cycle_runs(acme, gpu_models):
    """Nothing pending, so no cycle: the periodic sweep still adds what acme's job holds on owned GPUs."""
    from broker.scheduler.services import tenants_to_schedule
    from broker.tenancy.services import fair_share_usage_sweep

    job = submit(acme, resources={"gpus": 2})
    allocation_commit(job=job, requests=[GpuRequest(node=acme.nodes[0], gpu_indices=(0, 1))])
    assert tenants_to_schedule() == []
    t0 = timezone.now()
    assert fair_share_usage_sweep(now=t0) == 1
    fair_share_usage_sweep(now=t0 + timedelta(minutes=30))
    row = FairShareUsage.objects.get(tenant=acme.tenant, flavor="A100-80GB")
    assert row.decayed_hours == pytest.approx(1.0, rel=1e-3)  # 2 GPUs x 0.5 h (the decay of 0 is 0)


def test_usage_is_brought_up_to_date_once_a_step_not_at_every_cycle(acme, gpu_models, settings):
    """A cycle leaves usage updated less than a step ago as it is (reading every running job's GPUs was most
    of a cycle with nothing new); the first cycle after the step charges the whole interval since."""
    from broker.scheduler.services import scheduling_cycle_run

    settings.WHALEZEN_FAIR_SHARE_STEP_SECONDS = 30
    job = submit(acme, resources={"gpus": 2})
    allocation_commit(job=job, requests=[GpuRequest(node=acme.nodes[0], gpu_indices=(0, 1))])
    ten_s_ago = timezone.now() - timedelta(seconds=10)
    FairShareUsage.objects.create(tenant=acme.tenant, flavor="A100-80GB", decayed_hours=1.0, updated_at=ten_s_ago)
    scheduling_cycle_run(tenant=acme.tenant)
    row = FairShareUsage.objects.get(tenant=acme.tenant)
    assert (row.decayed_hours, row.updated_at) == (1.0, ten_s_ago)
    an_hour_ago = timezone.now() - timedelta(hours=1)
    FairShareUsage.objects.filter(pk=row.pk).update(updated_at=an_hour_ago)
    scheduling_cycle_run(tenant=acme.tenant)
    row.refresh_from_db()
    assert row.updated_at > an_hour_ago
    assert row.decayed_hours == pytest.approx(1.0 * 2 ** (-1 / 168) + 2.0, rel=1e-3)  # 2 GPUs for the hour


def test_the_sweep_skips_teams_updated_within_a_step_and_charges_the_others(acme, globex, gpu_models, settings):
    from broker.tenancy.services import fair_share_usage_sweep

    settings.WHALEZEN_FAIR_SHARE_STEP_SECONDS = 30
    t0 = timezone.now()
    FairShareUsage.objects.create(tenant=acme.tenant, flavor="A100-80GB", decayed_hours=3.0,
                                  updated_at=t0 - timedelta(seconds=5))
    FairShareUsage.objects.create(tenant=globex.tenant, flavor="A100-80GB", decayed_hours=3.0,
                                  updated_at=t0 - timedelta(hours=168))
    assert fair_share_usage_sweep(now=t0) == 1
    assert FairShareUsage.objects.get(tenant=acme.tenant).decayed_hours == 3.0
    assert FairShareUsage.objects.get(tenant=globex.tenant).decayed_hours == pytest.approx(1.5)
    assert fair_share_usage_sweep(now=t0 + timedelta(seconds=20)) == 0  # both fresh now
    assert fair_share_usage_sweep(now=t0 + timedelta(seconds=28)) == 1  # acme's step has passed, not globex's


def test_the_shared_demo_is_opt_in_and_idempotent(db, settings, tmp_path, monkeypatch):
    from broker.ops.demo_agents import demo_nodes

    settings.VAR_DIR = tmp_path
    call_command("seed_demo", stdout=StringIO())
    assert not Pool.objects.filter(tenant__slug="platform").exists() and not PoolGrant.objects.exists()
    monkeypatch.setenv("WHALEZEN_DEMO_SHARED", "1")
    first, second = StringIO(), StringIO()
    call_command("seed_demo", stdout=first)
    call_command("seed_demo", stdout=second)
    assert first.getvalue() == second.getvalue() and "TOKEN platform " in first.getvalue()
    pool = Pool.objects.get(tenant__slug="platform", name="shared-l40s")
    assert demo_nodes(pool) == {"platform-l40s-0": "4xL40S"}  # serve starts its agent
    assert sorted(PoolGrant.objects.values_list("tenant__slug", flat=True)) == ["acme", "globex"]
    assert sorted(TeamQuota.objects.values_list("tenant__slug", "flavor", "nominal")) == [
        ("acme", "L40S", Decimal("2")), ("globex", "L40S", Decimal("2"))]
