"""Demo data: two tenants with admins, GPU models, an on-prem pool of simulated nodes, one token each.

Idempotent: re-running keeps existing rows and replaces each tenant's demo token (its secret is only
known at creation, so a fresh one is printed every time).
"""
from __future__ import annotations

import os
from decimal import Decimal

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand
from django.db import transaction

from broker.inventory.gpu_catalog import DEFAULT_GPU_MODELS, compute_units_for
from broker.inventory.models import GpuModel, Pool, PoolKind
from broker.inventory.services import node_create_simulated
from broker.tenancy.models import ApiToken, Quota, Role, Tenant
from broker.tenancy.services import api_token_create, membership_add

DEMO_TOKEN_NAME = "demo"
# tenant slug -> (display name, quota GPUs, [(node prefix, count, model, GPUs per node, NVLink island size)])
DEMO_TENANTS = {
    "acme": ("Acme Research", 48, [("acme-a100", 2, "A100-80GB", 8, 8), ("acme-t4", 2, "T4", 4, 0)]),
    "globex": ("Globex ML", 32, [("globex-h100", 1, "H100-80GB", 8, 8), ("globex-v100", 2, "V100-32GB", 4, 4)]),
}


def seed_gpu_models() -> dict[str, GpuModel]:
    models = {}
    for name, memory_gb, tflops, nvlink, aliases in DEFAULT_GPU_MODELS:
        model, _ = GpuModel.objects.update_or_create(
            name=name,
            defaults={"memory_gb": memory_gb, "peak_dense_tflops": Decimal(tflops), "nvlink": nvlink,
                      "compute_units": compute_units_for(tflops), "aliases": aliases,
                      "mig_profiles": (["1g.10gb", "2g.20gb", "3g.40gb", "7g.80gb"] if name in ("A100-80GB", "H100-80GB")
                                       else [])},
        )
        models[name] = model
    return models


class Command(BaseCommand):
    help = "Create demo tenants, users, GPU models and simulated nodes; print one API token per tenant."

    def handle(self, *args, **options) -> None:
        password = os.environ.get("WHALEZEN_DEMO_PASSWORD", "whalezen-demo")
        User = get_user_model()
        with transaction.atomic():
            models = seed_gpu_models()
            lines = []
            for slug, (display, quota_gpus, node_groups) in DEMO_TENANTS.items():
                tenant, _ = Tenant.objects.get_or_create(slug=slug, defaults={"name": display})
                Quota.objects.get_or_create(tenant=tenant, defaults={"max_gpus": quota_gpus})
                user, created = User.objects.get_or_create(username=f"{slug}-admin",
                                                           defaults={"email": f"admin@{slug}.example"})
                if created:
                    user.set_password(password)
                    user.save()
                membership_add(tenant=tenant, user=user, role=Role.ADMIN)
                pool, _ = Pool.objects.get_or_create(
                    tenant=tenant, name="onprem", defaults={"kind": PoolKind.ONPREM, "region": "dc1",
                                                            "gpu_hour_rate_usd": Decimal("1.10")})
                for prefix, count, model_name, gpus, island in node_groups:
                    for i in range(count):
                        node_create_simulated(pool=pool, name=f"{prefix}-{i}", gpu_model=models[model_name],
                                              gpu_count=gpus, nvlink_island_size=island,
                                              cpu_milli=gpus * 12000, memory_mb=gpus * 120 * 1024)
                ApiToken.objects.filter(tenant=tenant, user=user, name=DEMO_TOKEN_NAME).delete()
                created_token = api_token_create(tenant=tenant, user=user, name=DEMO_TOKEN_NAME)
                lines.append(f"TOKEN {slug} {created_token.secret}")
        for line in lines:
            self.stdout.write(line)
