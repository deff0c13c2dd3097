"""Celery tasks: thin, load by id, call the service, safe to run twice at once (the lease decides)."""
from __future__ import annotations

from celery import shared_task

from broker.ops.services import periodic_run_record
from broker.scheduler.services import scheduling_cycle_run, tenants_to_schedule
from broker.scheduler.timeouts import stalled_boots_retire, stalled_starts_requeue
from broker.tenancy.models import Tenant
from broker.tenancy.services import fair_share_usage_sweep


@shared_task(name="scheduler.cycle", acks_late=True, ignore_result=True)
def scheduling_cycle(tenant_id: int) -> None:
    tenant = Tenant.objects.filter(pk=tenant_id).first()
    if tenant is not None:
        scheduling_cycle_run(tenant=tenant)


@shared_task(name="scheduler.sweep", ignore_result=True)
def scheduling_sweep() -> None:
    """Periodic: give up on stalled starts and boots, bring fair-share usage up to date, then run a cycle
    for every scheduling component with pending work or a consolidation due (this also catches anything
    a lost message missed). One cycle per component: it covers every team sharing capacity."""
    stalled_starts_requeue()
    stalled_boots_retire()
    fair_share_usage_sweep()
    for tenant in tenants_to_schedule():
        scheduling_cycle.delay(tenant.pk)
    periodic_run_record(name="scheduler.sweep")  # /healthz: scheduling is alive
