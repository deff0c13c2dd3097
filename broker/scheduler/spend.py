"""Month-to-date spend of a tenant: the billing figure (broker.billing.selectors), which budgets are checked
against (broker.scheduler.snapshot.tenant_budget) and /metrics shows.

Billing charges every allocation from hold to release at the price fixed when it started (an owned pool's
chargeback rate, a rented instance's price split by GPU share) plus the idle time of rented instances the
team's jobs launched; stored usage records plus the live remainder of this UTC month (README.md,
"Billing and cost reports").
"""
from __future__ import annotations

from datetime import datetime

from broker.tenancy.models import Tenant


def month_start(now: datetime) -> datetime:
    return now.replace(day=1, hour=0, minute=0, second=0, microsecond=0)


def month_to_date_spend(*, tenant: Tenant, now: datetime) -> float:
    from broker.billing.selectors import month_to_date_spend as billed

    return float(billed(tenant=tenant, now=now))


def month_to_date_spend_by_provider(*, now: datetime, tenant: Tenant | None = None) -> dict[tuple[str, str], float]:
    """(tenant slug, pool kind) -> dollars this month, for one tenant or all (the /metrics gauge)."""
    from broker.billing.selectors import month_to_date_spend_by_provider as billed

    return {key: float(value) for key, value in billed(now=now, tenant=tenant).items()}
