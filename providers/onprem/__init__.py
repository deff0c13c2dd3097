"""On-prem provider: registered nodes priced at internal rates."""
from providers.onprem.provider import OnPremNode, OnPremProvider, PoolRates

__all__ = ["OnPremNode", "OnPremProvider", "PoolRates"]
