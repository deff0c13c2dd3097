"""GPU models the fake NVML can simulate, and the `--fake-gpus` spec parser.

Spec grammar (case-insensitive model names):

    SPEC   := GROUP ("+" GROUP)* ("," OPTION)*
    GROUP  := COUNT "x" MODEL                      e.g. 8xA100-80GB-SXM, 4xT4, 4xH100-80GB-SXM+2xL4
    OPTION := nvlink=AxB | nvlink=none             A islands of B GPUs (SXM models only)
            | numa=N | cpus=N | memory_gb=N        host shape (defaults from the model table)
            | mig=on                               MIG enabled on MIG-capable GPUs
            | seed=N                               changes UUIDs and the telemetry pattern
            | xid=GPU:CODE | ecc=GPU:COUNT | lost=GPU   faults present from the start (repeatable)

By default the SXM GPUs of a group form NVLink islands of up to 8 (one HGX board each): through
NVSwitches for A100/H100/H200, direct GPU-to-GPU links for V100 (hybrid cube mesh). PCIe parts
have no NVLink.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class GpuModelSpec:
    key: str
    nvml_name: str  # what nvmlDeviceGetName returns on the real part
    memory_mb: int  # nvmlDeviceGetMemoryInfo().total in MiB, close to the real part
    tdp_w: int
    nvlink_links: int
    fabric: str  # "nvswitch" | "direct" | "none"
    nvswitches: int  # per island, for fabric == "nvswitch"
    mig_capable: bool
    row_remapping: bool  # Ampere and newer; older parts retire pages instead
    host_cpus_per_gpu: int  # default host shape when simulating a whole node
    host_memory_gb_per_gpu: int


GPU_MODELS: dict[str, GpuModelSpec] = {
    m.key: m
    for m in (
        GpuModelSpec("A100-80GB-SXM", "NVIDIA A100-SXM4-80GB", 81920, 400, 12, "nvswitch", 6, True, True, 32, 256),
        GpuModelSpec("A100-40GB-SXM", "NVIDIA A100-SXM4-40GB", 40960, 400, 12, "nvswitch", 6, True, True, 12, 144),
        GpuModelSpec("A100-80GB-PCIE", "NVIDIA A100 80GB PCIe", 81920, 300, 0, "none", 0, True, True, 16, 128),
        GpuModelSpec("A100-40GB-PCIE", "NVIDIA A100-PCIE-40GB", 40960, 250, 0, "none", 0, True, True, 16, 128),
        GpuModelSpec("H100-80GB-SXM", "NVIDIA H100 80GB HBM3", 81559, 700, 18, "nvswitch", 4, True, True, 24, 256),
        GpuModelSpec("H100-80GB-PCIE", "NVIDIA H100 PCIe", 81559, 350, 0, "none", 0, True, True, 16, 128),
        GpuModelSpec("H200-141GB-SXM", "NVIDIA H200", 143771, 700, 18, "nvswitch", 4, True, True, 24, 256),
        GpuModelSpec("V100-16GB-SXM2", "Tesla V100-SXM2-16GB", 16384, 300, 6, "direct", 0, False, False, 8, 61),
        GpuModelSpec("V100-32GB-SXM2", "Tesla V100-SXM2-32GB", 32768, 300, 6, "direct", 0, False, False, 12, 96),
        GpuModelSpec("L40S-48GB", "NVIDIA L40S", 46068, 350, 0, "none", 0, False, True, 12, 96),
        GpuModelSpec("L4-24GB", "NVIDIA L4", 23034, 72, 0, "none", 0, False, True, 12, 48),
        GpuModelSpec("A10G-24GB", "NVIDIA A10G", 23028, 300, 0, "none", 0, False, True, 12, 48),
        GpuModelSpec("T4-16GB", "Tesla T4", 15360, 70, 0, "none", 0, False, False, 12, 48),
    )
}
ALIASES: dict[str, str] = {
    "A100": "A100-80GB-SXM",
    "A100-80GB": "A100-80GB-SXM",
    "A100-40GB": "A100-40GB-SXM",
    "H100": "H100-80GB-SXM",
    "H100-80GB": "H100-80GB-SXM",
    "H200": "H200-141GB-SXM",
    "V100": "V100-16GB-SXM2",
    "L40S": "L40S-48GB",
    "L4": "L4-24GB",
    "A10G": "A10G-24GB",
    "T4": "T4-16GB",
}
BOARD_SIZE = 8  # GPUs per HGX/DGX baseboard: the largest default NVLink island


class FakeSpecError(ValueError):
    pass


@dataclass(frozen=True)
class FakeNodeSpec:
    models: tuple[GpuModelSpec, ...]  # one entry per GPU, index order
    islands: tuple[int | None, ...]  # NVLink island per GPU (None: no NVLink)
    numa_nodes: int
    cpus: int
    memory_gb: int
    mig: bool
    seed: int
    xids: tuple[tuple[int, int], ...] = ()
    ecc: tuple[tuple[int, int], ...] = ()
    lost: tuple[int, ...] = ()
    text: str = field(default="", compare=False)


def resolve_model(name: str) -> GpuModelSpec:
    key = name.strip().upper()
    key = ALIASES.get(key, key)
    if key not in GPU_MODELS:
        known = ", ".join(sorted(GPU_MODELS))
        raise FakeSpecError(f"unknown GPU model {name!r}; known models: {known} (aliases: {', '.join(ALIASES)})")
    return GPU_MODELS[key]


def parse_spec(text: str) -> FakeNodeSpec:
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts:
        raise FakeSpecError("empty --fake-gpus spec; example: 8xA100-80GB-SXM")
    groups: list[tuple[int, GpuModelSpec]] = []
    for group in parts[0].split("+"):
        count_text, sep, model_name = group.strip().partition("x")
        if not sep or not count_text.strip().isdigit() or int(count_text) < 1:
            raise FakeSpecError(f"bad GPU group {group!r}; expected COUNTxMODEL such as 4xT4")
        groups.append((int(count_text), resolve_model(model_name)))
    options: dict[str, list[str]] = {}
    for option in parts[1:]:
        key, sep, value = option.partition("=")
        if not sep:
            raise FakeSpecError(f"bad option {option!r}; expected KEY=VALUE")
        options.setdefault(key.strip().lower(), []).append(value.strip())
    unknown = set(options) - {"nvlink", "numa", "cpus", "memory_gb", "mig", "seed", "xid", "ecc", "lost"}
    if unknown:
        raise FakeSpecError(f"unknown option(s) {', '.join(sorted(unknown))}")

    models = tuple(model for count, model in groups for _ in range(count))
    total = len(models)
    islands = _islands(groups, _single(options, "nvlink"))
    numa = _int(_single(options, "numa"), "numa", default=2 if total >= 4 else 1)
    if not 1 <= numa <= total:
        raise FakeSpecError(f"numa={numa} must be between 1 and the GPU count {total}")
    cpus = _int(_single(options, "cpus"), "cpus", default=sum(m.host_cpus_per_gpu for m in models))
    memory_gb = _int(_single(options, "memory_gb"), "memory_gb", default=sum(m.host_memory_gb_per_gpu for m in models))
    mig_text = (_single(options, "mig") or "off").lower()
    if mig_text not in ("on", "off", "1", "0", "true", "false"):
        raise FakeSpecError(f"mig={mig_text!r}: use on or off")
    return FakeNodeSpec(
        models=models,
        islands=islands,
        numa_nodes=numa,
        cpus=cpus,
        memory_gb=memory_gb,
        mig=mig_text in ("on", "1", "true"),
        seed=_int(_single(options, "seed"), "seed", default=0),
        xids=tuple(_gpu_pair(v, "xid", total) for v in options.get("xid", [])),
        ecc=tuple(_gpu_pair(v, "ecc", total) for v in options.get("ecc", [])),
        lost=tuple(_gpu_index(v, "lost", total) for v in options.get("lost", [])),
        text=text,
    )


def _islands(groups: list[tuple[int, GpuModelSpec]], nvlink: str | None) -> tuple[int | None, ...]:
    if nvlink is not None and nvlink.lower() == "none":
        return tuple(None for count, _ in groups for _ in range(count))
    nvlink_capable = sum(count for count, model in groups if model.fabric != "none")
    explicit: list[int] | None = None
    if nvlink is not None:
        a, sep, b = nvlink.lower().partition("x")
        if not sep or not a.isdigit() or not b.isdigit() or int(a) * int(b) != nvlink_capable or int(b) < 1:
            raise FakeSpecError(
                f"nvlink={nvlink!r}: expected AxB islands covering the {nvlink_capable} NVLink-capable GPUs, or none"
            )
        explicit = [int(b)] * int(a)
    result: list[int | None] = []
    next_island = 0
    for count, model in groups:
        if model.fabric == "none":
            result.extend([None] * count)
            continue
        remaining = count
        while remaining > 0:
            if explicit is not None:
                size = explicit.pop(0)
                if size > remaining:
                    raise FakeSpecError(f"nvlink={nvlink}: an island cannot span two GPU models")
            else:
                size = min(remaining, BOARD_SIZE)
            # One GPU alone is not an island: it has nobody to talk to over NVLink.
            result.extend([next_island if size > 1 else None] * size)
            next_island += 1 if size > 1 else 0
            remaining -= size
    return tuple(result)


def _single(options: dict[str, list[str]], key: str) -> str | None:
    values = options.get(key)
    if not values:
        return None
    if len(values) > 1:
        raise FakeSpecError(f"option {key} given more than once")
    return values[0]


def _int(value: str | None, key: str, *, default: int) -> int:
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise FakeSpecError(f"{key}={value!r} is not a whole number") from None


def _gpu_index(value: str, key: str, total: int) -> int:
    index = _int(value, key, default=0)
    if not 0 <= index < total:
        raise FakeSpecError(f"{key}={value}: GPU index out of range 0..{total - 1}")
    return index


def _gpu_pair(value: str, key: str, total: int) -> tuple[int, int]:
    gpu, sep, number = value.partition(":")
    if not sep:
        raise FakeSpecError(f"{key}={value!r}: expected GPU:NUMBER, e.g. {key}=3:48")
    return _gpu_index(gpu, key, total), _int(number, key, default=0)
