"""Writes for pools, nodes and GPUs."""
from __future__ import annotations

from django.db import transaction

from broker.inventory.models import Gpu, GpuModel, Node, Pool, PoolGrant
from broker.tenancy import tokens
from broker.tenancy.models import Tenant


class PoolShareError(Exception):
    """A refused grant or revocation, with a message for the platform admin."""


def pool_join_token_issue(*, pool: Pool) -> str:
    """Make a new join token for agents of this pool (replaces the old one); returns the plaintext once."""
    issued = tokens.issue("wzj")
    Pool.objects.filter(pk=pool.pk).update(join_token_prefix=issued.prefix, join_token_hash=issued.digest)
    pool.join_token_prefix, pool.join_token_hash = issued.prefix, issued.digest
    return issued.plaintext


def gpu_model_resolve(name: str) -> GpuModel | None:
    """Match a driver-reported or user-written name to a catalogue model (name or alias, any case, hyphens
    and spaces alike: GPU Feature Discovery labels a node `NVIDIA-H100-80GB-HBM3` for NVML's
    `NVIDIA H100 80GB HBM3`)."""
    wanted = _spelling(name)
    for model in GpuModel.objects.all():
        if wanted == _spelling(model.name) or wanted in (_spelling(a) for a in model.aliases or []):
            return model
    return None


def _spelling(name: str) -> str:
    return "-".join(name.strip().lower().replace("_", " ").replace("-", " ").split())


def node_create_simulated(*, pool: Pool, name: str, gpu_model: GpuModel, gpu_count: int,
                          nvlink_island_size: int, cpu_milli: int, memory_mb: int) -> Node:
    """A node with simulated GPUs (demo data and tests); real nodes register through the agent."""
    with transaction.atomic():
        node, created = Node.objects.get_or_create(
            pool=pool, name=name,
            defaults={"tenant": pool.tenant, "hostname": name, "cpu_milli": cpu_milli, "memory_mb": memory_mb,
                      "labels": {"simulated": "true"}},
        )
        if created:
            Gpu.objects.bulk_create([
                Gpu(node=node, index=i, uuid=f"GPU-sim-{pool.pk}-{name}-{i}", model=gpu_model,
                    model_name=gpu_model.name, memory_mb=gpu_model.memory_gb * 1024,
                    nvlink_island=(i // nvlink_island_size) if gpu_model.nvlink and nvlink_island_size else None,
                    numa_node=0 if i < gpu_count / 2 else 1)
                for i in range(gpu_count)
            ])
    return node


def pool_resolve(ref: str) -> Pool:
    """The pool an admin names as OWNER_SLUG/POOL_NAME (pool names are unique per owner only)."""
    owner_slug, sep, name = ref.partition("/")
    if not sep or not owner_slug or not name:
        raise PoolShareError(f"Name the pool as OWNER_SLUG/POOL_NAME (e.g. platform/shared-a100), not {ref[:80]!r}.")
    pool = Pool.objects.filter(tenant__slug=owner_slug, name=name).select_related("tenant").first()
    if pool is None:
        if not Tenant.objects.filter(slug=owner_slug).exists():
            raise PoolShareError(f"No tenant {owner_slug[:63]!r} (the pool's owner).")
        names = ", ".join(Pool.objects.filter(tenant__slug=owner_slug).values_list("name", flat=True)) or "none"
        raise PoolShareError(f"Tenant {owner_slug} has no pool {name[:100]!r} (its pools: {names}).")
    return pool


def pool_share(*, pool: Pool, tenant: Tenant) -> tuple[PoolGrant, bool]:
    """Let `tenant` use `pool` (its nodes, and renting through it for a cloud pool); idempotent.

    The team joins the owner's scheduling component from the next cycle on: one decision for all of them."""
    if tenant.pk == pool.tenant_id:
        raise PoolShareError(f"{tenant.slug} owns {pool}: an owner always may use its pool.")
    return PoolGrant.objects.get_or_create(pool=pool, tenant=tenant)


def pool_unshare(*, pool: Pool, tenant: Tenant) -> None:
    """Take the grant back. Jobs of the team already running on the pool run on (a revocation does not
    kill work); nothing new of the team is placed there, and its moves and restarts go elsewhere."""
    deleted, _ = PoolGrant.objects.filter(pool=pool, tenant=tenant).delete()
    if not deleted:
        raise PoolShareError(f"{pool} is not shared with {tenant.slug}: nothing to revoke.")


def pool_resource_rates_set(*, pool: Pool, rates: dict[str, str | None]) -> Pool:
    """Set an owned pool's CPU and/or memory chargeback rates ({field: "0.02" or None to stop charging});
    a field not named keeps its rate. Refuses (ValidationError, by field) a value that is not a
    non-negative amount of at most 6 decimals, or any rate on a cloud pool. Only allocations whose price
    is fixed from now on pay the new rate."""
    from django.core.exceptions import ValidationError

    from broker.inventory.models import RESOURCE_RATE_FIELDS

    for name, raw in rates.items():
        if name not in RESOURCE_RATE_FIELDS:
            raise ValidationError({name: f"Unknown rate: use {' or '.join(RESOURCE_RATE_FIELDS)}."})
        setattr(pool, name, None if raw in (None, "", "none") else raw)
    pool.full_clean(exclude=[f.name for f in Pool._meta.fields if f.name not in RESOURCE_RATE_FIELDS])
    pool.save(update_fields=list(rates))
    pool.refresh_from_db(fields=list(rates))
    return pool
