"""`manage.py quota_set --tenant SLUG --flavor A100-80GB --nominal 8 [--borrowing-limit 4]
[--lending-limit 8] [--delete]`: a team's quota of one flavor of owned capacity.

The flavor is a GPU model (its name or an alias) or CU (compute units over all models). Nominal is
guaranteed (borrowers are reclaimed for it); the borrowing limit caps use above nominal (left out: no
limit); the lending limit caps how much of the unused nominal others may borrow (left out: all of it).
Setting a flavor again replaces all three. `--delete` removes the team's quota of the flavor.
"""
from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError

from broker.tenancy.models import Tenant
from broker.tenancy.services import QuotaError, team_quota_delete, team_quota_set


class Command(BaseCommand):
    help = "Set (or delete) a team's nominal quota, borrowing limit and lending limit of one GPU flavor."

    def add_arguments(self, parser) -> None:
        parser.add_argument("--tenant", required=True, help="team (tenant) slug")
        parser.add_argument("--flavor", required=True, help='GPU model (e.g. A100-80GB) or "CU"')
        parser.add_argument("--nominal", help="guaranteed GPUs (or compute units), >= 0")
        parser.add_argument("--borrowing-limit", dest="borrowing_limit",
                            help="most it may use above nominal (default: no limit)")
        parser.add_argument("--lending-limit", dest="lending_limit",
                            help="most of its unused nominal others may borrow, <= nominal (default: all)")
        parser.add_argument("--delete", action="store_true", help="remove the team's quota of this flavor")

    def handle(self, *args, tenant: str, flavor: str, nominal: str | None, borrowing_limit: str | None,
               lending_limit: str | None, delete: bool, **options) -> None:
        team = Tenant.objects.filter(slug=tenant).first()
        if team is None:
            raise CommandError(f"No tenant {tenant[:63]!r}.")
        try:
            if delete:
                if nominal is not None or borrowing_limit is not None or lending_limit is not None:
                    raise QuotaError("--delete takes no --nominal, --borrowing-limit or --lending-limit.")
                if not team_quota_delete(tenant=team, flavor=flavor):
                    raise QuotaError(f"{team.slug} has no quota of {flavor[:64]}: nothing to delete.")
                self.stdout.write(f"Deleted {team.slug}'s quota of {flavor}.")
                return
            if nominal is None:
                raise QuotaError("--nominal is required (or --delete).", field="nominal")
            quota = team_quota_set(tenant=team, flavor=flavor, nominal=nominal, borrowing_limit=borrowing_limit,
                                   lending_limit=lending_limit)
        except QuotaError as exc:
            raise CommandError(f"{exc.field}: {exc}" if exc.field != "non_field_errors" else str(exc)) from None
        borrow = "no limit" if quota.borrowing_limit is None else f"{quota.borrowing_limit:g}"
        lend = "all of nominal" if quota.lending_limit is None else f"{quota.lending_limit:g}"
        self.stdout.write(f"{team.slug} {quota.flavor}: nominal {quota.nominal:g}, borrowing limit {borrow}, "
                          f"lending limit {lend}.")
