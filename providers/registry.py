"""Providers by kind. Imports are lazy so that using `local` never pays for boto3 or the
Google client (the latter takes about a second to import)."""
from __future__ import annotations

import importlib
from typing import Any

from providers.base import Provider

# kind -> "module:Class"
_PROVIDER_PATHS: dict[str, str] = {
    "onprem": "providers.onprem.provider:OnPremProvider",
    "local": "providers.local.provider:LocalProvider",
    "aws": "providers.aws.provider:AwsProvider",
    "gcp": "providers.gcp.provider:GcpProvider",
}


def provider_kinds() -> list[str]:
    return sorted(_PROVIDER_PATHS)


def register_provider(kind: str, path: str) -> None:
    """Add a provider kind ("module:Class"); used by plugins and tests."""
    _PROVIDER_PATHS[kind] = path


def provider_class(kind: str) -> type[Provider]:
    try:
        module_name, class_name = _PROVIDER_PATHS[kind].split(":")
    except KeyError:
        raise KeyError(f"unknown provider kind {kind!r}; known: {provider_kinds()}") from None
    cls = getattr(importlib.import_module(module_name), class_name)
    if not (isinstance(cls, type) and issubclass(cls, Provider)):
        raise TypeError(f"{kind}: {cls!r} is not a Provider")
    return cls


def build_provider(kind: str, **config: Any) -> Provider:
    """Build a provider from plain config (what the broker stores per cloud account/pool)."""
    return provider_class(kind)(**config)
