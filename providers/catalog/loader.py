"""Load price CSVs (the column layout of the public multi-cloud catalog, schema v8) into Offers.

AWS rows are all-inclusive, one per instance type and availability zone. GCP rows are split: a
host row per machine type and zone, and an accelerator row per GPU name (and count) and zone; a
launch costs host + accelerator, so we sum them (per-GPU accelerator price x GPUs on the host).

Quirks handled, each counted in `CatalogLoad.skipped`/`warnings` rather than failing the load:
empty spot price (-> None), spot at or above on-demand (-> spot unavailable), rows without a
price (skipped), placeholder prices for regions where the type is not sold (skipped).
"""
from __future__ import annotations

import ast
import csv
import logging
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

from providers.base import Offer
from providers.catalog.families import (
    GPU_MEMORY_MIB,
    N1_ATTACHABLE,
    fabric_for,
    gcp_bundled_gpus,
)

log = logging.getLogger(__name__)

DATA_DIR = Path(__file__).with_name("data")

# No GPU rents for more than this per GPU-hour (B200 is about $11-14): anything above is a
# "not sold here" placeholder, like the 700.0 rows the public catalog carries.
MAX_PLAUSIBLE_PER_GPU_HOUR = 100.0


@dataclass
class CatalogLoad:
    offers: list[Offer] = field(default_factory=list)
    skipped: Counter[str] = field(default_factory=Counter)  # reason -> rows
    warnings: list[str] = field(default_factory=list)

    def merge(self, other: "CatalogLoad") -> "CatalogLoad":
        self.offers += other.offers
        self.skipped.update(other.skipped)
        self.warnings += other.warnings
        return self

    def _warn(self, reason: str, message: str) -> None:
        self.skipped[reason] += 1
        self.warnings.append(message)


def _price(text: str | None) -> float | None:
    text = (text or "").strip()
    if not text:
        return None
    try:
        return float(text)
    except ValueError:
        return None


def _is_placeholder(on_demand: float, spot: float | None, gpu_count: int) -> bool:
    if on_demand <= 0:
        return True
    if on_demand / max(gpu_count, 1) > MAX_PLAUSIBLE_PER_GPU_HOUR:
        return True
    # A round number repeated as spot price is how "not available here" rows look.
    return spot is not None and spot == on_demand and on_demand.is_integer() and on_demand >= 100


def _gpu_memory_mib(gpu_info: str, gpu_model: str) -> int:
    try:
        info = ast.literal_eval(gpu_info) if gpu_info.strip().startswith("{") else None
        if info:
            return int(info["Gpus"][0]["MemoryInfo"]["SizeInMiB"])
    except (ValueError, SyntaxError, KeyError, IndexError, TypeError):
        pass
    return GPU_MEMORY_MIB.get(gpu_model, 0)


def _spot_or_none(load: CatalogLoad, label: str, on_demand: float, spot: float | None) -> float | None:
    if spot is not None and spot >= on_demand:
        # Spot at/above on-demand means the feed has no real spot market there; offering it
        # would make the solver pick an interruptible machine for no saving.
        load._warn("spot_not_below_on_demand", f"{label}: spot {spot} >= on-demand {on_demand}; spot ignored")
        return None
    return spot


def _rows(path: Path) -> Iterator[dict[str, str]]:
    with path.open(newline="") as handle:
        yield from csv.DictReader(handle)


def detect_provider(path: Path) -> str:
    with path.open(newline="") as handle:
        header = next(csv.reader(handle), [])
    if "Arch" in header:
        return "aws"
    if header[:2] == ["InstanceType", "vCPUs"]:
        return "gcp"
    raise ValueError(f"{path}: cannot tell the provider from the header {header}")


def load_aws_rows(rows: Iterable[dict[str, str]], source: str = "aws") -> CatalogLoad:
    load = CatalogLoad()
    for line, row in enumerate(rows, start=2):
        instance_type = row.get("InstanceType", "").strip()
        gpu_model = (row.get("AcceleratorName") or "").strip()
        label = f"{source}:{line} {instance_type} {row.get('AvailabilityZone', '')}"
        if not gpu_model or not _price(row.get("AcceleratorCount")):
            load.skipped["not_gpu"] += 1
            continue
        on_demand = _price(row.get("Price"))
        if on_demand is None:
            load._warn("no_price", f"{label}: no on-demand price; skipped")
            continue
        gpu_count = int(_price(row.get("AcceleratorCount")) or 0)
        spot = _price(row.get("SpotPrice"))
        if _is_placeholder(on_demand, spot, gpu_count):
            load._warn("placeholder_price", f"{label}: placeholder price {on_demand}; skipped")
            continue
        load.offers.append(
            Offer(
                provider="aws",
                region=row["Region"].strip(),
                zone=(row.get("AvailabilityZone") or "").strip(),
                instance_type=instance_type,
                gpu_model=gpu_model,
                gpu_count=gpu_count,
                gpu_memory_mib=_gpu_memory_mib(row.get("GpuInfo") or "", gpu_model),
                vcpus=_price(row.get("vCPUs")) or 0.0,
                memory_gib=_price(row.get("MemoryGiB")) or 0.0,
                on_demand_per_hour=on_demand,
                spot_per_hour=_spot_or_none(load, label, on_demand, spot),
                fabric=fabric_for("aws", instance_type, gpu_count),
            )
        )
    return load


@dataclass(frozen=True)
class _GcpGpuPrice:
    per_gpu_on_demand: float
    per_gpu_spot: float | None
    memory_mib: int


def load_gcp_rows(rows: Iterable[dict[str, str]], source: str = "gcp") -> CatalogLoad:
    load = CatalogLoad()
    hosts: list[tuple[str, dict[str, str]]] = []
    gpu_prices: dict[tuple[str, str, str], _GcpGpuPrice] = {}  # (gpu, region, zone) -> price
    for line, row in enumerate(rows, start=2):
        instance_type = (row.get("InstanceType") or "").strip()
        gpu_model = (row.get("AcceleratorName") or "").strip()
        label = f"{source}:{line} {instance_type or gpu_model} {row.get('AvailabilityZone', '')}"
        if instance_type:
            hosts.append((label, row))
            continue
        if not gpu_model or gpu_model.lower().startswith("tpu"):
            load.skipped["not_gpu"] += 1
            continue
        count = int(_price(row.get("AcceleratorCount")) or 0)
        on_demand = _price(row.get("Price"))
        if on_demand is None or count <= 0:
            load._warn("no_price", f"{label}: accelerator row without price/count; skipped")
            continue
        spot = _price(row.get("SpotPrice"))
        if _is_placeholder(on_demand, spot, count):
            load._warn("placeholder_price", f"{label}: placeholder price {on_demand}; skipped")
            continue
        spot = _spot_or_none(load, label, on_demand, spot)
        key = (gpu_model, row["Region"].strip(), row["AvailabilityZone"].strip())
        gpu_prices.setdefault(
            key,
            _GcpGpuPrice(
                on_demand / count,
                None if spot is None else spot / count,
                _gpu_memory_mib(row.get("GpuInfo") or "", gpu_model),
            ),
        )
    for label, row in hosts:
        _add_gcp_host_offers(load, label, row, gpu_prices)
    return load


def _add_gcp_host_offers(
    load: CatalogLoad, label: str, row: dict[str, str], gpu_prices: dict[tuple[str, str, str], _GcpGpuPrice]
) -> None:
    instance_type = row["InstanceType"].strip()
    region, zone = row["Region"].strip(), row["AvailabilityZone"].strip()
    vcpus = _price(row.get("vCPUs")) or 0.0
    bundled = gcp_bundled_gpus(instance_type)
    if bundled:
        attachments = [bundled]
    elif instance_type.startswith("n1-"):
        attachments = [
            (gpu, count)
            for gpu, limits in N1_ATTACHABLE.items()
            if (gpu, region, zone) in gpu_prices
            for count, max_vcpus in limits.items()
            if vcpus <= max_vcpus
        ]
        if not attachments:
            load.skipped["host_without_gpu_price"] += 1
            return
    else:
        load.skipped["not_gpu"] += 1
        return
    host_od = _price(row.get("Price"))
    if host_od is None:
        load._warn("no_price", f"{label}: no on-demand price; skipped")
        return
    host_spot = _price(row.get("SpotPrice"))
    if _is_placeholder(host_od, host_spot, 1):
        load._warn("placeholder_price", f"{label}: placeholder price {host_od}; skipped")
        return
    host_spot = _spot_or_none(load, label, host_od, host_spot)
    for gpu_model, count in attachments:
        gpu = gpu_prices.get((gpu_model, region, zone))
        if gpu is None:
            load._warn("no_gpu_price", f"{label}: no {gpu_model} price in {zone}; skipped")
            continue
        spot = None
        if host_spot is not None and gpu.per_gpu_spot is not None:
            spot = round(host_spot + gpu.per_gpu_spot * count, 5)
        load.offers.append(
            Offer(
                provider="gcp",
                region=region,
                zone=zone,
                instance_type=instance_type,
                gpu_model=gpu_model,
                gpu_count=count,
                gpu_memory_mib=gpu.memory_mib,
                vcpus=vcpus,
                memory_gib=_price(row.get("MemoryGiB")) or 0.0,
                on_demand_per_hour=round(host_od + gpu.per_gpu_on_demand * count, 5),
                spot_per_hour=spot,
                fabric=fabric_for("gcp", instance_type, count),
            )
        )


def load_catalog_csv(path: str | Path, *, provider: str | None = None) -> CatalogLoad:
    """Load one catalog CSV. `provider` ("aws"/"gcp") defaults to what the header says."""
    path = Path(path)
    provider = provider or detect_provider(path)
    loaders = {"aws": load_aws_rows, "gcp": load_gcp_rows}
    if provider not in loaders:
        raise ValueError(f"no catalog loader for provider {provider!r}")
    load = loaders[provider](_rows(path), source=path.name)
    if load.warnings:
        log.warning("catalog %s: %d rows skipped or adjusted: %s", path.name, len(load.warnings), dict(load.skipped))
    return load


def load_default_catalog() -> CatalogLoad:
    """The catalog shipped with WhaleZen (providers/catalog/data/*.csv)."""
    load = CatalogLoad()
    for name, provider in (("aws.csv", "aws"), ("gcp.csv", "gcp")):
        load.merge(load_catalog_csv(DATA_DIR / name, provider=provider))
    return load
