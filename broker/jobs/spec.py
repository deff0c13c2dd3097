"""The job spec users write, its validation, and its normalised demand.

Accepts the native form (`resources.gpus` / `gpu_models` / `gpu_fraction` / `compute_units`) and the
two spellings users already know: SkyPilot's `accelerators: "A100-80GB:4"` and Kubernetes'
`limits: {"nvidia.com/gpu": 2, "cpu": "8", "memory": "32Gi"}`. Every error names its field.
"""
from __future__ import annotations

import functools
import math
import os
import re
import urllib.parse
from dataclasses import asdict, dataclass
from decimal import Decimal
from typing import Any, Callable

from django.conf import settings
from django.utils import timezone
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from broker.api.fields import (
    PrebuiltFieldsMixin,
    StrictBooleanField,
    StrictCharField,
    StrictFloatField,
    StrictIntegerField,
    StrictSerializer,
)
from broker.api.excerpts import excerpt, quoted
from broker.inventory.labels import MAX_LABELS, label_key_problem, label_value_problem

PRIORITY_NAMES: dict[str, int] = {"low": 10, "normal": 50, "high": 100, "critical": 1000}
MAX_PRIORITY = 1000
MAX_GPUS_PER_NODE = 64
MAX_NODES = 256
MAX_CPU_PER_NODE = 4096  # cores
MAX_MEMORY_GB_PER_NODE = 65536
PROVIDERS = ("onprem", "aws", "gcp", "local")
RESERVED_ENV_PREFIX = "WHALEZEN_"
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")
# A container image reference: [registry[:port]/]path[:tag][@digest]. No leading '-' (a runtime
# would read it as an option), no spaces or shell characters.
IMAGE_RE = re.compile(r"^(?:[A-Za-z0-9][A-Za-z0-9.-]*(?::[0-9]{1,5})?/)?[A-Za-z0-9][A-Za-z0-9._/-]*"
                      r"(?::[A-Za-z0-9_][A-Za-z0-9._-]{0,127})?(?:@sha256:[a-f0-9]{64})?$")
ENV_KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
K8S_GPU_KEY = "nvidia.com/gpu"
_K8S_CPU_RE = re.compile(r"^(\d+(?:\.\d+)?)(m?)$")
_K8S_MEM_RE = re.compile(r"^(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti|K|M|G|T)?$")
_K8S_MEM_MB = {None: 1 / 2**20, "Ki": 1 / 1024, "Mi": 1, "Gi": 1024, "Ti": 2**20,
               "K": 1e3 / 2**20, "M": 1e6 / 2**20, "G": 1e9 / 2**20, "T": 1e12 / 2**20}


def _ascii_digits(text: str) -> bool:
    """0-9 only: str.isdigit() also accepts other scripts' digits and superscripts."""
    return text.isascii() and text.isdigit()


@dataclass(frozen=True)
class GpuModelRef:
    name: str
    memory_gb: int


class GpuCatalog:
    """Known GPU models by every accepted spelling (case-insensitive)."""

    def __init__(self, models: list[tuple[str, int, list[str]]] | Callable[[], list[tuple[str, int, list[str]]]]):
        """`models` as (name, memory in GB, aliases), or a function that reads them when first needed: most
        specs name no model, and their submission then never reads the catalogue."""
        self._models = models
        self._by_spelling: dict[str, GpuModelRef] | None = None

    def _index(self) -> dict[str, GpuModelRef]:
        if self._by_spelling is None:
            models = self._models() if callable(self._models) else self._models
            by_spelling: dict[str, GpuModelRef] = {}
            for name, memory_gb, aliases in models:
                ref = GpuModelRef(name=name, memory_gb=memory_gb)
                for spelling in [name, *aliases]:
                    by_spelling.setdefault(spelling.lower(), ref)
            self._by_spelling = by_spelling
        return self._by_spelling

    @functools.cached_property
    def names(self) -> list[str]:
        return sorted({ref.name for ref in self._index().values()})

    def resolve(self, spelling: str) -> GpuModelRef | None:
        return self._index().get(spelling.strip().lower())


@dataclass(frozen=True)
class Demand:
    """What the scheduler reads. GPU counts are per node; `gpu_milli` is the share of each GPU."""

    gpus_per_node: int
    nodes: int
    total_gpus: int
    gpu_milli: int
    compute_units: float | None
    gpu_models: list[str]
    # Alternatives with their own per-node counts, {model: GPUs per node}; empty when every model
    # in gpu_models takes gpus_per_node.
    gpu_alternatives: dict[str, int]
    min_gpu_memory_gb: int
    interconnect: str
    cpu_milli: int
    memory_mb: int
    spot: str
    max_price_per_hour: float | None
    providers: list[str]
    regions: list[str]

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@extend_schema_field({"oneOf": [{"type": "string", "enum": list(PRIORITY_NAMES)},
                             {"type": "integer", "minimum": 0, "maximum": MAX_PRIORITY}]})
class PriorityField(serializers.Field):
    default_error_messages = {
        "invalid": "Must be one of low, normal, high, critical or an integer from 0 to 1000."
    }

    def to_internal_value(self, data: Any) -> int:
        if isinstance(data, str) and data.lower() in PRIORITY_NAMES:
            return PRIORITY_NAMES[data.lower()]
        if isinstance(data, int) and not isinstance(data, bool) and 0 <= data <= MAX_PRIORITY:
            return data
        self.fail("invalid")

    def to_representation(self, value: int) -> int:
        return value


class StringListField(serializers.ListField):
    def __init__(self, **kwargs: Any):
        kwargs.setdefault("child", StrictCharField(min_length=1, max_length=200))
        super().__init__(**kwargs)


@extend_schema_field({"oneOf": [{"type": "string", "example": "A100-80GB:4"},
                             {"type": "object", "additionalProperties": {"type": "integer"}},
                             {"type": "array", "items": {"type": "string"}}]})
class AcceleratorsField(serializers.Field):
    """SkyPilot's spelling: `"A100-80GB:4"`, `"T4"` (one GPU), `"A100:0.5"` (half of one GPU),
    `{"A100-80GB": 4}`, or alternatives with their own counts, any of which will do:
    `{"L4": 8, "A100-80GB": 2}`, `["L4:8", "A100-80GB:2"]` or YAML's flow set `{L4:8, A100-80GB:2}`
    (which parses as keys "L4:8" with null values). Gives [(model, count), ...]; a count below 1 is a
    share of one GPU."""

    default_error_messages = {"invalid": 'Must look like "MODEL" or "MODEL:COUNT", e.g. "A100-80GB:4", '
                                         'a {{MODEL: COUNT}} object or a list of "MODEL:COUNT" strings.'}
    MAX_ALTERNATIVES = 16

    def to_internal_value(self, data: Any) -> list[tuple[str, int | float]]:
        if isinstance(data, str):
            items: list[tuple[Any, Any]] = [self._split(data)]
        elif isinstance(data, dict) and data:
            items = [self._split(k) if v is None and isinstance(k, str) else (k, v) for k, v in data.items()]
        elif isinstance(data, list) and data and all(isinstance(item, str) for item in data):
            items = [self._split(item) for item in data]
        else:
            self.fail("invalid")
        if len(items) > self.MAX_ALTERNATIVES:
            raise serializers.ValidationError(f"At most {self.MAX_ALTERNATIVES} alternatives.")
        out: list[tuple[str, int | float]] = []
        for model, count in items:
            if not isinstance(model, str) or not model.strip():
                self.fail("invalid")
            out.append((model.strip(), self._count(count)))
        if len({model.lower() for model, _ in out}) != len(out):
            raise serializers.ValidationError("A GPU model is listed twice.")
        return out

    def _split(self, text: str) -> tuple[str, Any]:
        model, colon, count_text = text.partition(":")
        count_text = count_text.strip()
        if not colon:
            return model, 1
        if _ascii_digits(count_text):
            return model, int(count_text)
        if re.fullmatch(r"0?\.\d{1,3}", count_text):
            return model, float(count_text)
        self.fail("invalid")

    @staticmethod
    def _count(count: Any) -> int | float:
        if isinstance(count, float) and 0 < count < 1:
            return count
        if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_GPUS_PER_NODE:
            raise serializers.ValidationError(
                f"GPU count must be an integer from 1 to {MAX_GPUS_PER_NODE}, or a share of one GPU "
                "such as 0.5.")
        return count

    def to_representation(self, value: Any) -> Any:
        return value


class ParsedLimits(dict):
    """Parsed Kubernetes limits (gpus, cpu_milli, memory_mb) that remember how the user wrote them."""

    def __init__(self, parsed: dict[str, int], raw: dict[str, Any]):
        super().__init__(parsed)
        self.raw = raw


@extend_schema_field({"type": "object", "properties": {
    K8S_GPU_KEY: {"type": "integer"}, "cpu": {"type": "string"}, "memory": {"type": "string"}},
    "additionalProperties": False})
class KubernetesLimitsField(serializers.Field):
    """Kubernetes' spelling: `{"nvidia.com/gpu": 2, "cpu": "8", "memory": "32Gi"}`."""

    def to_internal_value(self, data: Any) -> ParsedLimits:
        if not isinstance(data, dict):
            raise serializers.ValidationError("Must be an object such as {\"nvidia.com/gpu\": 2}.")
        unknown = sorted(set(data) - {K8S_GPU_KEY, "cpu", "memory"})
        if unknown:
            raise serializers.ValidationError(f"Unknown resource(s): {', '.join(quoted(k) for k in unknown[:5])}.")
        out: dict[str, int] = {}
        if K8S_GPU_KEY in data:
            gpus = data[K8S_GPU_KEY]
            if isinstance(gpus, str) and _ascii_digits(gpus):
                gpus = int(gpus)
            if isinstance(gpus, bool) or not isinstance(gpus, int) or not 1 <= gpus <= MAX_GPUS_PER_NODE:
                raise serializers.ValidationError(
                    f"{K8S_GPU_KEY} must be an integer from 1 to {MAX_GPUS_PER_NODE}."
                )
            out["gpus"] = gpus
        if "cpu" in data:
            match = _K8S_CPU_RE.match(str(data["cpu"])) if not isinstance(data["cpu"], bool) else None
            if not match:
                raise serializers.ValidationError('cpu must look like "8", "0.5" or "500m".')
            value = float(match.group(1))
            if (value / 1000 if match.group(2) else value) < 0.001:
                raise serializers.ValidationError("cpu must be at least 1m (0.001 cores).")
            if (value / 1000 if match.group(2) else value) > MAX_CPU_PER_NODE:
                raise serializers.ValidationError(f"cpu must be at most {MAX_CPU_PER_NODE} cores.")
            out["cpu_milli"] = int(value if match.group(2) else value * 1000)
        if "memory" in data:
            match = _K8S_MEM_RE.match(str(data["memory"])) if not isinstance(data["memory"], bool) else None
            if not match:
                raise serializers.ValidationError('memory must look like "32Gi", "512Mi" or "64G".')
            memory_mb = float(match.group(1)) * _K8S_MEM_MB[match.group(2)]
            if memory_mb > MAX_MEMORY_GB_PER_NODE * 1024:
                raise serializers.ValidationError(f"memory must be at most {MAX_MEMORY_GB_PER_NODE}Gi.")
            out["memory_mb"] = math.ceil(memory_mb)
        return ParsedLimits(out, raw=dict(data))

    def to_representation(self, value: Any) -> Any:
        return value


class ResourcesSerializer(PrebuiltFieldsMixin, StrictSerializer):
    gpus = StrictIntegerField(required=False, min_value=1, max_value=MAX_GPUS_PER_NODE,
                              help_text="GPUs per node.")
    gpu_models = StringListField(required=False, min_length=1, max_length=32,
                                 help_text="Allowed GPU models (any of them).")
    min_gpu_memory_gb = StrictIntegerField(required=False, min_value=1, max_value=4096)
    gpu_fraction = StrictFloatField(required=False, min_value=0.001, max_value=1.0,
                                    help_text="Share of one GPU, 0 < f <= 1, for small work.")
    compute_units = StrictFloatField(required=False, min_value=0.01, max_value=100000,
                                     help_text="Abstract capacity (A100 = 1.0); the broker picks the GPUs.")
    interconnect = serializers.ChoiceField(choices=["any", "pcie", "nvlink"], required=False)
    nodes = StrictIntegerField(required=False, min_value=1, max_value=MAX_NODES)
    cpu = StrictFloatField(required=False, min_value=0.001, max_value=MAX_CPU_PER_NODE, help_text="CPU cores per node.")
    memory_gb = StrictFloatField(required=False, min_value=0.001, max_value=MAX_MEMORY_GB_PER_NODE,
                                 help_text="Per node.")
    accelerators = AcceleratorsField(required=False, help_text='SkyPilot spelling, e.g. "A100-80GB:4".')
    limits = KubernetesLimitsField(required=False, help_text='Kubernetes spelling, e.g. {"nvidia.com/gpu": 2}.')

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        errors: dict[str, str] = {}
        if "accelerators" in attrs:
            for clash in ("gpus", "gpu_models", "limits"):
                if clash in attrs:
                    errors["accelerators"] = f"Give either accelerators or {clash}, not both."
        if "limits" in attrs and "gpus" in attrs and "gpus" in attrs["limits"]:
            errors["limits"] = f"Give either limits.{K8S_GPU_KEY} or gpus, not both."
        if "compute_units" in attrs:
            for clash in ("gpus", "gpu_fraction", "accelerators"):
                if clash in attrs:
                    errors["compute_units"] = f"Ask for compute_units or for concrete GPUs ({clash}), not both."
        if errors:
            raise serializers.ValidationError(errors)
        return attrs


class PlacementSerializer(PrebuiltFieldsMixin, StrictSerializer):
    providers = serializers.ListField(child=serializers.ChoiceField(choices=PROVIDERS), required=False,
                                      min_length=1, max_length=len(PROVIDERS))
    regions = StringListField(required=False, min_length=1, max_length=64)
    spot = serializers.ChoiceField(choices=["never", "allowed", "required"], required=False)
    max_price_per_hour = StrictFloatField(required=False, min_value=0.0001, max_value=100000,
                                          help_text="Ceiling in USD per hour for the whole job.")
    node_selector = serializers.DictField(child=serializers.CharField(allow_blank=True, max_length=63),
                                          required=False, help_text="Node labels the job's nodes must carry "
                                                                    "(Kubernetes nodeSelector).")

    def validate_node_selector(self, value: dict[str, str]) -> dict[str, str]:
        if len(value) > MAX_LABELS:
            raise serializers.ValidationError(f"At most {MAX_LABELS} labels.")
        for key, label in value.items():
            problem = label_key_problem(key)
            if problem is None:
                problem = label_value_problem(label)
                key = f"{key}={label}"
            if problem:
                raise serializers.ValidationError(f"{quoted(key)}: {problem}.")
        return value

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        providers = attrs.get("providers")
        if attrs.get("spot") == "required" and providers and not set(providers) & {"aws", "gcp", "local"}:
            raise serializers.ValidationError({"spot": "Spot capacity exists only on cloud providers (aws, gcp)."})
        return attrs


def _resolved(path: str) -> str:
    """`path` as the filesystem would resolve it: `..` removed, symlinks of its existing part followed.

    realpath() is applied to the nearest existing parent (the checkpoint directory itself usually does
    not exist yet), so a symlink inside a root that points elsewhere is seen for what it is.
    """
    path = os.path.normpath(path)
    head, rest = path, []
    while not os.path.lexists(head) and head != os.path.dirname(head):
        head, name = os.path.split(head)
        rest.append(name)
    return os.path.join(os.path.realpath(head), *reversed(rest))


def _within(path: str, root: str) -> bool:
    return path.startswith(root.rstrip("/") + "/")


def checkpoint_roots() -> list[str]:
    """The operator's checkpoint roots (WHALEZEN_CHECKPOINT_ROOTS), resolved like the paths they hold."""
    return [_resolved(root) for root in settings.WHALEZEN_CHECKPOINT_ROOTS if root.startswith("/")]


class CheckpointSerializer(PrebuiltFieldsMixin, StrictSerializer):
    uri = StrictCharField(max_length=1024, help_text="s3://bucket/prefix, or an absolute path or file:// URI "
                                                     "under one of the broker's checkpoint roots.")
    interval_minutes = StrictIntegerField(required=False, min_value=1, max_value=24 * 60)
    interval_seconds = StrictIntegerField(required=False, min_value=10, max_value=24 * 3600,
                                          help_text="The same in seconds (at least 10), e.g. for a demo.")

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        if "interval_minutes" in attrs and "interval_seconds" in attrs:
            raise serializers.ValidationError({"interval_seconds": "Give interval_minutes or interval_seconds, "
                                                                   "not both."})
        return attrs

    def validate_uri(self, value: str) -> str:
        if "\x00" in value or ".." in value.split("/"):
            raise serializers.ValidationError("Must not contain '..' segments or NUL bytes.")
        if value.startswith("s3://"):
            if not re.match(r"^s3://[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9](/.*)?$", value):
                raise serializers.ValidationError("Not a valid s3://bucket/prefix URI.")
            return value
        if value.startswith("file://"):
            path = value[len("file://"):]
            if not path.startswith("/"):
                raise serializers.ValidationError("file:// URIs must hold an absolute path.")
            # A reader that decodes %XX opens another path than one that does not: both must be safe.
            paths = {path, urllib.parse.unquote(path)}
        elif value.startswith("/"):
            paths = {value}
        else:
            raise serializers.ValidationError("Must be an absolute path, a file:// URI or an s3:// URI.")
        roots = checkpoint_roots()
        for path in paths:
            if "\x00" in path or ".." in path.split("/"):
                raise serializers.ValidationError("Must not contain '..' segments or NUL bytes.")
            if not any(_within(_resolved(path), root) for root in roots):
                shown = ", ".join(settings.WHALEZEN_CHECKPOINT_ROOTS) or "none configured"
                # The resolved path is not shown: it would tell users where the broker's symlinks lead.
                raise serializers.ValidationError(
                    f"Local checkpoints must be inside one of the checkpoint roots ({excerpt(shown, 120)}), "
                    "after '..' and symbolic links are resolved."
                )
        return value


FILE_SOURCE_RE = re.compile(r"^(s3://[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9](/[^\x00]*)?|gs://[a-z0-9][a-z0-9._\-]{1,220}"
                            r"(/[^\x00]*)?|upload:[0-9a-f]{32})$")
MAX_FILES = 64


class FileSerializer(PrebuiltFieldsMixin, StrictSerializer):
    source = StrictCharField(max_length=1024, help_text="s3://bucket/key-or-prefix, gs://bucket/key-or-prefix, "
                                                        "or upload:<id> (POST /api/v1/uploads/).")
    destination = StrictCharField(max_length=1024, help_text="~/path or a relative path (under the job's home); "
                                                             "an absolute path only for a job with an image.")

    def validate_source(self, value: str) -> str:
        if not FILE_SOURCE_RE.match(value):
            raise serializers.ValidationError("Must be s3://bucket[/key], gs://bucket[/key] or upload:<32 hex>.")
        return value

    def validate_destination(self, value: str) -> str:
        parts = value.split("/")
        if "\x00" in value or ".." in parts:
            raise serializers.ValidationError("Must not contain '..' segments or NUL bytes.")
        if value in ("~", "~/", "/", ".") or (value.startswith("~") and not value.startswith("~/")):
            raise serializers.ValidationError('Name a folder or file, e.g. "~/data" or "/data".')
        return value


class JobSpecSerializer(PrebuiltFieldsMixin, StrictSerializer):
    name = StrictCharField(max_length=200)
    command = serializers.ListField(child=StrictCharField(max_length=8192, allow_blank=True), required=False,
                                    min_length=1, max_length=1024)
    image = StrictCharField(required=False, max_length=512)
    env = serializers.DictField(child=StrictCharField(max_length=32768, allow_blank=True), required=False)
    secrets = serializers.DictField(child=StrictCharField(max_length=32768, allow_blank=True), required=False,
                                    help_text="Environment values kept out of the stored spec, events and "
                                              "logs (tokens, keys); the job's processes get them.")
    priority = PriorityField(required=False, help_text="low|normal|high|critical or 0..1000.")
    preemptible = StrictBooleanField(required=False)
    expected_duration_hours = StrictFloatField(required=False, min_value=0.001, max_value=24 * 366)
    deadline = serializers.DateTimeField(required=False)
    resources = ResourcesSerializer()
    placement = PlacementSerializer(required=False)
    checkpoint = CheckpointSerializer(required=False)
    files = FileSerializer(many=True, required=False, max_length=MAX_FILES,
                           help_text="Copied onto every node before the command runs (docs/job-spec.md).")

    def validate_name(self, value: str) -> str:
        if not NAME_RE.match(value):
            raise serializers.ValidationError(
                "Use 1-200 letters, digits, '.', '_' or '-', starting with a letter or digit."
            )
        return value

    def validate_image(self, value: str) -> str:
        if not IMAGE_RE.match(value) or "//" in value:
            raise serializers.ValidationError(
                'Must be a container image reference such as "nvcr.io/nvidia/pytorch:24.05-py3" or '
                '"ghcr.io/acme/train@sha256:<64 hex>".')
        return value

    def validate_secrets(self, value: dict[str, str]) -> dict[str, str]:
        return self.validate_env(value)

    def validate_env(self, value: dict[str, str]) -> dict[str, str]:
        if len(value) > 256:
            raise serializers.ValidationError("At most 256 variables.")
        for key in value:
            if not ENV_KEY_RE.match(key):
                raise serializers.ValidationError(f"{quoted(key)} is not a valid environment variable name.")
            if key.upper().startswith(RESERVED_ENV_PREFIX):
                raise serializers.ValidationError(f"{quoted(key)}: names starting with WHALEZEN_ are set by the broker.")
        return value

    def validate_deadline(self, value):
        if value <= timezone.now():
            raise serializers.ValidationError("Must be in the future.")
        return value

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        if "command" not in attrs and "image" not in attrs:
            raise serializers.ValidationError({"command": "Give a command, an image, or both."})
        absolute = [f["destination"] for f in attrs.get("files", []) if f["destination"].startswith("/")]
        if absolute and "image" not in attrs:
            raise serializers.ValidationError({"files": f"{quoted(absolute[0])}: an absolute destination needs an "
                                                        "image (it is mounted into the container); use ~/... for a "
                                                        "job on the host."})
        clash = sorted(set(attrs.get("env", {})) & set(attrs.get("secrets", {})))
        if clash:
            raise serializers.ValidationError({"secrets": f"{quoted(clash[0])} is in env too; give it once."})
        catalog: GpuCatalog = self.context["gpu_catalog"]
        attrs["_demand"] = _normalise(attrs, catalog)
        return attrs


def _normalise(attrs: dict[str, Any], catalog: GpuCatalog) -> Demand:
    """Fold the aliases into one demand and refuse impossible combinations (all errors name a field)."""
    res = attrs["resources"]
    placement = attrs.get("placement", {})
    errors: dict[str, Any] = {}

    gpus = res.get("gpus")
    model_spellings = list(res.get("gpu_models", []))
    cpu_milli = int(round(res["cpu"] * 1000)) if "cpu" in res else 0
    memory_mb = int(math.ceil(res["memory_gb"] * 1024)) if "memory_gb" in res else 0
    counts_by_spelling: dict[str, int] = {}
    fraction = res.get("gpu_fraction")
    if "accelerators" in res:
        alternatives = res["accelerators"]
        model_spellings = [model for model, _ in alternatives]
        shares = [count for _, count in alternatives if isinstance(count, float)]
        if shares and len(alternatives) > 1:
            errors["accelerators"] = ["A share of one GPU (such as A100:0.5) cannot be one of several alternatives."]
        elif shares:
            if "gpu_fraction" in res:
                errors["accelerators"] = ["Give the share in accelerators or in gpu_fraction, not both."]
            fraction, gpus = shares[0], None
        else:
            counts_by_spelling = {model: count for model, count in alternatives}
            gpus = min(counts_by_spelling.values())
    limits = res.get("limits", {})
    if "gpus" in limits:
        gpus = limits["gpus"]
    cpu_milli = limits.get("cpu_milli", cpu_milli)
    memory_mb = limits.get("memory_mb", memory_mb)

    compute_units = res.get("compute_units")
    nodes = res.get("nodes", 1)
    interconnect = res.get("interconnect", "any")

    resolved = []
    unknown = []
    gpus_by_model: dict[str, int] = {}
    for spelling in model_spellings:
        ref = catalog.resolve(spelling)
        (resolved if ref else unknown).append(ref or spelling)
        if ref is not None and spelling in counts_by_spelling:
            if gpus_by_model.get(ref.name, counts_by_spelling[spelling]) != counts_by_spelling[spelling]:
                errors["accelerators"] = [f"{quoted(spelling)} is {ref.name}, listed twice with other counts."]
            gpus_by_model[ref.name] = counts_by_spelling[spelling]
    field = "accelerators" if "accelerators" in res else "gpu_models"
    if unknown:
        errors[field] = [
            f"Unknown GPU model(s): {', '.join(quoted(u) for u in unknown[:5])}. "
            f"Known: {', '.join(catalog.names) or 'none'}."
        ]

    if fraction is not None:
        if gpus is not None and gpus > 1:
            errors["gpu_fraction"] = ["A GPU fraction applies to one shared GPU; it cannot be combined with gpus > 1."]
        if nodes > 1:
            errors["gpu_fraction"] = ["A GPU fraction cannot be spread over several nodes."]
        if interconnect == "nvlink":
            errors["interconnect"] = ["nvlink makes no sense for a fraction of one GPU."]
        gpus = 1
    if gpus is None and compute_units is None:
        errors.setdefault("gpus", ["Ask for GPUs: gpus, gpu_fraction, compute_units, accelerators or limits."])
    if interconnect == "nvlink" and nodes > 1:
        errors["interconnect"] = ["NVLink does not span nodes; use interconnect 'any' for a multi-node job."]
    if interconnect in ("nvlink", "pcie") and gpus == 1 and fraction is None and compute_units is None:
        pass  # a single GPU trivially satisfies a topology ask
    min_mem = res.get("min_gpu_memory_gb", 0)
    if min_mem and resolved and not unknown and all(ref.memory_gb < min_mem for ref in resolved):
        biggest = max(ref.memory_gb for ref in resolved)
        errors["min_gpu_memory_gb"] = [f"None of the allowed GPU models has {min_mem} GB; the largest has {biggest} GB."]

    if errors:
        raise serializers.ValidationError({"resources": errors})

    spot = placement.get("spot", "never")
    gpu_milli = int(round(fraction * 1000)) if fraction is not None else 1000
    gpus_per_node = gpus or 0
    price = placement.get("max_price_per_hour")
    return Demand(
        gpus_per_node=gpus_per_node,
        nodes=nodes,
        total_gpus=gpus_per_node * nodes,
        gpu_milli=gpu_milli,
        compute_units=compute_units,
        gpu_models=sorted({ref.name for ref in resolved}),
        gpu_alternatives=dict(sorted(gpus_by_model.items())) if len(set(gpus_by_model.values())) > 1 else {},
        min_gpu_memory_gb=min_mem,
        interconnect=interconnect,
        cpu_milli=cpu_milli,
        memory_mb=memory_mb,
        spot=spot,
        max_price_per_hour=float(Decimal(str(price))) if price is not None else None,
        providers=sorted(set(placement.get("providers", []))),
        regions=sorted(set(placement.get("regions", []))),
    )


def spec_to_json(validated: dict[str, Any]) -> dict[str, Any]:
    """The stored spec: the validated fields as the user spelled them (aliases kept), JSON-safe."""
    out = {k: v for k, v in validated.items() if not k.startswith("_")}
    if "deadline" in out:
        out["deadline"] = out["deadline"].isoformat()
    res = dict(out["resources"])
    if "accelerators" in res:
        alternatives = [f"{model}:{count:g}" for model, count in res["accelerators"]]
        res["accelerators"] = alternatives[0] if len(alternatives) == 1 else alternatives
    if "secrets" in out:  # the values live in Job.secret_env, never in the spec users and events see
        out["secrets"] = sorted(out["secrets"])
    if "limits" in res:
        res["limits"] = res["limits"].raw
    out["resources"] = res
    return out
