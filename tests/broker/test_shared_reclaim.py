"""Reclaim end to end through the broker (issue 11): acme's nominal 8 H100 on an 8-GPU shared pool,
globex borrowing all 8 with checkpointable jobs while acme has nothing to run. When acme submits, one
cycle asks globex's jobs for a checkpoint (the preemption path, naming the team that takes its share
back and nothing else of it), acme's job waits with RECLAIMING, and runs once they stopped.

The teams here have no cluster of their own (`only_shared`): all their GPUs are the platform's."""
from __future__ import annotations

import json
from datetime import timedelta

import pytest
from django.utils import timezone

from broker.inventory.services import pool_share
from broker.jobs.migration import migrations_sweep
from broker.jobs.models import Job, JobEvent, Migration
from broker.jobs.services import job_transition
from broker.jobs.states import JobState
from broker.scheduler.services import scheduling_cycle_run
from broker.tenancy.services import team_quota_set

from .test_api_tenancy import submit
from .test_checkpoints import root  # noqa: F401 (fixture)
from .test_shared_pools import make_platform

H100x4 = {"gpus": 4, "gpu_models": ["H100-80GB"]}


def only_shared(*teams) -> None:
    for team in teams:
        team.pool.delete()  # and its nodes


def running_for_an_hour(job: Job) -> Job:
    job.refresh_from_db()
    for to in (JobState.STARTING, JobState.RUNNING):
        job = job_transition(job=job, to=to)
    # Past the minimum run time before a preemption (WHALEZEN_MIN_RUN_BEFORE_PREEMPT_SECONDS).
    Job.objects.filter(pk=job.pk).update(started_at=timezone.now() - timedelta(hours=1))
    job.refresh_from_db()
    return job


@pytest.fixture
def borrowed(acme, globex, gpu_models, root, settings):  # noqa: F811
    """globex holds the whole shared node (acme's nominal, lent while acme had nothing pending)."""
    settings.WHALEZEN_PREEMPTION_GRACE_SECONDS = 60
    only_shared(acme, globex)
    platform = make_platform(gpu_models)
    for team in (acme, globex):
        pool_share(pool=platform.pool, tenant=team.tenant)
    team_quota_set(tenant=acme.tenant, flavor="H100-80GB", nominal=8)  # globex: no row, nominal 0
    jobs = [submit(globex, name=f"globex-borrower-{i}", resources=H100x4, preemptible=True,
                   checkpoint={"uri": str(root / f"g{i}")}) for i in range(2)]
    outcome = scheduling_cycle_run(tenant=globex.tenant)
    assert sorted(outcome.placed) == sorted(j.pk for j in jobs), outcome.conflicts
    return platform, [running_for_an_hour(job) for job in jobs]


def test_a_team_gets_its_nominal_share_back_checkpoint_first(acme, globex, borrowed):
    platform, victims = borrowed
    (quota,) = globex.client.get("/api/v1/quota/").json()["quotas"]
    assert quota["in_use"] == 8.0 and quota["borrowed"] == 8.0
    mine = submit(acme, name="acme-needs-its-share", resources={"gpus": 8, "gpu_models": ["H100-80GB"]})
    outcome = scheduling_cycle_run(tenant=acme.tenant)
    assert sorted(outcome.preempted) == sorted(v.pk for v in victims), (outcome.conflicts, outcome.plan.pending)
    mine.refresh_from_db()
    assert mine.state == JobState.PENDING and mine.pending_reason_code == "RECLAIMING", mine.pending_reason
    for victim in victims:
        victim.refresh_from_db()
        assert victim.state == JobState.CHECKPOINTING  # still running, writing its checkpoint
        move = Migration.objects.get(job=victim)
        assert move.cause == "PREEMPTION"
        event = JobEvent.objects.filter(job=victim).order_by("-id").first()
        assert "Reclaimed for team acme's nominal H100-80GB quota: checkpoint requested; it stops within 60 s." \
            in event.message
    # What globex can read of it names acme's team, never acme's job.
    seen = json.dumps(globex.client.get(f"/api/v1/jobs/{victims[0].pk}/events/").json())
    assert "acme" in seen and str(mine.name) not in seen and f'"for_job": "{mine.pk}"' not in seen
    assert "Reclaimed for team acme" in seen

    scheduling_cycle_run(tenant=acme.tenant)  # the next cycle does not reclaim them twice
    assert Migration.objects.filter(job__in=victims).count() == 2

    # No checkpoint within the grace: they are stopped anyway and go back to the queue.
    late = migrations_sweep(now=timezone.now() + timedelta(seconds=61))["late"]
    assert len(late) == 2
    for victim in victims:
        victim.refresh_from_db()
        assert victim.state == JobState.PENDING and not victim.allocations.filter(active=True).exists()
    outcome = scheduling_cycle_run(tenant=acme.tenant)
    mine.refresh_from_db()
    assert mine.state == JobState.PLACED, (mine.pending_reason, outcome.conflicts)
    assert mine.allocations.get(active=True).node == platform.node
    # globex waits: its nominal is 0 and the cohort has nothing idle.
    for victim in victims:
        victim.refresh_from_db()
        assert victim.state == JobState.PENDING and victim.pending_reason_code in (
            "NOMINAL_QUOTA_USED", "INSUFFICIENT_GPUS", "CAPACITY_TAKEN"), victim.pending_reason


def test_a_borrower_without_checkpoints_is_stopped_at_once_and_told_why(acme, globex, gpu_models):
    only_shared(acme, globex)
    platform = make_platform(gpu_models)
    for team in (acme, globex):
        pool_share(pool=platform.pool, tenant=team.tenant)
    team_quota_set(tenant=acme.tenant, flavor="H100-80GB", nominal=8)
    victim = submit(globex, name="globex-plain", resources={"gpus": 8, "gpu_models": ["H100-80GB"]},
                    preemptible=True)
    assert scheduling_cycle_run(tenant=globex.tenant).placed == [victim.pk]
    victim = running_for_an_hour(victim)
    mine = submit(acme, resources={"gpus": 8, "gpu_models": ["H100-80GB"]})
    assert scheduling_cycle_run(tenant=acme.tenant).preempted == [victim.pk]
    victim.refresh_from_db()
    assert victim.state == JobState.PENDING
    stopped = victim.events.get(kind="state", data__to="PREEMPTED")
    assert stopped.reason_code == "RECLAIMED"
    assert stopped.message.startswith("Reclaimed for team acme's nominal H100-80GB quota; it has no checkpoint")
    assert "for_job" not in stopped.data and stopped.data["for_team"] == "acme"
    assert f"job {mine.pk}" not in stopped.message
    scheduling_cycle_run(tenant=acme.tenant)
    mine.refresh_from_db()
    assert mine.state == JobState.PLACED


def test_a_team_within_its_nominal_is_not_reclaimed(acme, globex, gpu_models):
    """globex uses only its own nominal 8: acme's job (nominal 0), critical as it may be, takes nothing."""
    only_shared(acme, globex)
    platform = make_platform(gpu_models)
    for team in (acme, globex):
        pool_share(pool=platform.pool, tenant=team.tenant)
    team_quota_set(tenant=globex.tenant, flavor="H100-80GB", nominal=8)
    victim = submit(globex, resources={"gpus": 8, "gpu_models": ["H100-80GB"]}, preemptible=True)
    assert scheduling_cycle_run(tenant=globex.tenant).placed == [victim.pk]
    victim = running_for_an_hour(victim)
    mine = submit(acme, resources={"gpus": 8, "gpu_models": ["H100-80GB"]}, priority="critical")
    assert scheduling_cycle_run(tenant=acme.tenant).preempted == []
    victim.refresh_from_db()
    mine.refresh_from_db()
    assert victim.state == JobState.RUNNING and mine.state == JobState.PENDING
    assert "acme uses 0/0 nominal H100-80GB" in mine.pending_reason, mine.pending_reason


def test_reclaim_also_happens_when_the_teams_have_private_clusters_too(acme, globex, gpu_models, root):  # noqa: F811
    """As test_a_borrower_without_checkpoints..., but acme and globex keep their own A100 nodes."""
    platform = make_platform(gpu_models)
    for team in (acme, globex):
        pool_share(pool=platform.pool, tenant=team.tenant)
    team_quota_set(tenant=acme.tenant, flavor="H100-80GB", nominal=8)
    victim = submit(globex, resources={"gpus": 8, "gpu_models": ["H100-80GB"]}, preemptible=True)
    assert scheduling_cycle_run(tenant=globex.tenant).placed == [victim.pk]
    victim = running_for_an_hour(victim)
    submit(acme, resources={"gpus": 8, "gpu_models": ["H100-80GB"]})
    assert scheduling_cycle_run(tenant=acme.tenant).preempted == [victim.pk]
