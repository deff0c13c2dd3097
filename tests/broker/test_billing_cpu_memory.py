"""CPU and memory chargeback (issue 13): an owned pool's rate per vCPU-hour and per GiB-hour of memory,
charged on the job's requested CPU and memory for the seconds its allocation holds its GPUs, at the
rates fixed when its price was, split by UTC day and rounded once per line like the GPU amount.

The figures (UTC, Monday 2026-11-02), acme's on-prem pool at $2.50 per GPU-hour, CPU $0.0333 per
vCPU-hour and memory $0.0047 per GiB-hour set with `billing_pool_rates`:
  J1, 1 GPU, 6 vCPUs, 50 GiB, Mon 22:00 -> Tue 01:30 (the CPU rate goes to $1 at Mon 23:00: J1 keeps
     $0.0333).
     Mon 2 h:   GPU 2 x 2.50 = 5.00; CPU 6 x 2 x 0.0333 = 0.3996 -> 0.40; memory 50 x 2 x 0.0047 = 0.47.
     Tue 1.5 h: GPU 3.75; CPU 6 x 1.5 x 0.0333 = 0.2997 -> 0.30; memory 50 x 1.5 x 0.0047 = 0.3525 -> 0.35.
  J2, 1 GPU, 2 vCPUs, 4 GiB, Tue 10:00 -> 11:00, placed after the change: GPU 2.50; CPU 2 x 1 x 1.00 = 2.00;
     memory 4 x 1 x 0.0047 = 0.0188 -> 0.02.
  Lines: 5.87, 4.40, 4.52 = 14.79; CPU 2.70, memory 0.84, GPU 11.25.
  Globex's pool sets no CPU or memory rate: its job (1 GPU, 16 vCPUs, 64 GiB, Mon 10:00 -> 11:00 at
  $1.20) pays 1.20 and nothing for CPU or memory.
"""
from __future__ import annotations

import io
import json
from decimal import Decimal

import pytest
from django.core.management import CommandError, call_command

from broker.billing.models import UsageRecord
from broker.inventory.models import Pool, PoolKind
from broker.jobs.services import GpuRequest, allocation_commit

from .test_api_tenancy import submit
from .test_billing_week import finish, frozen_clock, run

WEEK = "from=2026-11-02&to=2026-11-09"


def rates(pool: str, **options) -> str:
    out = io.StringIO()
    call_command("billing_pool_rates", "--pool", pool, *[f"--{k}={v}" for k, v in options.items()], stdout=out)
    return out.getvalue()


def meter() -> None:
    from broker.billing.services import meter as run_meter

    run_meter()


def start(world, node, name: str, **resources):
    """A 1-GPU job with `resources` (cpu, memory_gb) submitted, given GPU 0 of `node` and running."""
    job = submit(world, name=name, resources={"gpus": 1, **resources})
    allocation_commit(job=job, requests=[GpuRequest(node=node, gpu_indices=(0,))])
    return run(job)


@pytest.fixture
def replayed(acme, globex):
    with frozen_clock() as clock:
        Pool.objects.filter(pk=acme.pool.pk).update(gpu_hour_rate_usd=Decimal("2.50"))
        Pool.objects.filter(pk=globex.pool.pk).update(gpu_hour_rate_usd=Decimal("1.20"))
        assert rates("acme/onprem", cpu="0.0333", memory="0.0047") == (
            "acme/onprem: CPU $0.033300 per vCPU-hour, memory $0.004700 per GiB-hour\n")

        clock.at(0, 10)
        g1 = start(globex, globex.nodes[0], "globex-cpu", cpu=16, memory_gb=64)
        clock.at(0, 11)
        finish(g1)

        clock.at(0, 22)
        j1 = start(acme, acme.nodes[0], "j1-cpu", cpu=6, memory_gb=50)
        clock.at(0, 22, 1)
        meter()  # fixes J1's rates: $0.0333 per vCPU-hour
        clock.at(0, 23)
        rates("acme/onprem", cpu="1.00")
        clock.at(1, 1, 30)
        finish(j1)

        clock.at(1, 10)
        j2 = start(acme, acme.nodes[1], "j2-cpu", cpu=2, memory_gb=4)
        clock.at(1, 10, 1)
        meter()  # fixes J2's: $1.00 per vCPU-hour
        clock.at(1, 10, 30)
        live = acme.client.get(f"/api/v1/costs/?{WEEK}&group_by=job").json()["rows"]
        clock.at(1, 11)
        finish(j2)
        clock.at(2, 0, 30)
        meter()
        yield {"clock": clock, "jobs": {"j1": j1, "j2": j2, "g1": g1}, "live": live}


def test_cpu_and_memory_are_charged_to_the_cent_at_the_rates_fixed_at_the_start(replayed, acme):
    jobs = replayed["jobs"]
    records = UsageRecord.objects.filter(tenant=acme.tenant).order_by("start")
    got = [(r.job_id, r.day.isoformat(), str(r.gpu_amount_usd), str(r.cpu_amount_usd), str(r.memory_amount_usd),
            str(r.amount_usd)) for r in records]
    j1, j2 = jobs["j1"].pk, jobs["j2"].pk
    assert got == [(j1, "2026-11-02", "5.00", "0.40", "0.47", "5.87"), (j1, "2026-11-03", "3.75", "0.30", "0.35", "4.40"),
                   (j2, "2026-11-03", "2.50", "2.00", "0.02", "4.52")]
    first = records[0]
    assert first.cpu_core_seconds == Decimal(6 * 7200) and first.memory_gib_seconds == Decimal(50 * 7200)
    # J1 kept the CPU rate fixed when it started, although the pool's went to $1 while it ran.
    assert {r.cpu_rate_usd_per_core_hour for r in records if r.job_id == j1} == {Decimal("0.0333")}


def test_a_pool_without_rates_charges_no_cpu_or_memory(replayed, globex):
    (record,) = UsageRecord.objects.filter(tenant=globex.tenant)
    assert (record.amount_usd, record.cpu_amount_usd, record.memory_amount_usd) == (Decimal("1.20"), 0, 0)
    assert record.cpu_rate_usd_per_core_hour is None and record.cpu_core_seconds == 0
    body = globex.client.get(f"/api/v1/costs/?{WEEK}&group_by=team").json()
    assert body["rows"] == [{"team": "globex", "gpu_hours": 1.0, "cost": "1.20", "idle_gpu_hours": 0.0,
                             "idle_cost": "0.00", "cpu_cost": "0.00", "memory_cost": "0.00",
                             "avg_gpu_utilisation": None}]


def test_the_cost_report_csv_and_statement_show_cpu_and_memory(replayed, acme):
    jobs = replayed["jobs"]
    # While J2 ran (Tue 10:31), its live line already paid half an hour of CPU: 2 x 0.5 x 1.00 = 1.00.
    live = {r["job"]: r for r in replayed["live"]}
    assert live[jobs["j2"].pk]["cpu_cost"] == "1.00" and live[jobs["j2"].pk]["cost"] == "2.26"  # 1.25+1.00+0.01

    team = acme.client.get(f"/api/v1/costs/?{WEEK}&group_by=team").json()["rows"]
    assert team == [{"team": "acme", "gpu_hours": 4.5, "cost": "14.79", "idle_gpu_hours": 0.0, "idle_cost": "0.00",
                     "cpu_cost": "2.70", "memory_cost": "0.84", "avg_gpu_utilisation": None}]
    by_day = acme.client.get(f"/api/v1/costs/?{WEEK}&group_by=day,job").json()["rows"]
    assert [(r["day"], r["cost"], r["cpu_cost"], r["memory_cost"]) for r in by_day] == [
        ("2026-11-02", "5.87", "0.40", "0.47"), ("2026-11-03", "4.40", "0.30", "0.35"),
        ("2026-11-03", "4.52", "2.00", "0.02")]
    assert sum(Decimal(r["cost"]) for r in by_day) == Decimal("14.79")

    csv_lines = acme.client.get(f"/api/v1/costs/?{WEEK}&group_by=team&format=csv").content.decode().splitlines()
    assert csv_lines == ["team,gpu_hours,cost,idle_gpu_hours,idle_cost,cpu_cost,memory_cost,avg_gpu_utilisation",
                         "acme,4.5,14.79,0.0,0.00,2.70,0.84,"]

    st = acme.client.get("/api/v1/statements/2026-11/").json()
    assert st["totals"]["total_usd"] == "14.79" and st["totals"]["usage_usd"] == "14.79"
    assert st["totals"]["cpu_usd"] == "2.70" and st["totals"]["memory_usd"] == "0.84"
    j1_line = next(line for line in st["lines"] if line["job_name"] == "j1-cpu")
    assert (j1_line["cpu_core_hours"], j1_line["cpu_rate_usd_per_core_hour"], j1_line["cpu_amount_usd"],
            j1_line["memory_gib_hours"], j1_line["memory_amount_usd"], j1_line["amount_usd"]) == (
        "21.0000", "0.033300", "0.70", "175.0000", "0.82", "10.27")
    j2_line = next(line for line in st["lines"] if line["job_name"] == "j2-cpu")
    assert (j2_line["cpu_rate_usd_per_core_hour"], j2_line["cpu_amount_usd"], j2_line["amount_usd"]) == (
        "1.000000", "2.00", "4.52")
    assert sum(Decimal(line["amount_usd"]) for line in st["lines"]) == Decimal("14.79")
    header = acme.client.get("/api/v1/statements/2026-11/?format=csv").content.decode().splitlines()[0]
    assert "cpu_amount_usd" in header.split(",") and "memory_amount_usd" in header.split(",")
    printable = acme.client.get("/api/v1/statements/2026-11/?format=html").content.decode()
    assert "<th class=\"n\">CPU $</th>" in printable and ">2.70</td>" in printable and ">0.84</td>" in printable
    # The budget counts what the team pays, CPU and memory included (the clock is still at Wed 00:30).
    assert acme.client.get("/api/v1/budget/").json()["spent_usd"] == "14.79"


def test_billing_rebuild_check_agrees_and_catches_a_tampered_cpu_amount(replayed, acme):
    out = io.StringIO()
    call_command("billing_rebuild", "--check", stdout=out)
    assert "0 missing, 0 differing, 0 extra" in out.getvalue()
    record = UsageRecord.objects.filter(tenant=acme.tenant, cpu_amount_usd=Decimal("2.00")).get()
    UsageRecord.objects.filter(pk=record.pk).update(cpu_amount_usd=Decimal("1.00"))  # behind save()'s back
    out = io.StringIO()
    with pytest.raises(SystemExit) as exit_:
        call_command("billing_rebuild", "--check", stdout=out)
    assert exit_.value.code == 1
    assert f"differing: {record.key} (cpu_amount_usd)" in out.getvalue()


@pytest.mark.parametrize("options, reason", [
    ({"cpu": "-0.01"}, "--cpu: Ensure this value is greater than or equal to 0."),
    ({"memory": "cheap"}, "--memory: “cheap” value must be a decimal number."),
    ({"cpu": "0.1234567"}, "--cpu: Ensure that there are no more than 6 decimal places."),
    ({"cpu": "NaN"}, "--cpu: “NaN” value must be a decimal number."),
])
def test_bad_rates_are_refused_with_the_option_and_reason(acme, options, reason):
    with pytest.raises(CommandError) as err:
        rates("acme/onprem", **options)
    assert str(err.value) == reason
    pool = Pool.objects.get(pk=acme.pool.pk)
    assert pool.cpu_rate_usd_per_core_hour is None and pool.memory_rate_usd_per_gib_hour is None


def test_a_cloud_pool_takes_no_cpu_or_memory_rate_and_none_clears_a_rate(acme):
    Pool.objects.create(tenant=acme.tenant, name="aws-use1", kind=PoolKind.AWS, region="us-east-1")
    with pytest.raises(CommandError) as err:
        rates("acme/aws-use1", cpu="0.02")
    assert str(err.value) == ("--cpu: On a cloud pool (AWS) the instance price already covers CPU and memory: CPU "
                              "and memory rates apply to owned pools only.")
    with pytest.raises(CommandError, match="has no pool 'nope'"):
        rates("acme/nope", cpu="0.02")
    rates("acme/onprem", cpu="0.02", memory="0.01")
    assert rates("acme/onprem", memory="none") == "acme/onprem: CPU $0.020000 per vCPU-hour, memory not charged\n"
    assert rates("acme/onprem") == "acme/onprem: CPU $0.020000 per vCPU-hour, memory not charged\n"


def test_the_admin_pool_form_sets_rates_and_refuses_them_on_a_cloud_pool(acme, rf):
    from django.contrib import admin
    from django.contrib.auth import get_user_model
    from django.forms.models import model_to_dict

    request = rf.get("/admin/")
    request.user = get_user_model().objects.create_superuser("root", "root@example.com", "x" * 16)
    pool_admin = admin.site._registry[Pool]

    def submitted(pool: Pool, **changes):
        form_class = pool_admin.get_form(request, pool)
        data = {k: json.dumps(v) if isinstance(v, (dict, list)) else v for k, v in model_to_dict(pool).items()
                if k in form_class.base_fields and v is not None}
        return form_class(data={**data, **changes}, instance=pool)

    form = submitted(acme.pool, cpu_rate_usd_per_core_hour="0.05", memory_rate_usd_per_gib_hour="0.002")
    assert form.is_valid(), form.errors
    form.save()
    assert Pool.objects.get(pk=acme.pool.pk).cpu_rate_usd_per_core_hour == Decimal("0.05")
    assert "cpu_rate_usd_per_core_hour" in pool_admin.get_list_display(request)
    aws = Pool.objects.create(tenant=acme.tenant, name="aws-use1", kind=PoolKind.AWS, region="us-east-1")
    form = submitted(aws, memory_rate_usd_per_gib_hour="0.002")
    assert not form.is_valid()
    assert form.errors["memory_rate_usd_per_gib_hour"] == [
        "On a cloud pool (AWS) the instance price already covers CPU and memory: CPU and memory rates apply to "
        "owned pools only."]
    assert submitted(acme.pool, cpu_rate_usd_per_core_hour="-1").errors["cpu_rate_usd_per_core_hour"] == [
        "Ensure this value is greater than or equal to 0."]


def test_a_bulk_placement_fixes_the_cpu_and_memory_rates_with_the_gpu_rate(acme):
    """broker.jobs.batch's placements fix their prices through meters_create (no post_save)."""
    from django.utils import timezone

    from broker.billing.models import AllocationMeter
    from broker.billing.services import meters_create
    from broker.jobs.signals import PlacedAllocation

    rates("acme/onprem", cpu="0.02", memory="0.001")
    job = start(acme, acme.nodes[0], "bulk", cpu=4, memory_gb=8)
    alloc = job.allocations.select_related("node").get()
    AllocationMeter.objects.filter(allocation=alloc).delete()  # none yet: the commit's on_commit never ran
    meters_create(now=timezone.now(), allocations=[
        PlacedAllocation(alloc.pk, alloc.node_id, alloc.node.pool_id, "A100-80GB")])
    fixed = AllocationMeter.objects.get(allocation=alloc)
    assert (fixed.cpu_rate_usd_per_core_hour, fixed.memory_rate_usd_per_gib_hour) == (Decimal("0.02"), Decimal("0.001"))


def test_a_quote_on_an_owned_pool_includes_its_cpu_and_memory_rates(acme):
    """2 GPUs at $2.50, 16 vCPUs at $0.05 and 64 GiB at $0.01 per hour: 5.00 + 0.80 + 0.64 = $6.44/h, x 3 h."""
    Pool.objects.filter(pk=acme.pool.pk).update(gpu_hour_rate_usd=Decimal("2.50"))
    rates("acme/onprem", cpu="0.05", memory="0.01")
    spec = {"name": "train", "command": ["python", "train.py"], "expected_duration_hours": 3,
            "resources": {"gpus": 2, "cpu": 16, "memory_gb": 64}}
    resp = acme.member_client.post("/api/v1/quotes/", spec, format="json")
    assert resp.status_code == 200, resp.content[:300]
    best = resp.json()["options"][0]
    assert best["placement"]["owned"] is True
    assert (best["price_per_hour_usd"], best["expected_cost_usd"]) == ("6.4400", "19.32")
    pools = {p["name"]: p for p in acme.client.get("/api/v1/pools/").json()["results"]}
    assert (pools["onprem"]["cpu_rate_usd_per_core_hour"], pools["onprem"]["memory_rate_usd_per_gib_hour"]) == (
        "0.050000", "0.010000")
