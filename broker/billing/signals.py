"""Fix an allocation's price the moment it is committed, not only at the next metering run.

allocation_commit (broker.jobs.services, not billing's) creates the Allocation and then its slices in one
transaction; once that transaction commits, the price is fixed from the slices' GPU model (on_commit, so a
rolled-back commit fixes nothing). The metering run still fixes any allocation this missed (a crash
between commit and callback, rows written by other paths): `rates_fix` is idempotent. Bulk placements
(broker.jobs.batch) send no post_save; they send broker.jobs.signals.allocations_placed inside their
transaction, and the meters are inserted in it."""
from __future__ import annotations

import logging

from django.db import transaction
from django.db.models.signals import post_save
from django.dispatch import receiver
from django.utils import timezone

from broker.jobs.models import Allocation
from broker.jobs.signals import PlacedAllocation, allocations_placed

log = logging.getLogger(__name__)


@receiver(post_save, sender=Allocation, dispatch_uid="billing-fix-price")
def allocation_price_fix(sender, instance: Allocation, created: bool, raw: bool = False, **kwargs) -> None:
    if not created or raw:
        return
    allocation_id = instance.pk

    def fix() -> None:
        from broker.billing.services import rates_fix

        try:
            rates_fix(now=timezone.now(), allocation_ids=[allocation_id])
        except Exception:  # noqa: BLE001 - billing must never break a placement; the metering run retries
            log.exception("billing: could not fix the price of allocation %s now", allocation_id)

    transaction.on_commit(fix, robust=True)


@receiver(allocations_placed, dispatch_uid="billing-fix-prices-bulk")
def allocations_prices_fix(sender, allocations: list[PlacedAllocation], **kwargs) -> None:
    """Bulk placements (broker.jobs.batch) insert allocations without post_save: their prices are fixed
    in the placements' own transaction, from what the placement already read (no query of the rows it
    just wrote)."""
    from broker.billing.services import meters_create

    try:
        with transaction.atomic():  # a savepoint: a failure here leaves the placements as they are
            meters_create(now=timezone.now(), allocations=allocations)
    except Exception:  # noqa: BLE001 - billing must never break a placement; the metering run retries
        log.exception("billing: could not fix the prices of %d allocation(s) now", len(allocations))
