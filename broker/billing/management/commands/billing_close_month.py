"""`manage.py billing_close_month --month YYYY-MM [--tenant SLUG]`: freeze the statements of a month that
has ended (every team, or one). A closed statement never changes; closing it again changes nothing."""
from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError

from broker.billing.services import BillingError, month_close
from broker.tenancy.models import Tenant


class Command(BaseCommand):
    help = "Close (freeze) the monthly statements of a past month."

    def add_arguments(self, parser) -> None:
        parser.add_argument("--month", required=True, help="YYYY-MM (UTC), a month that has ended")
        parser.add_argument("--tenant", help="one team's slug (default: every team)")

    def handle(self, *args, month: str, tenant: str | None, **options) -> None:
        teams = Tenant.objects.all().order_by("pk")
        if tenant is not None:
            teams = teams.filter(slug=tenant)
            if not teams.exists():
                raise CommandError(f"No tenant {tenant[:63]!r}.")
        for team in teams:
            try:
                row = month_close(tenant=team, month=month)
            except BillingError as exc:
                raise CommandError(str(exc)) from None
            total = row.statement.get("totals", {}).get("total_usd", "0.00")
            self.stdout.write(f"{team.slug} {month}: closed, total ${total}, "
                              f"{row.statement.get('totals', {}).get('line_count', 0)} line(s)")
