"""Hostile request bodies, each built from a body the route accepts, so that a validator that lets one
through would really change something (and the suite's database digest would see it)."""
from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from bench.hostile_input import alias_bomb, job_alias_bomb

DEPTH = 10_000  # the nesting bomb
_MARK = "\x01hostile\x01"  # stands where a raw literal (a number JSON cannot spell) goes


@dataclass(frozen=True)
class Hostile:
    name: str
    content_type: str
    body: bytes

    def __repr__(self) -> str:  # what a failure report shows
        return f"<{self.name}, {self.content_type}, {len(self.body)} bytes>"


JSON, YAML = "application/json", "application/yaml"
CATEGORIES = ("alias bombs", "nesting bombs", "bad text", "huge strings", "huge numbers")


def _walk(value: Any, path: tuple = ()) -> Iterator[tuple[tuple, Any]]:
    """(path, value) of every value; a list is represented by its first item (they share a shape)."""
    yield path, value
    if isinstance(value, dict):
        for key, child in value.items():
            yield from _walk(child, path + (key,))
    elif isinstance(value, list) and value:
        yield from _walk(value[0], path + (0,))


def _replaced(base: Any, path: tuple, new: Any) -> Any:
    out = copy.deepcopy(base)
    if not path:
        return new
    target = out
    for part in path[:-1]:
        target = target[part]
    target[path[-1]] = new
    return out


def _with_key(base: dict, path: tuple, key: str) -> Any:
    out = copy.deepcopy(base)
    target = out
    for part in path:
        target = target[part]
    target[key] = "x"
    return out


def _dotted(path: tuple) -> str:
    return ".".join(map(str, path)) or "(top)"


def _raw(base: Any, path: tuple, literal: str) -> bytes:
    """`base` as JSON with the value at `path` written as `literal` (e.g. 1e999 or a 5,000-digit int)."""
    return json.dumps(_replaced(base, path, _MARK)).replace(json.dumps(_MARK), literal).encode()


def _strings(base: Any) -> list[tuple]:
    return [path for path, value in _walk(base) if isinstance(value, str)]


def _numbers(base: Any) -> list[tuple]:
    return [path for path, value in _walk(base)
            if isinstance(value, (int, float)) and not isinstance(value, bool)]


def _dicts(base: Any) -> list[tuple]:
    return [path for path, value in _walk(base) if isinstance(value, dict)]


def alias_bombs(base: dict) -> list[Hostile]:
    # A valid body whose first field carries an anchor: refused although nothing would expand.
    first, *rest = base.items()
    small = "\n".join([f"{json.dumps(first[0])}: &a {json.dumps(first[1])}",
                        *(f"{json.dumps(k)}: {json.dumps(v)}" for k, v in rest)])
    return [Hostile("YAML alias bomb (registration, 490 bytes)", YAML, alias_bomb()),
            Hostile("YAML alias bomb (job spec)", YAML, job_alias_bomb()),
            Hostile("YAML alias bomb, 12 levels (9^12 nodes if expanded)", "application/x-yaml",
                    alias_bomb(levels=12)),
            Hostile("YAML alias bomb as text/yaml", "text/yaml", alias_bomb()),
            Hostile("an anchor on a field of a valid body", YAML, small.encode())]


def nesting_bombs(base: dict) -> list[Hostile]:
    deep_list = "[" * DEPTH + "]" * DEPTH
    deep_map_json = '{"a":' * DEPTH + "1" + "}" * DEPTH
    deep_map_yaml = "{a: " * DEPTH + "1" + "}" * DEPTH
    first_field = next(iter(base))
    in_body = json.dumps(_replaced(base, (first_field,), _MARK)).replace(json.dumps(_MARK), deep_list)
    return [Hostile("JSON list 10,000 deep", JSON, deep_list.encode()),
            Hostile("JSON object 10,000 deep", JSON, deep_map_json.encode()),
            Hostile(f"JSON {first_field} 10,000 deep", JSON, in_body.encode()),
            Hostile("JSON 33 deep (one past the cap)", JSON, ("[" * 33 + "]" * 33).encode()),
            Hostile("YAML flow list 10,000 deep", YAML, deep_list.encode()),
            Hostile("YAML flow map 10,000 deep", YAML, deep_map_yaml.encode()),
            Hostile(f"YAML {first_field} 10,000 deep", YAML, in_body.encode())]


def bad_text(base: dict) -> list[Hostile]:
    out = []
    for path in _dicts(base):
        for key in ("\ud800", "k\x00", "\udfff"):
            body = json.dumps(_with_key(base, path, key)).encode()  # ensure_ascii: sent as \ud800 escapes
            out.append(Hostile(f"key {key!r} in {_dotted(path)}", JSON, body))
    for path in _strings(base):
        for value in ("\ud800", "a\x00b", "tail\udc00"):
            body = json.dumps(_replaced(base, path, value)).encode()
            out.append(Hostile(f"{value!r} as {_dotted(path)}", JSON, body))
    nul_yaml = "\n".join(f"{json.dumps(k)}: {json.dumps(v)}" for k, v in base.items()) + '\n"x\\0": "\\0"\n'
    out.append(Hostile("NUL in a YAML key and value", YAML, nul_yaml.encode()))
    return out


def huge_strings(base: dict, body_limit: int) -> list[Hostile]:
    out = []
    for path in _strings(base):
        room = body_limit - len(json.dumps(_replaced(base, path, ""))) - 16
        out.append(Hostile(f"{room:,}-character {_dotted(path)}", JSON,
                           json.dumps(_replaced(base, path, "x" * room)).encode()))
    room = body_limit - len(json.dumps(base)) - 32
    out.append(Hostile(f"{room:,}-character key", JSON, json.dumps({**base, "k" * room: 1}).encode()))
    return out


def huge_numbers(base: dict) -> list[Hostile]:
    literals = ["1" + "0" * 5000, "-" + "9" * 4000, "1e999", "-1e999", str(2**63), "NaN", "Infinity"]
    paths = _numbers(base) + _strings(base)[:1]
    return [Hostile(f"{_excerpt(literal)} as {_dotted(path)}", JSON, _raw(base, path, literal))
            for path in paths for literal in literals]


def _excerpt(text: str) -> str:
    return text if len(text) <= 12 else f"{text[:6]}...({len(text)} chars)"


def hostile_bodies(category: str, base: dict, body_limit: int) -> list[Hostile]:
    if category == "alias bombs":
        return alias_bombs(base)
    if category == "nesting bombs":
        return nesting_bombs(base)
    if category == "bad text":
        return bad_text(base)
    if category == "huge strings":
        return huge_strings(base, body_limit)
    if category == "huge numbers":
        return huge_numbers(base)
    raise ValueError(category)
