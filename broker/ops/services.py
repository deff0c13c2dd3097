"""Writes of the ops side: periodic-run records for /healthz, and what a restarted `serve` does with
the `local` provider's instances its previous run left."""
from __future__ import annotations

import logging
from typing import Callable

from django.utils import timezone

from broker.inventory.models import CloudInstance, InstanceState, Pool, PoolKind
from broker.ops.models import PeriodicRun
from broker.provisioning.reconcile import PoolReconcileSummary, pool_reconcile

log = logging.getLogger(__name__)


def periodic_run_record(*, name: str) -> None:
    """Note that the periodic task `name` just completed (read by /healthz from any process)."""
    now = timezone.now()
    if not PeriodicRun.objects.filter(name=name).update(last_run_at=now):
        PeriodicRun.objects.get_or_create(name=name, defaults={"last_run_at": now})


def local_instances_recover(*, say: Callable[[str], None] = log.info) -> list[PoolReconcileSummary]:
    """Reconcile every `local` pool at once, before the worker starts: instances its records know and
    whose agent still runs are adopted; agents no live record knows are terminated now (no grace:
    they are this machine's processes, and with no worker running no launch is in flight); records
    whose agent died are confirmed gone and their jobs requeued."""
    summaries = []
    for pool in Pool.objects.filter(kind=PoolKind.LOCAL).select_related("tenant"):
        summary = pool_reconcile(pool=pool, orphan_grace_seconds=0)
        summaries.append(summary)
        kept = CloudInstance.objects.filter(pool=pool, state=InstanceState.RUNNING).count()
        if kept or summary.adopted or summary.orphans_terminated or summary.lost or summary.errors:
            say(f"pool {summary.pool}: {kept} running instance(s) kept ({summary.adopted} adopted), "
                f"{summary.orphans_terminated} orphan(s) terminated, {summary.lost} found gone"
                + (f"; errors: {summary.errors}" if summary.errors else ""))
    return summaries
