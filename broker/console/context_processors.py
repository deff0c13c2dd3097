"""Template context every console page shares."""
from __future__ import annotations

from django.urls import NoReverseMatch, reverse

# The main navigation, in order: (url name, label). `nav` in a view's context names the current one
# by its label in lower case.
NAV = [("console:jobs", "Jobs"), ("console:submit", "Submit"), ("console:nodes", "Nodes"),
       ("console:costs", "Costs"), ("console:team", "Team")]


def _routed() -> list[tuple[str, str]]:
    out = []
    for name, label in NAV:
        try:
            reverse(name)
        except NoReverseMatch:
            continue
        out.append((name, label))
    return out


def console(request) -> dict:
    return {"console_nav": _routed()} if getattr(request, "console", None) else {}
