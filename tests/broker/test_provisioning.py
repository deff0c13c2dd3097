"""Cloud bursting through the broker: plan a launch, provision it on (moto) EC2, fail over on capacity
errors, hand the GPUs to the job when the node registers, requeue when the provider takes it away."""
from __future__ import annotations

from decimal import Decimal

import boto3
import pytest

from broker.inventory.models import CloudInstance, Gpu, InstanceState, Node, OfferBlock, Pool, PoolKind
from broker.jobs.models import Job
from broker.jobs.states import JobState
from broker.provisioning import services as provisioning
from broker.provisioning.reconcile import pool_reconcile
from broker.scheduler.services import scheduling_cycle_run
from broker.scheduler.timeouts import stalled_boots_retire
from providers.base import ErrorKind, ProviderError
from tests.providers.conftest import moto_ami, moto_endpoint  # noqa: F401  (fixtures)

from .conftest import requires_postgres
from .test_api_tenancy import submit


@pytest.fixture
def aws_pool(acme, moto_endpoint, moto_ami, settings):  # noqa: F811
    from django.core.cache import cache

    cache.clear()  # offers are cached per pool (in Redis when REDIS_URL is set)
    settings.WHALEZEN_BROKER_ID = f"wz-broker-test-{acme.tenant.pk}-{id(settings)}"
    for node in acme.nodes:  # no on-prem capacity: the job must burst
        node.state = "OFFLINE"
        node.save()
    return Pool.objects.create(
        tenant=acme.tenant, name="aws-use1", kind=PoolKind.AWS, region="us-east-1", max_instances=4,
        provider_config={"endpoint_url": moto_endpoint, "regions": ["us-east-1"],
                         "image_ids": {"us-east-1": moto_ami}})


def ec2(endpoint):
    return boto3.client("ec2", region_name="us-east-1", endpoint_url=endpoint)


def running_ours(endpoint, broker_id):
    found = ec2(endpoint).describe_instances(Filters=[
        {"Name": "tag:whalezen:broker", "Values": [broker_id]},
        {"Name": "instance-state-name", "Values": ["pending", "running"]}])
    return [i for r in found["Reservations"] for i in r["Instances"]]


def at_once(call, args) -> None:
    """`call(arg)` for each of `args` in a thread of its own, with its own database connection, all
    released at the same moment; returns when every one has finished (PostgreSQL concurrency tests)."""
    import threading

    from django.db import close_old_connections, connection

    start = threading.Barrier(len(args))

    def run(arg) -> None:
        close_old_connections()
        try:
            start.wait()
            call(arg)
        finally:
            connection.close()

    threads = [threading.Thread(target=run, args=(arg,)) for arg in args]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)


def register_node_for(instance: CloudInstance) -> Node:
    """What the agent on the new VM does when it boots: register under the instance's node name."""
    node = Node.objects.create(tenant=instance.tenant, pool=instance.pool, name=instance.node_name,
                               cpu_milli=8000, memory_mb=32768)
    for i in range(int(instance.offer["gpu_count"])):
        Gpu.objects.create(node=node, index=i, model_name=instance.offer["gpu_model"], memory_mb=16384,
                           uuid=f"GPU-{instance.pk}-{i}")
    return node


def test_job_bursts_to_aws_and_starts_when_the_node_registers(acme, aws_pool, moto_endpoint, settings):  # noqa: F811
    job = submit(acme, resources={"gpus": 1}, placement={"providers": ["aws"]}, expected_duration_hours=2)
    outcome = scheduling_cycle_run(tenant=acme.tenant)
    assert outcome.launched, outcome.conflicts
    job.refresh_from_db()
    assert job.state == JobState.PROVISIONING
    instance = CloudInstance.objects.get(pk=outcome.launched[0])
    assert instance.state == InstanceState.REQUESTED and instance.request_key  # recorded before the call
    assert instance.hourly_price_usd > Decimal("0")

    instance = provisioning.instance_provision(instance=instance)
    assert instance.state in (InstanceState.PENDING, InstanceState.RUNNING) and instance.provider_id
    ours = running_ours(moto_endpoint, settings.WHALEZEN_BROKER_ID)
    assert [i["InstanceId"] for i in ours] == [instance.provider_id]
    tags = {t["Key"]: t["Value"] for t in ours[0]["Tags"]}
    assert tags["whalezen:request"] == instance.request_key and tags["whalezen:node"] == instance.node_name
    # A retry (lost task ack, worker killed after the call) creates nothing new.
    CloudInstance.objects.filter(pk=instance.pk).update(state=InstanceState.REQUESTED)
    instance.refresh_from_db()
    provisioning.instance_provision(instance=instance)
    assert len(running_ours(moto_endpoint, settings.WHALEZEN_BROKER_ID)) == 1

    started = provisioning.instance_node_registered(node=register_node_for(instance))
    job.refresh_from_db()
    assert started == [job.pk] and job.state == JobState.STARTING
    assert job.allocations.get(active=True).node.name == instance.node_name


def test_a_gang_over_two_instances_starts_when_the_last_registers_with_both_parts(acme, aws_pool):
    """Started on the first instance alone, the gang ran short of a node and the second instance's
    part found it no longer waiting: it sat in STARTING with half its GPUs."""
    job = submit(acme, resources={"gpus": 1, "nodes": 2}, placement={"providers": ["aws"]}, expected_duration_hours=2)
    outcome = scheduling_cycle_run(tenant=acme.tenant)
    first, second = (CloudInstance.objects.get(pk=pk) for pk in outcome.launched)
    assert [p["job_id"] for p in first.placements + second.placements] == [job.pk, job.pk]

    assert provisioning.instance_node_registered(node=register_node_for(first)) == []
    job.refresh_from_db()
    assert job.state == JobState.PROVISIONING and not job.allocations.filter(active=True).exists()

    assert provisioning.instance_node_registered(node=register_node_for(second)) == [job.pk]
    job.refresh_from_db()
    assert job.state == JobState.STARTING
    assert sorted(job.allocations.filter(active=True).values_list("node__name", flat=True)) == \
        sorted([first.node_name, second.node_name])


@requires_postgres
@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_a_gangs_two_instances_registering_at_once_start_it_once_with_both_parts(acme, aws_pool, monkeypatch):
    """Real concurrency on PostgreSQL: both agents register at the same moment. Whichever takes the
    job's row lock first must see the other instance if it has registered (and start the gang with
    both parts), or leave the start to it; the gang starts exactly once either way. The first to
    hold the lock waits inside it until the other has registered and queued on the lock."""
    import threading

    for round_ in range(3):
        job = submit(acme, name=f"gang-{round_}", resources={"gpus": 1, "nodes": 2}, placement={"providers": ["aws"]},
                     expected_duration_hours=2)
        launched = [CloudInstance.objects.get(pk=pk) for pk in scheduling_cycle_run(tenant=acme.tenant).launched]
        assert len(launched) == 2, launched
        nodes = [register_node_for(instance) for instance in launched]  # rows only: the call is what races
        inside = threading.Barrier(2)
        siblings = provisioning._gang_requests

        def wait_inside_the_lock(**kwargs):
            try:
                inside.wait(timeout=1)  # the other thread is blocked on the job's lock: it never arrives
            except threading.BrokenBarrierError:
                pass
            return siblings(**kwargs)

        monkeypatch.setattr(provisioning, "_gang_requests", wait_inside_the_lock)
        started: list[int] = []
        at_once(lambda node: started.extend(provisioning.instance_node_registered(node=node)), nodes)
        monkeypatch.undo()
        job.refresh_from_db()
        assert started == [job.pk], f"round {round_}: {started}"
        assert job.state == JobState.STARTING
        assert sorted(job.allocations.filter(active=True).values_list("node__name", flat=True)) == \
            sorted(instance.node_name for instance in launched)
        Job.objects.filter(pk=job.pk).update(state=JobState.CANCELLED)
        CloudInstance.objects.filter(pk__in=[i.pk for i in launched]).update(state=InstanceState.TERMINATED)
        Node.objects.filter(pk__in=[node.pk for node in nodes]).update(state="OFFLINE")  # the next gang bursts too


def test_a_gang_placed_again_after_a_boot_timeout_starts_on_its_new_instances_only(acme, aws_pool, settings):
    """The instance that did come up the first time still lists the gang (its `placements` are never
    cleared); the gang's next launch must not count it as one of its own."""
    job = submit(acme, resources={"gpus": 1, "nodes": 2}, placement={"providers": ["aws"]}, expected_duration_hours=2)
    came_up, never = (CloudInstance.objects.get(pk=pk) for pk in scheduling_cycle_run(tenant=acme.tenant).launched)
    provisioning.instance_node_registered(node=register_node_for(came_up))
    CloudInstance.objects.filter(pk=never.pk).update(state=InstanceState.PENDING)  # asked for, never registers
    settings.WHALEZEN_BOOT_TIMEOUT_SECONDS = 0
    assert stalled_boots_retire() == [never.pk]
    job.refresh_from_db()
    assert job.state == JobState.PENDING

    again = [CloudInstance.objects.get(pk=pk) for pk in scheduling_cycle_run(tenant=acme.tenant).launched]
    assert len(again) == 2 and came_up.pk not in {i.pk for i in again}
    assert provisioning.instance_node_registered(node=register_node_for(again[0])) == []
    assert provisioning.instance_node_registered(node=register_node_for(again[1])) == [job.pk]
    job.refresh_from_db()
    assert sorted(job.allocations.filter(active=True).values_list("node__name", flat=True)) == \
        sorted(i.node_name for i in again)


def test_capacity_error_blocks_the_place_and_the_next_cycle_fails_over(acme, aws_pool, monkeypatch):
    job = submit(acme, resources={"gpus": 1}, placement={"providers": ["aws"]})
    first = CloudInstance.objects.get(pk=scheduling_cycle_run(tenant=acme.tenant).launched[0])

    def no_capacity(self, request):
        raise ProviderError(ErrorKind.CAPACITY, "We currently do not have sufficient capacity",
                            provider="aws", code="InsufficientInstanceCapacity")

    from providers.aws.provider import AwsProvider

    monkeypatch.setattr(AwsProvider, "provision", no_capacity)
    provisioning.instance_provision(instance=first)
    first.refresh_from_db()
    job.refresh_from_db()
    assert first.state == InstanceState.FAILED and "InsufficientInstanceCapacity" in first.last_error
    assert job.state == JobState.PENDING
    assert OfferBlock.objects.filter(pool=aws_pool, instance_type=first.instance_type, zone=first.zone).exists()
    assert "trying another place" in job.events.last().message

    second = CloudInstance.objects.get(pk=scheduling_cycle_run(tenant=acme.tenant).launched[0])
    assert (second.zone, second.instance_type) != (first.zone, first.instance_type)
    assert second.request_key != first.request_key


def test_a_permanent_error_does_not_block_other_places_but_requeues(acme, aws_pool, monkeypatch):
    job = submit(acme, resources={"gpus": 1}, placement={"providers": ["aws"]})
    instance = CloudInstance.objects.get(pk=scheduling_cycle_run(tenant=acme.tenant).launched[0])
    from providers.aws.provider import AwsProvider

    monkeypatch.setattr(AwsProvider, "provision", lambda self, r: (_ for _ in ()).throw(
        ProviderError(ErrorKind.AUTH, "credentials rejected", provider="aws", code="AuthFailure")))
    provisioning.instance_provision(instance=instance)
    job.refresh_from_db()
    assert job.state == JobState.PENDING and not OfferBlock.objects.exists()


def test_instance_taken_away_by_the_provider_requeues_its_job(acme, aws_pool, moto_endpoint, settings):  # noqa: F811
    job = submit(acme, resources={"gpus": 1}, placement={"providers": ["aws"]})
    instance = CloudInstance.objects.get(pk=scheduling_cycle_run(tenant=acme.tenant).launched[0])
    instance = provisioning.instance_provision(instance=instance)
    provisioning.instance_node_registered(node=register_node_for(instance))
    ec2(moto_endpoint).terminate_instances(InstanceIds=[instance.provider_id])  # e.g. a spot reclaim
    summary = pool_reconcile(pool=aws_pool)
    assert summary.lost == 1, summary
    job.refresh_from_db()
    instance.refresh_from_db()
    assert job.state == JobState.PENDING and job.pending_reason_code == "INSTANCE_LOST"
    assert job.events.filter(reason_code="INSTANCE_LOST").exists()
    assert instance.state == InstanceState.TERMINATED
    assert Node.objects.get(name=instance.node_name).state == "LOST"


def test_idle_instance_is_terminated_only_when_the_provider_confirms(acme, aws_pool, moto_endpoint, settings):  # noqa: F811
    job = submit(acme, resources={"gpus": 1}, placement={"providers": ["aws"]})
    instance = CloudInstance.objects.get(pk=scheduling_cycle_run(tenant=acme.tenant).launched[0])
    instance = provisioning.instance_provision(instance=instance)
    assert provisioning.idle_instances(idle_seconds=0) == [], "a job still waits for it"
    Job.objects.filter(pk=job.pk).update(state=JobState.CANCELLED)
    CloudInstance.objects.filter(pk=instance.pk).update(state=InstanceState.RUNNING)
    idle = provisioning.idle_instances(idle_seconds=0)
    assert [i.pk for i in idle] == [instance.pk]
    provisioning.instance_terminate(instance=idle[0], reason="idle")
    instance.refresh_from_db()
    assert instance.state in (InstanceState.TERMINATING, InstanceState.TERMINATED)
    assert running_ours(moto_endpoint, settings.WHALEZEN_BROKER_ID) == []


def test_offers_follow_the_providers_availability(acme, aws_pool, monkeypatch):
    """The catalogue says where a type is priced; the provider's API says where it is sold today."""
    from django.core.cache import cache

    from broker.provisioning import offers as offers_module
    from broker.provisioning.tasks import refresh_offers

    cache.clear()
    all_types = {o.instance_type for o in offers_module.cloud_offers(tenant=acme.tenant)[0]}
    assert len(all_types) > 3

    class OnlyG4dn:
        provider = "aws"

        def offered(self, region):
            return {(zone, "g4dn.xlarge") for zone in ("us-east-1a", "us-east-1b", "use1-az1", "use1-az2",
                                                       "use1-az4", "use1-az5", "use1-az6")}

    monkeypatch.setattr(offers_module, "_availability_source", lambda pool, provider: OnlyG4dn())
    refresh_offers()
    remaining = offers_module.cloud_offers(tenant=acme.tenant)[0]
    assert remaining and {o.instance_type for o in remaining} == {"g4dn.xlarge"}
    job = submit(acme, resources={"gpus": 8}, placement={"providers": ["aws"]})
    scheduling_cycle_run(tenant=acme.tenant)
    job.refresh_from_db()
    assert job.state == JobState.PENDING and CloudInstance.objects.count() == 0
    cache.clear()


def test_an_instance_that_never_registers_is_terminated_and_its_job_requeued(acme, aws_pool, moto_endpoint, settings):  # noqa: F811
    from datetime import timedelta

    from django.utils import timezone

    from broker.scheduler.timeouts import stalled_boots_retire

    job = submit(acme, resources={"gpus": 1}, placement={"providers": ["aws"]})
    instance = CloudInstance.objects.get(pk=scheduling_cycle_run(tenant=acme.tenant).launched[0])
    instance = provisioning.instance_provision(instance=instance)
    assert stalled_boots_retire() == []
    CloudInstance.objects.filter(pk=instance.pk).update(
        created_at=timezone.now() - timedelta(seconds=settings.WHALEZEN_BOOT_TIMEOUT_SECONDS + 1))
    assert stalled_boots_retire() == [instance.pk]
    job.refresh_from_db()
    instance.refresh_from_db()
    assert job.state == JobState.PENDING and job.pending_reason_code == "BOOT_TIMEOUT"
    assert instance.state in (InstanceState.TERMINATING, InstanceState.TERMINATED)
    assert running_ours(moto_endpoint, settings.WHALEZEN_BROKER_ID) == []


# -- a pool's instance cap (issue 8 item 9) -------------------------------------------------------------
@pytest.fixture
def sim_pool(acme, settings, tmp_path):
    """The demo's `cloud-sim`: the local provider's 1xL4, 4xT4 and 8xA100 shapes, at most 2 instances."""
    settings.VAR_DIR = tmp_path
    for node in acme.nodes:  # no on-prem capacity: every job must burst
        node.state = "OFFLINE"
        node.save()
    return Pool.objects.create(tenant=acme.tenant, name="cloud-sim", kind=PoolKind.LOCAL, region="sim-east-1",
                               max_instances=2)


def burst_jobs(acme, count: int, prefix: str = "j") -> list[Job]:
    # A mix that fits three instance types, as the 320 one-GPU jobs of the issue did.
    models = (["A100-80GB"], ["T4"], ["L4"])
    return [submit(acme, name=f"{prefix}{k}", resources={"gpus": 1, "gpu_models": models[k % 3]},
                   placement={"providers": ["local"]}, expected_duration_hours=4) for k in range(count)]


def live_instances(pool: Pool) -> int:
    from broker.provisioning.offers import pool_instances_capped

    return pool_instances_capped(pool=pool)


def test_one_cycle_launches_at_most_the_pools_cap_over_all_instance_types(acme, sim_pool):
    jobs = burst_jobs(acme, 30)
    outcome = scheduling_cycle_run(tenant=acme.tenant)
    assert 0 < len(outcome.launched) <= 2 and live_instances(sim_pool) == len(outcome.launched)
    # Every job that got no instance waits, and says why.
    waiting = Job.objects.filter(pk__in=[j.pk for j in jobs], state=JobState.PENDING)
    assert waiting.exists() and all(j.pending_reason for j in waiting)
    # The next cycle sees the pool full and launches nothing more.
    assert scheduling_cycle_run(tenant=acme.tenant).launched == []
    assert live_instances(sim_pool) <= 2


def stale_plans(acme, first: list[Job], second: list[Job]):
    """Two cycles' plans made from the same moment (the pool empty), each for its own jobs."""
    from dataclasses import replace

    from broker.provisioning.offers import cloud_offers, pool_launch_limits
    from broker.scheduler.services import BROKER_POLICY
    from broker.scheduler.snapshot import tenant_snapshot
    from scheduling.engine import schedule

    offers, index = cloud_offers(tenant=acme.tenant)
    snap = tenant_snapshot(tenant=acme.tenant, offers=offers, launch_limits=pool_launch_limits(tenant=acme.tenant))
    plans = []
    for jobs in (first, second):
        ids = {str(j.pk) for j in jobs}
        plans.append(schedule(replace(snap, pending=tuple(p for p in snap.pending if p.job_id in ids)), BROKER_POLICY))
    assert all(sum(launch.count for launch in plan.launches) == 2 for plan in plans)  # each alone: up to the cap
    return plans, index


def test_a_stale_plan_cannot_launch_past_the_cap(acme, sim_pool):
    from broker.scheduler.services import plan_commit

    first, second = burst_jobs(acme, 6, "a"), burst_jobs(acme, 6, "b")
    (plan_a, plan_b), index = stale_plans(acme, first, second)
    assert len(plan_commit(tenant=acme.tenant, plan=plan_a, offer_index=index).launched) == 2
    late = plan_commit(tenant=acme.tenant, plan=plan_b, offer_index=index)
    assert late.launched == [] and any("allows 2 instance(s) at once" in c for c in late.conflicts)
    assert live_instances(sim_pool) == 2
    for job in Job.objects.filter(pk__in=[j.pk for j in second]):
        assert job.state == JobState.PENDING
    held = Job.objects.filter(pk__in=[int(j) for launch in plan_b.launches for j in launch.job_ids])
    assert held and all(j.pending_reason_code == "OFFER_QUOTA" and "cloud-sim" in j.pending_reason for j in held)


@requires_postgres
@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_two_cycles_committing_launches_at_once_stay_under_the_cap(acme, sim_pool, monkeypatch):
    """Real concurrency on PostgreSQL: both commits count the pool's instances at the same moment
    unless the pool row lock serialises them. The counting is widened to a rendezvous so that,
    without the lock, both would certainly count 0 and launch 2 each."""
    import threading

    from broker.scheduler.services import plan_commit

    for round_ in range(3):
        CloudInstance.objects.filter(pool=sim_pool).delete()
        first, second = burst_jobs(acme, 4, f"a{round_}-"), burst_jobs(acme, 4, f"b{round_}-")
        (plan_a, plan_b), index = stale_plans(acme, first, second)
        rendezvous = threading.Barrier(2)
        counted = provisioning.pool_instances_capped

        def count_then_meet(*, pool):
            n = counted(pool=pool)
            try:
                rendezvous.wait(timeout=2)  # with the lock held, the other commit never gets here in time
            except threading.BrokenBarrierError:
                pass
            return n

        monkeypatch.setattr(provisioning, "pool_instances_capped", count_then_meet)
        launched: list[int] = []
        at_once(lambda plan: launched.extend(plan_commit(tenant=acme.tenant, plan=plan, offer_index=index).launched),
                [plan_a, plan_b])
        monkeypatch.undo()
        assert len(launched) == 2 and live_instances(sim_pool) == 2, f"round {round_}: {launched}"
        Job.objects.filter(pk__in=[j.pk for j in first + second]).update(state=JobState.CANCELLED)


def test_idle_owned_gpus_are_used_before_anything_is_rented(acme, gpu_models, settings, tmp_path):
    """The demo's misfire: two T4:4 jobs rented cloud-sim sim.4xT4 instances at $3.91/h while the
    tenant's on-prem T4 nodes stood idle, because on-prem was priced at its chargeback rate
    (4 x $1.10/h). Owned GPUs cost the platform their marginal cost (default 0): they go first."""
    from broker.inventory.management.commands.seed_demo import SIM_CLOUD_CONFIG
    from broker.inventory.services import node_create_simulated

    settings.VAR_DIR = tmp_path
    acme.pool.gpu_hour_rate_usd = Decimal("1.10")
    acme.pool.save()
    t4_nodes = {node_create_simulated(pool=acme.pool, name=f"acme-t4-{i}", gpu_model=gpu_models["T4"], gpu_count=4,
                                      nvlink_island_size=0, cpu_milli=48000, memory_mb=192 * 1024).pk
                for i in range(2)}
    Pool.objects.create(tenant=acme.tenant, name="cloud-sim", kind=PoolKind.LOCAL, region="sim-east-1",
                        max_instances=2, provider_config=SIM_CLOUD_CONFIG)
    jobs = [submit(acme, name=f"t4-{i}", resources={"gpus": 4, "gpu_models": ["T4"]}, expected_duration_hours=2)
            for i in range(2)]
    outcome = scheduling_cycle_run(tenant=acme.tenant)
    assert outcome.launched == [] and sorted(outcome.placed) == sorted(j.pk for j in jobs), outcome.conflicts
    assert {j.allocations.get(active=True).node_id for j in jobs} == t4_nodes


@pytest.mark.parametrize("nice, error", [(0, None), (15, None), ("high", "nice must be a whole number"),
                                         (-5, "nice must be a whole number"), (True, "nice must be")])
def test_a_local_pools_niceness_is_checked_where_the_provider_is_built(acme, settings, tmp_path, nice, error):
    from broker.provisioning.factory import provider_for_pool

    settings.VAR_DIR = tmp_path
    pool = Pool.objects.create(tenant=acme.tenant, name="cloud-sim", kind=PoolKind.LOCAL, region="sim",
                               max_instances=1, provider_config={"nice": nice})
    if error is None:
        assert provider_for_pool(pool).nice == nice
        return
    # The admin's mistake is the pool's one provider error (offers and cycles skip the pool and say why).
    with pytest.raises(ProviderError) as raised:
        provider_for_pool(pool)
    assert raised.value.kind is ErrorKind.BAD_REQUEST
    assert "cloud-sim is misconfigured" in str(raised.value) and error in str(raised.value)
