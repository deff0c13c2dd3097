"""Strict serializer building blocks: unknown keys and loosely typed values are errors, not guesses."""
from __future__ import annotations

from typing import Any

from rest_framework import serializers


class StrictSerializer(serializers.Serializer):
    """Rejects keys it does not declare, naming each one."""

    def to_internal_value(self, data: Any) -> Any:
        unknown = sorted(set(data) - set(self.fields)) if isinstance(data, dict) else []
        errors = {key: ["Unknown field."] for key in unknown}
        try:
            value = super().to_internal_value(data)
        except serializers.ValidationError as exc:
            # Report unknown keys together with the other field errors, so one round trip shows all.
            if not errors or not isinstance(exc.detail, dict):
                raise
            raise serializers.ValidationError({**exc.detail, **errors}) from exc
        if errors:
            raise serializers.ValidationError(errors)
        return value


class PrebuiltFieldsMixin:
    """For serializers on a hot path (every agent's heartbeat, every few seconds) that never read
    `self.context`, `parent` or `instance` while validating: the declared fields are deep-copied once per
    class, and each new serializer binds shallow copies of them. DRF deep-copies every declared field
    per instance by calling its `__init__` again (validators, error messages): for a heartbeat's four GPU
    readings that was a quarter of the broker's CPU per heartbeat (bench.service, py-spy).

    A field's bound state (name, parent, source) lives in its own copy; what the copies share is what
    validation only reads: validators (built once here), error messages, a ListField's child, a nested
    `many=True` serializer's child (ListSerializer validates each item through its one child).
    """

    def get_fields(self) -> dict[str, serializers.Field]:
        cls = type(self)
        prototype = cls.__dict__.get("_prebuilt_fields")
        if prototype is None:
            prototype = super().get_fields()  # type: ignore[misc]
            for field in prototype.values():
                field.validators  # built now, so the copies share them instead of each building its own
            cls._prebuilt_fields = prototype
        return {name: _shallow_copy(field) for name, field in prototype.items()}


def _shallow_copy(field: serializers.Field) -> serializers.Field:
    """What `copy.copy` makes of a field (DRF fields define no `__copy__`), without its `__reduce_ex__`
    detour: 40 fields per submission, a twentieth of its CPU that way (cProfile, bench.service)."""
    clone = object.__new__(type(field))
    clone.__dict__.update(field.__dict__)
    return clone


class StrictIntegerField(serializers.IntegerField):
    """An integer written as a JSON/YAML number: no booleans, strings or fractional numbers."""

    def to_internal_value(self, data: Any) -> int:
        if isinstance(data, bool) or not isinstance(data, (int, float)):
            raise serializers.ValidationError("Must be an integer.")
        if isinstance(data, float) and not data.is_integer():
            raise serializers.ValidationError("Must be a whole number.")
        return super().to_internal_value(int(data))


class StrictFloatField(serializers.FloatField):
    def to_internal_value(self, data: Any) -> float:
        if isinstance(data, bool) or not isinstance(data, (int, float)):
            raise serializers.ValidationError("Must be a number.")
        return super().to_internal_value(data)


class StrictBooleanField(serializers.BooleanField):
    def to_internal_value(self, data: Any) -> bool:
        if not isinstance(data, bool):
            raise serializers.ValidationError("Must be true or false.")
        return data


class StrictCharField(serializers.CharField):
    def to_internal_value(self, data: Any) -> str:
        if not isinstance(data, str):
            raise serializers.ValidationError("Must be a string.")
        return super().to_internal_value(data)
