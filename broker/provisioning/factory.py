"""Build the `providers` object for a pool from its stored, credential-free configuration."""
from __future__ import annotations

import sys
from typing import Any

from django.conf import settings

from broker.inventory.models import Pool, PoolKind
from providers.base import ErrorKind, Provider, ProviderError
from providers.registry import build_provider

# Built providers are kept per process: the local provider tracks its child processes, and the
# cloud ones hold HTTP connection pools.
_cache: dict[tuple[int, str, str, str, str], Provider] = {}


def _local_config(pool: Pool, config: dict[str, Any]) -> dict[str, Any]:
    from providers.local.provider import CloudSimulation, LocalShape, agent_command

    state_dir = settings.VAR_DIR / "local-provider" / f"pool-{pool.pk}"
    out: dict[str, Any] = {"state_dir": str(state_dir), "region": pool.region or "local",
                           # each simulated VM's agent keeps its identity in a directory of its own
                           "command_factory": agent_command(sys.executable, state_root=state_dir / "agents")}
    if "shapes" in config:
        out["shapes"] = tuple(LocalShape(**{**s, "fabric": tuple(s.get("fabric", ()))}) for s in config["shapes"])
    if "simulation" in config:
        out["simulation"] = CloudSimulation(**config["simulation"])
    if "zones" in config:
        out["zones"] = tuple(config["zones"])
    if "nice" in config:
        nice = config["nice"]
        if isinstance(nice, bool) or not isinstance(nice, int) or not 0 <= nice <= 19:
            raise TypeError(f"nice must be a whole number from 0 to 19, not {nice!r}")  # told as misconfigured
        out["nice"] = nice
    return out


def _aws_config(pool: Pool, config: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in config.items() if k in (
        "image_ids", "subnet_ids", "security_group_ids", "iam_instance_profile", "key_name", "root_volume_gib",
        "endpoint_url")}
    out["regions"] = config.get("regions") or [pool.region]
    if pool.credentials_ref:
        import boto3

        # The reference names an AWS profile; the secret itself never enters our database.
        out["session"] = boto3.session.Session(profile_name=pool.credentials_ref)
    return out


def _gcp_config(pool: Pool, config: dict[str, Any]) -> dict[str, Any]:
    config = {k: v for k, v in config.items() if k != "container_runtimes"}  # the broker's (offers.py), not GCP's
    return {**config, "regions": config.get("regions") or [pool.region]} if "regions" in config or pool.region \
        else dict(config)


def provider_for_pool(pool: Pool) -> Provider:
    # Everything the provider is built from: a pool's config, and the broker id and var dir it tags
    # and keeps its books under (fixed in a deployment; tests and benches change them per run).
    key = (pool.pk, pool.kind, repr(sorted(pool.provider_config.items())) + pool.credentials_ref,
           settings.WHALEZEN_BROKER_ID, str(settings.VAR_DIR))
    if key in _cache:
        return _cache[key]
    config = dict(pool.provider_config or {})
    builders = {PoolKind.LOCAL: _local_config, PoolKind.AWS: _aws_config, PoolKind.GCP: _gcp_config}
    if pool.kind not in builders:
        raise ValueError(f"pool {pool} ({pool.kind}) does not launch instances")
    try:
        provider = build_provider(pool.kind, broker_id=settings.WHALEZEN_BROKER_ID, **builders[pool.kind](pool, config))
    except TypeError as exc:
        # A pool whose provider_config lacks a setting the provider needs (a GCP pool without `project`)
        # is the admin's mistake, not a crash: the one provider error, so offers, quotes, savings and
        # the scheduling cycle skip the pool and say why, as for a cloud that does not answer.
        raise ProviderError(ErrorKind.BAD_REQUEST, f"pool {pool.name} is misconfigured: {exc}",
                            provider=str(pool.kind)) from exc
    _cache[key] = provider
    return provider
