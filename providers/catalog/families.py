"""Facts about GPU instance families that a price CSV does not carry: which GPUs a GCP machine
type comes with, which GPUs an N1 host can take, the fast fabric of a type, and GPU memory when
a row lacks GpuInfo. Sources: AWS and GCP public instance documentation."""
from __future__ import annotations

import re

# GPU memory per GPU (MiB) when a catalog row has no GpuInfo. AWS reports L4 and L40S a bit below
# the nominal size (22888, 45776); we only fall back to nominal sizes here.
GPU_MEMORY_MIB: dict[str, int] = {
    "T4": 16384, "T4g": 16384, "V100": 16384, "V100-32GB": 32768, "P100": 16384, "P4": 8192,
    "A10G": 24576, "L4": 24576, "L40S": 46068, "A100": 40960, "A100-80GB": 81920,
    "H100": 81920, "H100-MEGA": 81920, "H200": 144384, "B200": 184320,
}

# GCP accelerator type names (the `acceleratorType` URL suffix) for catalog GPU names.
GCP_ACCELERATOR_TYPES: dict[str, str] = {
    "T4": "nvidia-tesla-t4", "V100": "nvidia-tesla-v100", "P100": "nvidia-tesla-p100",
    "P4": "nvidia-tesla-p4", "L4": "nvidia-l4", "A100": "nvidia-tesla-a100",
    "A100-80GB": "nvidia-a100-80gb", "H100": "nvidia-h100-80gb", "H100-MEGA": "nvidia-h100-mega-80gb",
    "H200": "nvidia-h200-141gb", "B200": "nvidia-b200",
}

# GPUs that can be attached to N1 hosts: allowed counts -> max host vCPUs for that count
# (GCP "GPU machine types", N1 general-purpose with attached GPUs).
N1_ATTACHABLE: dict[str, dict[int, int]] = {
    "T4": {1: 48, 2: 48, 4: 96},
    "V100": {1: 12, 2: 24, 4: 48, 8: 96},
    "P100": {1: 16, 2: 32, 4: 96},
    "P4": {1: 24, 2: 48, 4: 96},
}

_G2_GPUS = {"4": 1, "8": 1, "12": 1, "16": 1, "32": 1, "24": 2, "48": 4, "96": 8}


def gcp_bundled_gpus(instance_type: str) -> tuple[str, int] | None:
    """(GPU name, count) for accelerator-optimized GCP types whose GPUs come with the machine
    (A2, A3, G2); None for other types (N1 takes attached GPUs, others have none)."""
    m = re.fullmatch(r"a2-highgpu-(\d+)g|a2-megagpu-(16)g", instance_type)
    if m:
        return "A100", int(m.group(1) or m.group(2))
    m = re.fullmatch(r"a2-ultragpu-(\d+)g", instance_type)
    if m:
        return "A100-80GB", int(m.group(1))
    m = re.fullmatch(r"a3-(?:highgpu|edgegpu)-(\d+)g", instance_type)
    if m:
        return "H100", int(m.group(1))
    if instance_type == "a3-megagpu-8g":
        return "H100-MEGA", 8
    if instance_type == "a3-ultragpu-8g":
        return "H200", 8
    m = re.fullmatch(r"g2-standard-(\d+)", instance_type)
    if m and m.group(1) in _G2_GPUS:
        return "L4", _G2_GPUS[m.group(1)]
    return None


def fabric_for(provider: str, instance_type: str, gpu_count: int) -> tuple[str, ...]:
    """The fast interconnects of a type: NVLink between its GPUs, and a network fabric for
    multi-node jobs (AWS EFA, GCP GPUDirect-TCPX/TCPXO). () = PCIe only or not known."""
    fabrics: list[str] = []
    if provider == "aws":
        family = instance_type.split(".")[0]
        if family in ("p5", "p5e", "p5en", "p4d", "p4de", "p3dn"):
            fabrics += ["efa", "nvlink"]
        elif family == "p3" and gpu_count >= 4:
            fabrics.append("nvlink")
    elif provider == "gcp":
        if instance_type in ("a3-highgpu-8g", "a3-edgegpu-8g"):
            fabrics += ["gpudirect-tcpx", "nvlink"]
        elif instance_type == "a3-megagpu-8g":
            fabrics += ["gpudirect-tcpxo", "nvlink"]
        elif instance_type == "a3-ultragpu-8g":
            fabrics += ["gpudirect-rdma", "nvlink"]
        elif instance_type.startswith(("a2-", "a3-")) and gpu_count >= 2:
            fabrics.append("nvlink")
    return tuple(sorted(fabrics))
