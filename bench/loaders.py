"""Readers for the shared data sets (I/O lives here, never in `scheduling/`)."""

from __future__ import annotations

import csv
from pathlib import Path

from scheduling.sim.cluster import NodeSpec, TaskSpec


def read_nodes(path: str | Path) -> list[NodeSpec]:
    """Alibaba `openb_node_list_*.csv`: sn,cpu_milli,memory_mib,gpu,model."""
    with open(path, newline="") as f:
        return [NodeSpec(r["sn"], int(r["cpu_milli"]), int(r["memory_mib"]), int(r["gpu"]), r["model"])
                for r in csv.DictReader(f)]


def read_tasks(path: str | Path) -> list[TaskSpec]:
    """Alibaba `openb_pod_list_*.csv`; `gpu_spec` like `V100M16|V100M32` lists allowed models."""
    out: list[TaskSpec] = []
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            num = int(r["num_gpu"])
            milli = int(r["gpu_milli"]) if num > 0 else 0
            spec = (r.get("gpu_spec") or "").strip()
            models = frozenset(s for s in spec.split("|") if s) if spec else None
            out.append(TaskSpec(r["name"], int(r["cpu_milli"]), int(r["memory_mib"]), num, milli, models))
    return out


# ------------------------------------------------------------------------------- cloud catalog

def _price(text: str | None) -> float | None:
    try:
        v = float(text) if text not in (None, "") else None
    except ValueError:
        return None
    return v if v is not None and v > 0 else None


def read_offers(folder: str | Path) -> list["SimOffer"]:
    """Cloud offers from the catalog excerpts (schema v8).

    AWS rows are all-inclusive per instance type and zone.  A GCP launch costs the host row plus
    the accelerator rows of the same zone: a2/a3 hosts bundle their GPUs (a2-highgpu-Ng: N x A100,
    a2-ultragpu-Ng: N x A100-80GB, a3-highgpu-Ng: N x H100); a GPU row prices `count` GPUs, so one
    GPU costs price / count.  Quirks handled: rows without a price or GPU are skipped; a spot price
    at or above on-demand is no spot price; an H100 row whose spot equals on-demand is a
    placeholder for an unavailable region and is kept on demand only.
    """
    from scheduling.sim.events import SimOffer

    folder = Path(folder)
    offers: list[SimOffer] = []
    with open(folder / "aws_vms_v8_gpu_excerpt.csv", newline="") as f:
        for r in csv.DictReader(f):
            price = _price(r.get("Price"))
            if not r.get("AcceleratorName") or price is None or r["AcceleratorName"] == "T4g":
                continue  # no GPU, no price, or an ARM host our images do not run on
            spot = _price(r.get("SpotPrice"))
            spot = spot if spot is not None and spot < price else None
            offers.append(SimOffer(f"aws:{r['AvailabilityZone']}:{r['InstanceType']}", "aws", r["Region"],
                                   r["AvailabilityZone"], r["InstanceType"], r["AcceleratorName"],
                                   int(float(r["AcceleratorCount"])), price, spot,
                                   int(float(r["vCPUs"] or 0)), float(r["MemoryGiB"] or 0)))
    gpu_rows: dict[tuple[str, str], tuple[float, float | None]] = {}
    hosts: list[dict[str, str]] = []
    with open(folder / "gcp_vms_v8_gpu_excerpt.csv", newline="") as f:
        for r in csv.DictReader(f):
            if r.get("InstanceType"):
                hosts.append(r)
                continue
            price, count = _price(r.get("Price")), int(float(r.get("AcceleratorCount") or 0))
            if price is None or count <= 0 or r["AcceleratorName"].startswith("tpu"):
                continue
            spot = _price(r.get("SpotPrice"))
            key = (r["AcceleratorName"], r["AvailabilityZone"])
            if key not in gpu_rows:  # first row per model and zone: its per-GPU price
                gpu_rows[key] = (price / count, spot / count if spot else None)
    bundled = {"a2-highgpu": "A100", "a2-ultragpu": "A100-80GB", "a3-highgpu": "H100", "a3-edgegpu": "H100"}
    for h in hosts:
        family = "-".join(h["InstanceType"].split("-")[:2])
        model = bundled.get(family)
        host_price = _price(h.get("Price"))
        if model is None or host_price is None:
            continue
        n = int(h["InstanceType"].rsplit("-", 1)[1].rstrip("g"))
        gpu = gpu_rows.get((model, h["AvailabilityZone"]))
        if gpu is None:
            continue  # no accelerator price in this zone: not launchable here
        price = host_price + n * gpu[0]
        host_spot = _price(h.get("SpotPrice"))
        spot = host_spot + n * gpu[1] if host_spot and gpu[1] else None
        spot = spot if spot is not None and spot < price else None
        offers.append(SimOffer(f"gcp:{h['AvailabilityZone']}:{h['InstanceType']}", "gcp", h["Region"],
                               h["AvailabilityZone"], h["InstanceType"], model, n, round(price, 5), spot,
                               int(float(h["vCPUs"] or 0)), float(h["MemoryGiB"] or 0)))
    return sorted(offers, key=lambda o: o.id)


# ----------------------------------------------------------------------------------- philly

def read_philly(path: str | Path, start_day: float, days: float, every: int = 1,
                max_gpus: int = 8) -> tuple[list["SimJob"], int]:
    """Jobs of `philly.csv` submitted in [start_day, start_day + days) after the trace's first
    job, keeping one job in `every` (in submission order).  Jobs asking for more than `max_gpus`
    GPUs are left out (they need multi-node gangs our fleets do not model); returns how many."""
    from datetime import datetime

    from scheduling.sim.events import SimJob

    rows = []
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            rows.append((datetime.fromisoformat(r["timestamp"]).timestamp(), float(r["duration"]),
                         int(r["num_gpus"])))
    rows.sort()
    t0 = rows[0][0] + start_day * 86400
    window = [r for r in rows if t0 <= r[0] < t0 + days * 86400][::every]
    jobs = [SimJob(f"philly-{i:06d}", ts - t0, gpus, max(dur, 1.0))
            for i, (ts, dur, gpus) in enumerate(window) if 0 < gpus <= max_gpus]
    return jobs, sum(1 for r in window if r[2] > max_gpus)
