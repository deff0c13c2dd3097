"""Preemption through the broker: a victim with checkpoints is asked for one and stops once it is
committed (or when its grace runs out); one without restarts from the beginning and is told so; a job
below its minimum run time is left alone."""
from __future__ import annotations

from datetime import timedelta

from django.utils import timezone

from broker.jobs import checkpoints
from broker.jobs.migration import migration_checkpoint_committed, migration_source_stopped, migrations_sweep
from broker.jobs.models import MigrationState
from broker.jobs.models import Checkpoint, Job, Migration, MigrationState
from broker.jobs.services import GpuRequest, allocation_commit, job_transition
from broker.jobs.states import JobState
from broker.scheduler.services import scheduling_cycle_run

from .test_agent_api import API, agent_client, registered, join_token  # noqa: F401 (fixtures)
from .test_api_tenancy import submit
from .test_checkpoints import report_checkpoint, root, verify_queue, write  # noqa: F401


def low_running(acme, node, *, ran_for: timedelta, checkpoint_uri: str | None = None) -> Job:
    spec = {"checkpoint": {"uri": checkpoint_uri}} if checkpoint_uri else {}
    low = submit(acme, name="low", resources={"gpus": 4}, preemptible=True, priority="low", **spec)
    (allocation,) = allocation_commit(job=low, requests=[GpuRequest(node=node, gpu_indices=(0, 1, 2, 3))])
    for to in (JobState.STARTING, JobState.RUNNING):
        low = job_transition(job=low, to=to)
    Job.objects.filter(pk=low.pk).update(started_at=timezone.now() - ran_for)
    low.refresh_from_db()
    return low


def only_the_registered_node(acme):
    for node in acme.nodes:  # the simulated nodes: out of the way, so the two jobs compete
        node.state = "OFFLINE"
        node.save()


def test_a_victim_with_checkpoints_checkpoints_first_then_yields(acme, registered, root, verify_queue):
    node, token = registered
    only_the_registered_node(acme)
    low = low_running(acme, node, ran_for=timedelta(hours=2), checkpoint_uri=str(root / "train"))
    high = submit(acme, name="high", resources={"gpus": 4}, priority="critical")
    outcome = scheduling_cycle_run(tenant=acme.tenant)
    assert outcome.preempted == [low.pk]
    low.refresh_from_db()
    assert low.state == JobState.CHECKPOINTING  # still running, writing its checkpoint
    move = Migration.objects.get(job=low)
    assert move.cause == "PREEMPTION" and move.deadline is not None
    assert (move.deadline - timezone.now()).total_seconds() > 100  # the default grace is 120 s
    scheduling_cycle_run(tenant=acme.tenant)  # the next cycle does not preempt it twice
    assert Migration.objects.filter(job=low).count() == 1

    (a,) = agent_client(token).get(f"{API}/assignments").json()["assignments"]
    assert report_checkpoint(token, low.allocations.get(active=True), write(root, 321),
                             request_id=a["checkpoint_request_id"]).status_code == 200
    checkpoints.checkpoint_verify(checkpoint_id=Checkpoint.objects.get(job=low).pk)
    low.refresh_from_db()
    assert low.state == JobState.PENDING and low.pending_reason_code == "PREEMPTED"
    assert "resumes from it" in low.pending_reason and "step 321" in low.pending_reason
    scheduling_cycle_run(tenant=acme.tenant)
    high.refresh_from_db()
    assert high.state == JobState.PLACED


def test_a_victim_that_does_not_checkpoint_in_its_grace_is_stopped_anyway(acme, registered, root, settings):
    node, _ = registered
    only_the_registered_node(acme)
    settings.WHALEZEN_PREEMPTION_GRACE_SECONDS = 30
    low = low_running(acme, node, ran_for=timedelta(hours=2), checkpoint_uri=str(root / "train"))
    submit(acme, name="high", resources={"gpus": 4}, priority="critical")
    scheduling_cycle_run(tenant=acme.tenant)
    assert migrations_sweep(now=timezone.now() + timedelta(seconds=10))["late"] == []
    assert len(migrations_sweep(now=timezone.now() + timedelta(seconds=31))["late"]) == 1
    low.refresh_from_db()
    assert low.state == JobState.PENDING
    assert "restarts from the beginning" in low.pending_reason
    assert Migration.objects.get(job=low).state == MigrationState.PLACING
    assert not low.allocations.filter(active=True).exists()


def test_a_victim_without_checkpoints_is_told_it_restarts_from_the_beginning(acme, registered):
    node, _ = registered
    only_the_registered_node(acme)
    low = low_running(acme, node, ran_for=timedelta(hours=2))
    submit(acme, name="high", resources={"gpus": 4}, priority="critical")
    assert scheduling_cycle_run(tenant=acme.tenant).preempted == [low.pk]
    low.refresh_from_db()
    assert low.state == JobState.PENDING
    preempted = low.events.filter(kind="state", data__to="PREEMPTED").get()
    assert "restarts from the beginning" in preempted.message


def test_a_job_below_its_minimum_run_time_is_not_preempted(acme, registered, root):
    node, _ = registered
    only_the_registered_node(acme)
    low = low_running(acme, node, ran_for=timedelta(minutes=2), checkpoint_uri=str(root / "train"))
    high = submit(acme, name="high", resources={"gpus": 4}, priority="critical")
    assert scheduling_cycle_run(tenant=acme.tenant).preempted == []
    low.refresh_from_db()
    high.refresh_from_db()
    assert low.state == JobState.RUNNING and high.state == JobState.PENDING
    assert not Migration.objects.filter(job=low).exists()


def test_the_engines_defragmentation_moves_are_begun_as_checkpointed_migrations(acme, root):
    """Two 8-GPU nodes, a small movable job on each: an 8-GPU job fits nowhere until one of them moves
    beside the other. The cycle begins that move (checkpoint first) and the big job waits for it."""
    small = []
    for index, node in enumerate(acme.nodes):
        job = submit(acme, name=f"small{index}", resources={"gpus": 1}, preemptible=True, priority="high",
                     checkpoint={"uri": str(root / f"s{index}")})
        allocation_commit(job=job, requests=[GpuRequest(node=node, gpu_indices=(0,))])
        for to in (JobState.STARTING, JobState.RUNNING):
            job = job_transition(job=job, to=to)
        small.append(job)
    Job.objects.filter(pk__in=[j.pk for j in small]).update(started_at=timezone.now() - timedelta(hours=1))
    big = submit(acme, name="big", resources={"gpus": 8}, priority="high")
    outcome = scheduling_cycle_run(tenant=acme.tenant)
    assert len(outcome.moved) == 1, outcome.conflicts
    (move,) = Migration.objects.all()
    assert move.cause == "DEFRAGMENTATION" and move.state == MigrationState.CHECKPOINTING
    mover = Job.objects.get(pk=move.job_id)
    other = next(j for j in small if j.pk != mover.pk)
    assert mover.state == JobState.CHECKPOINTING
    assert move.target_node == other.allocations.get(active=True).node.name
    big.refresh_from_db()
    assert big.state == JobState.PENDING and big.pending_reason_code == "WAITING_FOR_DEFRAGMENTATION"
    scheduling_cycle_run(tenant=acme.tenant)
    assert Migration.objects.count() == 1  # one move at a time per job; the next cycle does not repeat it


def test_with_nothing_pending_a_consolidation_cycle_moves_a_lone_job_off_a_costly_rented_node(
        acme, gpu_models, root, settings):
    """A long job alone on an expensive rented 8-GPU instance, free on-prem GPUs at a fraction of its
    price: with no job pending the sweep still schedules the tenant, its cycle begins the move, and
    the next sweep within WHALEZEN_CONSOLIDATION_INTERVAL_SECONDS does not schedule it again."""
    from broker.inventory.models import Pool, PoolKind
    from broker.inventory.services import node_create_simulated
    from broker.scheduler.models import CycleRecord
    from broker.scheduler.services import tenants_to_schedule

    acme.pool.gpu_hour_rate_usd = 1
    acme.pool.save()
    rented_pool = Pool.objects.create(tenant=acme.tenant, name="aws-east", kind=PoolKind.AWS, region="us-east-1",
                                      gpu_hour_rate_usd=12)
    rented = node_create_simulated(pool=rented_pool, name="aws-east-p4d", gpu_model=gpu_models["A100-80GB"],
                                   gpu_count=8, nvlink_island_size=8, cpu_milli=96000, memory_mb=1024 * 1024)
    job = submit(acme, name="long", resources={"gpus": 1, "gpu_models": ["A100-80GB"]}, preemptible=True,
                 expected_duration_hours=10, checkpoint={"uri": str(root / "long")})
    allocation_commit(job=job, requests=[GpuRequest(node=rented, gpu_indices=(0,))])
    for to in (JobState.STARTING, JobState.RUNNING):
        job = job_transition(job=job, to=to)
    interval = timedelta(seconds=settings.WHALEZEN_CONSOLIDATION_INTERVAL_SECONDS + 1)

    assert tenants_to_schedule() == [acme.tenant]  # nothing pending, a job on rented capacity
    assert scheduling_cycle_run(tenant=acme.tenant).moved == []  # it has run too short a time to move
    assert tenants_to_schedule() == []  # the next consolidation cycle is an interval away
    CycleRecord.objects.update(started_at=timezone.now() - interval)
    Job.objects.filter(pk=job.pk).update(started_at=timezone.now() - timedelta(hours=1))
    assert tenants_to_schedule() == [acme.tenant]
    outcome = scheduling_cycle_run(tenant=acme.tenant)
    assert outcome.moved == [job.pk], outcome.conflicts
    move = Migration.objects.get(job=job)
    assert move.cause == "CONSOLIDATION" and move.target_node in {n.name for n in acme.nodes}
    assert tenants_to_schedule() == []  # one consolidation cycle per interval


def home_coming(acme, gpu_models, root):
    """8 owned GPUs free, 4 on each of acme's nodes (a movable 4-GPU job on the first, a pinned one on
    the second), and an 8-GPU job on a rented instance: (near, far, mover, big)."""
    from broker.inventory.models import Pool, PoolKind
    from broker.inventory.services import node_create_simulated

    rented_pool = Pool.objects.create(tenant=acme.tenant, name="aws-east", kind=PoolKind.AWS, region="us-east-1",
                                      gpu_hour_rate_usd=12)
    instance = node_create_simulated(pool=rented_pool, name="aws-east-p4d", gpu_model=gpu_models["A100-80GB"],
                                     gpu_count=8, nvlink_island_size=8, cpu_milli=96000, memory_mb=1024 * 1024)

    def running(name, node, gpus, checkpoint=True):
        spec = {"checkpoint": {"uri": str(root / name)}} if checkpoint else {}
        job = submit(acme, name=name, resources={"gpus": len(gpus), "gpu_models": ["A100-80GB"]}, preemptible=True,
                     expected_duration_hours=10, **spec)
        allocation_commit(job=job, requests=[GpuRequest(node=node, gpu_indices=gpus)])
        for to in (JobState.STARTING, JobState.RUNNING):
            job = job_transition(job=job, to=to)
        Job.objects.filter(pk=job.pk).update(started_at=timezone.now() - timedelta(hours=1))
        return job

    near, far = acme.nodes
    mover = running("mover", near, (0, 1, 2, 3))
    running("pinned", far, (0, 1, 2, 3), checkpoint=False)
    return near, far, mover, running("big", instance, tuple(range(8)))


def checkpointed_and_stopped(job, root):
    """Drive a job's open move through a committed checkpoint and its source's confirmed stop."""
    job.refresh_from_db()
    ckpt = Checkpoint.objects.create(job=job, uri=f"{root}/{job.name}/step-1", step=1, state="COMMITTED",
                                     committed_at=timezone.now())
    assert migration_checkpoint_committed(job=job, checkpoint=ckpt)
    assert migration_source_stopped(job=job, allocation=Migration.objects.get(job=job).source_allocation)
    job.refresh_from_db()
    return job


def test_a_rented_job_comes_home_once_an_owned_job_makes_room_for_it(acme, gpu_models, root):
    """The cycle moves the owned job that frees a whole node and brings the rented job onto it, each a
    checkpointed move whose event says why; the rented job, stopped first, waits for the room (it is
    not requeued onto another instance) and is placed once the mover has left."""
    near, far, mover, big = home_coming(acme, gpu_models, root)
    outcome = scheduling_cycle_run(tenant=acme.tenant)
    assert sorted(outcome.moved) == sorted([mover.pk, big.pk]), outcome.conflicts
    making_room = Migration.objects.get(job=mover)
    assert making_room.cause == "DEFRAGMENTATION" and making_room.target_node == far.name
    assert f"to make room for job {big.pk}" in mover.events.order_by("-id").first().message
    home = Migration.objects.get(job=big)
    assert home.cause == "CONSOLIDATION" and home.target_node == near.name

    big = checkpointed_and_stopped(big, root)
    assert big.state == JobState.MIGRATING and Migration.objects.get(job=big).state == MigrationState.PLACING
    assert migrations_sweep()["redriven"] == [home.pk]  # the sweep tries again, and it still waits
    big.refresh_from_db()
    assert big.state == JobState.MIGRATING and not big.allocations.filter(active=True).exists()
    mover = checkpointed_and_stopped(mover, root)
    assert mover.state == JobState.PLACED and mover.allocations.get(active=True).node == far
    big.refresh_from_db()
    assert big.state == JobState.PLACED
    placed = big.allocations.get(active=True)
    assert placed.node == near
    assert sorted(set(placed.slices.values_list("gpu__index", flat=True))) == list(range(8))


def test_a_move_waiting_for_room_goes_back_to_the_queue_when_the_job_making_it_stays(acme, gpu_models, root):
    """The move that was to leave room is called off (its checkpoint never came): the waiting job is
    requeued, to be placed wherever the scheduler finds room, as any move whose target filled up."""
    near, far, mover, big = home_coming(acme, gpu_models, root)
    scheduling_cycle_run(tenant=acme.tenant)
    big = checkpointed_and_stopped(big, root)
    assert big.state == JobState.MIGRATING
    Migration.objects.filter(job=mover).update(deadline=timezone.now() - timedelta(seconds=1))
    swept = migrations_sweep()
    assert swept["late"] == [Migration.objects.get(job=mover).pk]
    mover.refresh_from_db()
    assert mover.state == JobState.RUNNING and mover.allocations.get(active=True).node == near
    migrations_sweep()
    big.refresh_from_db()
    assert big.state == JobState.PENDING and big.pending_reason_code == "MIGRATING"
