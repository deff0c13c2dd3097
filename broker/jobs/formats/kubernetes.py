"""Kubernetes manifests (a `v1` Pod, a `batch/v1` Job, a Pod template) as native WhaleZen specs.

One pod with one container is one job: its image, argv, environment, GPU/CPU/memory limits and the
node labels it selects (GPU Feature Discovery's and the operator's own). Whatever would change how
the job runs and cannot be honoured (volumes, init containers, a security context, ...) is refused
by field; what does not change a batch run is accepted with a warning. Nothing is dropped silently.
Each decision is documented in docs/job-spec.md, "Kubernetes manifests".

Pure: no database. The native spec made here is validated next by broker/jobs/spec.py, which keeps
the parsing of `resources.limits` and of labels in one place; this module calls the same parsers
only to put an error at the path the user wrote.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from rest_framework import serializers

from broker.api.excerpts import quoted
from broker.inventory.gpu_catalog import DEFAULT_GPU_MODELS
from broker.inventory.labels import MAX_LABELS, label_key_problem, label_value_problem
from broker.jobs.formats.common import FieldProblem, FormatError, Translation
from broker.jobs.spec import ENV_KEY_RE, K8S_GPU_KEY, NAME_RE, PRIORITY_NAMES, KubernetesLimitsField

KINDS = {("v1", "Pod"), ("batch/v1", "Job"), ("v1", "PodTemplate")}
MAX_ERRORS = 50  # more would only be cut by the API's error body anyway
MAX_VALUES = 32  # values of one matchExpression; native gpu_models takes at most 32
MAX_TERMS = 16

PRODUCT_KEY = "nvidia.com/gpu.product"
MEMORY_KEY = "nvidia.com/gpu.memory"
COUNT_KEY = "nvidia.com/gpu.count"
REGION_KEY = "topology.kubernetes.io/region"
OS_KEY = "kubernetes.io/os"

# GPU Feature Discovery's `nvidia.com/gpu.product` values (the driver's product name with spaces
# turned into '-') -> our catalogue names (broker/inventory/gpu_catalog.py). Our own names and aliases
# are accepted too (built below), so a label an operator copied from our catalogue also works.
GFD_PRODUCTS: dict[str, str] = {
    "NVIDIA-H200": "H200-141GB",
    "NVIDIA-H200-141GB-HBM3e": "H200-141GB",
    "NVIDIA-H100-80GB-HBM3": "H100-80GB",
    "NVIDIA-H100-PCIe": "H100-80GB",
    "NVIDIA-A100-SXM4-80GB": "A100-80GB",
    "NVIDIA-A100-80GB-PCIe": "A100-80GB",
    "NVIDIA-A100-SXM4-40GB": "A100-40GB",
    "NVIDIA-A100-PCIE-40GB": "A100-40GB",
    "NVIDIA-L40S": "L40S",
    "NVIDIA-A10G": "A10G",
    "NVIDIA-A10": "A10",
    "NVIDIA-L4": "L4",
    "Tesla-V100-SXM2-32GB": "V100-32GB",
    "Tesla-V100-PCIE-32GB": "V100-32GB",
    "Tesla-V100-SXM2-16GB": "V100-16GB",
    "Tesla-V100-PCIE-16GB": "V100-16GB",
    "Tesla-T4": "T4",
    "Tesla-P100-PCIE-16GB": "P100",
    "Tesla-P100-SXM2-16GB": "P100",
}
_PRODUCTS: dict[str, str] = {k.lower(): v for k, v in GFD_PRODUCTS.items()}
for _name, _memory, _tflops, _nvlink, _aliases in DEFAULT_GPU_MODELS:
    for _spelling in [_name, *_aliases]:
        _PRODUCTS.setdefault(_spelling.replace(" ", "-").lower(), _name)
_MODEL_NAMES = ", ".join(name for name, *_ in DEFAULT_GPU_MODELS)
_SHARED_SUFFIX = "-shared"  # GFD's rename of a time-sliced GPU: still that model

# Fields accepted with a warning: they do not change what a batch run computes.
_POD_WARN = {
    "terminationGracePeriodSeconds": "Ignored: the node agent gives every job the same grace period.",
    "activeDeadlineSeconds": "Not enforced: WhaleZen has no run-time limit for a job.",
    "tolerations": "Ignored: WhaleZen nodes have no taints; every node the team may use is a candidate.",
    "schedulerName": "Ignored: the WhaleZen engine places the job.",
    "serviceAccountName": "Ignored: jobs get no Kubernetes API credentials.",
    "serviceAccount": "Ignored: jobs get no Kubernetes API credentials.",
    "automountServiceAccountToken": "Ignored: jobs get no Kubernetes API credentials.",
    "dnsPolicy": "Ignored: the job uses the node's DNS.",
    "enableServiceLinks": "Ignored: there are no Kubernetes services to link.",
    "hostname": "Ignored: the job sees the node's host name.",
    "subdomain": "Ignored: the job sees the node's host name.",
    "setHostnameAsFQDN": "Ignored: the job sees the node's host name.",
    "preemptionPolicy": "Ignored: preemption follows the job's priority and preemptible flag.",
    "priority": "Ignored: WhaleZen reads priorityClassName low, normal, high or critical.",
    "topologySpreadConstraints": "Ignored: the job is one pod.",
    "readinessGates": "Ignored: a batch job has no readiness.",
    "runtimeClassName": "Ignored: the node agent picks a container runtime with NVIDIA's toolkit.",
    "overhead": "Ignored.",
    "os": "Ignored: WhaleZen nodes run Linux.",
    "hostUsers": "Ignored: the node agent decides the job's user namespace.",
    "shareProcessNamespace": "Ignored: the job has one container.",
}
_CONTAINER_WARN = {
    "imagePullPolicy": "Ignored: the node's runtime pulls the image when it does not have it.",
    "terminationMessagePath": "Ignored: the job's events and logs say how it ended.",
    "terminationMessagePolicy": "Ignored: the job's events and logs say how it ended.",
    "livenessProbe": "Ignored: probes are not run for batch jobs.",
    "readinessProbe": "Ignored: probes are not run for batch jobs.",
    "startupProbe": "Ignored: probes are not run for batch jobs.",
    "stdin": "Ignored: batch jobs have no terminal.",
    "stdinOnce": "Ignored: batch jobs have no terminal.",
    "tty": "Ignored: batch jobs have no terminal.",
    "resizePolicy": "Ignored: a job's resources do not change while it runs.",
}
_JOB_WARN = {
    "backoffLimit": "Ignored: WhaleZen does not retry a failed job.",
    "backoffLimitPerIndex": "Ignored: WhaleZen does not retry a failed job.",
    "maxFailedIndexes": "Ignored: the job is one pod.",
    "podFailurePolicy": "Ignored: WhaleZen does not retry a failed job.",
    "podReplacementPolicy": "Ignored: the job is one pod.",
    "activeDeadlineSeconds": "Not enforced: WhaleZen has no run-time limit for a job.",
    "ttlSecondsAfterFinished": "Ignored: finished jobs stay listed.",
    "completionMode": "Ignored: the job is one pod.",
    "successPolicy": "Ignored: the job succeeds when its one pod does.",
    "selector": "Ignored: the job is one pod.",
    "manualSelector": "Ignored: the job is one pod.",
    "managedBy": "Ignored: WhaleZen manages the job.",
}
_NO_HOST = "is not supported: the node agent decides the job's namespaces."
_NO_VOLUMES = "Volumes are not supported: put the data in the image or fetch it in the command (S3, HTTP)."
_NO_SECURITY = ("A securityContext is not supported: jobs run as the node agent's unprivileged job user, "
                "without extra capabilities.")
# Fields refused by field when they ask for something (an empty value asks for nothing).
_POD_REFUSE = {
    "volumes": _NO_VOLUMES,
    "initContainers": "Init containers are not supported: run those steps in the container's command.",
    "ephemeralContainers": "Ephemeral containers are not supported.",
    "securityContext": _NO_SECURITY,
    "hostNetwork": f"hostNetwork {_NO_HOST}",
    "hostPID": f"hostPID {_NO_HOST}",
    "hostIPC": f"hostIPC {_NO_HOST}",
    "hostAliases": "hostAliases are not supported: the job uses the node's /etc/hosts.",
    "dnsConfig": "dnsConfig is not supported: the job uses the node's DNS.",
    "nodeName": "Pinning a node by name is not supported: select it by a node label in nodeSelector.",
    "imagePullSecrets": "Registry credentials are not supported: use an image the nodes can pull "
                        "without them.",
    "schedulingGates": "Scheduling gates are not supported: submit the job when it may start.",
    "resourceClaims": "Resource claims are not supported: ask for GPUs with resources.limits nvidia.com/gpu.",
}
_CONTAINER_REFUSE = {
    "volumeMounts": _NO_VOLUMES,
    "volumeDevices": _NO_VOLUMES,
    "envFrom": "envFrom is not supported: list each variable in env with its name and value.",
    "lifecycle": "Lifecycle hooks are not supported: run those steps in the command.",
    "workingDir": "workingDir is not supported: change directory in the command, e.g. "
                  "[sh, -c, 'cd /work && exec python train.py'].",
    "securityContext": _NO_SECURITY,
    "restartPolicy": "A container restartPolicy (a sidecar) is not supported: the job has one container.",
}
_POD_HANDLED = {"containers", "restartPolicy", "priorityClassName", "nodeSelector", "affinity"}
_CONTAINER_HANDLED = {"name", "image", "command", "args", "env", "resources", "ports"}
_RESOURCE_KEYS = {K8S_GPU_KEY, "cpu", "memory"}
_VAR_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def looks_like_kubernetes(doc: Any) -> bool:
    """A manifest (apiVersion and kind), or a bare pod template ({metadata, spec: {containers}})."""
    if not isinstance(doc, dict):
        return False
    if "apiVersion" in doc and "kind" in doc:
        return True
    spec = doc.get("spec")
    return set(doc) <= {"metadata", "spec"} and isinstance(spec, dict) and "containers" in spec


def translate_kubernetes(doc: Any) -> Translation:
    """The native spec for `doc`, with warnings; FormatError({field path: message}) if it cannot run."""
    reader = _Reader()
    spec = reader.document(doc)
    if reader.errors:
        raise FormatError(reader.errors)
    return Translation(spec=spec, warnings=reader.warnings, problems=[])


@dataclass
class _Selection:
    """What the node labels asked for, folded together (nodeSelector AND every required term)."""

    products: list[str] | None = None  # catalogue names, in the user's order; None: any model
    min_memory_gb: int = 0
    counts: set[int] | None = None  # node GPU counts allowed; None: any
    labels: dict[str, str] = field(default_factory=dict)
    regions: list[str] | None = None


class _Reader:
    """Walks one manifest, collecting errors by the user's field paths and warnings."""

    def __init__(self) -> None:
        self.errors: dict[str, str] = {}
        self.warnings: list[FieldProblem] = []

    # -- plumbing ---------------------------------------------------------------------------------
    def error(self, path: str, message: str) -> None:
        if len(self.errors) < MAX_ERRORS:
            self.errors.setdefault(path, message)

    def warn(self, path: str, message: str) -> None:
        self.warnings.append(FieldProblem(path, message))

    def obj(self, value: Any, path: str) -> dict[str, Any]:
        """`value` as an object; null reads as absent, as Kubernetes reads it."""
        if value is None:
            return {}
        if isinstance(value, dict):
            return value
        self.error(path, "Must be an object.")
        return {}

    def lst(self, value: Any, path: str) -> list[Any]:
        if value is None:
            return []
        if isinstance(value, list):
            return value
        self.error(path, "Must be a list.")
        return []

    def string(self, value: Any, path: str, what: str = "a string") -> str | None:
        if isinstance(value, str):
            return value
        self.error(path, f"Must be {what}.")
        return None

    def unknown(self, obj: dict[str, Any], path: str, known: set[str]) -> None:
        extra = [key for key in obj if key not in known]
        if extra:
            names = ", ".join(quoted(key) for key in extra[:5])
            self.error(path, f"Not supported here: {names}{' and more' if len(extra) > 5 else ''}.")

    def table(self, obj: dict[str, Any], path: str, warn: dict[str, str], refuse: dict[str, str]) -> None:
        for key, value in obj.items():
            if key in warn and value is not None:
                self.warn(f"{path}.{key}", warn[key])
            elif key in refuse and value not in (None, False, [], {}, ""):
                self.error(f"{path}.{key}", refuse[key])

    # -- the document -----------------------------------------------------------------------------
    def document(self, doc: Any) -> dict[str, Any]:
        if not isinstance(doc, dict):
            self.error("body", "A Kubernetes manifest must be an object.")
            return {}
        if "apiVersion" not in doc and "kind" not in doc and looks_like_kubernetes(doc):
            return self.template(doc, "", "a pod template")
        api, kind = doc.get("apiVersion"), doc.get("kind")
        if not (isinstance(api, str) and isinstance(kind, str) and (api, kind) in KINDS):
            expected = {k: a for a, k in KINDS}
            if isinstance(kind, str) and kind in expected:
                self.error("apiVersion", f"A {kind} is apiVersion {expected[kind]}.")
            else:
                shown = f" (not {quoted(kind)} of {quoted(api)})" if isinstance(kind, str) else ""
                self.error("kind", "Only a v1 Pod, a batch/v1 Job and a v1 PodTemplate can be "
                                   f"submitted{shown}.")
            return {}
        if kind == "PodTemplate":
            self.unknown(doc, "", {"apiVersion", "kind", "metadata", "template"})
            if "template" not in doc:
                self.error("template", "A PodTemplate needs its template.")
            return self.template(self.obj(doc.get("template"), "template"), "template", "a pod template",
                                 outer=self.obj(doc.get("metadata"), "metadata"), outer_path="metadata")
        self.unknown(doc, "", {"apiVersion", "kind", "metadata", "spec", "status"})
        if doc.get("status") is not None:
            self.warn("status", "Ignored: written by Kubernetes, not by users.")
        if "spec" not in doc:
            self.error("spec", f"A {kind} needs its spec.")
        metadata = self.obj(doc.get("metadata"), "metadata")
        if kind == "Pod":
            return self.pod(metadata, "metadata", self.obj(doc.get("spec"), "spec"), "spec")
        return self.job(metadata, self.obj(doc.get("spec"), "spec"))

    def job(self, metadata: dict[str, Any], spec: dict[str, Any]) -> dict[str, Any]:
        self.unknown(spec, "spec", {"template", "completions", "parallelism", "suspend", *_JOB_WARN})
        self.table(spec, "spec", _JOB_WARN, {})
        for key in ("completions", "parallelism"):
            value = spec.get(key)
            if value is not None and (isinstance(value, bool) or value != 1):
                self.error(f"spec.{key}", "Must be 1: a WhaleZen job is one pod (for several nodes working "
                                          "together, submit a native spec with resources.nodes).")
        if spec.get("suspend") not in (None, False):
            self.error("spec.suspend", "A suspended Job is not supported: submit it when it should run.")
        if "template" not in spec:
            self.error("spec.template", "A Job needs its pod template.")
        template = self.obj(spec.get("template"), "spec.template")
        return self.template(template, "spec.template", "a pod template", outer=metadata,
                             outer_path="metadata")

    def template(self, template: dict[str, Any], path: str, what: str, *, outer: dict[str, Any] | None = None,
                 outer_path: str = "") -> dict[str, Any]:
        """A pod template ({metadata, spec}); a name in `outer` (the Job's or PodTemplate's) wins."""
        prefix = f"{path}." if path else ""
        self.unknown(template, path or "body", {"metadata", "spec"})
        if "spec" not in template:
            self.error(f"{prefix}spec", f"{what[0].upper()}{what[1:]} needs its spec.")
        metadata = self.obj(template.get("metadata"), f"{prefix}metadata")
        out = self.pod(metadata, f"{prefix}metadata", self.obj(template.get("spec"), f"{prefix}spec"),
                       f"{prefix}spec")
        if outer is not None:
            name = self.name(outer, outer_path)
            if name is not None:
                out.pop("name", None)
                out = {"format": out.pop("format"), "name": name, **out}
        return out

    def name(self, metadata: dict[str, Any], path: str) -> str | None:
        """metadata.name, else generateName without its trailing '-' (names need not be unique here)."""
        for key, value in metadata.items():
            if key not in ("name", "generateName") and value is not None:
                self.warn(f"{path}.{key}", "Ignored: metadata other than the name is not kept.")
        for key in ("name", "generateName"):
            value = metadata.get(key)
            if value is None:
                continue
            text = self.string(value, f"{path}.{key}")
            if text is None:
                return None
            text = text.rstrip("-") if key == "generateName" else text
            if not NAME_RE.match(text):
                self.error(f"{path}.{key}", "Use 1-200 letters, digits, '.', '_' or '-', starting with a "
                                            "letter or digit.")
                return None
            return text
        return None

    # -- the pod ----------------------------------------------------------------------------------
    def pod(self, metadata: dict[str, Any], metadata_path: str, spec: dict[str, Any],
            path: str) -> dict[str, Any]:
        out: dict[str, Any] = {"format": "kubernetes"}
        name = self.name(metadata, metadata_path)
        if name is not None:
            out["name"] = name
        self.unknown(spec, path, _POD_HANDLED | set(_POD_WARN) | set(_POD_REFUSE))
        self.table(spec, path, _POD_WARN, _POD_REFUSE)
        self.restart_policy(spec.get("restartPolicy"), f"{path}.restartPolicy")
        priority_class = spec.get("priorityClassName")
        if priority_class is not None:
            text = self.string(priority_class, f"{path}.priorityClassName")
            if text is not None and text in PRIORITY_NAMES:
                out["priority"] = text
            elif text is not None:
                self.warn(f"{path}.priorityClassName", "Ignored: WhaleZen priorities are low, normal, high "
                                                       "and critical.")
        containers = self.lst(spec.get("containers"), f"{path}.containers")
        if len(containers) != 1:
            self.error(f"{path}.containers", f"Exactly one container is supported, not {len(containers)}: "
                                             "do a sidecar's work in the one container.")
            return out
        selection = _Selection()
        self.node_selector(spec.get("nodeSelector"), f"{path}.nodeSelector", selection)
        self.affinity(spec.get("affinity"), f"{path}.affinity", selection)
        out.update(self.container(containers[0], f"{path}.containers[0]", selection))
        placement = {}
        if selection.labels:
            placement["node_selector"] = selection.labels
        if selection.regions is not None:
            placement["regions"] = selection.regions
        if placement:
            out["placement"] = placement
        return out

    def restart_policy(self, value: Any, path: str) -> None:
        if value is None or value == "Never":
            return
        if value == "OnFailure":
            self.warn(path, "A failed container is not restarted in place: the job fails.")
        elif value == "Always":
            self.error(path, "Always is not supported: a WhaleZen job runs once to completion; use Never "
                             "or OnFailure.")
        else:
            self.error(path, "Must be Never or OnFailure.")

    # -- the container ----------------------------------------------------------------------------
    def container(self, container: Any, path: str, selection: _Selection) -> dict[str, Any]:
        container = self.obj(container, path)
        out: dict[str, Any] = {}
        self.unknown(container, path, _CONTAINER_HANDLED | set(_CONTAINER_WARN) | set(_CONTAINER_REFUSE))
        self.table(container, path, _CONTAINER_WARN, _CONTAINER_REFUSE)
        if container.get("name") is not None:
            self.string(container["name"], f"{path}.name")
        image = container.get("image")
        if image is None:
            self.error(f"{path}.image", "The container needs an image.")
        elif (text := self.string(image, f"{path}.image")) is not None:
            if text.strip():
                out["image"] = text
            else:
                self.error(f"{path}.image", "Must not be blank.")
        env = self.env(container.get("env"), f"{path}.env")
        if env:
            out["env"] = env
        command = self.argv(container.get("command"), f"{path}.command", env)
        args = self.argv(container.get("args"), f"{path}.args", env)
        if args and not command:
            # Kubernetes runs args after the image's ENTRYPOINT, which only the image knows; native
            # `command` is the whole argv, so guessing would run the wrong program.
            self.error(f"{path}.args", "args without command is not supported: WhaleZen cannot know the "
                                       "image's ENTRYPOINT; give the whole argv in command.")
        elif command:
            out["command"] = command + args
        self.ports(container.get("ports"), f"{path}.ports")
        out["resources"] = self.resources(container.get("resources"), f"{path}.resources", selection)
        return out

    def env(self, value: Any, path: str) -> dict[str, str]:
        out: dict[str, str] = {}
        for index, entry in enumerate(self.lst(value, path)):
            where = f"{path}[{index}]"
            entry = self.obj(entry, where)
            self.unknown(entry, where, {"name", "value", "valueFrom"})
            if entry.get("valueFrom") is not None:
                self.error(f"{where}.valueFrom", "valueFrom (secrets, config maps, fields) is not supported: "
                                                 "give the value itself.")
                continue
            name = self.string(entry.get("name"), f"{where}.name")
            raw = entry.get("value", "")
            text = self.string("" if raw is None else raw, f"{where}.value", "a string (quote numbers, as "
                                                                           "Kubernetes requires)")
            if name is None or text is None:
                continue
            if not ENV_KEY_RE.match(name):
                self.error(f"{where}.name", f"{quoted(name)} is not a valid environment variable name.")
                continue
            if name in out:
                self.warn(f"{where}.name", f"{quoted(name)} is given twice; the last value wins, as in "
                                           "Kubernetes.")
            out[name] = _expand(text, out)  # later variables may use earlier ones, as in Kubernetes
        return out

    def argv(self, value: Any, path: str, env: dict[str, str]) -> list[str]:
        out: list[str] = []
        for index, item in enumerate(self.lst(value, path)):
            text = self.string(item, f"{path}[{index}]", "a string (quote numbers, as Kubernetes requires)")
            if text is not None:
                out.append(_expand(text, env))
        return out

    def ports(self, value: Any, path: str) -> None:
        ports = self.lst(value, path)
        for index, port in enumerate(ports):
            if isinstance(port, dict) and port.get("hostPort") not in (None, 0):
                self.error(f"{path}[{index}].hostPort", "hostPort is not supported: a batch job publishes "
                                                        "no ports on the node.")
                return
        if ports:
            self.warn(path, "Ignored: a batch job publishes no ports.")

    # -- resources --------------------------------------------------------------------------------
    def resources(self, value: Any, path: str, selection: _Selection) -> dict[str, Any]:
        resources = self.obj(value, path)
        self.unknown(resources, path, {"limits", "requests", "claims"})
        if resources.get("claims") not in (None, []):
            self.error(f"{path}.claims", "Resource claims are not supported: ask for GPUs with "
                                         "limits nvidia.com/gpu.")
        limits = self.quantities(resources.get("limits"), f"{path}.limits")
        requests = self.quantities(resources.get("requests"), f"{path}.requests")
        parsed_limits = self.parse(limits, f"{path}.limits")
        parsed_requests = self.parse(requests, f"{path}.requests")
        out: dict[str, Any] = {}
        raw: dict[str, Any] = {}
        if K8S_GPU_KEY in requests and K8S_GPU_KEY not in limits:
            self.error(f"{path}.requests", f"{K8S_GPU_KEY} in requests needs the same number in limits, as "
                                           "Kubernetes requires.")
        elif K8S_GPU_KEY in limits:
            if (K8S_GPU_KEY in requests and "gpus" in parsed_limits and "gpus" in parsed_requests
                    and parsed_requests["gpus"] != parsed_limits["gpus"]):
                self.error(f"{path}.requests", f"{K8S_GPU_KEY} in requests must equal limits, as Kubernetes "
                                               "requires.")
            raw[K8S_GPU_KEY] = limits[K8S_GPU_KEY]
        else:
            self.error(f"{path}.limits", f"Ask for GPUs with {K8S_GPU_KEY}: WhaleZen runs GPU jobs.")
        for key, parsed_key in (("cpu", "cpu_milli"), ("memory", "memory_mb")):
            if key in limits:
                raw[key] = limits[key]
                if parsed_requests.get(parsed_key, 0) > parsed_limits.get(parsed_key, float("inf")):
                    self.error(f"{path}.requests", f"The {key} request must not exceed its limit, as "
                                                   "Kubernetes requires.")
            elif key in requests:
                raw[key] = requests[key]  # a request without a limit is the demand
        if raw:
            out["limits"] = raw
        gpus = parsed_limits.get("gpus")
        if selection.products is not None:
            out["gpu_models"] = selection.products
        if selection.min_memory_gb:
            out["min_gpu_memory_gb"] = selection.min_memory_gb
        if selection.counts is not None and gpus is not None and gpus not in selection.counts:
            shown = ", ".join(str(c) for c in sorted(selection.counts)[:5])
            self.error(f"{path}.limits", f"{K8S_GPU_KEY} is {gpus} but {COUNT_KEY} selects nodes with "
                                         f"{shown}: WhaleZen reads the count as the job's GPUs; make them "
                                         "equal.")
        return out

    def quantities(self, value: Any, path: str) -> dict[str, Any]:
        """The resources WhaleZen reserves; ephemeral storage is only warned about."""
        quantities = self.obj(value, path)
        out: dict[str, Any] = {}
        for key, amount in quantities.items():
            if key in _RESOURCE_KEYS:
                if amount is not None:
                    out[key] = amount
            elif key == "ephemeral-storage":
                self.warn(path, "ephemeral-storage is not reserved: the job uses the node's disk.")
            else:
                self.error(path, f"Unsupported resource {quoted(key)}: WhaleZen takes {K8S_GPU_KEY}, cpu "
                                 "and memory.")
        return out

    def parse(self, quantities: dict[str, Any], path: str) -> dict[str, int]:
        """The same parsing as the native `limits` field, so values and messages agree."""
        try:
            return dict(KubernetesLimitsField().to_internal_value(quantities))
        except serializers.ValidationError as exc:
            detail = exc.detail[0] if isinstance(exc.detail, list) and exc.detail else exc.detail
            self.error(path, str(detail))
        except ValueError:  # an integer too long to print (sys.get_int_max_str_digits)
            self.error(path, 'Quantities must look like 2, "8", "500m" or "32Gi".')
        return {}

    # -- node selection ---------------------------------------------------------------------------
    def node_selector(self, value: Any, path: str, selection: _Selection) -> None:
        selector = self.obj(value, path)
        if len(selector) > MAX_LABELS:
            self.error(path, f"At most {MAX_LABELS} labels.")
            return
        for key, label in selector.items():
            if not isinstance(label, str):
                self.error(path, f"{quoted(key)}: the value must be a string (quote it, as Kubernetes "
                                 "requires).")
                continue
            self.require(selection, key, "In", [label], path)

    def affinity(self, value: Any, path: str, selection: _Selection) -> None:
        affinity = self.obj(value, path)
        self.unknown(affinity, path, {"nodeAffinity", "podAffinity", "podAntiAffinity"})
        for key in ("podAffinity", "podAntiAffinity"):
            pod_affinity = self.obj(affinity.get(key), f"{path}.{key}")
            self.unknown(pod_affinity, f"{path}.{key}", {"requiredDuringSchedulingIgnoredDuringExecution",
                                                         "preferredDuringSchedulingIgnoredDuringExecution"})
            if pod_affinity.get("requiredDuringSchedulingIgnoredDuringExecution") not in (None, []):
                self.error(f"{path}.{key}.requiredDuringSchedulingIgnoredDuringExecution",
                           "Not supported: WhaleZen does not place jobs relative to other pods.")
            elif pod_affinity:
                self.warn(f"{path}.{key}", "Ignored: WhaleZen does not place jobs relative to other pods.")
        node_path = f"{path}.nodeAffinity"
        node = self.obj(affinity.get("nodeAffinity"), node_path)
        self.unknown(node, node_path, {"requiredDuringSchedulingIgnoredDuringExecution",
                                       "preferredDuringSchedulingIgnoredDuringExecution"})
        if node.get("preferredDuringSchedulingIgnoredDuringExecution") not in (None, []):
            self.warn(f"{node_path}.preferredDuringSchedulingIgnoredDuringExecution",
                      "Ignored for placement: only required node affinity is honoured.")
        required_path = f"{node_path}.requiredDuringSchedulingIgnoredDuringExecution"
        required = self.obj(node.get("requiredDuringSchedulingIgnoredDuringExecution"), required_path)
        self.unknown(required, required_path, {"nodeSelectorTerms"})
        terms_path = f"{required_path}.nodeSelectorTerms"
        terms = self.lst(required.get("nodeSelectorTerms"), terms_path)
        if len(terms) > MAX_TERMS:
            self.error(terms_path, f"At most {MAX_TERMS} terms.")
        elif len(terms) == 1:
            self.term(terms[0], f"{terms_path}[0]", selection)
        elif terms:
            self.product_terms(terms, terms_path, selection)

    def term(self, term: Any, path: str, selection: _Selection) -> None:
        term = self.obj(term, path)
        self.unknown(term, path, {"matchExpressions", "matchFields"})
        if term.get("matchFields") not in (None, []):
            self.error(f"{path}.matchFields", "matchFields (node names) is not supported: select nodes by "
                                              "label with matchExpressions.")
        expressions = self.lst(term.get("matchExpressions"), f"{path}.matchExpressions")
        if len(expressions) > MAX_LABELS:
            self.error(f"{path}.matchExpressions", f"At most {MAX_LABELS} expressions.")
            return
        for index, expression in enumerate(expressions):
            parsed = self.expression(expression, f"{path}.matchExpressions[{index}]")
            if parsed is not None:
                self.require(selection, *parsed, f"{path}.matchExpressions[{index}]")

    def product_terms(self, terms: list[Any], path: str, selection: _Selection) -> None:
        """Several terms are ORed; that maps onto our model only as alternatives of GPU product."""
        values: list[str] = []
        for index, term in enumerate(terms):
            expressions = term.get("matchExpressions") if isinstance(term, dict) else None
            alone = (isinstance(expressions, list) and len(expressions) == 1
                     and set(term) == {"matchExpressions"})
            parsed = (self.expression(expressions[0], f"{path}[{index}].matchExpressions[0]")
                      if alone else None)
            if parsed is None or parsed[0] != PRODUCT_KEY or parsed[1] != "In":
                self.error(f"{path}[{index}]", f"Several terms (OR) are supported only when each is one "
                                               f"{PRODUCT_KEY} In expression (model alternatives); write "
                                               "other labels in one term.")
                return
            values.extend(parsed[2])
        self.require(selection, PRODUCT_KEY, "In", values, path)

    def expression(self, value: Any, path: str) -> tuple[str, str, list[str]] | None:
        expression = self.obj(value, path)
        self.unknown(expression, path, {"key", "operator", "values"})
        key = self.string(expression.get("key"), f"{path}.key")
        operator = expression.get("operator")
        if operator not in ("In", "NotIn", "Exists", "DoesNotExist", "Gt", "Lt"):
            self.error(f"{path}.operator", "Must be In, NotIn, Exists, DoesNotExist, Gt or Lt.")
            return None
        values = self.lst(expression.get("values"), f"{path}.values")
        if len(values) > MAX_VALUES:
            self.error(f"{path}.values", f"At most {MAX_VALUES} values.")
            return None
        if not all(isinstance(v, str) for v in values):
            self.error(f"{path}.values", "Every value must be a string (quote numbers, as Kubernetes "
                                         "requires).")
            return None
        if operator in ("In", "NotIn") and not values:
            self.error(f"{path}.values", f"{operator} needs at least one value.")
            return None
        if operator in ("Gt", "Lt") and len(values) != 1:
            self.error(f"{path}.values", f"{operator} needs exactly one value.")
            return None
        if operator in ("Exists", "DoesNotExist") and values:
            self.error(f"{path}.values", f"{operator} takes no values.")
            return None
        return (key, operator, values) if key is not None else None

    def require(self, selection: _Selection, key: Any, operator: str, values: list[str], path: str) -> None:
        """Fold one label requirement into `selection` (requirements are ANDed, as in Kubernetes)."""
        if not isinstance(key, str):
            self.error(path, "A label key must be a string.")
        elif key == PRODUCT_KEY:
            self.require_product(selection, operator, values, path)
        elif key == MEMORY_KEY:
            self.require_memory(selection, operator, values, path)
        elif key == COUNT_KEY:
            self.require_count(selection, operator, values, path)
        elif key.startswith("nvidia.com/"):
            self.error(path, f"Of GPU Feature Discovery's labels WhaleZen reads {PRODUCT_KEY}, {MEMORY_KEY} "
                             f"and {COUNT_KEY}, not {quoted(key)}.")
        elif key == OS_KEY:
            if operator == "In" and "linux" in values:
                self.warn(path, f"{OS_KEY}=linux holds on every WhaleZen node.")
            else:
                self.error(path, f"WhaleZen nodes run Linux: {OS_KEY} can only be linux.")
        elif key == REGION_KEY and operator == "In":
            wanted = list(dict.fromkeys(values))
            regions = wanted if selection.regions is None else [r for r in selection.regions if r in wanted]
            if not regions:
                self.error(path, f"No region satisfies every {REGION_KEY} requirement.")
            selection.regions = regions
        elif operator != "In" or len(values) != 1:
            self.error(path, f"On node label {quoted(key)} only equality is supported (nodeSelector, or In "
                             "with one value).")
        elif (problem := label_key_problem(key) or label_value_problem(values[0])) is not None:
            self.error(path, f"{quoted(key)}: {problem}.")
        elif selection.labels.get(key, values[0]) != values[0]:
            self.error(path, f"{quoted(key)} must be both {quoted(selection.labels[key])} and "
                             f"{quoted(values[0])}.")
        else:
            selection.labels[key] = values[0]

    def require_product(self, selection: _Selection, operator: str, values: list[str], path: str) -> None:
        if operator == "Exists":
            return  # every GPU node has a product
        if operator != "In":
            self.error(path, f"On {PRODUCT_KEY} only In (and Exists) is supported: list the models you want.")
            return
        models: list[str] = []
        for value in values:
            model = _product(value)
            if model is None:
                self.error(path, f"Unknown GPU product {quoted(value)}. Known: {_MODEL_NAMES}, in our or "
                                 "GFD's spelling.")
                return
            if model not in models:
                models.append(model)
        if selection.products is not None:
            models = [m for m in selection.products if m in models]
            if not models:
                self.error(path, f"No GPU model satisfies every {PRODUCT_KEY} requirement.")
        selection.products = models

    def require_memory(self, selection: _Selection, operator: str, values: list[str], path: str) -> None:
        if operator == "Exists":
            return
        numbers = all(v.isascii() and v.isdigit() and len(v) <= 9 for v in values)
        if operator not in ("In", "Gt") or not numbers:
            self.error(path, f"On {MEMORY_KEY} (MiB) only a number, In or Gt is supported: WhaleZen asks for "
                             "at least that much GPU memory.")
            return
        mib = [int(v) for v in values]
        # GFD reports a GPU's usable MiB (81559 on an 80 GB H100): round down to whole GB for In, and
        # ask for more than the value for Gt.
        gb = mib[0] // 1024 + 1 if operator == "Gt" else min(mib) // 1024
        selection.min_memory_gb = max(selection.min_memory_gb, gb)

    def require_count(self, selection: _Selection, operator: str, values: list[str], path: str) -> None:
        if operator == "Exists":
            return
        if operator != "In" or not all(v.isascii() and v.isdigit() and len(v) <= 4 for v in values):
            self.error(path, f"On {COUNT_KEY} only a number (or In) is supported.")
            return
        counts = {int(v) for v in values}
        selection.counts = counts if selection.counts is None else selection.counts & counts
        if not selection.counts:
            self.error(path, f"No GPU count satisfies every {COUNT_KEY} requirement.")


def _product(value: str) -> str | None:
    """Our catalogue name for a GFD product label value (a time-sliced '-SHARED' GPU is that model)."""
    text = value.strip().lower()
    if text.endswith(_SHARED_SUFFIX):
        text = text[: -len(_SHARED_SUFFIX)]
    return _PRODUCTS.get(text)


def _expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion: defined variables replaced, `$$` is a literal `$`, others kept."""
    def one(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        return env.get(match.group(1), match.group(0))

    return _VAR_REF.sub(one, text)
