"""The spec formats a job may be submitted in, and how one is told from another.

`whalezen` (broker/jobs/spec.py) passes through; a SkyPilot task file and a Kubernetes Pod, batch/v1
Job or Pod template are translated into it first. The format is declared with `?spec_format=`, else
detected from the document's shape: `apiVersion` and `kind` make a Kubernetes
manifest; a SkyPilot-only field (`run`, `setup`, `envs`, `num_nodes`, ...) or resources spelled
SkyPilot's way (`cpus`, `use_spot`, `infra`, `any_of`, ...) without a `command` make a SkyPilot task;
anything else is native.
"""
from __future__ import annotations

from typing import Any

from broker.jobs.formats.common import FieldProblem, FormatError, Translation
from broker.jobs.formats.kubernetes import looks_like_kubernetes, translate_kubernetes
from broker.jobs.formats.skypilot import looks_like_skypilot, translate_skypilot

FORMATS = ("whalezen", "skypilot", "kubernetes")

__all__ = ["FORMATS", "FieldProblem", "FormatError", "Translation", "detect_format", "translate"]


def detect_format(doc: dict[str, Any]) -> str:
    if looks_like_kubernetes(doc):
        return "kubernetes"
    if looks_like_skypilot(doc):
        return "skypilot"
    return "whalezen"


def translate(doc: Any, *, declared: str | None = None) -> tuple[str, Translation]:
    """(format, the native spec with warnings and problems). Raises FormatError by field."""
    if not isinstance(doc, dict):
        raise FormatError({"non_field_errors": "A job spec must be a mapping (a JSON object or a YAML mapping)."})
    if declared is not None and declared not in FORMATS:
        raise FormatError({"spec_format": f"One of {', '.join(FORMATS)}."})
    fmt = declared or detect_format(doc)
    if fmt == "kubernetes":
        return fmt, translate_kubernetes(doc)
    if fmt == "skypilot":
        return fmt, translate_skypilot(doc)
    return fmt, Translation(spec=dict(doc))
