"""The GPU models the broker knows out of the box, with compute-unit ratings.

CU = dense BF16/FP16 tensor TFLOPS relative to an A100 (312 TFLOPS). Admins can edit ratings in the
admin; the scheduler may refine them per job family from measured progress.
"""
from __future__ import annotations

from decimal import Decimal

A100_TFLOPS = Decimal("312")

# name, memory GB, dense FP16/BF16 tensor TFLOPS, NVLink, aliases (driver names and common spellings)
DEFAULT_GPU_MODELS: list[tuple[str, int, str, bool, list[str]]] = [
    ("H200-141GB", 141, "989", True, ["H200", "NVIDIA H200", "H200-SXM", "H200-141GB-SXM"]),
    ("H100-80GB", 80, "989", True, ["H100", "H100-SXM", "H100-80GB-SXM", "NVIDIA H100 80GB HBM3"]),
    ("A100-80GB", 80, "312", True, ["A100-80GB-SXM", "A100-SXM4-80GB", "NVIDIA A100-SXM4-80GB"]),
    ("A100-40GB", 40, "312", True, ["A100", "A100-40GB-SXM", "A100-SXM4-40GB", "NVIDIA A100-SXM4-40GB"]),
    ("L40S", 48, "362", False, ["NVIDIA L40S"]),
    ("A10G", 24, "70", False, ["NVIDIA A10G"]),
    ("A10", 24, "125", False, ["NVIDIA A10"]),
    ("L4", 24, "121", False, ["NVIDIA L4"]),
    ("V100-32GB", 32, "125", True, ["V100M32", "Tesla V100-SXM2-32GB", "V100-32GB-SXM"]),
    ("V100-16GB", 16, "125", True, ["V100", "V100M16", "Tesla V100-SXM2-16GB", "V100-16GB-SXM"]),
    ("T4", 16, "65", False, ["Tesla T4", "NVIDIA T4"]),
    ("P100", 16, "18.7", False, ["Tesla P100-PCIE-16GB"]),
]


def compute_units_for(tflops: str) -> Decimal:
    return (Decimal(tflops) / A100_TFLOPS).quantize(Decimal("0.001"))
