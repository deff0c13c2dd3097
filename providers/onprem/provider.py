"""On-prem provider: nodes the team owns, registered by their node agents.

We never create or destroy these machines, so `provision`/`terminate` raise a ProviderError that
says so (BAD_REQUEST, not retry-elsewhere: the broker asked the wrong provider). Offers come from
the registered free capacity, handed in as plain data by the broker (no Django here), priced at
the pool's internal $/GPU-hour rate.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from providers.base import (
    ErrorKind,
    InstanceInfo,
    InstanceRef,
    InstanceState,
    Offer,
    Provider,
    ProviderError,
    ProvisionRequest,
)


@dataclass(frozen=True)
class OnPremNode:
    """Free capacity of one registered node, as the broker's inventory sees it now."""

    node_name: str
    pool: str  # becomes the offer's zone; the site becomes its region
    gpu_model: str
    free_gpus: int
    gpu_memory_mib: int
    free_vcpus: float = 0.0
    free_memory_gib: float = 0.0
    fabric: tuple[str, ...] = ()
    site: str = "onprem"
    healthy: bool = True


@dataclass(frozen=True)
class PoolRates:
    """Internal $/GPU-hour charged for a pool, optionally per GPU model (finance's transfer price)."""

    default_per_gpu_hour: float
    per_model: tuple[tuple[str, float], ...] = ()

    def rate(self, gpu_model: str) -> float:
        return dict(self.per_model).get(gpu_model, self.default_per_gpu_hour)


class OnPremProvider(Provider):
    kind = "onprem"

    def __init__(
        self,
        *,
        broker_id: str,
        nodes: Sequence[OnPremNode] = (),
        rates: Mapping[str, PoolRates] | None = None,
        default_rate: PoolRates = PoolRates(0.0),
    ) -> None:
        super().__init__(broker_id=broker_id)
        self.nodes = list(nodes)
        self.rates = dict(rates or {})
        self.default_rate = default_rate

    def update_nodes(self, nodes: Sequence[OnPremNode]) -> None:
        """Replace the snapshot of registered free capacity (the broker calls this each cycle)."""
        self.nodes = list(nodes)

    def list_offers(self) -> list[Offer]:
        offers = []
        for node in self.nodes:
            if not node.healthy or node.free_gpus <= 0:
                continue
            rate = self.rates.get(node.pool, self.default_rate).rate(node.gpu_model)
            offers.append(Offer(
                provider="onprem", region=node.site, zone=node.pool, instance_type=node.node_name,
                gpu_model=node.gpu_model, gpu_count=node.free_gpus, gpu_memory_mib=node.gpu_memory_mib,
                vcpus=node.free_vcpus, memory_gib=node.free_memory_gib,
                on_demand_per_hour=round(rate * node.free_gpus, 6), spot_per_hour=None, fabric=node.fabric,
            ))
        return offers

    def provision(self, request: ProvisionRequest) -> InstanceInfo:
        raise ProviderError(ErrorKind.BAD_REQUEST, "on-prem nodes are not created by the broker: start the "
                            "node agent on the machine with the pool's join token", provider="onprem",
                            code="NotProvisionable")

    def terminate(self, ref: InstanceRef) -> InstanceInfo:
        raise ProviderError(ErrorKind.BAD_REQUEST, "on-prem nodes are not terminated by the broker: drain or "
                            "deregister the node instead", provider="onprem", code="NotTerminable")

    def describe(self, ref: InstanceRef) -> InstanceInfo:
        for node in self.nodes:
            if node.node_name == ref.instance_id:
                return InstanceInfo(ref=ref, state=InstanceState.RUNNING if node.healthy else InstanceState.UNKNOWN,
                                    instance_type=node.node_name)
        raise ProviderError(ErrorKind.NOT_FOUND, f"no registered node {ref.instance_id}", provider="onprem")

    def list_owned(self) -> list[InstanceInfo]:
        # Nothing here was created by us, so there is nothing the reconciler may ever delete.
        return []
