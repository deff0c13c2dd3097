"""Celery tasks of billing: thin, safe to run twice at once (unique keys and the month lock decide)."""
from __future__ import annotations

from celery import shared_task

from broker.billing.savings import on_demand_prices_record
from broker.billing.services import meter
from broker.ops.services import periodic_run_record


@shared_task(name="billing.meter", ignore_result=True)
def billing_meter() -> None:
    """Periodic: fix new allocations' prices, sample utilisation, store final usage lines, budget alerts."""
    meter()
    on_demand_prices_record()  # once per team and UTC day: the savings report's prices of that day
    periodic_run_record(name="billing.meter")
