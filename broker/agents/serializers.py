"""Validation of what agents send (docs/agent.md). Bad input is a 400 naming the field, never a 500.

Everything an agent sends is untrusted input, exactly like a user's job spec (a join token can leak,
a job can steal a node token): the same strict fields, unknown keys refused, every string, list and
map bounded, and each body of the shape `agent/protocol.py` really builds. Readings NVML could not
take arrive as null; every such field is optional and nullable here.
"""
from __future__ import annotations

import ipaddress
import json
import re
import urllib.parse
from typing import Any

from rest_framework import serializers

from broker.api.excerpts import quoted
from broker.api.fields import (PrebuiltFieldsMixin, StrictBooleanField, StrictCharField, StrictFloatField,
                               StrictIntegerField, StrictSerializer)
from broker.inventory.labels import MAX_LABELS, label_key_problem, label_value_problem

MAX_GPUS = 64  # more GPUs than any real node has; bounds the work one request can cause
MAX_NVLINKS = 32  # NVML_NVLINK_MAX_LINKS is 18 (Hopper, Blackwell)
# The topology of an 8-GPU HGX board with 18 NVLinks per GPU is about 21 KB of JSON; this leaves
# room for 16-GPU nodes and bounds what one node stores and every node-list read loads.
MAX_TOPOLOGY_BYTES = 128 * 1024
JOB_ISOLATION = ["separate-user", "shared-user"]
# What the agent can run a job's image with (agent/runtimes.py RUNTIME_NAMES), and a Kubernetes node's
# kubelet (the bridge, agent/kube/: every job there runs in an image).
CONTAINER_RUNTIMES = ["podman", "docker", "apptainer", "singularity", "kubernetes"]
# "PIX", "CHIPSET_NOT_SUPPORTED", and the agent's fallbacks "LEVEL_<n>" / "STATUS_<n>" for values
# a newer NVML may return.
_TOPOLOGY_WORD = re.compile(r"[A-Z0-9_]{1,32}")
_GPU_INDEX_KEY = re.compile(r"[0-9]{1,2}")  # ASCII digits only: '²'.isdigit() is True


def _int(required: bool = True, **kwargs: Any) -> StrictIntegerField:
    return StrictIntegerField(required=required, **kwargs)


def _nullable_int(**kwargs: Any) -> StrictIntegerField:
    return StrictIntegerField(required=False, allow_null=True, **kwargs)


def _nullable_float(**kwargs: Any) -> StrictFloatField:
    return StrictFloatField(required=False, allow_null=True, **kwargs)


def _text(max_length: int, *, required: bool = False, nullable: bool = True, **kwargs: Any) -> StrictCharField:
    return StrictCharField(max_length=max_length, required=required, allow_null=nullable, allow_blank=True, **kwargs)


def _choice(choices: list[str], **kwargs: Any) -> serializers.ChoiceField:
    # DRF's default message quotes the whole bad value; a fixed one cannot be made huge.
    return serializers.ChoiceField(choices=choices, error_messages={
        "invalid_choice": f"Must be one of: {', '.join(choices)}."}, **kwargs)


class StrictRegexField(serializers.RegexField):
    """A string matching `regex`; numbers are not silently turned into strings."""

    def to_internal_value(self, data: Any) -> str:
        if not isinstance(data, str):
            raise serializers.ValidationError("Must be a string.")
        return super().to_internal_value(data)


def _index_list(**kwargs: Any) -> serializers.ListField:
    return serializers.ListField(child=_int(min_value=0, max_value=MAX_GPUS - 1), required=False,
                                 max_length=MAX_GPUS, **kwargs)


class TopologyWordField(StrictCharField):
    """One cell of a topology matrix: "X" (self), a PCIe level or a P2P status name, or null."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(max_length=32, allow_null=True, **kwargs)

    def to_internal_value(self, data: Any) -> str:
        value = super().to_internal_value(data)
        if not _TOPOLOGY_WORD.fullmatch(value):
            raise serializers.ValidationError(f"Not a topology name: {quoted(value)}.")
        return value


def _matrix() -> serializers.ListField:
    row = serializers.ListField(child=TopologyWordField(), max_length=MAX_GPUS)
    return serializers.ListField(child=row, max_length=MAX_GPUS, required=False)


# -- registration --------------------------------------------------------------------------------
class RegisterGpuSerializer(StrictSerializer):
    index = _int(min_value=0, max_value=MAX_GPUS - 1)
    uuid = _text(64)
    model = _text(64)
    memory_mb = _nullable_int(min_value=0, max_value=2**31 - 1)
    pci_bus_id = _text(32)
    numa_node = _nullable_int(min_value=-1, max_value=1024)
    cpu_affinity = _text(4096)
    nvlink_island = _nullable_int(min_value=0, max_value=MAX_GPUS)
    nvlink_peers = _index_list()
    mig_mode = _choice(["enabled", "disabled", "unsupported"], required=False)
    power_limit_w = _nullable_float(min_value=0, max_value=100_000)


class NvLinkSerializer(StrictSerializer):
    link = _int(min_value=0, max_value=MAX_NVLINKS - 1)
    active = StrictBooleanField()
    remote_pci_bus_id = _text(32)
    remote_device_type = _choice(["gpu", "switch", "ibmnpu", "unknown"], required=False, allow_null=True)
    remote_gpu_index = _nullable_int(min_value=0, max_value=MAX_GPUS - 1)


class TopologyGpuSerializer(StrictSerializer):
    index = _int(min_value=0, max_value=MAX_GPUS - 1)
    numa_node = _nullable_int(min_value=-1, max_value=1024)
    cpu_affinity = _text(4096)
    nvlinks = NvLinkSerializer(many=True, max_length=MAX_NVLINKS, required=False)
    nvlink_peers = _index_list()
    nvlink_island = _nullable_int(min_value=0, max_value=MAX_GPUS)


class TopologySerializer(StrictSerializer):
    """`agent.protocol.registration_payload`'s topology: three GPU x GPU matrices and per-GPU links."""

    pcie_common_ancestor = _matrix()
    p2p_nvlink = _matrix()
    p2p_read = _matrix()
    gpus = TopologyGpuSerializer(many=True, max_length=MAX_GPUS, required=False)

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        for name in ("pcie_common_ancestor", "p2p_nvlink", "p2p_read"):
            rows = attrs.get(name)
            if rows is not None and any(len(row) != len(rows) for row in rows):
                raise serializers.ValidationError({name: ["Must be a square matrix (one row and column per GPU)."]})
        if len(json.dumps(attrs)) > MAX_TOPOLOGY_BYTES:
            raise serializers.ValidationError(f"Topology is larger than {MAX_TOPOLOGY_BYTES // 1024} KB.")
        return attrs


class LabelsField(serializers.DictField):
    """Node labels in the Kubernetes label syntax (broker/inventory/labels.py).

    Checked here rather than by a child field: a DictField reports errors under each bad key, and
    echoing a bad key (a lone surrogate) would break the error response itself.
    """

    def to_internal_value(self, data: Any) -> dict[str, str]:
        if not isinstance(data, dict):
            raise serializers.ValidationError("Must be an object of label keys to values.")
        if len(data) > MAX_LABELS:
            raise serializers.ValidationError(f"At most {MAX_LABELS} labels.")
        problems = []
        for key, value in data.items():
            why = label_key_problem(key)
            if why is None:
                why = label_value_problem(value)
                why = None if why is None else f"value {why}"
            if why is not None:
                problems.append(f"Label {quoted(key)}: {why}.")
        if problems:
            raise serializers.ValidationError(problems[:8])
        return dict(data)


class MetricsUrlField(StrictRegexField):
    """Where an agent serves its GPU metrics (agent/metrics.py): a plain http(s) URL with a host and a
    port, no credentials or query; it is handed to Prometheus as a scrape target."""

    def __init__(self, **kwargs: Any):
        super().__init__(
            r"^https?://(\[[0-9A-Fa-f:.]{2,45}\]|[A-Za-z0-9][A-Za-z0-9.-]{0,252}):[0-9]{1,5}/[A-Za-z0-9._~/-]{0,100}\Z",
            max_length=300, error_messages={
                "invalid": "An http(s) URL with a host and a port, e.g. http://gpu-node-7:9400/metrics."}, **kwargs)
        self.validators.append(_port_in_range)


def _port_in_range(value: str) -> None:
    """After the pattern: a host and a port are there; the port must be one a server can listen on."""
    try:
        port = urllib.parse.urlsplit(value).port
    except ValueError:
        port = None
    if value and not (port and 0 < port < 65536):
        raise serializers.ValidationError("The port must be 1-65535.")


_DNS_LABEL = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?")


class NodeAddressField(StrictCharField):
    """The address a gang's other nodes reach this node at (the agent's --advertise-address): an
    IPv4/IPv6 address or a DNS name, nothing else. It becomes MASTER_ADDR and WHALEZEN_NODE_IPS in
    other jobs' environments, so no spaces, newlines, ports or URLs."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(max_length=253, **kwargs)

    def to_internal_value(self, data: Any) -> str:
        value = super().to_internal_value(data)
        if value and not node_address_valid(value):
            raise serializers.ValidationError("Must be an IP address or a DNS name, e.g. 10.0.0.7 or gpu-7.dc1.")
        return value


def node_address_valid(value: str) -> bool:
    try:
        ipaddress.ip_address(value)
        return True
    except ValueError:
        pass
    labels = (value[:-1] if value.endswith(".") else value).split(".")
    # A last label of digits only is a malformed IPv4 address (10.0.0.999), not a name.
    return len(value) <= 253 and all(_DNS_LABEL.fullmatch(label) for label in labels) and not labels[-1].isdigit()


class RegisterSerializer(StrictSerializer):
    join_token = StrictCharField(max_length=200)
    name = StrictRegexField(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}\Z", max_length=200,
                            error_messages={"invalid": "Use letters, digits, '.', '_' or '-' (max 200)."})
    hostname = _text(255, nullable=False)
    agent_key = StrictRegexField(r"^[A-Za-z0-9_-]{8,64}\Z",
                                 error_messages={"invalid": "8 to 64 letters, digits, '_' or '-'."})
    agent_version = _text(32, nullable=False)
    cpu_milli = _int(required=False, min_value=0, max_value=2**31 - 1)
    memory_mb = _nullable_int(min_value=0, max_value=2**31 - 1)
    labels = LabelsField(required=False)
    driver_version = _text(64)
    cuda_driver_version = _text(16)
    backend = _text(200, nullable=False)
    gpus = RegisterGpuSerializer(many=True, max_length=MAX_GPUS)
    topology = TopologySerializer(required=False)
    # Whether the agent runs jobs as a user of their own ("separate-user") or as itself
    # ("shared-user": jobs could read the agent's secrets). Shown to tenant admins on the node.
    job_isolation = _choice(JOB_ISOLATION, required=False)
    metrics_url = MetricsUrlField(required=False, allow_blank=True)
    address = NodeAddressField(required=False, allow_blank=True)
    container_runtimes = serializers.ListField(child=_choice(CONTAINER_RUNTIMES), required=False,
                                               max_length=len(CONTAINER_RUNTIMES))

    def validate_container_runtimes(self, runtimes: list[str]) -> list[str]:
        if len(set(runtimes)) != len(runtimes):
            raise serializers.ValidationError("Each runtime may appear once.")
        return runtimes

    def validate_gpus(self, gpus: list[dict[str, Any]]) -> list[dict[str, Any]]:
        indices = [g["index"] for g in gpus]
        if len(set(indices)) != len(indices):
            raise serializers.ValidationError("Each GPU index may appear once.")
        uuids = [g["uuid"] for g in gpus if g.get("uuid")]
        if len(set(uuids)) != len(uuids):
            raise serializers.ValidationError("Each GPU UUID may appear once.")
        return gpus


# -- heartbeats ----------------------------------------------------------------------------------
class ReadingSerializer(PrebuiltFieldsMixin, StrictSerializer):
    index = _int(min_value=0, max_value=MAX_GPUS - 1)
    uuid = _text(64)
    utilization_pct = _nullable_int(min_value=0, max_value=100)
    memory_utilization_pct = _nullable_int(min_value=0, max_value=100)
    memory_used_mb = _nullable_int(min_value=0, max_value=2**31 - 1)
    memory_total_mb = _nullable_int(min_value=0, max_value=2**31 - 1)
    temperature_c = _nullable_int(min_value=-100, max_value=300)
    power_w = _nullable_float(min_value=0, max_value=100_000)
    power_limit_w = _nullable_float(min_value=0, max_value=100_000)
    ecc_corrected = _nullable_int(min_value=0, max_value=2**31 - 1)
    ecc_uncorrected = _nullable_int(min_value=0, max_value=2**31 - 1)
    retired_pages = _nullable_int(min_value=0, max_value=2**31 - 1)
    remapped_rows_pending = StrictBooleanField(required=False, allow_null=True)
    remapped_rows_failed = StrictBooleanField(required=False, allow_null=True)
    xid_errors = serializers.ListField(child=_int(min_value=0, max_value=2**31 - 1), required=False, max_length=64)
    mig_mode = _choice(["enabled", "disabled", "unsupported"], required=False)
    lost = StrictBooleanField(required=False)
    health = _choice(["HEALTHY", "DEGRADED", "FAILED"])
    health_reasons = serializers.ListField(child=StrictCharField(max_length=500), required=False, max_length=32)
    # The GPU is taken by work the broker did not place (a Kubernetes node's other pods): not free.
    held_outside = StrictBooleanField(required=False)


class ProcessSerializer(PrebuiltFieldsMixin, StrictSerializer):
    assignment_id = StrictCharField(max_length=32)
    job_id = _text(32, nullable=False)
    epoch = _int(required=False, min_value=0, max_value=2**31 - 1)
    pid = _nullable_int(min_value=0, max_value=2**31 - 1)
    gpu_indices = _index_list()
    state = _choice(["running", "stopping"], required=False)


class InterruptionSerializer(PrebuiltFieldsMixin, StrictSerializer):
    """The cloud's notice that it takes the instance back (agent/spot.py)."""

    kind = _choice(["spot"])
    action = _choice(["terminate", "stop", "hibernate"])
    deadline = StrictFloatField(min_value=0, max_value=2**40)
    source = _choice(["aws", "gcp", "local"])


class HeartbeatSerializer(PrebuiltFieldsMixin, StrictSerializer):
    agent_version = _text(32, nullable=False)
    sent_at = _nullable_float(min_value=0)
    sampled_at = _nullable_float(min_value=0)
    max_epoch_seen = _int(required=False, min_value=0, max_value=2**31 - 1)
    missed_heartbeats = _int(required=False, min_value=0, max_value=2**31 - 1)
    last_error = _text(2000)
    telemetry = ReadingSerializer(many=True, max_length=MAX_GPUS, required=False)
    processes = ProcessSerializer(many=True, max_length=256, required=False)
    interruption = InterruptionSerializer(required=False)
    metrics_url = MetricsUrlField(required=False, allow_blank=True)  # it changes when an agent restarts


# -- status reports ------------------------------------------------------------------------------
STATUS_STATES = ["running", "checkpoint_requested", "checkpoint_written", "exited", "failed", "stopped", "refused"]


class FailedGpusField(serializers.DictField):
    """GPU index (as a string of ASCII digits) -> health reasons."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(child=serializers.ListField(child=StrictCharField(max_length=500), max_length=32),
                         **kwargs)

    def to_internal_value(self, data: Any) -> dict[str, list[str]]:
        if not isinstance(data, dict):
            raise serializers.ValidationError("Must be an object of GPU index to health reasons.")
        if len(data) > MAX_GPUS:
            raise serializers.ValidationError(f"At most {MAX_GPUS} GPUs.")
        for key in data:
            if not isinstance(key, str) or not _GPU_INDEX_KEY.fullmatch(key) or int(key) >= MAX_GPUS:
                raise serializers.ValidationError(f"Keys must be GPU indices (0 to {MAX_GPUS - 1}), "
                                                  f"not {quoted(key)}.")
        return super().to_internal_value(data)


class CheckpointWrittenSerializer(StrictSerializer):
    """A checkpoint the job wrote (the helper's notice, agent/checkpoint), for the broker to verify."""

    step = _int(min_value=0, max_value=2**62)
    uri = StrictCharField(max_length=1024)
    manifest_sha256 = StrictRegexField(r"^[0-9a-f]{64}$", max_length=64)
    request_id = StrictCharField(max_length=128, required=False, allow_null=True, allow_blank=True)


class StatusSerializer(StrictSerializer):
    epoch = _int(min_value=0, max_value=2**31 - 1)
    state = _choice(STATUS_STATES)
    reason = StrictCharField(max_length=24, required=False, allow_blank=True)
    exit_code = _nullable_int(min_value=-255, max_value=255)
    message = StrictCharField(max_length=2000, required=False, allow_blank=True)
    pid = _nullable_int(min_value=0, max_value=2**31 - 1)
    job_id = StrictCharField(max_length=32, required=False, allow_blank=True)
    at = _nullable_float(min_value=0)
    # The end of the job's output (the agent sends about 4 KB), shown to the job's owner in its events.
    output_tail = StrictCharField(max_length=16384, required=False, allow_blank=True, trim_whitespace=False)
    # GPU index -> health reasons, for a job that failed on a GPU the agent now sees as FAILED.
    failed_gpus = FailedGpusField(required=False)
    checkpoint = CheckpointWrittenSerializer(required=False)

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        if (attrs.get("state") == "checkpoint_written") != ("checkpoint" in attrs):
            raise serializers.ValidationError({"checkpoint": "Sent with state checkpoint_written, and only then."})
        return attrs
