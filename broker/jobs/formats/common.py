"""What every foreign spec format translates into: the native spec, warnings, and blocking problems."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class FieldProblem:
    """One remark about one field of what the user sent, in the user's own field path."""

    field: str
    message: str

    def as_dict(self) -> dict[str, str]:
        return {"field": self.field, "message": self.message}


@dataclass
class Translation:
    """A foreign spec turned into the native one (broker/jobs/spec.py validates `spec` next).

    `warnings` are fields accepted that do not change a batch run (the response lists them);
    `problems` would block a real submission but not a dry run (an env value still to supply).
    """

    spec: dict[str, Any]
    warnings: list[FieldProblem] = field(default_factory=list)
    problems: list[FieldProblem] = field(default_factory=list)


class FormatError(Exception):
    """The document cannot be translated: {field path: message}, answered as a 400 by field. `literal`:
    keys of `errors` that are a top-level key as the user wrote it, not a path (an unknown key `a.b`
    is named `a.b`, not `b` inside `a`)."""

    def __init__(self, errors: dict[str, str], *, literal: frozenset[str] = frozenset()):
        super().__init__("; ".join(f"{k}: {v}" for k, v in errors.items()))
        self.errors = errors
        self.literal = literal
