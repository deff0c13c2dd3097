"""A multi-node job's place in its gang: its rank, its peers' addresses, where rank 0 listens.

The broker sends one `gang` object with every assignment (docs/agent.md, "Multi-node jobs"); a
single-node job is a gang of one (rank 0, its own node's address), as SkyPilot does it, so a
script written for N nodes runs unchanged on one. The agent turns it into the variables torchrun
and SkyPilot `run` scripts read. Everything here comes from the network: checked before use.
"""
from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from typing import Any

MAX_NODES = 1024  # far beyond any gang the broker places; bounds what one assignment carries
MAX_GPUS_PER_NODE = 64
_DNS_LABEL = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?")

WHALEZEN_GANG_ENV = ("WHALEZEN_NODE_RANK", "WHALEZEN_NUM_NODES", "WHALEZEN_NODE_IPS", "WHALEZEN_NUM_GPUS_PER_NODE",
                     "MASTER_ADDR", "MASTER_PORT")
SKYPILOT_GANG_ENV = ("SKYPILOT_NODE_RANK", "SKYPILOT_NUM_NODES", "SKYPILOT_NODE_IPS", "SKYPILOT_NUM_GPUS_PER_NODE")
# Set by the agent from the gang, never by the job's own env: a job that could claim another rank
# or point MASTER_ADDR elsewhere would break (or eavesdrop on) its peers' rendezvous.
GANG_ENV = (*WHALEZEN_GANG_ENV, *SKYPILOT_GANG_ENV)


def address_problem(text: Any) -> str | None:
    """Why `text` is not a node address (an IPv4/IPv6 address or a DNS name), or None."""
    if not isinstance(text, str) or not text:
        return "must be a non-empty string"
    if len(text) > 253:
        return "is longer than 253 characters"
    try:
        ipaddress.ip_address(text)
        return None
    except ValueError:
        pass
    labels = text[:-1].split(".") if text.endswith(".") else text.split(".")
    if all(_DNS_LABEL.fullmatch(label) for label in labels) and not labels[-1].isdigit():
        return None
    return "must be an IP address or a DNS name"


@dataclass(frozen=True)
class Gang:
    rank: int
    addresses: tuple[str, ...]  # one per node, in rank order
    gpus_per_node: int
    master_port: int
    skypilot: bool = False  # submitted as a SkyPilot task: its scripts read the SKYPILOT_* names

    @property
    def size(self) -> int:
        return len(self.addresses)

    @property
    def master_addr(self) -> str:
        return self.addresses[0]

    @classmethod
    def from_json(cls, data: Any) -> "Gang":
        """Raises ValueError naming the bad field."""
        if not isinstance(data, dict):
            raise ValueError("gang must be an object")
        addresses = data.get("node_addresses")
        if not isinstance(addresses, list) or not 1 <= len(addresses) <= MAX_NODES:
            raise ValueError(f"gang.node_addresses must list 1 to {MAX_NODES} node addresses")
        for position, address in enumerate(addresses):
            problem = address_problem(address)
            if problem:
                raise ValueError(f"gang.node_addresses[{position}] {problem}")
        rank = data.get("rank")
        if not _whole(rank) or not 0 <= rank < len(addresses):
            raise ValueError(f"gang.rank must be a whole number from 0 to {len(addresses) - 1}")
        gpus = data.get("gpus_per_node")
        if not _whole(gpus) or not 0 <= gpus <= MAX_GPUS_PER_NODE:
            raise ValueError(f"gang.gpus_per_node must be a whole number from 0 to {MAX_GPUS_PER_NODE}")
        port = data.get("master_port")
        if not _whole(port) or not 1024 <= port <= 65535:
            raise ValueError("gang.master_port must be a port number from 1024 to 65535")
        skypilot = data.get("skypilot_env", False)
        if not isinstance(skypilot, bool):
            raise ValueError("gang.skypilot_env must be true or false")
        return cls(rank=rank, addresses=tuple(addresses), gpus_per_node=gpus, master_port=port, skypilot=skypilot)

    def environment(self) -> dict[str, str]:
        ips = "\n".join(self.addresses)  # one per line, rank order: SkyPilot's format
        env = {
            "WHALEZEN_NODE_RANK": str(self.rank),
            "WHALEZEN_NUM_NODES": str(self.size),
            "WHALEZEN_NODE_IPS": ips,
            "WHALEZEN_NUM_GPUS_PER_NODE": str(self.gpus_per_node),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
        }
        if self.skypilot:
            env.update({
                "SKYPILOT_NODE_RANK": env["WHALEZEN_NODE_RANK"],
                "SKYPILOT_NUM_NODES": env["WHALEZEN_NUM_NODES"],
                "SKYPILOT_NODE_IPS": ips,
                "SKYPILOT_NUM_GPUS_PER_NODE": env["WHALEZEN_NUM_GPUS_PER_NODE"],
            })
        return env


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
