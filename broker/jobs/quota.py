"""A team's room under its GPU and compute-unit quotas, as every commit path counts it.

Both quotas count shares, in slots (docs/job-spec.md, "Quotas"): a job holding half of a GPU counts 0.5
GPU and half of that GPU's compute units, as the engine counts it (`Pricing.gpu_share`), so two half-GPU
jobs fit a quota of one GPU and a third does not, wherever they are placed. `allocation_commit` asks for
one job; a set-based commit (broker/jobs/batch.py) draws one room down over its whole chunk."""
from __future__ import annotations

from decimal import Decimal

from broker.inventory.models import Gpu
from broker.jobs.selectors import tenant_held_share
from broker.tenancy.models import Quota


class QuotaRoom:
    """What the team holds now (read once, under the caller's locks) against its quotas."""

    def __init__(self, tenant_id: int) -> None:
        quota = Quota.objects.filter(tenant_id=tenant_id).first()
        self.max_slots = quota.max_gpus * Gpu.SLOTS if quota is not None and quota.max_gpus else None
        self.max_cu = quota.max_compute_units if quota is not None and quota.max_compute_units else None
        held = tenant_held_share(tenant_id=tenant_id) if (self.max_slots or self.max_cu) else None
        self.slots = held.slots if held else 0
        self.cu_slots = held.cu_slots if held else Decimal(0)

    def take(self, adding: list[tuple[Decimal, int]]) -> str | None:
        """Count `adding` ((compute units of the GPU, slots taken of it) pairs) as held, or say which
        quota it would exceed (and count nothing)."""
        slots = sum(count for _, count in adding)
        cu = sum(units * count for units, count in adding)
        if self.max_slots is not None and self.slots + slots > self.max_slots:
            return (f"GPU quota exceeded: {self.slots / Gpu.SLOTS:g} in use + {slots / Gpu.SLOTS:g} "
                    f"> {self.max_slots // Gpu.SLOTS}.")
        if self.max_cu is not None and (self.cu_slots + cu) / Gpu.SLOTS > self.max_cu:
            return (f"Compute-unit quota exceeded: {self.cu_slots / Gpu.SLOTS:g} in use + {cu / Gpu.SLOTS:g} "
                    f"> {self.max_cu:g}.")
        self.slots += slots
        self.cu_slots += cu
        return None
