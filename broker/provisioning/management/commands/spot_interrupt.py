"""Reclaim a simulated spot instance, as a cloud would: `manage.py spot_interrupt NODE [--in SECONDS]`.

Only for pools of the `local` provider (`cloud-sim` in the demo): the instance's metadata endpoint starts
answering a notice (AWS's `spot/instance-action` shape), its agent sends it to the broker in the next
heartbeat, and the instance is terminated when the time is up. Real clouds send their own notices.
"""
from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError

from broker.inventory.models import CloudInstance, InstanceState, PoolKind
from broker.provisioning.factory import provider_for_pool
from providers.base import InstanceRef


class Command(BaseCommand):
    help = "Post a spot interruption notice to a simulated (local provider) cloud instance."

    def add_arguments(self, parser) -> None:
        parser.add_argument("node", help="the instance's node name (GET /api/v1/nodes/ lists them)")
        parser.add_argument("--in", dest="seconds", type=float, default=120.0,
                            help="seconds until the instance is taken (default 120, as on AWS)")

    def handle(self, *args, node: str, seconds: float, **options) -> None:
        if not 1 <= seconds <= 3600:
            raise CommandError("--in must be between 1 and 3600 seconds.")
        instance = (CloudInstance.objects.select_related("pool")
                    .filter(node_name=node).exclude(state=InstanceState.TERMINATED).first())
        if instance is None:
            raise CommandError(f"No live cloud instance has the node name {node!r}.")
        if instance.pool.kind != PoolKind.LOCAL:
            raise CommandError(f"{node} is in a {instance.pool.kind} pool: only the simulated cloud (local) "
                               "takes notices from here; real clouds send their own.")
        if not instance.provider_id:
            raise CommandError(f"{node} has not been launched yet.")
        provider = provider_for_pool(instance.pool)
        info = provider.interrupt(InstanceRef(provider=instance.pool.kind, region=instance.offer.get("region", ""),
                                              zone=instance.zone, instance_id=instance.provider_id),
                                  after_seconds=seconds)
        self.stdout.write(f"{node}: spot notice posted; the instance is taken in {seconds:.0f} s "
                          f"(now {info.state.value}).")
