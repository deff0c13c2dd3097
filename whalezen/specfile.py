"""Reading a spec file (YAML or JSON) the way the server reads a body, before anything is sent.

DESIGN.md's rules for YAML and JSON hold on this side too, so a hostile file cannot make the CLI
expand an alias bomb or recurse without end:
- YAML anchors and aliases are refused when the composer meets the first one (never expanded);
- lists and objects nested deeper than `MAX_DEPTH` levels, or more than `MAX_VALUES` values, are refused
  while composing (YAML) or by a scan of the raw text before parsing (JSON);
- YAML gives only JSON's types: no tags (`!!python/...`, `!!binary`, `!!set`), dates stay strings;
- one document per file; at most `MAX_BYTES` bytes.
The server checks all of it again; this side only gives a clearer message, sooner.
"""
from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path
from typing import Any

import yaml
from yaml.composer import Composer
from yaml.constructor import SafeConstructor
from yaml.resolver import Resolver

from whalezen.errors import SpecError

try:  # libyaml's parser when PyYAML was built with it (fast); the pure-Python one otherwise
    from yaml.cyaml import CParser as _Parser
except ImportError:  # pragma: no cover - depends on how PyYAML was built
    from yaml.parser import Parser as _Parser  # type: ignore[assignment]
    from yaml.reader import Reader as _Reader
    from yaml.scanner import Scanner as _Scanner
else:
    _Reader = _Scanner = None  # type: ignore[assignment,misc]

MAX_DEPTH = 32  # the server's default WHALEZEN_MAX_BODY_DEPTH
MAX_VALUES = 20_000
MAX_BYTES = 1024 * 1024  # the server refuses bodies over its own limit (256 KiB by default) anyway
_JSON_STRING = re.compile(r'"(?:[^"\\]++|\\.)*+"', re.S)
_JSON_BRACKET = re.compile(r"[\[\]{}]")


class _Resolver(Resolver):
    """YAML 1.1's implicit types minus timestamps: `2026-01-01` stays a string, as in JSON."""


_Resolver.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:timestamp"]
    for first, resolvers in Resolver.yaml_implicit_resolvers.items()
}


class _Constructor(SafeConstructor):
    yaml_constructors: dict = {}


for _tag in ("null", "bool", "int", "float", "str", "seq", "map"):
    _Constructor.add_constructor(f"tag:yaml.org,2002:{_tag}", getattr(SafeConstructor, f"construct_yaml_{_tag}"))
_Constructor.add_constructor(None, SafeConstructor.construct_undefined)  # type: ignore[arg-type]


class _Composer(Composer):
    def compose_node(self, parent, index):
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None) is not None:
            mark = event.start_mark
            raise SpecError(f"line {mark.line + 1}, column {mark.column + 1}: YAML anchors and aliases "
                            "are not accepted")
        self._values += 1
        if self._values > MAX_VALUES:
            raise SpecError(f"it holds more than {MAX_VALUES} values")
        if isinstance(event, (yaml.SequenceStartEvent, yaml.MappingStartEvent)):
            self._depth += 1
            if self._depth > MAX_DEPTH:
                mark = event.start_mark
                raise SpecError(f"line {mark.line + 1}: nested deeper than {MAX_DEPTH} levels")
            try:
                return super().compose_node(parent, index)
            finally:
                self._depth -= 1
        return super().compose_node(parent, index)


if _Reader is None:
    class _Loader(_Composer, _Parser, _Constructor, _Resolver):  # type: ignore[misc,valid-type]
        def __init__(self, stream: str) -> None:
            _Parser.__init__(self, stream)
            _Composer.__init__(self)
            _Constructor.__init__(self)
            _Resolver.__init__(self)
            self._values = 0
            self._depth = 0
else:  # pragma: no cover
    class _Loader(_Reader, _Scanner, _Parser, _Composer, _Constructor, _Resolver):  # type: ignore[no-redef]
        def __init__(self, stream: str) -> None:
            _Reader.__init__(self, stream)
            _Scanner.__init__(self)
            _Parser.__init__(self)
            _Composer.__init__(self)
            _Constructor.__init__(self)
            _Resolver.__init__(self)
            self._values = 0
            self._depth = 0


def load_yaml(text: str) -> Any:
    loader = _Loader(text)
    try:
        if not loader.check_node():
            raise SpecError("it is empty")
        node = loader.get_node()
        if loader.check_node():
            raise SpecError("it holds more than one YAML document: submit one spec per file")
        return loader.construct_document(node)
    except SpecError:
        raise
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        raise SpecError(f"not valid YAML: {where}{exc.problem or exc.context or 'cannot parse'}") from None
    except (yaml.YAMLError, ValueError, RecursionError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise SpecError(f"not valid YAML: {first[:160]}") from None
    finally:
        loader.dispose()


def load_json(text: str) -> Any:
    depth = 0
    for match in _JSON_BRACKET.finditer(_JSON_STRING.sub("", text)):
        depth += 1 if match.group() in "[{" else -1
        if depth > MAX_DEPTH:
            raise SpecError(f"nested deeper than {MAX_DEPTH} levels")
    try:
        value = json.loads(text)
    except RecursionError:
        raise SpecError(f"nested deeper than {MAX_DEPTH} levels") from None
    except ValueError as exc:
        raise SpecError(f"not valid JSON: {exc}") from None
    _check(value)
    return value


def _check(value: Any) -> None:
    stack = [value]
    seen = 0
    while stack:
        item = stack.pop()
        seen += 1
        if seen > MAX_VALUES:
            raise SpecError(f"it holds more than {MAX_VALUES} values")
        if isinstance(item, float) and not math.isfinite(item):
            raise SpecError("numbers must be finite (no NaN or Infinity)")
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


def parse(text: str, *, name: str = "") -> dict[str, Any]:
    """A spec from text: JSON when the file is `.json` or the text starts with `{`, else YAML."""
    stripped = text.lstrip("\ufeff \t\r\n")
    if name.lower().endswith(".json") or stripped.startswith("{"):
        value = load_json(stripped)
    else:
        value = load_yaml(text)
    if not isinstance(value, dict):
        raise SpecError(f"a spec is a mapping of fields (name, command, resources, ...), not a {_kind(value)}")
    return value


def read(path: str) -> dict[str, Any]:
    """Read and parse a spec file (`-`: standard input). Raises SpecError with a one-line reason."""
    try:
        if path == "-":
            raw = sys.stdin.buffer.read(MAX_BYTES + 1)
        else:
            with Path(path).open("rb") as f:
                raw = f.read(MAX_BYTES + 1)
    except OSError as exc:
        raise SpecError(f"cannot read it: {exc.strerror or exc}") from None
    if len(raw) > MAX_BYTES:
        raise SpecError(f"it is larger than {MAX_BYTES} bytes")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SpecError(f"it is not UTF-8 text (byte {exc.start})") from None
    return parse(text, name=path)


def _kind(value: Any) -> str:
    return {list: "list", str: "string", int: "number", float: "number", bool: "boolean"}.get(type(value), "null")
