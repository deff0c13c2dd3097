"""Validation of what agents send (docs/agent.md). Bad input is a 400 naming the field, never a 500.

Readings NVML could not take arrive as null; every such field is optional and nullable here.
"""
from __future__ import annotations

from typing import Any

from rest_framework import serializers

MAX_GPUS = 64  # more GPUs than any real node has; bounds the work one request can cause


def _nullable_int(**kwargs: Any) -> serializers.IntegerField:
    return serializers.IntegerField(required=False, allow_null=True, **kwargs)


class RegisterGpuSerializer(serializers.Serializer):
    index = serializers.IntegerField(min_value=0, max_value=MAX_GPUS - 1)
    uuid = serializers.CharField(max_length=64, required=False, allow_null=True, allow_blank=True)
    model = serializers.CharField(max_length=64, required=False, allow_null=True, allow_blank=True)
    memory_mb = _nullable_int(min_value=0)
    pci_bus_id = serializers.CharField(max_length=32, required=False, allow_null=True, allow_blank=True)
    numa_node = _nullable_int(min_value=-1, max_value=1024)
    cpu_affinity = serializers.CharField(max_length=4096, required=False, allow_null=True, allow_blank=True)
    nvlink_island = _nullable_int(min_value=0, max_value=MAX_GPUS)
    nvlink_peers = serializers.ListField(child=serializers.IntegerField(min_value=0, max_value=MAX_GPUS - 1),
                                         required=False, max_length=MAX_GPUS)
    mig_mode = serializers.ChoiceField(choices=["enabled", "disabled", "unsupported"], required=False)
    power_limit_w = serializers.FloatField(required=False, allow_null=True, min_value=0)


class RegisterSerializer(serializers.Serializer):
    join_token = serializers.CharField(max_length=200)
    name = serializers.RegexField(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$", max_length=200,
                                  error_messages={"invalid": "Use letters, digits, '.', '_' or '-' (max 200)."})
    hostname = serializers.CharField(max_length=255, required=False, allow_blank=True)
    agent_key = serializers.RegexField(r"^[A-Za-z0-9_-]{8,64}$",
                                       error_messages={"invalid": "8 to 64 letters, digits, '_' or '-'."})
    agent_version = serializers.CharField(max_length=32, required=False, allow_blank=True)
    cpu_milli = serializers.IntegerField(min_value=0, max_value=2**31 - 1, required=False)
    memory_mb = _nullable_int(min_value=0, max_value=2**31 - 1)
    labels = serializers.DictField(child=serializers.CharField(max_length=200, allow_blank=True), required=False)
    driver_version = serializers.CharField(max_length=64, required=False, allow_null=True, allow_blank=True)
    cuda_driver_version = serializers.CharField(max_length=16, required=False, allow_null=True, allow_blank=True)
    backend = serializers.CharField(max_length=200, required=False, allow_blank=True)
    gpus = RegisterGpuSerializer(many=True, max_length=MAX_GPUS)
    topology = serializers.DictField(required=False)

    def validate_gpus(self, gpus: list[dict[str, Any]]) -> list[dict[str, Any]]:
        indices = [g["index"] for g in gpus]
        if len(set(indices)) != len(indices):
            raise serializers.ValidationError("Each GPU index may appear once.")
        return gpus

    def validate_labels(self, labels: dict[str, str]) -> dict[str, str]:
        if len(labels) > 64:
            raise serializers.ValidationError("At most 64 labels.")
        return labels


class ReadingSerializer(serializers.Serializer):
    index = serializers.IntegerField(min_value=0, max_value=MAX_GPUS - 1)
    uuid = serializers.CharField(max_length=64, required=False, allow_null=True, allow_blank=True)
    utilization_pct = _nullable_int(min_value=0, max_value=100)
    memory_utilization_pct = _nullable_int(min_value=0, max_value=100)
    memory_used_mb = _nullable_int(min_value=0)
    memory_total_mb = _nullable_int(min_value=0)
    temperature_c = _nullable_int(min_value=-100, max_value=300)
    power_w = serializers.FloatField(required=False, allow_null=True, min_value=0)
    power_limit_w = serializers.FloatField(required=False, allow_null=True, min_value=0)
    ecc_corrected = _nullable_int(min_value=0)
    ecc_uncorrected = _nullable_int(min_value=0)
    retired_pages = _nullable_int(min_value=0)
    remapped_rows_pending = serializers.BooleanField(required=False, allow_null=True)
    remapped_rows_failed = serializers.BooleanField(required=False, allow_null=True)
    xid_errors = serializers.ListField(child=serializers.IntegerField(min_value=0), required=False, max_length=64)
    mig_mode = serializers.ChoiceField(choices=["enabled", "disabled", "unsupported"], required=False)
    lost = serializers.BooleanField(required=False)
    health = serializers.ChoiceField(choices=["HEALTHY", "DEGRADED", "FAILED"])
    health_reasons = serializers.ListField(child=serializers.CharField(max_length=500), required=False,
                                           max_length=32)


class ProcessSerializer(serializers.Serializer):
    assignment_id = serializers.CharField(max_length=32)
    job_id = serializers.CharField(max_length=32, required=False)
    epoch = serializers.IntegerField(min_value=0, required=False)
    pid = _nullable_int(min_value=0)
    gpu_indices = serializers.ListField(child=serializers.IntegerField(min_value=0), required=False,
                                        max_length=MAX_GPUS)
    state = serializers.CharField(max_length=16, required=False)


class HeartbeatSerializer(serializers.Serializer):
    agent_version = serializers.CharField(max_length=32, required=False, allow_blank=True)
    max_epoch_seen = serializers.IntegerField(min_value=0, required=False)
    missed_heartbeats = serializers.IntegerField(min_value=0, required=False)
    last_error = serializers.CharField(max_length=2000, required=False, allow_null=True, allow_blank=True)
    telemetry = ReadingSerializer(many=True, max_length=MAX_GPUS, required=False)
    processes = ProcessSerializer(many=True, max_length=256, required=False)


STATUS_STATES = ["running", "checkpoint_requested", "exited", "failed", "stopped", "refused"]


class StatusSerializer(serializers.Serializer):
    epoch = serializers.IntegerField(min_value=0)
    state = serializers.ChoiceField(choices=STATUS_STATES)
    reason = serializers.CharField(max_length=24, required=False, allow_blank=True)
    exit_code = _nullable_int(min_value=-255, max_value=255)
    message = serializers.CharField(max_length=2000, required=False, allow_blank=True)
    pid = _nullable_int(min_value=0)
    job_id = serializers.CharField(max_length=32, required=False)
    # The end of the job's output (the agent sends about 4 KB), shown to the job's owner in its events.
    output_tail = serializers.CharField(max_length=16384, required=False, allow_blank=True, trim_whitespace=False)
    # GPU index -> health reasons, for a job that failed on a GPU the agent now sees as FAILED.
    failed_gpus = serializers.DictField(child=serializers.ListField(child=serializers.CharField(max_length=500),
                                                                    max_length=32), required=False)

    def validate_failed_gpus(self, value: dict[str, list[str]]) -> dict[str, list[str]]:
        if len(value) > MAX_GPUS or not all(k.isdigit() and int(k) < MAX_GPUS for k in value):
            raise serializers.ValidationError("Keys must be GPU indices.")
        return value
