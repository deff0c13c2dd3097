"""The provider contract: one tiny base class and the frozen values that cross it.

Modelled on healthchecks' transports: every provider is a small package implementing
`Provider`; the broker only ever sees the dataclasses below and `ProviderError`.
Nothing here (or in any provider) imports `broker` or Django.
"""
from __future__ import annotations

import hashlib
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from datetime import datetime
from enum import Enum
from typing import ClassVar, Mapping

# Tag keys written on everything we create (AWS tags). GCP label keys cannot contain ':',
# so providers.gcp uses the same names with '-' (see providers.gcp.labels).
TAG_BROKER = "whalezen:broker"
TAG_ALLOCATION = "whalezen:allocation"
TAG_REQUEST = "whalezen:request"
TAG_ATTEMPT = "whalezen:attempt"
TAG_NODE_NAME = "whalezen:node"
TAG_CREATED = "whalezen:created"


class ErrorKind(str, Enum):
    CAPACITY = "capacity"        # no machines of that shape there right now
    QUOTA = "quota"              # our account may not have more there
    AUTH = "auth"                # credentials wrong, expired or not allowed
    BAD_REQUEST = "bad_request"  # the request itself is wrong (type, image, parameters)
    TRANSIENT = "transient"      # throttling, timeouts, 5xx: the same call may work later
    NOT_FOUND = "not_found"      # the thing asked about does not exist


# Capacity and quota are properties of one (provider, region, zone, type): the broker should
# block that place for a while and fail over. Everything else is not fixed by moving.
_RETRY_ELSEWHERE_BY_DEFAULT = {ErrorKind.CAPACITY, ErrorKind.QUOTA}


class ProviderError(Exception):
    """The one error a provider raises. `kind` says what happened, `retry_elsewhere` whether the
    broker should block this place and try another zone, region or cloud."""

    def __init__(
        self,
        kind: ErrorKind,
        message: str,
        *,
        retry_elsewhere: bool | None = None,
        provider: str = "",
        code: str = "",
    ) -> None:
        super().__init__(message)
        self.kind = ErrorKind(kind)
        self.message = message
        self.retry_elsewhere = (
            self.kind in _RETRY_ELSEWHERE_BY_DEFAULT if retry_elsewhere is None else retry_elsewhere
        )
        self.provider = provider
        self.code = code  # the provider's own error code, e.g. InsufficientInstanceCapacity

    def __reduce__(self) -> tuple[object, ...]:
        # Celery and multiprocessing pickle exceptions; keep kind/retry_elsewhere across that.
        return (_rebuild_provider_error, (self.kind.value, self.message, self.retry_elsewhere, self.provider, self.code))

    @property
    def permanent(self) -> bool:
        """True when repeating the same call unchanged cannot succeed."""
        return self.kind in (ErrorKind.AUTH, ErrorKind.BAD_REQUEST, ErrorKind.NOT_FOUND)

    def __str__(self) -> str:
        where = f"{self.provider}: " if self.provider else ""
        code = f" [{self.code}]" if self.code else ""
        return f"{where}{self.kind.value}{code}: {self.message}"


def _rebuild_provider_error(kind: str, message: str, retry_elsewhere: bool, provider: str, code: str) -> ProviderError:
    return ProviderError(ErrorKind(kind), message, retry_elsewhere=retry_elsewhere, provider=provider, code=code)


class InstanceState(str, Enum):
    PENDING = "pending"
    RUNNING = "running"
    STOPPING = "stopping"
    STOPPED = "stopped"
    TERMINATING = "terminating"
    # Confirmed by the provider: it says terminated, or it no longer knows the instance.
    TERMINATED = "terminated"
    UNKNOWN = "unknown"

    @property
    def is_gone(self) -> bool:
        return self is InstanceState.TERMINATED


# Interconnects between nodes fast enough for a multi-node gang: an offer's `fabric` entry among these
# makes it a fast-fabric offer, and a node's `fabric` label among these a fast-fabric node.
FAST_FABRICS = frozenset({"infiniband", "efa", "roce", "gpudirect-tcpx", "gpudirect-tcpxo"})


@dataclass(frozen=True)
class Offer:
    """One thing that can be rented (or, on-prem, used) at a price, in one place."""

    provider: str
    region: str
    zone: str  # "" = any zone of the region
    instance_type: str
    gpu_model: str
    gpu_count: int
    gpu_memory_mib: int  # per GPU
    vcpus: float
    memory_gib: float
    on_demand_per_hour: float
    spot_per_hour: float | None = None  # None: no spot offer (or not trustworthy)
    fabric: tuple[str, ...] = ()  # e.g. ("efa", "nvlink"); () = PCIe only or unknown
    available: bool = True

    def price_per_hour(self, *, spot: bool) -> float | None:
        return self.spot_per_hour if spot else self.on_demand_per_hour

    @property
    def key(self) -> tuple[str, str, str, str, str, int]:
        # GCP N1 hosts take different attached GPUs, so the type alone is not unique.
        return (self.provider, self.region, self.zone, self.instance_type, self.gpu_model, self.gpu_count)


@dataclass(frozen=True)
class ProvisionRequest:
    """What the broker asks for. `request_key` is the idempotency key: the broker stores it
    BEFORE calling `provision`, and calling again with the same key never makes a second
    instance. Build it with `derive_request_key`."""

    request_key: str
    allocation_id: str
    attempt: int
    region: str
    zone: str
    instance_type: str
    agent_server_url: str
    agent_join_token: str = field(repr=False)  # a secret: never in repr or logs
    node_name: str = ""
    spot: bool = False
    gpu_model: str = ""
    gpu_count: int = 0
    image: str = ""  # provider-specific image; "" = the provider's configured default
    max_spot_price: float | None = None
    extra_tags: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class InstanceRef:
    provider: str
    region: str
    zone: str
    instance_id: str


@dataclass(frozen=True)
class InstanceInfo:
    ref: InstanceRef
    state: InstanceState
    instance_type: str = ""
    spot: bool = False
    request_key: str = ""  # from our tag/label; "" when the instance has none
    launched_at: datetime | None = None
    private_ip: str = ""
    public_ip: str = ""
    tags: tuple[tuple[str, str], ...] = ()
    # Why it stopped, when the provider says (e.g. spot interruption).
    state_reason: str = ""

    def tag(self, key: str, default: str = "") -> str:
        return dict(self.tags).get(key, default)


class Provider(ABC):
    """Base class of every provider. Subclasses set `kind` and implement five methods.

    Rules every implementation keeps:
    - `provision` is idempotent on `request.request_key`: it first looks for an instance that
      already carries that key and returns it; every instance is tagged at creation with the
      broker id and request key, so a lost record can be adopted and a leak found.
    - `describe`/`terminate` never claim TERMINATED unless the provider confirmed it
      (it says so, or no longer knows the instance).
    - Failures raise `ProviderError`; credentials never appear in messages or logs.
    """

    kind: ClassVar[str] = ""

    def __init__(self, *, broker_id: str) -> None:
        if not broker_id:
            raise ValueError("broker_id is required: it is the tag that says what we own")
        self.broker_id = broker_id

    @abstractmethod
    def list_offers(self) -> list[Offer]: ...

    @abstractmethod
    def provision(self, request: ProvisionRequest) -> InstanceInfo: ...

    @abstractmethod
    def describe(self, ref: InstanceRef) -> InstanceInfo: ...

    @abstractmethod
    def terminate(self, ref: InstanceRef) -> InstanceInfo: ...

    @abstractmethod
    def list_owned(self) -> list[InstanceInfo]: ...

    def broker_tags(self, request: ProvisionRequest, *, created_at: datetime | None = None) -> dict[str, str]:
        """The tags every created resource carries (AWS spelling; GCP converts them). They are a
        pure function of the request (plus `created_at` where the provider has no launch time
        of its own), so a retry sends identical parameters: AWS rejects a reused ClientToken
        whose parameters changed (IdempotentParameterMismatch)."""
        tags = dict(request.extra_tags)
        tags.update(
            {
                TAG_BROKER: self.broker_id,
                TAG_ALLOCATION: request.allocation_id,
                TAG_REQUEST: request.request_key,
                TAG_ATTEMPT: str(request.attempt),
            }
        )
        if created_at is not None:
            tags[TAG_CREATED] = created_at.strftime("%Y-%m-%dT%H:%M:%SZ")
        if request.node_name:
            tags[TAG_NODE_NAME] = request.node_name
        return tags


_KEY_UNSAFE = re.compile(r"[^a-z0-9-]+")


def derive_request_key(
    *, allocation_id: str, attempt: int, provider: str, instance_type: str, zone: str
) -> str:
    """The idempotency key of one launch attempt: stable for the same inputs, different when any
    changes. At most 63 chars of [a-z0-9-] starting with a letter, so it is valid as an AWS
    ClientToken (<= 64 ASCII), a GCP label value and a file name. The broker stores it before
    calling `provision`."""
    digest = hashlib.sha256(
        "\x1f".join([allocation_id, str(attempt), provider, instance_type, zone]).encode()
    ).hexdigest()[:16]
    readable = _KEY_UNSAFE.sub("-", allocation_id.lower()).strip("-")[:30]
    return f"wz-{readable}-a{attempt}-{digest}"[:63] if readable else f"wz-a{attempt}-{digest}"


def tags_tuple(tags: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted(tags.items()))
