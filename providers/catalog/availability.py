"""Refresh which catalog offers can be launched now, from the providers' own APIs.

Prices change rarely and come from the CSV; where a type is sold changes more often (new zones,
retired types). AWS says it through `describe_instance_type_offerings` per region, GCP through
the accelerator types list. A later issue runs `refresh_availability` periodically.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Protocol, Sequence

from providers.base import Offer
from providers.catalog.families import GCP_ACCELERATOR_TYPES

log = logging.getLogger(__name__)


class AvailabilitySource(Protocol):
    provider: str

    def offered(self, region: str) -> set[tuple[str, str]]:
        """(zone, item) pairs sold in `region`; item is an instance type (AWS) or GPU model (GCP)."""
        ...


class AwsAvailability:
    """`describe_instance_type_offerings` per region, by zone name and by zone id (the public
    catalog uses ids like use1-az1, which name the same physical zone in every account)."""

    provider = "aws"

    def __init__(self, ec2_client_for_region: Callable[[str], Any]) -> None:
        self._client_for = ec2_client_for_region

    def offered(self, region: str) -> set[tuple[str, str]]:
        client = self._client_for(region)
        pairs: set[tuple[str, str]] = set()
        for location_type in ("availability-zone", "availability-zone-id"):
            paginator = client.get_paginator("describe_instance_type_offerings")
            for page in paginator.paginate(LocationType=location_type):
                for item in page.get("InstanceTypeOfferings", []):
                    pairs.add((item["Location"], item["InstanceType"]))
        return pairs


class GcpAvailability:
    """The accelerator types of every zone of the project (one aggregated list call)."""

    provider = "gcp"

    def __init__(self, accelerator_types_client: Any, project: str) -> None:
        self._client = accelerator_types_client
        self._project = project
        self._cache: set[tuple[str, str]] | None = None

    def offered(self, region: str) -> set[tuple[str, str]]:
        if self._cache is None:
            by_type = {v: k for k, v in GCP_ACCELERATOR_TYPES.items()}
            pairs: set[tuple[str, str]] = set()
            for scope, scoped in self._client.aggregated_list(project=self._project):
                for accelerator in scoped.accelerator_types:
                    zone = accelerator.zone.rsplit("/", 1)[-1] or scope.rsplit("/", 1)[-1]
                    if accelerator.name in by_type:
                        pairs.add((zone, by_type[accelerator.name]))
            self._cache = pairs
        return {(zone, gpu) for zone, gpu in self._cache if zone.startswith(region + "-")}


@dataclass
class AvailabilityReport:
    offers: list[Offer]
    became_unavailable: int = 0
    became_available: int = 0
    errors: list[str] = field(default_factory=list)  # regions we could not check (offers kept)


def _is_offered(offer: Offer, offered: set[tuple[str, str]]) -> bool:
    item = offer.instance_type if offer.provider == "aws" else offer.gpu_model
    if offer.zone:
        return (offer.zone, item) in offered
    return any(name == item for _, name in offered)  # region-wide row: any zone will do


def refresh_availability(offers: Sequence[Offer], provider_client: AvailabilitySource) -> AvailabilityReport:
    """Return `offers` with `available` set from the provider's API, for offers of that provider.
    A region whose query fails keeps its previous availability (and is listed in `errors`):
    an API hiccup must not make the solver think the whole cloud vanished."""
    report = AvailabilityReport(offers=[])
    regions = sorted({o.region for o in offers if o.provider == provider_client.provider})
    offered_by_region: dict[str, set[tuple[str, str]]] = {}
    for region in regions:
        try:
            offered_by_region[region] = provider_client.offered(region)
        except Exception as exc:  # any API failure: keep what we had for this region
            report.errors.append(f"{provider_client.provider} {region}: {type(exc).__name__}")
            log.warning("availability refresh failed for %s %s: %s", provider_client.provider, region, type(exc).__name__)
    for offer in offers:
        offered = offered_by_region.get(offer.region) if offer.provider == provider_client.provider else None
        if offered is None:
            report.offers.append(offer)
            continue
        available = _is_offered(offer, offered)
        if available != offer.available:
            if available:
                report.became_available += 1
            else:
                report.became_unavailable += 1
        report.offers.append(dataclasses.replace(offer, available=available))
    return report


def available_only(offers: Iterable[Offer]) -> list[Offer]:
    return [o for o in offers if o.available]
