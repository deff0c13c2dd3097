"""The parts of a multi-node job (a gang: one Allocation per node) as the agents see them.

Rank order is the order of the job's active allocations by primary key: they are all created in one
transaction (`allocation_commit`), and every part's assignment is computed from the same rows, so
each process gets the same order. A single-node job is a gang of one: rank 0, its own node's
address (as SkyPilot does it), so one script runs on one node or many.

MASTER_PORT is derived from the job id, `MASTER_PORT_BASE + job id % MASTER_PORT_SPAN`
(10000-29999: below Linux's ephemeral range 32768-60999, so no outgoing connection holds it), the
same for every part without any state. Two gangs whose rank 0 share a node get different ports
unless their ids differ by a multiple of 20000 and both run at once (docs/agent.md).
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from broker.agents.serializers import node_address_valid
from broker.inventory.models import Node
from broker.jobs.models import Allocation, Job

MASTER_PORT_BASE, MASTER_PORT_SPAN = 10000, 20000
LOOPBACK = "127.0.0.1"


def master_port(job_id: int) -> int:
    return MASTER_PORT_BASE + job_id % MASTER_PORT_SPAN


def node_address(node: Node) -> str:
    """Where the node's peers reach it: the address its agent registered with, else its host name,
    else loopback (a node registered before addresses were recorded; right for one node only)."""
    if node.address:
        return node.address
    return node.hostname if node.hostname and node_address_valid(node.hostname) else LOOPBACK


def is_gang(job: Job) -> bool:
    return job.node_count > 1


def gang_parts_by_job(jobs: Iterable[Job]) -> dict[int, list[Allocation]]:
    """The active allocations of each multi-node job among `jobs`, in rank order (one query)."""
    ids = {job.pk for job in jobs if is_gang(job)}
    parts: dict[int, list[Allocation]] = {}
    if ids:
        for allocation in (Allocation.objects.filter(job_id__in=ids, active=True).select_related("node")
                           .order_by("pk")):
            parts.setdefault(allocation.job_id, []).append(allocation)
    return parts


def gang_parts(job: Job) -> list[Allocation]:
    return gang_parts_by_job([job]).get(job.pk, [])


def rank_of(allocation: Allocation, parts: Sequence[Allocation]) -> int:
    """The allocation's rank, or 0 when it is not among the parts (a single-node job)."""
    ids = [part.pk for part in parts]
    return ids.index(allocation.pk) if allocation.pk in ids else 0


def gang_assignment(*, allocation: Allocation, parts: Sequence[Allocation], gpus_per_node: int) -> dict[str, Any]:
    """The `gang` object of an assignment (agent/gang.py reads it)."""
    job = allocation.job
    if allocation.pk not in {part.pk for part in parts}:
        parts = [allocation]  # a single-node job: a gang of one
    return {
        "rank": rank_of(allocation, parts),
        "node_addresses": [node_address(part.node) for part in parts],
        "gpus_per_node": gpus_per_node,
        "master_port": master_port(job.pk),
        "skypilot_env": (job.spec or {}).get("format") == "skypilot",
    }


def part_label(allocation: Allocation, node: Node) -> str:
    """"rank 1 of 2 on node-b" for a gang's part, else the node's name (events name it so)."""
    job = allocation.job
    if not is_gang(job):
        return node.name
    parts = gang_parts(job)
    return f"rank {rank_of(allocation, parts)} of {len(parts) or job.node_count} on {node.name}"


def part_data(allocation: Allocation) -> dict[str, Any]:
    """The rank and gang size for an event's data, or nothing for a single-node job."""
    job = allocation.job
    if not is_gang(job):
        return {}
    parts = gang_parts(job)
    return {"rank": rank_of(allocation, parts), "num_nodes": len(parts) or job.node_count}
