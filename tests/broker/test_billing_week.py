"""A metered week replayed through the real services (submission, allocation commits, moves, launches,
node registration, cancellation, release), with the metering task run along the way as beat would,
and every line and total checked against hand-computed figures to the cent.

The week (UTC, Monday 2026-11-02), acme's on-prem A100 pool charged at $2.50 per GPU-hour:
  J1 on-prem, 2 GPUs, Mon 22:00 -> Tue 01:30: Mon 2 h x 2 x 2.50 = 10.00, Tue 1.5 h x 2 x 2.50 = 7.50.
     (The pool's rate goes to $9 at Mon 23:00: J1 keeps the price fixed when it started.)
  J2 on-prem, 1 GPU, Tue 09:00 -> 12:00 = 7.50; moved to spot instance I1 (4 x L4, $4.00/h spot, so
     $1 per GPU-hour), requested Tue 12:00, registered 12:06, J2 holds 1 GPU 12:06 -> 18:06 = 6.00;
     I1 terminated 18:36: idle = (6.6 h x 4 - 6 h x 1) GPU-h x $1 = 20.40.
  J3 (4 GPUs, admin) and J4 (2 GPUs, member) share on-demand instance I2 (8 x A10G, $16.00/h, $2 per
     GPU-hour), requested Wed 08:00, registered 08:10; J3 08:10 -> 12:10 = 4 h x 4 x 2 = 32.00, J4
     08:10 -> 10:40 = 2.5 h x 2 x 2 = 10.00; I2 terminated 12:20: idle = (4 h 20 min x 8 - 16 - 5) GPU-h
     x $2 = 13.6667 x 2 = 27.3333 -> 27.33.
  J5 launches I3 (1 x A100-40GB on-demand, $3.673/h), requested Thu 09:00, J5 cancelled 09:02 while
     booting, I3 terminated 09:05: idle 5 min x 3.673 = 0.30608 -> 0.31 (charged to acme, the launcher).
  J6 fractional, gpu_fraction 0.25 (holds 3 of 10 slots: pays 0.3 GPU), Fri 10:00 -> 20:00:
     10 h x 0.3 x 2.50 = 7.50.
  Usage 10.00 + 7.50 + 7.50 + 6.00 + 32.00 + 10.00 + 7.50 = 80.50; idle 20.40 + 27.33 + 0.31 = 48.04;
  total 128.54; 40 GPU-hours held (7 + 9 + 16 + 5 + 3), 34.15 idle (20.4 + 13.6667 + 0.0833). Globex runs one job (1 GPU, Mon 10:00 -> 11:00, $0 rate) that acme never sees.
"""
from __future__ import annotations

from contextlib import contextmanager
from datetime import datetime, timedelta, timezone as dt_timezone
from decimal import Decimal
from unittest import mock

import pytest

from broker.billing.models import UsageRecord
from broker.billing.services import meter, rebuild
from broker.inventory.models import CloudInstance, Gpu, GpuModel, InstanceState, Node, Pool, PoolKind
from broker.jobs.services import GpuRequest, allocation_commit, job_allocations_release, job_cancel, job_transition
from broker.jobs.states import JobState
from broker.provisioning.services import instance_node_registered

from .conftest import bearer
from .test_api_tenancy import submit

MONDAY = datetime(2026, 11, 2, tzinfo=dt_timezone.utc)


class Clock:
    def __init__(self, start: datetime) -> None:
        self.now = start

    def __call__(self) -> datetime:
        return self.now

    def at(self, day: int, hour: int, minute: int = 0) -> datetime:
        self.now = MONDAY + timedelta(days=day, hours=hour, minutes=minute)
        return self.now


@contextmanager
def frozen_clock(start: datetime = MONDAY):
    clock = Clock(start)
    with mock.patch("django.utils.timezone.now", clock):
        yield clock


@pytest.fixture
def clock():
    with frozen_clock() as c:
        yield c


def run(job, *, to=JobState.RUNNING):
    job.refresh_from_db()
    if job.state == JobState.PLACED:
        job = job_transition(job=job, to=JobState.STARTING)
    if job.state == JobState.STARTING and to != JobState.STARTING:
        job = job_transition(job=job, to=JobState.RUNNING)
    return job


def finish(job):
    job.refresh_from_db()
    return job_transition(job=job, to=JobState.SUCCEEDED)


def cloud_pool(world, *, name: str, kind: str = PoolKind.AWS, region: str = "us-east-1") -> Pool:
    return Pool.objects.create(tenant=world.tenant, name=name, kind=kind, region=region, max_instances=8)


def launch(pool: Pool, *, jobs: list[tuple], instance_type: str, gpu_model: str, gpu_count: int, price: str,
           spot: bool, key: str) -> CloudInstance:
    """What launch_request records (the row before any cloud call), and the jobs PROVISIONING on it; then
    the provider's answer (a provider id)."""
    placements = [{"job_id": job.pk, "gpu_indices": list(indices), "milli": milli} for job, indices, milli in jobs]
    instance = CloudInstance.objects.create(
        tenant=pool.tenant, pool=pool, request_key=key, instance_type=instance_type, zone=f"{pool.region}a",
        spot=spot, hourly_price_usd=Decimal(price), node_name=f"{pool.name}-{key}", placements=placements,
        offer={"region": pool.region, "zone": f"{pool.region}a", "instance_type": instance_type,
               "gpu_model": gpu_model, "gpu_count": gpu_count, "on_demand_per_hour": float(price)})
    for job, _, _ in jobs:
        job.refresh_from_db()
        if job.state in (JobState.PENDING, JobState.MIGRATING):
            job = job_transition(job=job, to=JobState.PLACED, reason_code="LAUNCH")
        job_transition(job=job, to=JobState.PROVISIONING, reason_code="PROVISIONING")
    CloudInstance.objects.filter(pk=instance.pk).update(provider_id=f"i-{key}", state=InstanceState.PENDING)
    instance.refresh_from_db()
    return instance


def register(instance: CloudInstance) -> Node:
    """The instance's agent registers its node; the broker hands the waiting jobs their GPUs."""
    model = GpuModel.objects.get(name=instance.offer["gpu_model"])
    node = Node.objects.create(tenant=instance.tenant, pool=instance.pool, name=instance.node_name,
                               cpu_milli=64000, memory_mb=256 * 1024)
    for i in range(int(instance.offer["gpu_count"])):
        Gpu.objects.create(node=node, index=i, model=model, model_name=model.name, memory_mb=model.memory_gb * 1024,
                           uuid=f"GPU-{instance.pk}-{i}")
    instance_node_registered(node=node)
    return node


def terminated(instance: CloudInstance) -> None:
    """The provider confirmed the termination (what instance_terminate / the reconciler record)."""
    CloudInstance.objects.filter(pk=instance.pk).update(state=InstanceState.TERMINATED,
                                                        terminated_at=instance_now())


def instance_now():
    from django.utils import timezone

    return timezone.now()


def replay_week(clock: Clock, acme, globex) -> dict:
    pool = acme.pool
    pool.gpu_hour_rate_usd = Decimal("2.50")
    pool.save()
    onprem0, onprem1 = acme.nodes
    jobs = {}

    clock.at(0, 10)
    g1 = submit(globex, name="globex-job", resources={"gpus": 1})
    allocation_commit(job=g1, requests=[GpuRequest(node=globex.nodes[0], gpu_indices=(0,))])
    run(g1)
    clock.at(0, 11)
    finish(g1)

    # J1: Monday night on-prem, across midnight; the pool's rate changes while it runs.
    clock.at(0, 22)
    jobs["j1"] = j1 = submit(acme, name="j1-onprem", resources={"gpus": 2})
    allocation_commit(job=j1, requests=[GpuRequest(node=onprem0, gpu_indices=(0, 1))])
    run(j1)
    clock.at(0, 22, 1)
    meter()  # beat: fixes J1's price at $2.50
    clock.at(0, 23)
    pool.gpu_hour_rate_usd = Decimal("9.00")
    pool.save()
    clock.at(1, 0, 30)
    meter()  # Monday's line is final now
    clock.at(1, 1, 30)
    finish(j1)
    pool.gpu_hour_rate_usd = Decimal("2.50")
    pool.save()

    # J2: on-prem, then moved to a spot instance.
    clock.at(1, 9)
    jobs["j2"] = j2 = submit(acme, name="j2-moved", resources={"gpus": 1}, placement={"spot": "allowed"})
    allocation_commit(job=j2, requests=[GpuRequest(node=onprem1, gpu_indices=(0,))])
    run(j2)
    meter()
    clock.at(1, 12)
    j2 = job_transition(job=j2, to=JobState.CHECKPOINTING, reason_code="SPOT")
    j2 = job_transition(job=j2, to=JobState.MIGRATING, reason_code="CHEAPER")
    job_allocations_release(job=j2)  # the source stopped: its GPUs are free
    aws = cloud_pool(acme, name="aws-use1")
    i1 = launch(aws, jobs=[(j2, (0,), 1000)], instance_type="g6.12xlarge", gpu_model="L4", gpu_count=4,
                price="4.00", spot=True, key="i1")
    clock.at(1, 12, 6)
    register(i1)
    run(j2)
    meter()  # J2's spot price fixed
    clock.at(1, 18, 6)
    finish(j2)
    clock.at(1, 18, 36)
    terminated(i1)

    # J3 and J4 share an on-demand instance.
    clock.at(2, 8)
    jobs["j3"] = j3 = submit(acme, name="j3-shared", resources={"gpus": 4})
    jobs["j4"] = j4 = submit(acme, name="j4-shared", resources={"gpus": 2})
    j4.owner = acme.member
    j4.save(update_fields=["owner"])
    i2 = launch(aws, jobs=[(j3, (0, 1, 2, 3), 1000), (j4, (4, 5), 1000)], instance_type="g5.48xlarge",
                gpu_model="A10G", gpu_count=8, price="16.00", spot=False, key="i2")
    clock.at(2, 8, 10)
    register(i2)
    run(j3)
    run(j4)
    meter()
    clock.at(2, 10, 40)
    finish(j4)
    clock.at(2, 12, 10)
    finish(j3)
    clock.at(2, 12, 20)
    terminated(i2)

    # J5 cancelled while its instance boots.
    gcp = cloud_pool(acme, name="gcp-usc1", kind=PoolKind.GCP, region="us-central1")
    clock.at(3, 9)
    jobs["j5"] = j5 = submit(acme, name="j5-cancelled", resources={"gpus": 1})
    i3 = launch(gcp, jobs=[(j5, (0,), 1000)], instance_type="a2-highgpu-1g", gpu_model="A100-40GB",
                gpu_count=1, price="3.673", spot=False, key="i3")
    clock.at(3, 9, 2)
    job_cancel(job=j5)
    meter()
    clock.at(3, 9, 5)
    terminated(i3)

    # J6: a quarter of a GPU (3 slots).
    clock.at(4, 10)
    jobs["j6"] = j6 = submit(acme, name="j6-fraction", resources={"gpu_fraction": 0.25})
    allocation_commit(job=j6, requests=[GpuRequest(node=onprem1, gpu_indices=(3,), milli=250)])
    run(j6)
    meter()
    clock.at(4, 20)
    finish(j6)

    clock.at(7, 0, 30)  # next Monday: the whole week is final
    meter()
    return {"jobs": jobs, "instances": {"i1": i1, "i2": i2, "i3": i3}}


EXPECTED_USAGE = {  # (job, day) -> amount
    ("j1", "2026-11-02"): "10.00", ("j1", "2026-11-03"): "7.50",
    ("j2", "2026-11-03"): ["7.50", "6.00"],  # two placements: on-prem, then the spot instance
    ("j3", "2026-11-04"): "32.00", ("j4", "2026-11-04"): "10.00", ("j6", "2026-11-06"): "7.50",
}
EXPECTED_IDLE = {"i1": "20.40", "i2": "27.33", "i3": "0.31"}


def test_the_metered_week_to_the_cent(clock, acme, globex):
    world = replay_week(clock, acme, globex)
    jobs, instances = world["jobs"], world["instances"]
    records = list(UsageRecord.objects.filter(tenant=acme.tenant).order_by("start", "id"))
    usage = {}
    for r in records:
        if r.kind == "usage":
            name = next(k for k, j in jobs.items() if j.pk == r.job_id)
            usage.setdefault((name, r.day.isoformat()), []).append(str(r.amount_usd))
    assert {k: v if len(v) > 1 else v[0] for k, v in usage.items()} == EXPECTED_USAGE
    idle = {next(k for k, i in instances.items() if i.pk == r.instance_id): str(r.amount_usd)
            for r in records if r.kind == "idle"}
    assert idle == EXPECTED_IDLE
    # J1 kept its start price although the pool's went to $9 meanwhile; J2 on the instance paid spot.
    j1_rates = {r.rate_usd_per_gpu_hour for r in records if r.job_id == jobs["j1"].pk}
    assert j1_rates == {Decimal("2.500000")}
    j2_spot = [r for r in records if r.job_id == jobs["j2"].pk and r.spot]
    assert len(j2_spot) == 1 and j2_spot[0].rate_usd_per_gpu_hour == Decimal("1.000000")
    j6 = next(r for r in records if r.job_id == jobs["j6"].pk)
    assert j6.gpus == Decimal("0.300") and j6.seconds == 36000
    # Idle of I3 is acme's (the launcher), not its pool owner's by accident: the same here, so check the key.
    assert sum(r.amount_usd for r in records) == Decimal("128.54")
    assert sum(r.amount_usd for r in records if r.kind == "usage") == Decimal("80.50")
    # Globex's job is globex's only.
    assert not UsageRecord.objects.filter(tenant=acme.tenant, job_name="globex-job").exists()
    assert UsageRecord.objects.filter(tenant=globex.tenant).count() == 1

    # Metering again (and again) changes nothing; the rebuild from allocations agrees.
    before = UsageRecord.objects.count()
    meter()
    meter()
    assert UsageRecord.objects.count() == before
    report = rebuild(check_only=True)
    assert report.agrees, (report.missing, report.differing, report.extra)


def test_the_week_through_the_api(clock, acme, globex):
    replay_week(clock, acme, globex)
    client = acme.client
    body = client.get("/api/v1/costs/?from=2026-11-02&to=2026-11-09&group_by=team").json()
    assert body["rows"] == [{"team": "acme", "gpu_hours": 40.0, "cost": "128.54", "idle_gpu_hours": 34.15,
                             "idle_cost": "48.04", "cpu_cost": "0.00", "memory_cost": "0.00",
                             "avg_gpu_utilisation": None}]
    days = client.get("/api/v1/costs/?from=2026-11-02&to=2026-11-09&group_by=day").json()["rows"]
    assert [(r["day"], r["cost"]) for r in days] == [
        ("2026-11-02", "10.00"), ("2026-11-03", "41.40"), ("2026-11-04", "69.33"), ("2026-11-05", "0.31"),
        ("2026-11-06", "7.50")]
    by_job = {r["job"]: r["cost"] for r in client.get(
        "/api/v1/costs/?from=2026-11-02&to=2026-11-09&group_by=job").json()["rows"]}
    assert by_job["__idle__"] == "48.04" and sum(Decimal(v) for v in by_job.values()) == Decimal("128.54")
    combo = client.get("/api/v1/costs/?from=2026-11-02&to=2026-11-09&group_by=provider,gpu_model").json()["rows"]
    assert {(r["provider"], r["gpu_model"]): r["cost"] for r in combo} == {
        ("onprem", "A100-80GB"): "32.50", ("aws", "L4"): "26.40", ("aws", "A10G"): "69.33",
        ("gcp", "A100-40GB"): "0.31"}
    # A member sees only their own job's costs (J4), no idle.
    mine = acme.member_client.get("/api/v1/costs/?from=2026-11-02&to=2026-11-09&group_by=user").json()
    assert mine["rows"] == [{"user": "acme-member", "gpu_hours": 5.0, "cost": "10.00", "idle_gpu_hours": 0.0,
                             "idle_cost": "0.00", "cpu_cost": "0.00", "memory_cost": "0.00",
                             "avg_gpu_utilisation": None}]
    # CSV, both ways.
    csv_body = client.get("/api/v1/costs/?from=2026-11-02&to=2026-11-09&group_by=team&format=csv")
    assert csv_body["Content-Type"].startswith("text/csv")
    assert csv_body.content.decode().splitlines() == [
        "team,gpu_hours,cost,idle_gpu_hours,idle_cost,cpu_cost,memory_cost,avg_gpu_utilisation",
        "acme,40.0,128.54,34.15,48.04,0.00,0.00,"]
    accept = client.get("/api/v1/costs/?from=2026-11-02&to=2026-11-09", HTTP_ACCEPT="text/csv")
    assert accept.content.decode().splitlines()[1] == "acme,40.0,128.54,34.15,48.04,0.00,0.00,"
    # Globex sees its own team only.
    other = globex.client.get("/api/v1/costs/?from=2026-11-02&to=2026-11-09&group_by=team").json()["rows"]
    assert other == [{"team": "globex", "gpu_hours": 1.0, "cost": "0.00", "idle_gpu_hours": 0.0,
                      "idle_cost": "0.00", "cpu_cost": "0.00", "memory_cost": "0.00", "avg_gpu_utilisation": None}]

    # November's statement (the month is still open on 2026-11-09).
    st = client.get("/api/v1/statements/2026-11/").json()
    assert st["status"] == "open" and st["totals"]["total_usd"] == "128.54"
    assert st["totals"]["usage_usd"] == "80.50" and st["totals"]["idle_usd"] == "48.04"
    assert len(st["lines"]) == 9  # 6 placements (J1's two days are one line, J2 has two) and 3 idle instances
    assert sum(Decimal(line["amount_usd"]) for line in st["lines"]) == Decimal("128.54")
    j1_line = next(line for line in st["lines"] if line["job_name"] == "j1-onprem")
    assert j1_line["amount_usd"] == "17.50" and j1_line["gpu_hours"] == "7.0000"
    html = client.get("/api/v1/statements/2026-11/?format=html")
    assert html.status_code == 200 and b"128.54" in html.content and b"<table>" in html.content
    assert b"http" not in html.content.split(b"<body>")[0]  # no external assets
    csv_lines = client.get("/api/v1/statements/2026-11/?format=csv").content.decode().splitlines()
    assert len(csv_lines) == 10 and csv_lines[0].startswith("kind,job,job_name,user")
    assert globex.client.get("/api/v1/statements/2026-11/").json()["totals"]["total_usd"] == "0.00"


def test_savings_against_the_cheapest_on_demand_offer(clock, acme, globex, monkeypatch):
    """The week's jobs against on-demand A100-80GB at $4.10 and L4 at $0.80 per GPU-hour (no A10G offer:
    J3 and J4 are not comparable). J1: 7 GPU-h x 4.10 = 28.70 vs 17.50; J2: 3 x 4.10 + 6 x 0.80 = 17.10
    vs 13.50; J6: 3 x 4.10 = 12.30 vs 7.50. Saved 11.20 + 3.60 + 4.80 = 19.60."""
    from broker.billing import savings

    replay_week(clock, acme, globex)
    monkeypatch.setattr(savings, "cheapest_on_demand", lambda tenant: {
        "A100-80GB": (Decimal("4.10"), "aws us-east-1 p4de.24xlarge"), "L4": (Decimal("0.80"), "gcp us-central1 g2")})
    body = acme.client.get("/api/v1/costs/savings/?from=2026-11-02&to=2026-11-09").json()
    by_name = {j["job_name"]: j for j in body["jobs"]}
    assert by_name["j1-onprem"]["on_demand_usd"] == "28.70" and by_name["j1-onprem"]["saved_usd"] == "11.20"
    assert by_name["j2-moved"]["on_demand_usd"] == "17.10" and by_name["j2-moved"]["cost_usd"] == "13.50"
    assert by_name["j6-fraction"]["saved_usd"] == "4.80"
    assert by_name["j3-shared"]["on_demand_usd"] is None and by_name["j3-shared"]["cost_usd"] == "32.00"
    assert body["totals"] == {"cost_usd": "80.50", "idle_usd": "48.04", "compared_cost_usd": "38.50",
                              "on_demand_usd": "58.10", "saved_usd": "19.60"}
    assert acme.client.get("/api/v1/costs/savings/?from=x").status_code == 400


def test_savings_price_each_day_at_that_days_cheapest_offer(clock, acme, globex, monkeypatch):
    """The metering task records each day's cheapest on-demand prices; a later price change does not
    reprice the past. J1 ran 4 GPU-h on Monday (A100-80GB then $4.10) and 3 on Tuesday ($2.00): 16.40 +
    6.00 = 22.40 against its 17.50. Days with no record (Wednesday on) use today's offers ($1.00)."""
    from broker.billing import savings
    from broker.billing.models import OnDemandPrice

    replay_week(clock, acme, globex)
    for day, price in ((0, "4.10"), (1, "2.00")):
        monkeypatch.setattr(savings, "cheapest_on_demand", lambda tenant, price=price: {
            "A100-80GB": (Decimal(price), "aws us-east-1 p4de.24xlarge")})
        assert savings.on_demand_prices_record(now=MONDAY + timedelta(days=day, hours=12)) == 2  # acme, globex
        assert savings.on_demand_prices_record(now=MONDAY + timedelta(days=day, hours=13)) == 0  # once a day
    monkeypatch.setattr(savings, "cheapest_on_demand", lambda tenant: {
        "A100-80GB": (Decimal("1.00"), "gcp us-central1 a2-ultragpu-1g")})
    body = acme.client.get("/api/v1/costs/savings/?from=2026-11-02&to=2026-11-09").json()
    j1 = {j["job_name"]: j for j in body["jobs"]}["j1-onprem"]
    assert (j1["on_demand_usd"], j1["cost_usd"], j1["saved_usd"]) == ("22.40", "17.50", "4.90")
    j6 = {j["job_name"]: j for j in body["jobs"]}["j6-fraction"]  # Friday: no record, so today's $1
    assert j6["on_demand_usd"] == "3.00"
    assert OnDemandPrice.objects.filter(tenant=acme.tenant).count() == 2


def test_a_team_whose_offers_cannot_be_read_is_recorded_later_and_others_now(clock, acme, globex, monkeypatch):
    from broker.billing import savings
    from broker.billing.models import OnDemandPrice

    def offers(tenant):
        if tenant.slug == "globex":
            raise TypeError("a misconfigured pool")
        return {"L4": (Decimal("0.80"), "gcp us-central1 g2")}

    monkeypatch.setattr(savings, "cheapest_on_demand", offers)
    assert savings.on_demand_prices_record() == 1
    assert not OnDemandPrice.objects.filter(tenant=globex.tenant).exists()
    monkeypatch.setattr(savings, "cheapest_on_demand", lambda tenant: {"L4": (Decimal("0.90"), "aws g6")})
    assert savings.on_demand_prices_record() == 1  # globex now; acme keeps today's first price
    assert OnDemandPrice.objects.get(tenant=acme.tenant).usd_per_gpu_hour == Decimal("0.80")
