"""Demo data: two tenants with admins, GPU models, an on-prem pool of simulated nodes, one token each.

Idempotent: re-running keeps existing rows and the same demo tokens, so `make run` twice gives the
same demo. A token's secret is only known at creation, so the demo tokens are kept in
`var/demo-tokens.json` (mode 0600, beside the SQLite database); a token that file does not hold, or
that no longer works, is replaced by a new one. Each on-prem pool records its demo nodes and their
fake GPUs in `provider_config["demo_nodes"]`, which is how `serve` knows which agents to start.

With WHALEZEN_DEMO_SHARED=1 it also seeds a shared cluster (issue 11): a `platform` tenant owning an
on-prem pool `shared-l40s` (one node, 4 simulated L40S, an agent of its own under `serve`), shared with
acme and globex, each with a nominal quota of 2 L40S. Off by default: the default demo, which the
end-to-end tests drive, stays as it was. L40S is a model neither team has a cluster of, so the quota
covers the shared GPUs only.
"""
from __future__ import annotations

import json
import os
from decimal import Decimal
from pathlib import Path

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand
from django.db import transaction

from broker.inventory.gpu_catalog import DEFAULT_GPU_MODELS, compute_units_for
from broker.inventory.models import GpuModel, Pool, PoolGrant, PoolKind
from broker.inventory.services import node_create_simulated
from broker.ops.demo_agents import DEMO_NODES_KEY, fake_spec
from broker.ops.demo_kube import demo_cluster_config
from broker.tenancy import tokens
from broker.tenancy.models import ApiToken, Quota, Role, TeamQuota, Tenant
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


# WHALEZEN_DEMO_SHARED=1: (owner slug, pool, node prefix, nodes, model, GPUs per node, {team: nominal})
DEMO_SHARED = ("platform", "shared-l40s", "platform-l40s", 1, "L40S", 4, {"acme": 2, "globex": 2})


def seed_shared_demo(models: dict[str, GpuModel], *, password: str, saved: dict[str, str],
                     secrets: dict[str, str]) -> list[str]:
    """The opt-in shared cluster (module docstring); idempotent like the rest. Returns its TOKEN line."""
    slug, pool_name, prefix, count, model_name, gpus, nominal = DEMO_SHARED
    owner, _ = Tenant.objects.get_or_create(slug=slug, defaults={"name": "Platform"})
    Quota.objects.get_or_create(tenant=owner)
    User = get_user_model()
    user, created = User.objects.get_or_create(username=f"{slug}-admin", defaults={"email": f"admin@{slug}.example"})
    if created:
        user.set_password(password)
        user.save()
    membership_add(tenant=owner, user=user, role=Role.ADMIN)
    pool, _ = Pool.objects.get_or_create(tenant=owner, name=pool_name,
                                         defaults={"kind": PoolKind.ONPREM, "region": "dc1",
                                                   "gpu_hour_rate_usd": Decimal("0.90")})
    pool.provider_config = {**(pool.provider_config or {}), DEMO_NODES_KEY: {
        f"{prefix}-{i}": fake_spec(model_name, gpus) for i in range(count)}}
    pool.save(update_fields=["provider_config"])
    for i in range(count):
        node_create_simulated(pool=pool, name=f"{prefix}-{i}", gpu_model=models[model_name], gpu_count=gpus,
                              nvlink_island_size=0, cpu_milli=gpus * 12000, memory_mb=gpus * 120 * 1024)
    for team_slug, amount in nominal.items():
        team = Tenant.objects.get(slug=team_slug)
        PoolGrant.objects.get_or_create(pool=pool, tenant=team)
        TeamQuota.objects.get_or_create(tenant=team, flavor=model_name, defaults={"nominal": Decimal(amount)})
    secrets[slug] = demo_token(tenant=owner, user=user, saved=saved.get(slug))
    return [f"TOKEN {slug} {secrets[slug]}"]


def demo_console_users(*, tenant: Tenant, admin, password: str) -> list[str]:
    """A member and a viewer beside the admin, so the console's three roles can be tried; one line each
    for `make run` to print (the password is the demo's, never a real one)."""
    User = get_user_model()
    lines = [f"USER {admin.username} {password} admin of {tenant.slug}"]
    for role in (Role.MEMBER, Role.VIEWER):
        user, created = User.objects.get_or_create(username=f"{tenant.slug}-{role}",
                                                   defaults={"email": f"{role}@{tenant.slug}.example"})
        if created:
            user.set_password(password)
            user.save()
        membership_add(tenant=tenant, user=user, role=role)
        lines.append(f"USER {user.username} {password} {role} of {tenant.slug}")
    return lines


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


def demo_tokens_path() -> Path:
    return Path(settings.VAR_DIR) / "demo-tokens.json"


def _saved_tokens() -> dict[str, str]:
    try:
        saved = json.loads(demo_tokens_path().read_text())
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in saved.items() if isinstance(k, str) and isinstance(v, str)} if isinstance(saved, dict) \
        else {}


def _save_tokens(secrets: dict[str, str]) -> None:
    path = demo_tokens_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # a secret: never readable by others
    with os.fdopen(fd, "w") as handle:
        json.dump(secrets, handle, indent=1, sort_keys=True)
    os.replace(tmp, path)


def demo_token(*, tenant: Tenant, user, saved: str | None) -> str:
    """The tenant's demo token: the saved one while it still works, else a fresh one."""
    current = ApiToken.objects.filter(tenant=tenant, user=user, name=DEMO_TOKEN_NAME)
    if saved and (prefix := tokens.split_prefix(saved)):
        token = current.filter(prefix=prefix).first()
        if token is not None and tokens.matches(saved, token.secret_hash) and token.is_active:
            current.exclude(pk=token.pk).delete()
            return saved
    current.delete()
    return api_token_create(tenant=tenant, user=user, name=DEMO_TOKEN_NAME).secret


def _open_demo_checkpoint_root() -> None:
    """The demo's checkpoint root (the first of WHALEZEN_CHECKPOINT_ROOTS under the var dir): demo jobs
    run as an unprivileged user and create their checkpoint folders in it, so it is world-writable and
    sticky, like /tmp (a job may not remove another's folder). Production roots are shared storage
    provisioned by the operator; this only touches a root inside the demo's own var dir."""
    for root in settings.WHALEZEN_CHECKPOINT_ROOTS:
        path = Path(root)
        if settings.VAR_DIR in path.parents:
            path.mkdir(parents=True, exist_ok=True)
            path.chmod(0o1777)


class Command(BaseCommand):
    help = "Create demo tenants, users, GPU models and simulated nodes; print one API token per tenant."

    def handle(self, *args, **options) -> None:
        password = os.environ.get("WHALEZEN_DEMO_PASSWORD", "whalezen-demo")
        User = get_user_model()
        saved, secrets = _saved_tokens(), {}
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
                lines += demo_console_users(tenant=tenant, admin=user, password=password)
                pool, _ = Pool.objects.get_or_create(
                    tenant=tenant, name="onprem", defaults={"kind": PoolKind.ONPREM, "region": "dc1",
                                                            "gpu_hour_rate_usd": Decimal("1.10")})
                # The durable demo marker (see the module docstring); replaced, not merged, every seed.
                pool.provider_config = {**(pool.provider_config or {}), DEMO_NODES_KEY: {
                    f"{prefix}-{i}": fake_spec(model_name, gpus)
                    for prefix, count, model_name, gpus, _ in node_groups for i in range(count)}}
                pool.save(update_fields=["provider_config"])
                Pool.objects.get_or_create(
                    tenant=tenant, name="cloud-sim",
                    defaults={"kind": PoolKind.LOCAL, "region": "sim-east-1", "max_instances": 2,
                              "provider_config": SIM_CLOUD_CONFIG})
                for prefix, count, model_name, gpus, island in node_groups:
                    for i in range(count):
                        node_create_simulated(pool=pool, name=f"{prefix}-{i}", gpu_model=models[model_name],
                                              gpu_count=gpus, nvlink_island_size=island,
                                              cpu_milli=gpus * 12000, memory_mb=gpus * 120 * 1024)
                secrets[slug] = demo_token(tenant=tenant, user=user, saved=saved.get(slug))
                lines.append(f"TOKEN {slug} {secrets[slug]}")
            if os.environ.get("WHALEZEN_DEMO_SHARED", "0") == "1":
                lines += seed_shared_demo(models, password=password, saved=saved, secrets=secrets)
            if os.environ.get("WHALEZEN_DEMO_KUBERNETES", "0") == "1":
                # acme's simulated Kubernetes cluster, which serve starts with its bridge (broker/ops/demo_kube.py).
                pool, _ = Pool.objects.get_or_create(tenant=Tenant.objects.get(slug="acme"), name="k8s-demo",
                                                     defaults={"kind": PoolKind.KUBERNETES, "region": "dc1",
                                                               "gpu_hour_rate_usd": Decimal("1.50")})
                pool.provider_config = demo_cluster_config(pool_name=pool.name)
                pool.save(update_fields=["provider_config"])
            _save_tokens(secrets)
        _open_demo_checkpoint_root()
        for line in lines:
            self.stdout.write(line)
