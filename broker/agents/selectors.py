"""Reads for the agent protocol: which node a token belongs to, what the node should run."""
from __future__ import annotations

import functools
import hmac
from typing import Any

from django.db import DEFAULT_DB_ALIAS, models, transaction
from django.db.models import QuerySet

from broker.agents.fencing import unconfirmed_copies
from broker.agents.gang import gang_assignment, gang_parts_by_job
from broker.inventory.models import Node
from broker.jobs.models import Allocation, AllocationSlice
from broker.jobs.states import JobState
from broker.rows import CompiledRead
from broker.tenancy import tokens

# What the agent should do for an active allocation, by the state of its job.
_ACTION_BY_JOB_STATE = {
    JobState.PLACED: "start",
    JobState.PROVISIONING: "start",
    JobState.STARTING: "start",
    JobState.RUNNING: "start",
    JobState.CHECKPOINTING: "checkpoint",
    # Moving away: the checkpoint is committed, the source must stop writing (fence).
    JobState.MIGRATING: "stop",
}


# A start for a job in these states has not reached a process yet: the one place to hold it back.
_NOT_STARTED_STATES = frozenset({JobState.PLACED, JobState.PROVISIONING, JobState.STARTING})


def node_for_token(presented: str) -> Node | None:
    """The node a node token belongs to; the stored hash is compared in constant time."""
    prefix = tokens.split_prefix(presented)
    if not prefix or not presented.startswith("wzn_"):
        return None
    digest = tokens.digest(presented)
    for *values, instance_state in _NODES_OF_PREFIX.rows(prefix):
        node = Node.from_db(DEFAULT_DB_ALIAS, _node_columns(), values)
        if hmac.compare_digest(node.token_hash, digest):
            node.instance_state = instance_state  # what the authentication checks (given_up_reason)
            return node
    return None


@functools.cache
def _node_columns() -> tuple[str, ...]:
    """A node's columns but the JSON ones (labels, runtimes, a spot notice): decoding them was a fifth of
    the lookup, and the agent calls that read one load it on first use."""
    return tuple(f.attname for f in Node._meta.concrete_fields if not isinstance(f, models.JSONField))


def _nodes_of_token_prefix(prefix: str) -> QuerySet:
    """The nodes of a token prefix, unordered, each with its cloud instance's state (None without one)."""
    return (Node.objects.filter(token_prefix=prefix).exclude(token_hash="").order_by()
            .values_list(*_node_columns(), "instance__state"))


# Every agent call starts with this lookup: compiled once per database (broker/rows.py). Compiling it on
# each call was a quarter of the broker's CPU per heartbeat (bench.service, py-spy).
_NODES_OF_PREFIX = CompiledRead(_nodes_of_token_prefix)


def node_assignments(*, node: Node) -> dict[str, Any]:
    """Everything the node should be doing now, with the node epoch of that view.

    The node row is locked while reading so the epoch and the allocations belong to one moment
    (allocation_commit locks the same row when it changes them).

    A job requeued from a LOST node is not handed out as a `start` while its old copy may still
    run (broker.agents.fencing): it is left out of the list until then, so the agent neither starts
    nor refuses it; its GPUs stay reserved.
    """
    with transaction.atomic():
        epoch = Node.objects.select_for_update().filter(pk=node.pk).values_list("epoch", flat=True).get()
        allocations = list(Allocation.objects.filter(node=node, active=True).select_related("job")
                           .order_by("epoch", "pk"))
        not_started = [a.job_id for a in allocations if a.job.state in _NOT_STARTED_STATES]
        held = unconfirmed_copies(job_ids=not_started)
        allocations = [a for a in allocations if a.job_id not in held]
        slices = (AllocationSlice.objects.filter(allocation__in=allocations, active=True)
                  .select_related("gpu").order_by("gpu__index"))
        gpus_by_allocation: dict[int, dict[int, str]] = {}
        for piece in slices:
            gpus_by_allocation.setdefault(piece.allocation_id, {})[piece.gpu.index] = piece.gpu.uuid
        # Read in the same transaction as the allocations: every part sees the same peers.
        parts = gang_parts_by_job({a.job_id: a.job for a in allocations}.values())
    for allocation in allocations:
        allocation.node = node  # the parts' own node: its address for a gang of one
    return {"epoch": epoch, "assignments": [_assignment(a, gpus_by_allocation.get(a.pk, {}), parts.get(a.job_id, []))
                                            for a in allocations]}


def _assignment(allocation: Allocation, gpus: dict[int, str], parts: list[Allocation]) -> dict[str, Any]:
    job = allocation.job
    spec = job.spec or {}
    indices = sorted(gpus)
    uuids = [gpus[i] for i in indices]
    action = _ACTION_BY_JOB_STATE.get(job.state, "stop")
    return {
        "id": str(allocation.pk),
        "job_id": str(job.pk),
        "epoch": allocation.epoch,
        "action": action,
        "gpu_indices": indices,
        # Only when every GPU has a real UUID: the agent then checks it is talking about the same GPUs.
        "gpu_uuids": uuids if all(u.startswith("GPU-") and "-sim-" not in u for u in uuids) and uuids else None,
        "gpu_milli": job.gpu_milli if 0 < job.gpu_milli <= 1000 else 1000,
        "command": spec.get("command"),
        "image": spec.get("image") or None,
        # Secrets go to the job's processes only: never into the stored spec, events or logs.
        "env": {**(spec.get("env") or {}), **(job.secret_env or {})},
        # Copied onto the node by the job's own process before its command (agent/fetch.py); an
        # upload comes with a token that fetches only that upload, for this job.
        **({"files": _files(job, spec["files"])} if spec.get("files") else {}),
        "checkpoint_uri": job.checkpoint_uri or None,
        "checkpoint_request_id": _checkpoint_request_id(job) if action == "checkpoint" else None,
        # What a (re)start resumes from: the newest committed checkpoint, "" for none (start afresh).
        **({"restore_from": _restore_from(job)} if job.checkpoint_uri else {}),
        # Rank, peers, MASTER_PORT (broker/agents/gang.py); for a single-node job, a gang of one.
        "gang": gang_assignment(allocation=allocation, parts=parts, gpus_per_node=len(indices)),
    }


def _files(job, files: list[dict]) -> list[dict]:
    from broker.jobs.uploads import upload_download_token

    out = []
    for entry in files:
        item = {"source": entry["source"], "destination": entry["destination"]}
        if entry["source"].startswith("upload:"):
            item["token"] = upload_download_token(entry["source"][len("upload:"):], job.pk)
        out.append(item)
    return out


def _restore_from(job) -> str:
    from broker.jobs.checkpoints import committed_checkpoint

    checkpoint = committed_checkpoint(job)
    return checkpoint.uri if checkpoint is not None else ""


def _checkpoint_request_id(job) -> str:
    """One id per entry into CHECKPOINTING, so the agent delivers each request exactly once."""
    from broker.jobs.checkpoints import checkpoint_request_event

    event = checkpoint_request_event(job)
    return f"job{job.pk}-ev{event.pk if event is not None else 0}"
