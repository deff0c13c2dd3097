"""Celery tasks for cloud instances: thin, by id, idempotent."""
from __future__ import annotations

import logging

from celery import shared_task
from django.conf import settings

from broker.inventory.models import CloudInstance, InstanceState
from broker.provisioning.offers import pool_offers_refresh
from broker.provisioning.reconcile import all_cloud_pools, pool_reconcile
from broker.provisioning.services import idle_instances, instance_provision, instance_terminate
from providers.base import ProviderError

log = logging.getLogger(__name__)


@shared_task(name="provisioning.provision", bind=True, acks_late=True, ignore_result=True, max_retries=8)
def provision_instance(self, instance_id: int) -> None:
    instance = CloudInstance.objects.filter(pk=instance_id).select_related("pool", "tenant").first()
    if instance is None:
        return
    try:
        instance_provision(instance=instance)
    except ProviderError as exc:  # transient: same key, later
        raise self.retry(exc=exc, countdown=min(300, 5 * 2 ** self.request.retries))


@shared_task(name="provisioning.sweep", ignore_result=True)
def provisioning_sweep() -> None:
    """Periodic: re-drive launches a lost message left behind, retire idle instances, reconcile pools."""
    for instance in CloudInstance.objects.filter(state=InstanceState.REQUESTED):
        provision_instance.delay(instance.pk)
    for instance in idle_instances(idle_seconds=settings.WHALEZEN_IDLE_INSTANCE_SECONDS):
        try:
            instance_terminate(instance=instance, reason="idle")
        except ProviderError as exc:
            log.warning("terminating idle %s failed: %s", instance, exc)
    for pool in all_cloud_pools():
        summary = pool_reconcile(pool=pool)
        if summary.adopted or summary.orphans_terminated or summary.lost or summary.errors:
            log.info("reconciled %s", summary)


@shared_task(name="provisioning.refresh_offers", ignore_result=True)
def refresh_offers() -> None:
    """Periodic: which catalogue offers each cloud pool can launch now (new zones, retired types)."""
    for pool in all_cloud_pools():
        try:
            report = pool_offers_refresh(pool=pool)
        except ProviderError as exc:
            log.warning("refreshing offers of %s failed: %s", pool, exc)
            continue
        if report.became_available or report.became_unavailable or report.errors:
            log.info("offers of %s: %d became available, %d unavailable, errors: %s", pool,
                     report.became_available, report.became_unavailable, report.errors)
