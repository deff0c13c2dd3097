"""The broker's side of the reconciler: turn CloudInstance rows into `providers.reconcile` records per
pool, and write back what it found (adoptions, confirmed terminations, instances lost under us)."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import timedelta

from django.conf import settings
from django.utils import timezone

from broker.inventory.models import CloudInstance, InstanceState, Node, NodeState, Pool
from broker.jobs.models import Job
from broker.jobs.services import job_requeue, jobs_requeue_on_node
from broker.jobs.states import ACTIVE_STATES
from broker.provisioning.factory import provider_for_pool
from broker.provisioning.offers import CLOUD_KINDS
from providers.base import Provider
from providers.reconcile import KnownInstance, ReconcileReport, reconcile

log = logging.getLogger(__name__)
POOL_TAG = "whalezen:pool"


class PoolScopedProvider:
    """Shows the reconciler only the instances launched for one pool (pools may share an account)."""

    def __init__(self, provider: Provider, pool: Pool):
        self._provider, self._pool_id = provider, str(pool.pk)

    def list_owned(self):
        return [i for i in self._provider.list_owned() if i.tag(POOL_TAG) == self._pool_id]

    def __getattr__(self, name):
        return getattr(self._provider, name)


@dataclass
class PoolReconcileSummary:
    pool: str
    adopted: int = 0
    orphans_terminated: int = 0
    confirmed_terminated: int = 0
    lost: int = 0
    errors: list[str] = field(default_factory=list)


def _records(pool: Pool) -> list[KnownInstance]:
    # Live records only: an instance whose record already failed is an orphan and gets cleaned up.
    rows = CloudInstance.objects.filter(pool=pool, state__in=[
        InstanceState.REQUESTED, InstanceState.PENDING, InstanceState.RUNNING, InstanceState.TERMINATING])
    return [KnownInstance(provider=pool.kind, request_key=r.request_key, provider_instance_id=r.provider_id,
                          region=r.offer.get("region", pool.region), zone=r.zone, recorded_at=r.created_at,
                          terminating=r.state == InstanceState.TERMINATING)
            for r in rows]


def pool_reconcile(*, pool: Pool, orphan_grace_seconds: float | None = None) -> PoolReconcileSummary:
    """`orphan_grace_seconds` overrides WHALEZEN_ORPHAN_GRACE_SECONDS (serve passes 0 for the `local`
    pools at start: their instances are this machine's processes and no launch can be in flight)."""
    provider = PoolScopedProvider(provider_for_pool(pool), pool)
    grace = settings.WHALEZEN_ORPHAN_GRACE_SECONDS if orphan_grace_seconds is None else orphan_grace_seconds
    report: ReconcileReport = reconcile(
        {pool.kind: provider}, _records(pool), orphan_grace=timedelta(seconds=grace))
    summary = PoolReconcileSummary(pool=str(pool), errors=list(report.errors))
    for adoption in report.adopted:
        CloudInstance.objects.filter(pool=pool, request_key=adoption.record.request_key, provider_id="").update(
            provider_id=adoption.instance.ref.instance_id, zone=adoption.instance.ref.zone or adoption.record.zone,
            state=InstanceState.RUNNING)
        summary.adopted += 1
    summary.orphans_terminated = len(report.orphans_terminating)
    for gone in report.terminated_confirmed:
        CloudInstance.objects.filter(pool=pool, request_key=gone.record.request_key).update(
            state=InstanceState.TERMINATED, terminated_at=timezone.now())
        summary.confirmed_terminated += 1
    for gone in report.lost:
        summary.lost += 1
        _instance_lost(pool, gone.record.request_key, gone.instance.state_reason)
    return summary


def _instance_lost(pool: Pool, request_key: str, why: str) -> None:
    """The provider took the instance away (spot reclaim, failure): its jobs go back to the queue."""
    instance = CloudInstance.objects.filter(pool=pool, request_key=request_key).first()
    if instance is None:
        return
    CloudInstance.objects.filter(pk=instance.pk).update(state=InstanceState.TERMINATED, terminated_at=timezone.now(),
                                                        last_error=f"lost: {why or 'terminated by the provider'}")
    message = (f"Instance {instance.node_name} was terminated by the provider ({why or 'no reason given'}); "
               "re-queued.")
    for job in Job.objects.filter(pk__in=[p["job_id"] for p in instance.placements], state__in=ACTIVE_STATES):
        job_requeue(job=job, reason_code="INSTANCE_LOST", message=message)
    if instance.node_id:
        Node.objects.filter(pk=instance.node_id).update(state=NodeState.LOST)
        jobs_requeue_on_node(node_id=instance.node_id, reason_code="INSTANCE_LOST", message=message)


def all_cloud_pools() -> list[Pool]:
    return list(Pool.objects.filter(enabled=True, kind__in=CLOUD_KINDS))
