"""What a scheduling cycle's decision depends on, as one digest: a cycle whose inputs did not change
since the last full one, and ran less than WHALEZEN_CYCLE_REFRESH_SECONDS ago, has nothing new to do.

The engine is deterministic for a given snapshot (scheduling/), so the same inputs give the same plan,
and the plan of the last cycle was carried out already: what it placed is placed, what it left pending
says why. A cycle with 5,000 jobs pending on a full 1,213-node cluster took seconds to decide that
again (bench.service); these aggregates take milliseconds. What changes with time alone (run times that
make a job preemptible, checkpoint ages, spend against a budget, an offer block that expires) is picked
up by the full cycle every WHALEZEN_CYCLE_REFRESH_SECONDS.
"""
from __future__ import annotations

import hashlib

from django.db.models import Count, Max, Q
from django.utils import timezone

from broker.billing.models import UserBudget
from broker.inventory.models import CloudInstance, Gpu, Node, OfferBlock, Pool, PoolGrant
from broker.jobs.models import Allocation, Checkpoint, CheckpointState, Job, Migration
from broker.jobs.states import TERMINAL_STATES
from broker.tenancy.models import Quota, TeamQuota


def cycle_inputs_digest(*, tenant_ids: list[int]) -> str:
    now = timezone.now()
    live_jobs = Job.objects.filter(tenant_id__in=tenant_ids).exclude(state__in=TERMINAL_STATES)
    parts = [
        # Submissions, state changes (job_transition sets updated_at; pending reasons do not), finished jobs.
        live_jobs.aggregate(n=Count("id"), latest=Max("updated_at"), newest=Max("id")),
        Allocation.objects.filter(node__tenant_id__in=tenant_ids).aggregate(
            newest=Max("id"), active=Count("id", filter=Q(active=True))),
        sorted(Node.objects.filter(tenant_id__in=tenant_ids).values_list(
            "pk", "state", "epoch", "pool_id", "labels", "cpu_milli", "memory_mb")),
        sorted(Gpu.objects.filter(node__tenant_id__in=tenant_ids).values_list("health").annotate(n=Count("id"))),
        sorted(Pool.objects.filter(tenant_id__in=tenant_ids).values_list(
            "pk", "enabled", "max_instances", "gpu_hour_rate_usd", "marginal_cost_usd_per_gpu_hour", "region")),
        sorted(PoolGrant.objects.filter(tenant_id__in=tenant_ids).values_list("pool_id", "tenant_id")),
        sorted(TeamQuota.objects.filter(tenant_id__in=tenant_ids).values_list(
            "tenant_id", "flavor", "nominal", "borrowing_limit", "lending_limit")),
        sorted(Quota.objects.filter(tenant_id__in=tenant_ids).values_list(
            "tenant_id", "max_gpus", "max_compute_units", "monthly_budget_usd")),
        # Members' own budgets: one set, raised or cleared decides the queue again.
        sorted(UserBudget.objects.filter(tenant_id__in=tenant_ids).values_list(
            "tenant_id", "user_id", "monthly_budget_usd")),
        sorted(CloudInstance.objects.filter(pool__tenant_id__in=tenant_ids).values_list("state").annotate(
            n=Count("id"))),
        OfferBlock.objects.filter(pool__tenant_id__in=tenant_ids, until__gt=now).count(),
        Checkpoint.objects.filter(job__tenant_id__in=tenant_ids, state=CheckpointState.COMMITTED).aggregate(
            newest=Max("id")),
        Migration.objects.filter(job__tenant_id__in=tenant_ids).aggregate(
            newest=Max("id"), open=Count("id", filter=Q(state__in=Migration.OPEN_STATES))),
    ]
    return hashlib.sha256(repr(parts).encode()).hexdigest()
