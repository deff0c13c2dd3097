"""Request parsers for every API route, user and agent alike (the agent views use the defaults too).

Each body is read with a byte limit and parsed into plain JSON values, or refused with a 400 naming
`body`, before any serializer sees it:

- YAML anchors and aliases are refused when the composer meets the first one, so an alias bomb is
  never expanded (a 488-byte one once expanded to 312 MB). Job specs and agent reports need none.
- Nesting is capped (`WHALEZEN_MAX_BODY_DEPTH`): JSON by a scan of the raw text outside strings before
  `json.loads` (whose C decoder recurses: a 10,000-deep body raised RecursionError, a 500), YAML while
  composing. The number of values is capped too, which also bounds the cost of a YAML body.
- YAML gives only what JSON can hold: no timestamps, sets, binary or other tags.
- One iterative walk of the parsed value refuses NUL characters and lone surrogates in keys and
  strings (PostgreSQL cannot store them and a lone surrogate cannot even be written back as UTF-8),
  non-string keys, non-finite numbers and integers outside 64 bits, naming the path of the value.
"""
from __future__ import annotations

import json
import math
import re
from typing import Any

import yaml
from django.conf import settings
from rest_framework.exceptions import ParseError
from rest_framework.parsers import BaseParser
from yaml.composer import Composer
from yaml.cyaml import CParser
from yaml.constructor import SafeConstructor
from yaml.resolver import Resolver

from broker.api.excerpts import excerpt, quoted

# Most values a body may hold. A 16-GPU node's registration holds about 2,500; a job spec at most a
# few thousand (1,024 command arguments, 256 env variables). Composing 20,000 YAML nodes takes ~0.1 s.
MAX_BODY_ITEMS = 20_000
# A number written with more characters than this is refused before Python converts it (int() of a
# long digit string is quadratic, and YAML's sexagesimal `1:2:3:...` builds huge ints).
MAX_NUMBER_CHARS = 100
INT_MIN, INT_MAX = -(2**63), 2**63 - 1  # what every database column and JSON reader here can hold
_BAD_TEXT = re.compile("[\x00\ud800-\udfff]")
# A JSON string (possessive, so an unterminated one cannot make the scan backtrack) and a bracket.
_JSON_STRING = re.compile(r'"(?:[^"\\]++|\\.)*+"', re.S)
_JSON_BRACKET = re.compile(r"[\[\]{}]")
_PLAIN_KEY = re.compile(r"^[A-Za-z0-9_./-]{1,40}$")


class BodyError(ParseError):
    """A ParseError whose 400 body is `{"body": [reason]}`."""


class _OutOfRange:
    """Stands in for a number too long to convert; the walk reports it with its path."""


OUT_OF_RANGE = _OutOfRange()


def max_depth() -> int:
    return settings.WHALEZEN_MAX_BODY_DEPTH


def _too_deep() -> BodyError:
    return BodyError(f"Body is nested deeper than {max_depth()} levels.")


def _too_many() -> BodyError:
    return BodyError(f"Body holds more than {MAX_BODY_ITEMS} values.")


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
    length = str(request.META.get("CONTENT_LENGTH") or "") if request is not None else ""
    if length.isascii() and length.isdigit() and int(length) > settings.WHALEZEN_MAX_BODY_BYTES:
        raise BodyError(f"Request body is larger than {settings.WHALEZEN_MAX_BODY_BYTES} bytes.")


def _decode(raw: bytes, kind: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BodyError(f"Body is not valid {kind}: it is not UTF-8 text (byte {exc.start}).") from exc


def _path(parts: tuple) -> str:
    shown = [str(p) if isinstance(p, int) or _PLAIN_KEY.match(p) else quoted(p) for p in parts]
    return ".".join(shown) or "body"


def check_value(value: Any) -> None:
    """Refuse what no route accepts anywhere in a parsed body (see the module docstring).

    Iterative, so it costs no Python stack however the value was built.
    """
    limit = max_depth()
    stack: list[tuple[Any, tuple, int]] = [(value, (), 0)]
    seen = 0
    while stack:
        item, path, depth = stack.pop()
        seen += 1
        if seen > MAX_BODY_ITEMS:
            raise _too_many()
        if isinstance(item, str):
            if _BAD_TEXT.search(item):
                raise BodyError(f"{_path(path)}: text must not contain NUL characters or lone surrogates.")
        elif isinstance(item, bool) or item is None:
            pass
        elif isinstance(item, int):
            if not INT_MIN <= item <= INT_MAX:
                raise BodyError(f"{_path(path)}: number out of range.")
        elif isinstance(item, float):
            if not math.isfinite(item):
                raise BodyError(f"{_path(path)}: numbers must be finite.")
        elif isinstance(item, (dict, list)):
            if depth >= limit:
                raise _too_deep()
            if isinstance(item, dict):
                for key, child in item.items():
                    if not isinstance(key, str):
                        raise BodyError(f"{_path(path)}: keys must be strings, not {quoted(key)}.")
                    if _BAD_TEXT.search(key):
                        raise BodyError(f"{_path(path)}: key {quoted(key)} must not contain NUL characters "
                                        "or lone surrogates.")
                    stack.append((child, path + (key,), depth + 1))
            else:
                stack.extend((child, path + (index,), depth + 1) for index, child in enumerate(item))
        elif item is OUT_OF_RANGE:
            raise BodyError(f"{_path(path)}: number out of range.")
        else:  # only YAML can build other types, and its constructor below does not
            raise BodyError(f"{_path(path)}: unsupported value.")


# -- JSON --------------------------------------------------------------------------------------------
def _json_depth_ok(text: str, limit: int) -> bool:
    """Bracket depth outside strings, without parsing (an unbalanced body fails in json.loads)."""
    depth = 0
    for match in _JSON_BRACKET.finditer(_JSON_STRING.sub("", text)):
        if match.group() in "[{":
            depth += 1
            if depth > limit:
                return False
        else:
            depth -= 1
    return True


def _json_int(digits: str) -> int | _OutOfRange:
    return int(digits) if len(digits) <= MAX_NUMBER_CHARS else OUT_OF_RANGE


def load_json(raw: bytes) -> Any:
    text = _decode(raw, "JSON")
    if not _json_depth_ok(text, max_depth()):
        raise _too_deep()
    try:
        value = json.loads(text, parse_int=_json_int)
    except RecursionError as exc:  # not reachable after the scan; kept so a miss is a 400, not a 500
        raise _too_deep() from exc
    except ValueError as exc:
        raise BodyError(f"Body is not valid JSON: {exc}") from exc
    check_value(value)
    return value


class BoundedJSONParser(BaseParser):
    media_type = "application/json"

    def parse(self, stream, media_type=None, parser_context=None) -> Any:
        _check_content_length(parser_context)
        return load_json(_read_bounded(stream))


# -- YAML --------------------------------------------------------------------------------------------
class _JsonResolver(Resolver):
    """YAML 1.1's implicit types minus timestamps: `2026-01-01` stays the string JSON would give."""


_JsonResolver.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:timestamp"]
    for first, resolvers in Resolver.yaml_implicit_resolvers.items()
}


class _JsonConstructor(SafeConstructor):
    """Builds only JSON's types; any other tag (`!!binary`, `!!set`, `!!python/...`) is an error."""

    yaml_constructors: dict = {}

    def construct_yaml_int(self, node):
        if len(node.value) > MAX_NUMBER_CHARS:
            return OUT_OF_RANGE
        return super().construct_yaml_int(node)

    def construct_yaml_float(self, node):
        if len(node.value) > MAX_NUMBER_CHARS:
            return OUT_OF_RANGE
        return super().construct_yaml_float(node)


for _tag, _method in [("null", "construct_yaml_null"), ("bool", "construct_yaml_bool"),
                      ("int", "construct_yaml_int"), ("float", "construct_yaml_float"),
                      ("str", "construct_yaml_str"), ("seq", "construct_yaml_seq"),
                      ("map", "construct_yaml_map")]:
    _JsonConstructor.add_constructor(f"tag:yaml.org,2002:{_tag}", getattr(_JsonConstructor, _method))
_JsonConstructor.add_constructor(None, SafeConstructor.construct_undefined)


class _StrictComposer(Composer):
    """PyYAML's composer with three refusals, checked on each event before its node is built."""

    def compose_node(self, parent, index):
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None) is not None:
            mark = event.start_mark
            raise BodyError(f"YAML anchors and aliases are not accepted (line {mark.line + 1}, "
                            f"column {mark.column + 1}).")
        self._nodes += 1
        if self._nodes > MAX_BODY_ITEMS:
            raise _too_many()
        if isinstance(event, (yaml.SequenceStartEvent, yaml.MappingStartEvent)):
            self._depth += 1
            if self._depth > self._max_depth:
                raise _too_deep()
            try:
                return super().compose_node(parent, index)
            finally:
                self._depth -= 1
        return super().compose_node(parent, index)


class _StrictLoader(_StrictComposer, CParser, _JsonConstructor, _JsonResolver):
    """libyaml's parser (the pure-Python one took 1.8 s for a 120 KB list) under our composer."""

    def __init__(self, stream: str):
        CParser.__init__(self, stream)
        _StrictComposer.__init__(self)
        _JsonConstructor.__init__(self)
        _JsonResolver.__init__(self)
        self._nodes = 0
        self._depth = 0
        self._max_depth = max_depth()


def load_yaml(raw: bytes) -> Any:
    text = _decode(raw, "YAML")
    loader = _StrictLoader(text)
    try:
        value = loader.get_single_data()
    except (yaml.YAMLError, ValueError) as exc:
        # ConstructorError and the scanner's errors are YAMLErrors; ValueError covers a number that
        # Python refuses to convert. Only the first line: the rest quotes the document.
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise BodyError(f"Body is not valid YAML: {excerpt(reason, 160)}") from exc
    finally:
        loader.dispose()
    check_value(value)
    return value


class BoundedYAMLParser(BaseParser):
    """YAML bodies (`Content-Type: application/yaml`), read as JSON values (see the module docstring)."""

    media_type = "application/yaml"

    def parse(self, stream, media_type=None, parser_context=None) -> Any:
        _check_content_length(parser_context)
        return load_yaml(_read_bounded(stream))


class YAMLAliasParser(BoundedYAMLParser):
    """The older media type name (`application/x-yaml`); nothing to do with YAML's aliases."""

    media_type = "application/x-yaml"


class TextYAMLParser(BoundedYAMLParser):
    media_type = "text/yaml"
