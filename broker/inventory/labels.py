"""Node labels in the Kubernetes label syntax, so a label means the same here as on a cluster.

Keys: an optional DNS-subdomain prefix (at most 253 characters) and '/', then a name of at most 63
characters of [A-Za-z0-9] with '-', '_', '.' inside. Values: empty, or the name syntax (at most 63).
https://kubernetes.io/docs/concepts/overview/working-with-objects/labels/#syntax-and-character-set
Agents send labels; the node API shows them; both use these checks.
"""
from __future__ import annotations

import re
from typing import Any

MAX_LABELS = 64
# Set by the Kubernetes bridge on each node it registers (agent/kube/bridge.py VISIBILITY_LABEL): whether
# it counts other namespaces' pods ("all-namespaces") or may not list them ("namespace-only").
POD_VISIBILITY_LABEL = "whalezen.io/pod-visibility"
_NAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?")
_DNS_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_PREFIX = re.compile(rf"{_DNS_LABEL}(\.{_DNS_LABEL})*")


def label_key_problem(key: Any) -> str | None:
    """Why `key` is not a valid label key, or None."""
    if not isinstance(key, str):
        return "must be a string"
    prefix, slash, name = key.rpartition("/")
    if slash and (not prefix or len(prefix) > 253 or not _PREFIX.fullmatch(prefix)):
        return "the prefix before '/' must be a lowercase DNS subdomain of at most 253 characters"
    if not _NAME.fullmatch(name):
        return ("the name must be 1 to 63 characters of letters and digits, with '-', '_' or '.' inside "
                "(Kubernetes label syntax)")
    return None


def label_value_problem(value: Any) -> str | None:
    """Why `value` is not a valid label value, or None."""
    if not isinstance(value, str):
        return "must be a string"
    if value and not _NAME.fullmatch(value):
        return ("must be empty or 1 to 63 characters of letters and digits, with '-', '_' or '.' inside "
                "(Kubernetes label syntax)")
    return None


def valid_labels(labels: Any) -> dict[str, str]:
    """The valid pairs of a stored label dict. Rows written before labels were validated may hold
    keys nothing can render (a lone surrogate); showing the rest keeps the node list working."""
    if not isinstance(labels, dict):
        return {}
    return {k: v for k, v in labels.items() if label_key_problem(k) is None and label_value_problem(v) is None}
