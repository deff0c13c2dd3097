"""`manage.py issue_join_token --tenant acme --pool onprem`: a new agent join token for a pool.

Prints the token once (only its hash is stored); the previous token of the pool stops working.
Creates the pool (kind onprem) with --create if it does not exist.
"""
from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError

from broker.inventory.models import Pool, PoolKind
from broker.inventory.services import pool_join_token_issue
from broker.tenancy.models import Tenant


class Command(BaseCommand):
    help = "Issue a new node-agent join token for a tenant's pool and print it."

    def add_arguments(self, parser):
        parser.add_argument("--tenant", required=True, help="tenant slug")
        parser.add_argument("--pool", required=True, help="pool name")
        parser.add_argument("--create", action="store_true", help="create an on-prem pool of that name if missing")

    def handle(self, *args, tenant: str, pool: str, create: bool, **options):
        owner = Tenant.objects.filter(slug=tenant).first()
        if owner is None:
            raise CommandError(f"no tenant {tenant!r}")
        target = Pool.objects.filter(tenant=owner, name=pool).first()
        if target is None:
            if not create:
                raise CommandError(f"tenant {tenant} has no pool {pool!r} (use --create for an on-prem pool)")
            target = Pool.objects.create(tenant=owner, name=pool, kind=PoolKind.ONPREM)
        self.stdout.write(pool_join_token_issue(pool=target))
