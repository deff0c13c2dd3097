"""Selector: the cloud offers a tenant can launch now, as `scheduling.CloudOffer`s.

Offers come from each enabled cloud pool's provider (catalog prices), minus places blocked after a
capacity or quota error; `launchable` is what the pool's instance quota still allows. All offers of
a pool share that quota: they carry the pool as their `launch_group`, and `pool_launch_limits` says
how many more instances each group may launch, whatever their types (issue 8 item 9).
"""
from __future__ import annotations

import functools
import hashlib
import logging
from dataclasses import dataclass
from typing import Sequence

from django.core.cache import cache
from django.utils import timezone

from broker.inventory.models import CloudInstance, InstanceState, OfferBlock, Pool, PoolKind
from broker.inventory.selectors import pool_teams
from broker.inventory.services import gpu_model_resolve
from broker.provisioning.factory import provider_for_pool
from broker.tenancy.models import Tenant
from providers.base import FAST_FABRICS, Offer, ProviderError
from providers.catalog.availability import AvailabilityReport, AwsAvailability, GcpAvailability, refresh_availability
from scheduling import model as sm

log = logging.getLogger(__name__)
CLOUD_KINDS = (PoolKind.AWS, PoolKind.GCP, PoolKind.LOCAL)
# An instance in any other state is one the broker gave up on (or never had): its one-time token
# admits nothing and its node never comes back (broker.agents.services.node_given_up).
LIVE_INSTANCE_STATES = (InstanceState.REQUESTED, InstanceState.PENDING, InstanceState.RUNNING)
# What counts against a pool's max_instances: everything we may be paying for, so an instance
# whose termination the provider has not confirmed yet still holds its place.
CAPPED_INSTANCE_STATES = LIVE_INSTANCE_STATES + (InstanceState.TERMINATING,)
# Refreshed by the provisioning.refresh_offers task; a cycle refreshes on its own when the cache is cold.
OFFER_CACHE_SECONDS = 3600
# A cloud pool's provider_config key: the container runtimes its machine image comes with (what the
# agent on a new instance will find), so the engine may rent it for a job with an image.
POOL_RUNTIMES_KEY = "container_runtimes"
CONTAINER_RUNTIMES = ("podman", "docker", "apptainer", "singularity")  # agent/runtimes.py RUNTIME_NAMES


@dataclass(frozen=True)
class OfferRef:
    pool: Pool
    offer: Offer


def _cache_key(pool: Pool) -> str:
    config = hashlib.sha1(repr(sorted(pool.provider_config.items())).encode()).hexdigest()
    return f"wz:offers:{pool.pk}:{config}"


def _availability_source(pool: Pool, provider):
    """Where a provider says which types are sold in which zones now (None: the catalogue is all we have)."""
    if pool.kind == PoolKind.AWS:
        return AwsAvailability(provider.client)
    if pool.kind == PoolKind.GCP and pool.provider_config.get("project"):
        return GcpAvailability(provider.accelerator_types_client(), pool.provider_config["project"])
    return None


def pool_offers_refresh(*, pool: Pool) -> AvailabilityReport:
    """Catalogue offers of the pool with today's availability from the provider's API, cached."""
    provider = provider_for_pool(pool)
    offers = provider.list_offers()
    source = _availability_source(pool, provider)
    report = refresh_availability(offers, source) if source is not None else AvailabilityReport(offers=list(offers))
    cache.set(_cache_key(pool), report.offers, OFFER_CACHE_SECONDS)
    return report


def _pool_offers(pool: Pool) -> list[Offer]:
    offers = cache.get(_cache_key(pool))
    if offers is None:
        try:
            offers = pool_offers_refresh(pool=pool).offers
        except ProviderError as exc:
            log.warning("offers of pool %s unavailable: %s", pool, exc)
            return []
    return offers


def pool_container_runtimes(pool: Pool) -> tuple[str, ...]:
    """The runtimes an instance of this pool will have (docs/providers.md, "Container images").

    `provider_config["container_runtimes"]` says so for a custom machine image. Without it: AWS's
    default image (the Deep Learning Base OSS Nvidia Driver AMI) ships Docker and the NVIDIA container
    toolkit; GCP's default (plain Debian 12) and a custom image nothing; the local simulator's agents
    run on this machine and find what it has."""
    config = pool.provider_config or {}
    if POOL_RUNTIMES_KEY in config:
        value = config[POOL_RUNTIMES_KEY]
        if isinstance(value, list) and all(v in CONTAINER_RUNTIMES for v in value):
            return tuple(value)
        log.warning("pool %s: provider_config %s must list some of %s; taking none", pool, POOL_RUNTIMES_KEY,
                    ", ".join(CONTAINER_RUNTIMES))
        return ()
    if pool.kind == PoolKind.LOCAL:
        return _this_machines_runtimes()
    if pool.kind == PoolKind.AWS and not config.get("image_ids"):
        return ("docker",)
    return ()


@functools.lru_cache(maxsize=1)
def _this_machines_runtimes() -> tuple[str, ...]:
    # What a local instance's agent detects at its start (it runs here); once per process, since
    # detection runs `docker info`.
    from agent.runtimes import detect

    return tuple(r.name for r in detect(None))


def offer_id(pool: Pool, offer: Offer) -> str:
    return f"{pool.pk}:{offer.region}:{offer.zone}:{offer.instance_type}:{offer.gpu_model}:{offer.gpu_count}"


def launch_group(pool: Pool) -> str:
    return f"pool:{pool.pk}"


def pool_instances_capped(*, pool: Pool) -> int:
    """Instances counted against the pool's max_instances now."""
    return CloudInstance.objects.filter(pool=pool, state__in=CAPPED_INSTANCE_STATES).count()


def _owned_by(tenant: Tenant | None, tenants: Sequence[Tenant] | None) -> list[int]:
    """The owners whose cloud pools a cycle rents through: one tenant, or a scheduling component's teams
    (every pool a team of the component may use is owned by one of them)."""
    return [t.pk for t in tenants] if tenants is not None else [tenant.pk] if tenant is not None else []


def pool_launch_limits(*, tenant: Tenant | None = None,
                       tenants: Sequence[Tenant] | None = None) -> tuple[sm.LaunchLimit, ...]:
    """How many more instances each of the tenant's (or the component's) cloud pools may launch (all
    types together)."""
    return tuple(sm.LaunchLimit(launch_group(pool), max(0, pool.max_instances - pool_instances_capped(pool=pool)))
                 for pool in Pool.objects.filter(tenant_id__in=_owned_by(tenant, tenants), kind__in=CLOUD_KINDS)
                 .order_by("pk"))


def cloud_offers(*, tenant: Tenant | None = None, tenants: Sequence[Tenant] | None = None
                 ) -> tuple[tuple[sm.CloudOffer, ...], dict[str, OfferRef]]:
    """Offers of the tenant's (or the component's) cloud pools. Each says which teams may rent through
    it (`CloudOffer.tenants`: the pool's owner and the teams it is shared with)."""
    now = timezone.now()
    result: list[sm.CloudOffer] = []
    index: dict[str, OfferRef] = {}
    pools = list(Pool.objects.filter(tenant_id__in=_owned_by(tenant, tenants), enabled=True, kind__in=CLOUD_KINDS,
                                     max_instances__gt=0).order_by("pk"))
    teams_of_pool = pool_teams(pool.pk for pool in pools)
    for pool in pools:
        launchable = max(0, pool.max_instances - pool_instances_capped(pool=pool))
        blocked = set(OfferBlock.objects.filter(pool=pool, until__gt=now)
                      .values_list("region", "zone", "instance_type"))
        for offer in _pool_offers(pool):
            if not offer.available or offer.gpu_count <= 0:
                continue
            if (offer.region, offer.zone, offer.instance_type) in blocked or \
                    (offer.region, "", offer.instance_type) in blocked:
                continue
            model = gpu_model_resolve(offer.gpu_model)
            oid = offer_id(pool, offer)
            index[oid] = OfferRef(pool=pool, offer=offer)
            fabric = {f.lower() for f in offer.fabric}
            result.append(sm.CloudOffer(
                id=oid, provider=pool.kind, region=offer.region, zone=offer.zone,
                instance_type=offer.instance_type, gpu_model=model.name if model else offer.gpu_model,
                gpu_count=offer.gpu_count, gpu_memory_mb=offer.gpu_memory_mib,
                ondemand_price_per_hour=offer.on_demand_per_hour, spot_price_per_hour=offer.spot_per_hour,
                launchable=launchable, nvlink="nvlink" in fabric or "nvswitch" in fabric,
                fast_fabric=bool(fabric & FAST_FABRICS), vcpus=int(offer.vcpus),
                memory_mb=int(offer.memory_gib * 1024), launch_group=launch_group(pool),
                tenants=teams_of_pool.get(pool.pk, ()), container_runtimes=pool_container_runtimes(pool),
            ))
    result.sort(key=lambda o: o.id)
    return tuple(result), index


def pool_offer_models(pool: Pool) -> set[str]:
    """Catalogue names of the GPU models the pool's offers sell (what a team can rent through it)."""
    models = set()
    for offer in _pool_offers(pool):
        if offer.available and offer.gpu_count > 0:
            model = gpu_model_resolve(offer.gpu_model)
            models.add(model.name if model else offer.gpu_model)
    return models
