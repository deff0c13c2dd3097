"""What a Kubernetes cluster's GPU nodes offer, read from the objects the API returns (plain JSON dicts).

Pure functions, no client and no I/O, so every rule here is tested on literal objects. The labels are
those NVIDIA's GPU Feature Discovery and device plugin set:
- `nvidia.com/gpu.product`: the NVML name with spaces turned into hyphens (`NVIDIA-H100-80GB-HBM3`,
  `Tesla-T4`); the broker matches it to its catalogue by name or alias, hyphens and spaces alike;
- `nvidia.com/gpu.memory`: MiB per GPU; `nvidia.com/gpu.count`; `nvidia.com/mig.strategy`;
- the node's `status.allocatable["nvidia.com/gpu"]`: how many GPUs the device plugin hands out.
Free GPUs on a node are the allocatable ones less the GPU requests of every pod on it that has not
finished, the broker's own or not (kube-scheduler counts the same way).
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

GPU_RESOURCE = "nvidia.com/gpu"
PRODUCT_LABEL = "nvidia.com/gpu.product"
MEMORY_LABEL = "nvidia.com/gpu.memory"
MIG_STRATEGY_LABEL = "nvidia.com/mig.strategy"
HOSTNAME_LABEL = "kubernetes.io/hostname"
# The labels every Pod the bridge creates carries: which broker, which bridge, which job.
BROKER_LABEL = "whalezen.io/broker"
JOB_LABEL = "whalezen.io/job"
ASSIGNMENT_LABEL = "whalezen.io/assignment"
FINISHED_PHASES = frozenset({"Succeeded", "Failed"})


@dataclass(frozen=True)
class GpuNode:
    """One node with GPUs, as the broker is told about it."""

    name: str
    hostname: str
    gpu_count: int  # allocatable nvidia.com/gpu
    product: str  # the GFD product label, "" when the node has none
    memory_mib: int | None  # per GPU, from the GFD memory label
    cpu_milli: int
    memory_mb: int
    ready: bool
    schedulable: bool  # not cordoned (spec.unschedulable)
    mig_strategy: str = ""
    taints: tuple[Mapping[str, str], ...] = ()
    labels: Mapping[str, str] = field(default_factory=dict)


def quantity_milli(value: Any) -> int:
    """A Kubernetes quantity as thousandths (`"8"` -> 8000, `"7500m"` -> 7500); 0 when unreadable."""
    text = str(value or "").strip()
    try:
        if text.endswith("m"):
            return int(float(text[:-1]))
        return int(float(text) * 1000)
    except ValueError:
        return 0


_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50}
_DECIMAL = {"k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15}


def quantity_bytes(value: Any) -> int:
    """A memory quantity (`"512Gi"`, `"64G"`, `"1048576"`) in bytes; 0 when unreadable."""
    text = str(value or "").strip()
    for units in (_BINARY, _DECIMAL):
        for suffix, factor in units.items():
            if text.endswith(suffix):
                try:
                    return int(float(text[: -len(suffix)]) * factor)
                except ValueError:
                    return 0
    try:
        return int(float(text))
    except ValueError:
        return 0


def _whole(value: Any) -> int:
    return quantity_milli(value) // 1000


def gpu_node(node: Mapping[str, Any]) -> GpuNode | None:
    """The node as a GPU node, or None when the device plugin offers no GPU on it."""
    metadata, spec, status = node.get("metadata") or {}, node.get("spec") or {}, node.get("status") or {}
    allocatable = status.get("allocatable") or {}
    count = _whole(allocatable.get(GPU_RESOURCE))
    if count <= 0:
        return None
    labels = {str(k): str(v) for k, v in (metadata.get("labels") or {}).items()}
    conditions = {c.get("type"): c.get("status") for c in status.get("conditions") or [] if isinstance(c, dict)}
    try:
        memory_mib = int(labels[MEMORY_LABEL]) if labels.get(MEMORY_LABEL) else None
    except ValueError:
        memory_mib = None
    name = str(metadata.get("name") or "")
    return GpuNode(
        name=name,
        hostname=labels.get(HOSTNAME_LABEL, name),
        gpu_count=count,
        product=labels.get(PRODUCT_LABEL, ""),
        memory_mib=memory_mib,
        cpu_milli=quantity_milli(allocatable.get("cpu")),
        memory_mb=quantity_bytes(allocatable.get("memory")) // 2**20,
        ready=conditions.get("Ready") == "True",
        schedulable=not spec.get("unschedulable"),
        mig_strategy=labels.get(MIG_STRATEGY_LABEL, ""),
        taints=tuple({k: str(v) for k, v in t.items() if k in ("key", "value", "effect")}
                     for t in spec.get("taints") or [] if isinstance(t, dict)),
        labels=labels,
    )


def pod_gpu_request(pod: Mapping[str, Any]) -> int:
    """GPUs a pod holds: the sum over its containers (init containers run one at a time: their largest),
    limits where requests are absent (the device plugin's resources must have them equal)."""
    spec = pod.get("spec") or {}

    def of(container: Mapping[str, Any]) -> int:
        resources = container.get("resources") or {}
        amount = (resources.get("requests") or {}).get(GPU_RESOURCE, (resources.get("limits") or {}).get(GPU_RESOURCE))
        return _whole(amount)

    running = sum(of(c) for c in spec.get("containers") or [] if isinstance(c, dict))
    init = max((of(c) for c in spec.get("initContainers") or [] if isinstance(c, dict)), default=0)
    return max(running, init)


def pod_unfinished(pod: Mapping[str, Any]) -> bool:
    return (pod.get("status") or {}).get("phase") not in FINISHED_PHASES


def pod_node(pod: Mapping[str, Any]) -> str:
    return str((pod.get("spec") or {}).get("nodeName") or "")


def is_ours(pod: Mapping[str, Any], broker_id: str) -> bool:
    return ((pod.get("metadata") or {}).get("labels") or {}).get(BROKER_LABEL) == broker_id


def foreign_gpus_by_node(pods: Iterable[Mapping[str, Any]], broker_id: str) -> dict[str, int]:
    """GPUs held on each node by unfinished pods this broker did not create."""
    held: dict[str, int] = {}
    for pod in pods:
        node = pod_node(pod)
        if node and pod_unfinished(pod) and not is_ours(pod, broker_id):
            held[node] = held.get(node, 0) + pod_gpu_request(pod)
    return held


def untolerated_taints(node: GpuNode, tolerations: Iterable[Mapping[str, Any]]) -> list[str]:
    """The node's NoSchedule/NoExecute taints that neither the Pods' `nvidia.com/gpu` toleration nor the pool's
    tolerations tolerate, as `key=value:Effect`: kube-scheduler would never bind our Pods there, so the bridge
    leaves such a node out (placing jobs there would only bounce them back as unschedulable)."""
    allowed = [{"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}, *tolerations]
    blocking = []
    for taint in node.taints:
        if taint.get("effect") not in ("NoSchedule", "NoExecute"):
            continue  # PreferNoSchedule only steers kube-scheduler
        if not any(_tolerates(t, taint) for t in allowed):
            blocking.append(f"{taint.get('key')}={taint.get('value', '')}:{taint.get('effect')}")
    return blocking


def _tolerates(toleration: Mapping[str, Any], taint: Mapping[str, str]) -> bool:
    if toleration.get("effect") and toleration["effect"] != taint.get("effect"):
        return False
    if toleration.get("operator", "Equal") == "Exists":
        return not toleration.get("key") or toleration["key"] == taint.get("key")
    return toleration.get("key") == taint.get("key") and str(toleration.get("value", "")) == taint.get("value", "")


def selector_matches(labels: Mapping[str, str], selector: Mapping[str, str]) -> bool:
    """Whether a node's labels satisfy the pool's `key=value` node selector."""
    return all(labels.get(key) == value for key, value in selector.items())
