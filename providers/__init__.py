"""WhaleZen provider adapters: one package per provider behind `providers.base.Provider`."""
from providers.base import (
    ErrorKind,
    InstanceInfo,
    InstanceRef,
    InstanceState,
    Offer,
    Provider,
    ProviderError,
    ProvisionRequest,
    derive_request_key,
)
from providers.registry import build_provider, provider_class, provider_kinds

__all__ = [
    "ErrorKind",
    "InstanceInfo",
    "InstanceRef",
    "InstanceState",
    "Offer",
    "Provider",
    "ProviderError",
    "ProvisionRequest",
    "build_provider",
    "derive_request_key",
    "provider_class",
    "provider_kinds",
]
