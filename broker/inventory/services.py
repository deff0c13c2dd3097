"""Writes for pools, nodes and GPUs."""
from __future__ import annotations

from django.db import transaction

from broker.inventory.models import Gpu, GpuModel, Node, Pool
from broker.tenancy import tokens


def pool_join_token_issue(*, pool: Pool) -> str:
    """Make a new join token for agents of this pool (replaces the old one); returns the plaintext once."""
    issued = tokens.issue("wzj")
    Pool.objects.filter(pk=pool.pk).update(join_token_prefix=issued.prefix, join_token_hash=issued.digest)
    pool.join_token_prefix, pool.join_token_hash = issued.prefix, issued.digest
    return issued.plaintext


def gpu_model_resolve(name: str) -> GpuModel | None:
    """Match a driver-reported or user-written name to a catalogue model (name or alias, any case)."""
    wanted = name.strip().lower()
    for model in GpuModel.objects.all():
        if wanted == model.name.lower() or wanted in (a.lower() for a in model.aliases or []):
            return model
    return None


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
