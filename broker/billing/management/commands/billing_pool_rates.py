"""`manage.py billing_pool_rates --pool OWNER_SLUG/POOL_NAME [--cpu USD|none] [--memory USD|none]`: an owned
pool's CPU rate ($ per vCPU-hour) and memory rate ($ per GiB-hour) for chargeback; without --cpu or
--memory, print them. `none` stops charging it (the default: CPU and memory are not charged). A rate is
fixed for an allocation when its price is, so a change applies to allocations placed from then on.
The GPU chargeback rates stay in the admin (Pool, ChargebackRate), where these two can be set too.
README "Billing and cost reports"."""
from __future__ import annotations

from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError

from broker.inventory.services import PoolShareError, pool_resolve, pool_resource_rates_set

OPTIONS = {"cpu": "cpu_rate_usd_per_core_hour", "memory": "memory_rate_usd_per_gib_hour"}


class Command(BaseCommand):
    help = "Show or set an owned pool's CPU ($/vCPU-hour) and memory ($/GiB-hour) chargeback rates."

    def add_arguments(self, parser) -> None:
        parser.add_argument("--pool", required=True, help="OWNER_SLUG/POOL_NAME, e.g. acme/onprem")
        parser.add_argument("--cpu", help="$ per vCPU-hour requested, or none")
        parser.add_argument("--memory", help="$ per GiB-hour of memory requested, or none")

    def handle(self, *args, pool: str, **options) -> None:
        rates = {field: options[opt] for opt, field in OPTIONS.items() if options.get(opt) is not None}
        try:
            target = pool_resolve(pool)
            if rates:
                target = pool_resource_rates_set(pool=target, rates=rates)
        except PoolShareError as exc:
            raise CommandError(str(exc)) from None
        except ValidationError as exc:
            reasons = "; ".join(f"--{_option(name)}: {' '.join(msgs)}" for name, msgs in exc.message_dict.items())
            raise CommandError(reasons) from None
        self.stdout.write(f"{target}: CPU {_shown(target.cpu_rate_usd_per_core_hour, 'vCPU')}, "
                          f"memory {_shown(target.memory_rate_usd_per_gib_hour, 'GiB')}")


def _option(field: str) -> str:
    return next((opt for opt, name in OPTIONS.items() if name == field), field)


def _shown(rate, unit: str) -> str:
    return "not charged" if rate is None else f"${rate} per {unit}-hour"
