"""The billing API's edges: bad parameters (400 with the field), tenancy (another team's figures are absent,
its months 404), roles (statements and budget changes for admins), month close, budgets that act (the 80%
alert, the engine's remaining budget from the billing figure), and quotes from the engine."""
from __future__ import annotations

from datetime import datetime, timedelta, timezone as dt_timezone
from decimal import Decimal

import pytest
from django.core.management import call_command

from broker.billing.models import AppendOnly, BillingMonth, BudgetAlert, UsageRecord
from broker.billing.services import BillingError, meter, month_close
from broker.inventory.models import CloudInstance, Gpu, GpuModel, InstanceState, Node, Pool, PoolKind
from broker.jobs.models import Allocation
from broker.jobs.services import GpuRequest, allocation_commit
from broker.scheduler.snapshot import tenant_budget
from broker.tenancy.models import Quota

from .test_api_tenancy import submit
from .test_billing_week import MONDAY, frozen_clock, replay_week


@pytest.mark.parametrize("query, field", [
    ("from=2026-13-01", "from"), ("from=yesterday", "from"), ("to=2026-11-01&from=2026-11-05", "to"),
    ("from=2026-11-01&to=2026-11-01", "to"), ("from=2020-01-01&to=2026-01-01", "to"),
    ("group_by=team,planet", "group_by"), ("group_by=day,day", "group_by"), ("group_by=", "group_by"),
    ("format=xml", "format"), ("from=" + "9" * 5000, "from"),
])
def test_bad_cost_parameters_are_400_with_the_field(acme, query, field):
    resp = acme.client.get(f"/api/v1/costs/?{query}")
    assert resp.status_code == 400, resp.content[:200]
    body = resp.json()
    assert field in body and isinstance(body[field], list) and len(str(body)) < 600


def test_bad_months_and_budgets(acme):
    for bad in ("2026-13", "26-11", "1", "pools"):
        resp = acme.client.get(f"/api/v1/statements/{bad}/")
        assert resp.status_code == 400 and "is not a month" in resp.json()["non_field_errors"][0]
    csv_error = acme.client.get("/api/v1/costs/?format=csv&from=nope")
    assert csv_error.status_code == 400 and csv_error.json() == {"from": ["'nope' is not a date: use YYYY-MM-DD."]}
    resp = acme.client.patch("/api/v1/budget/", {"monthly_budget_usd": "-5"}, format="json")
    assert resp.status_code == 400 and "monthly_budget_usd" in resp.json()
    resp = acme.client.patch("/api/v1/budget/", {"monthly_budget_usd": "lots"}, format="json")
    assert resp.status_code == 400 and "monthly_budget_usd" in resp.json()
    resp = acme.client.post("/api/v1/quotes/", {"name": "x", "resources": {"gpus": 1}}, format="json")
    assert resp.status_code == 400 and "command" in resp.json()


def test_another_teams_figures_are_absent_and_its_past_months_404(gpu_models, acme, globex):
    with frozen_clock() as clock:
        replay_week(clock, acme, globex)
        rows = globex.client.get("/api/v1/costs/?from=2026-11-01&to=2026-12-01&group_by=job,user,pool").json()["rows"]
        assert rows and all(r["user"].startswith("globex") and r["pool"].startswith("globex/") for r in rows)
        listed = globex.client.get("/api/v1/statements/").json()["results"]
        assert [s["month"] for s in listed] == ["2026-11"] and listed[0]["total_usd"] == "0.00"
        assert "128.54" not in globex.client.get("/api/v1/statements/2026-11/").content.decode()
        assert globex.client.get("/api/v1/statements/2026-10/").status_code == 404
        # Unauthenticated: nothing.
        from rest_framework.test import APIClient

        for path in ("/api/v1/costs/", "/api/v1/statements/", "/api/v1/statements/2026-11/", "/api/v1/budget/"):
            assert APIClient().get(path).status_code in (401, 403)


def test_roles_members_see_their_own_costs_and_no_statements(acme):
    assert acme.member_client.get("/api/v1/costs/").status_code == 200
    assert acme.member_client.get("/api/v1/costs/").json()["scope"] == "user acme-member"
    assert acme.member_client.get("/api/v1/statements/").status_code == 403
    assert acme.viewer_client.get("/api/v1/statements/2026-11/").status_code == 403
    assert acme.member_client.get("/api/v1/budget/").status_code == 200
    assert acme.member_client.patch("/api/v1/budget/", {"monthly_budget_usd": "10"},
                                    format="json").status_code == 403
    assert acme.client.patch("/api/v1/budget/", {"monthly_budget_usd": "10"}, format="json").status_code == 200
    assert Quota.objects.get(tenant=acme.tenant).monthly_budget_usd == Decimal("10.00")


def test_a_closed_month_is_frozen(gpu_models, acme, globex):
    with frozen_clock() as clock:
        replay_week(clock, acme, globex)
        with pytest.raises(BillingError):
            month_close(tenant=acme.tenant, month="2026-11")  # not over yet
        clock.now = datetime(2026, 12, 1, 0, 5, tzinfo=dt_timezone.utc)
        call_command("billing_close_month", "--month", "2026-11")
        row = BillingMonth.objects.get(tenant=acme.tenant, month="2026-11")
        assert row.closed_at is not None and row.statement["totals"]["total_usd"] == "128.54"
        st = acme.client.get("/api/v1/statements/2026-11/").json()
        assert st["status"] == "closed" and st["totals"]["total_usd"] == "128.54"
        row.statement = {}
        with pytest.raises(AppendOnly):
            row.save()
        record = UsageRecord.objects.filter(tenant=acme.tenant).first()
        record.amount_usd = Decimal("0")
        with pytest.raises(AppendOnly):
            record.save()
        with pytest.raises(AppendOnly):
            record.delete()
        # Closing again changes nothing; the rebuild agrees.
        assert month_close(tenant=acme.tenant, month="2026-11").closed_at == row.closed_at
        call_command("billing_rebuild", "--check")


def test_budget_warning_at_80_percent_and_the_engine_reads_the_billing_figure(acme):
    """$2.50/GPU-h chargeback, 2 GPUs for 4 h = $20 of a $24 budget: 83%. The engine's remaining budget
    is the billing figure (an owned pool's chargeback), and a rented node pays its instance's price."""
    from django.utils import timezone

    pool = acme.pool
    pool.gpu_hour_rate_usd = Decimal("2.50")
    pool.save()
    Quota.objects.update_or_create(tenant=acme.tenant, defaults={"monthly_budget_usd": Decimal("24")})
    job = submit(acme, resources={"gpus": 2})
    allocation_commit(job=job, requests=[GpuRequest(node=acme.nodes[0], gpu_indices=(0, 1))])
    now = timezone.now()
    start = max(now - timedelta(hours=4), now.replace(day=1, hour=0, minute=0, second=0, microsecond=0))
    Allocation.objects.filter(job=job).update(created_at=start)
    held_h = Decimal(int(now.timestamp()) - int(start.timestamp())) / 3600
    expected = (2 * held_h * Decimal("2.50")).quantize(Decimal("0.01"))
    meter(now=now)
    body = acme.client.get("/api/v1/budget/").json()
    assert Decimal(body["spent_usd"]) == pytest.approx(expected, abs=Decimal("0.02"))
    if expected >= Decimal("19.2"):  # 80% of 24 (always, but on the 1st of a month before 04:00 UTC)
        assert body["warning"] is True and body["exceeded"] is False
        assert BudgetAlert.objects.filter(tenant=acme.tenant, threshold_pct=80).count() == 1
        assert [a["threshold_pct"] for a in body["alerts"]] == [80]
        meter(now=now)
        assert BudgetAlert.objects.filter(tenant=acme.tenant).count() == 1  # once per month
    budget = tenant_budget(tenant=acme.tenant, now=timezone.now())
    assert budget.remaining_budget == pytest.approx(24 - float(body["spent_usd"]), abs=0.05)
    # An admin raises the budget through the API; the engine sees it.
    acme.client.patch("/api/v1/budget/", {"monthly_budget_usd": "1000"}, format="json")
    assert tenant_budget(tenant=acme.tenant, now=timezone.now()).remaining_budget > 900


def test_a_rented_node_pays_its_instance_price_in_the_budget(acme):
    from django.utils import timezone

    Quota.objects.update_or_create(tenant=acme.tenant, defaults={"monthly_budget_usd": Decimal("100")})
    aws = Pool.objects.create(tenant=acme.tenant, name="aws", kind=PoolKind.AWS, region="us-east-1",
                              gpu_hour_rate_usd=Decimal("99"))  # the pool's rate is not what an instance costs
    node = Node.objects.create(tenant=acme.tenant, pool=aws, name="aws-node", cpu_milli=8000, memory_mb=32768)
    model = GpuModel.objects.get(name="L4")
    for i in range(4):
        Gpu.objects.create(node=node, index=i, model=model, model_name="L4", memory_mb=24576, uuid=f"GPU-x-{i}")
    now = timezone.now()
    CloudInstance.objects.create(tenant=acme.tenant, pool=aws, node=node, request_key="k1", provider_id="i-1",
                                 instance_type="g6.12xlarge", state=InstanceState.RUNNING, node_name="aws-node",
                                 hourly_price_usd=Decimal("4.00"), offer={"gpu_count": 4, "gpu_model": "L4"})
    job = submit(acme, resources={"gpus": 4})
    allocation_commit(job=job, requests=[GpuRequest(node=node, gpu_indices=(0, 1, 2, 3))])
    start = max(now - timedelta(hours=1), now.replace(day=1, hour=0, minute=0, second=0, microsecond=0))
    Allocation.objects.filter(job=job).update(created_at=start)
    CloudInstance.objects.filter(request_key="k1").update(created_at=start)
    hours = (int(now.timestamp()) - int(start.timestamp())) / 3600
    budget = tenant_budget(tenant=acme.tenant, now=now)
    assert budget.remaining_budget == pytest.approx(100 - 4.0 * hours, abs=0.02)


def test_a_quote_from_the_engine(acme):
    pool = acme.pool
    pool.gpu_hour_rate_usd = Decimal("2.50")
    pool.save()
    spec = {"name": "train", "command": ["python", "train.py"], "resources": {"gpus": 2},
            "expected_duration_hours": 3}
    resp = acme.member_client.post("/api/v1/quotes/", spec, format="json")
    assert resp.status_code == 200, resp.content[:300]
    body = resp.json()
    best = body["options"][0]
    assert best["placement"]["kind"] == "node" and best["placement"]["owned"] is True
    assert best["gpu_model"] == "A100-80GB" and best["market"] == "on-demand"
    assert best["expected_cost_usd"] == "15.00" and best["price_per_hour_usd"] == "5.0000"  # 2 x 2.50 x 3 h
    from broker.jobs.models import Job

    assert not Job.objects.filter(name="train").exists()  # nothing submitted
    # Nothing can hold 64 GPUs on one node: no option, the engine's reason.
    spec["resources"] = {"gpus": 64}
    body = acme.client.post("/api/v1/quotes/", spec, format="json").json()
    assert body["options"] == [] and body["unplaceable"]
    assert body["unplaceable"][0]["code"] == "INSUFFICIENT_GPUS"  # the code as the API writes codes elsewhere


def test_the_beat_task_meters_and_is_recorded(acme, settings):
    from broker.billing.tasks import billing_meter
    from broker.ops.models import PeriodicRun

    assert settings.CELERY_BEAT_SCHEDULE["billing-meter"]["task"] == "billing.meter"
    job = submit(acme, resources={"gpus": 1})
    allocation_commit(job=job, requests=[GpuRequest(node=acme.nodes[0], gpu_indices=(2,))])
    billing_meter()
    assert PeriodicRun.objects.filter(name="billing.meter").exists()
    from broker.billing.models import AllocationMeter

    assert AllocationMeter.objects.filter(allocation__job=job).count() == 1
