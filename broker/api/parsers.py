"""Request parsers that refuse oversized bodies and answer bad JSON/YAML with a 400 naming `body`."""
from __future__ import annotations

import json
from typing import Any

import yaml
from django.conf import settings
from rest_framework.exceptions import ParseError
from rest_framework.parsers import BaseParser


class BodyError(ParseError):
    """A ParseError whose 400 body is `{"body": [reason]}`."""


def _read_bounded(stream) -> bytes:
    limit = settings.WHALEZEN_MAX_BODY_BYTES
    if stream is None:
        return b""
    data = stream.read(limit + 1)
    if len(data) > limit:
        raise BodyError(f"Request body is larger than {limit} bytes.")
    return data


def _check_content_length(parser_context: dict | None) -> None:
    request = (parser_context or {}).get("request")
    length = request.META.get("CONTENT_LENGTH") if request is not None else None
    if length and str(length).isdigit() and int(length) > settings.WHALEZEN_MAX_BODY_BYTES:
        raise BodyError(f"Request body is larger than {settings.WHALEZEN_MAX_BODY_BYTES} bytes.")


class BoundedJSONParser(BaseParser):
    media_type = "application/json"

    def parse(self, stream, media_type=None, parser_context=None) -> Any:
        _check_content_length(parser_context)
        raw = _read_bounded(stream)
        try:
            return json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as exc:
            raise BodyError(f"Body is not valid JSON: {exc}") from exc


class BoundedYAMLParser(BaseParser):
    """YAML job specs (`Content-Type: application/yaml`), parsed with the safe loader."""

    media_type = "application/yaml"

    def parse(self, stream, media_type=None, parser_context=None) -> Any:
        _check_content_length(parser_context)
        raw = _read_bounded(stream)
        try:
            return yaml.safe_load(raw.decode("utf-8"))
        except (UnicodeDecodeError, yaml.YAMLError) as exc:
            raise BodyError(f"Body is not valid YAML: {str(exc).splitlines()[0]}") from exc


class YAMLAliasParser(BoundedYAMLParser):
    media_type = "application/x-yaml"


class TextYAMLParser(BoundedYAMLParser):
    media_type = "text/yaml"
