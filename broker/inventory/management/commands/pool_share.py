"""`manage.py pool_share --pool OWNER_SLUG/POOL_NAME --tenant SLUG [--revoke]`: share a pool with a team.

For a platform admin: the pool's owner (the platform's own tenant for a shared cluster) keeps it; the
team may then place jobs on its nodes and, for a cloud pool, rent instances through it. `--revoke`
takes the grant back (running jobs run on; nothing new is placed there). Quotas per flavor are set with
`quota_set`; README "Shared clusters and quotas".
"""
from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError

from broker.inventory.services import PoolShareError, pool_resolve, pool_share, pool_unshare
from broker.tenancy.models import Tenant


class Command(BaseCommand):
    help = "Share a pool with a team (tenant), or revoke the share."

    def add_arguments(self, parser) -> None:
        parser.add_argument("--pool", required=True, help="OWNER_SLUG/POOL_NAME, e.g. platform/shared-a100")
        parser.add_argument("--tenant", required=True, help="slug of the team that may use the pool")
        parser.add_argument("--revoke", action="store_true", help="take the grant back")

    def handle(self, *args, pool: str, tenant: str, revoke: bool, **options) -> None:
        try:
            target = pool_resolve(pool)
            team = Tenant.objects.filter(slug=tenant).first()
            if team is None:
                raise PoolShareError(f"No tenant {tenant[:63]!r}.")
            if revoke:
                pool_unshare(pool=target, tenant=team)
                self.stdout.write(f"{target} is no longer shared with {team.slug}.")
                return
            _, created = pool_share(pool=target, tenant=team)
        except PoolShareError as exc:
            raise CommandError(str(exc)) from None
        self.stdout.write(f"{target} is {'now' if created else 'already'} shared with {team.slug}.")
