"""A serializer's validation for the common, well-formed body in plain Python; anything else goes to DRF.

Every node agent heartbeats every few seconds, and DRF validates each of a heartbeat's four GPU readings
field by field (`run_validation`, empty-value checks, validators; 19 fields each): a quarter of the web
server's CPU per heartbeat (bench.service, py-spy). `FastCheck(SerializerClass)` reads the serializer's
declared fields once and checks a body against them directly. It only ever *accepts*: a value it is not
sure about (a string with surrounding whitespace or outside ASCII, a whole float for an integer, a field
type it does not know, a missing required field, an unknown key...) makes it give up, and the caller runs
the serializer itself, which gives the answer it always gave (a 400 naming the field and the reason). So
what is accepted, and the validated data, are those of the serializer by construction of each rule below;
tests/broker/test_fastcheck.py checks them against the serializer on the agent's own bodies and on
thousands of altered ones.
"""
from __future__ import annotations

import math
from typing import Any, Callable

from django.core.validators import (MaxLengthValidator, MaxValueValidator, MinValueValidator,
                                    ProhibitNullCharactersValidator)
from rest_framework import serializers
from rest_framework.validators import ProhibitSurrogateCharactersValidator

from broker.api.fields import (StrictBooleanField, StrictCharField, StrictFloatField, StrictIntegerField,
                               StrictSerializer)


class _Unsure(Exception):
    """The fast check does not decide this body: let the serializer do it."""


_UNSURE = _Unsure()
Check = Callable[[Any], Any]


def _nullable(field: serializers.Field, check: Check) -> Check:
    if not field.allow_null:
        return check

    def nullable(value: Any) -> Any:
        return None if value is None else check(value)
    return nullable


def _char(field: StrictCharField) -> Check:
    # DRF trims whitespace, then checks length, NUL and surrogate characters: only strings that trimming
    # leaves alone and that are ASCII (no surrogates) are decided here.
    if not field.trim_whitespace or field.min_length is not None:
        raise _UNSURE
    max_length, allow_blank = field.max_length, field.allow_blank

    def char(value: Any) -> str:
        if (type(value) is not str or not value.isascii() or "\x00" in value or value != value.strip()
                or (max_length is not None and len(value) > max_length) or (not value and not allow_blank)):
            raise _UNSURE
        return value
    return _nullable(field, char)


def _integer(field: StrictIntegerField) -> Check:
    low, high = field.min_value, field.max_value

    def integer(value: Any) -> int:
        # A whole float (5.0) is valid too, but left to DRF: only true ints are decided here.
        if type(value) is not int or (low is not None and value < low) or (high is not None and value > high):
            raise _UNSURE
        return value
    return _nullable(field, integer)


def _float(field: StrictFloatField) -> Check:
    low, high = field.min_value, field.max_value

    def floating(value: Any) -> float:
        if type(value) is not float and type(value) is not int:
            raise _UNSURE
        try:
            number = float(value)
        except OverflowError:
            raise _UNSURE from None
        if not math.isfinite(number) or (low is not None and number < low) or (high is not None and number > high):
            raise _UNSURE
        return number
    return _nullable(field, floating)


def _boolean(field: StrictBooleanField) -> Check:
    def boolean(value: Any) -> bool:
        if type(value) is not bool:
            raise _UNSURE
        return value
    return _nullable(field, boolean)


def _choice(field: serializers.ChoiceField) -> Check:
    # DRF looks up str(value): only strings that are a choice's own string are decided here.
    if field.allow_blank:
        raise _UNSURE
    choices = {key: value for key, value in field.choice_strings_to_values.items() if key == value}

    def choice(value: Any) -> Any:
        if type(value) is not str or value not in choices:
            raise _UNSURE
        return choices[value]
    return _nullable(field, choice)


def _list(field: serializers.ListField | serializers.ListSerializer, child: Check) -> Check:
    if field.min_length is not None or not field.allow_empty:
        raise _UNSURE
    max_length = field.max_length

    def listing(value: Any) -> list:
        if type(value) is not list or (max_length is not None and len(value) > max_length):
            raise _UNSURE
        return [child(item) for item in value]
    return _nullable(field, listing)


def _object(serializer: serializers.Serializer) -> Check:
    # A serializer with checks of its own (validate, validate_<field>) or one that lets unknown keys
    # through is not decided here.
    if (not isinstance(serializer, StrictSerializer)
            or type(serializer).validate is not serializers.Serializer.validate
            or any(hasattr(serializer, f"validate_{name}") for name in serializer.fields)):
        raise _UNSURE
    fields = []
    for name, field in serializer.fields.items():
        if field.read_only or field.source != name:
            raise _UNSURE
        try:
            check = _field(field)
        except _Unsure:
            check = None  # a field of a type not decided here: a body that has it goes to DRF
        fields.append((name, field.required, check))
    known = frozenset(name for name, _, _ in fields)

    def obj(value: Any) -> dict:
        if type(value) is not dict or not known.issuperset(value):
            raise _UNSURE
        out = {}
        for name, required, check in fields:
            if name in value:
                if check is None:
                    raise _UNSURE
                out[name] = check(value[name])
            elif required:
                raise _UNSURE
        return out
    return obj


# The validators DRF gives these fields from their own arguments, which the checks here apply; a field
# with any other validator is left to DRF.
_BUILT_IN_VALIDATORS = (MaxLengthValidator, MinValueValidator, MaxValueValidator, ProhibitNullCharactersValidator,
                        ProhibitSurrogateCharactersValidator)


def _field(field: serializers.Field) -> Check:
    if getattr(field, "default", serializers.empty) is not serializers.empty:
        raise _UNSURE  # an absent field would take its default: left to DRF
    if not all(type(v) in _BUILT_IN_VALIDATORS for v in getattr(field, "validators", ())):
        raise _UNSURE
    kind = type(field)
    if kind is StrictCharField:
        return _char(field)
    if kind is StrictIntegerField:
        return _integer(field)
    if kind is StrictFloatField:
        return _float(field)
    if kind is StrictBooleanField:
        return _boolean(field)
    if kind is serializers.ChoiceField:
        return _choice(field)
    if kind is serializers.ListField:
        return _list(field, _field(field.child))
    if kind is serializers.ListSerializer:
        return _list(field, _object(field.child))
    if isinstance(field, serializers.Serializer):
        return _nullable(field, _object(field))
    raise _UNSURE


class FastCheck:
    """`validated(data)`: what `serializer_class(data=data)` would validate, without DRF's per-field
    machinery when the body is plainly valid; otherwise the serializer runs (and raises its
    ValidationError as before)."""

    def __init__(self, serializer_class: type[serializers.Serializer]) -> None:
        self._serializer_class = serializer_class
        self._check: Check | None = None

    def _compiled(self) -> Check:
        if self._check is None:  # on first use: the fields need the app registry
            self._check = _object(self._serializer_class())
        return self._check

    def fast(self, data: Any) -> dict | None:
        """The validated data, or None when this body is left to the serializer."""
        try:
            return self._compiled()(data)
        except _Unsure:
            return None

    def validated(self, data: Any) -> dict:
        fast = self.fast(data)
        if fast is not None:
            return fast
        serializer = self._serializer_class(data=data)
        serializer.is_valid(raise_exception=True)
        return serializer.validated_data
