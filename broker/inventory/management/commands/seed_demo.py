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


# A simulated cloud per tenant (the `local` provider starts agents with fake GPUs as "instances").
# Prices mirror AWS us-east-1 list prices of the matching instance types (p4de.24xlarge,
# g4dn.12xlarge, g6.xlarge) so the scheduler's cost trade-offs look like the real ones.
SIM_CLOUD_CONFIG = {
    "shapes": [
        {"instance_type": "sim.8xA100-80GB", "fake_gpus": "8xA100-80GB-SXM", "gpu_model": "A100-80GB",
         "gpu_count": 8, "gpu_memory_mib": 81920, "vcpus": 96, "memory_gib": 1152,
         "price_per_hour": 27.44705, "spot_price_per_hour": 9.9734, "fabric": ["nvlink", "efa"]},
        {"instance_type": "sim.4xT4", "fake_gpus": "4xT4", "gpu_model": "T4", "gpu_count": 4,
         "gpu_memory_mib": 16384, "vcpus": 48, "memory_gib": 192, "price_per_hour": 3.912,
         "spot_price_per_hour": 1.2875},
        {"instance_type": "sim.1xL4", "fake_gpus": "1xL4", "gpu_model": "L4", "gpu_count": 1,
         "gpu_memory_mib": 22888, "vcpus": 4, "memory_gib": 16, "price_per_hour": 0.8048},
    ],
    "simulation": {"launch_latency_s": 3.0},
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
                Pool.objects.get_or_create(
                    tenant=tenant, name="cloud-sim",
                    defaults={"kind": PoolKind.LOCAL, "region": "sim-east-1", "max_instances": 2,
                              "provider_config": SIM_CLOUD_CONFIG})
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
