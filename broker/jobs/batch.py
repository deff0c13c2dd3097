"""Set-based writes for a scheduling cycle: many placements, many pending reasons, few statements.

`allocation_commit` (broker/jobs/services.py) places one job in one transaction of about fifteen
statements; a cycle placing 5,000 jobs that way spent 135-230 s committing on PostgreSQL
(bench.service). `placements_commit` does the same for a chunk of jobs in one transaction of a
fixed number of statements, under the same guarantees:

- the nodes are locked in id order, then the teams (quota checks are serialised per team), then
  the jobs still PENDING (a job cancelled meanwhile is left out: it lost the race, as its
  compare-and-set would have);
- every check of `allocation_commit` is made for every job (pool access, node ONLINE, GPU indices,
  GPU not FAILED, free slots, the team's GPU and CU quota counting what the chunk adds);
- slots are chosen from what the database holds active and what the chunk took so far, and the
  partial unique constraint still refuses any slot held twice: if it fires (a writer outside the
  locks), the whole chunk rolls back and its jobs are committed one by one by `allocation_commit`;
- each job moves PENDING -> PLACED with its state event, each allocation gets the node's next epoch.
- each allocation's price is fixed in the same transaction (`allocations_placed`: billing inserts its
  meter), and the rows go in by COPY on PostgreSQL (broker/rows.py).

`pending_reasons_set` writes only the reasons that changed, and an event only when the code changed
(as `job_set_pending_reason` does one job at a time).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any, NamedTuple

from django.db import IntegrityError, connection, transaction
from django.db.models.functions import Coalesce
from django.utils import timezone

from broker.inventory.models import Gpu, GpuHealth, Node, NodeState
from broker.inventory.selectors import usable_pool_ids
from broker.jobs.models import Allocation, AllocationSlice, Job, JobEvent
from broker.jobs.quota import QuotaRoom
from broker.jobs.selectors import held_slots
from broker.jobs.services import GpuRequest, JobError, allocation_commit
from broker.jobs.signals import PlacedAllocation, allocations_placed
from broker.jobs.states import JobState
from broker.rows import fields_insert, rows_update, values_insert
from broker.tenancy.services import tenants_lock

# Jobs per transaction. PostgreSQL locks only the chunk's node, team and job rows: 1,000 hold them about
# 0.6 s and commit 5,000 placements in 3.0-3.3 s where chunks of 250 took 4.1-4.8 s (bench.service). SQLite
# locks the whole database for a transaction's length, and every web request that writes waits for it.
CHUNK = {"postgresql": 1000}
CHUNK_DEFAULT = 250
# The nodes' JSON columns, which no placement reads: decoding them for every node of every chunk was a
# tenth of the commit (bench.service).
NODE_JSON = ("container_runtimes", "labels", "topology", "interruption")
# Pending reasons per transaction: on SQLite a chunk holds the database's one write lock, and submissions
# queue behind it (bench.service: p99 1.6 s at 32 submitters while cycles wrote reasons 1,000 at a time).
REASON_CHUNK = {"postgresql": 1000}
REASON_CHUNK_DEFAULT = 100


class GpuRow(NamedTuple):
    """What a chunk's checks read of a GPU."""
    pk: int
    index: int
    health: str
    compute_units: Decimal
    model: str  # its catalogue model's name, else the name the node reported


class JobRef(NamedTuple):
    """What a placement needs of its job: the cycle passes these for 5,000 jobs instead of model instances
    (0.5 s to load). A Job instance has the same two attributes and does as well."""
    pk: int
    tenant_id: int


@dataclass
class BatchResult:
    placed: list[int] = field(default_factory=list)
    refused: dict[int, str] = field(default_factory=dict)  # job id -> why (as allocation_commit says it)


def placements_commit(*, items: list[tuple[Job | JobRef, list[GpuRequest]]]) -> BatchResult:
    """Place every (job, requests) that still may be placed; the others are refused with a reason."""
    result = BatchResult()
    size = CHUNK.get(connection.vendor, CHUNK_DEFAULT)
    for start in range(0, len(items), size):
        chunk = items[start:start + size]
        try:
            with transaction.atomic():
                _commit_chunk(chunk, result)
        except IntegrityError:
            # Only a writer outside these locks can make the constraint fire: fall back to one
            # transaction per job, each with its own checks. The rolled-back chunk placed nothing
            # (`placed` is extended only after its inserts); what it refused is decided again.
            # allocation_commit works on Job instances: the chunk's are loaded now (rarely needed).
            loaded = Job.objects.in_bulk([job.pk for job, _ in chunk if not isinstance(job, Job)])
            for job, requests in chunk:
                result.refused.pop(job.pk, None)
                instance = job if isinstance(job, Job) else loaded.get(job.pk)
                if instance is None:
                    result.refused[job.pk] = f"The job is deleted, not {JobState.PENDING} any more."
                    continue
                try:
                    allocation_commit(job=instance, requests=requests)
                    result.placed.append(job.pk)
                except JobError as exc:
                    result.refused[job.pk] = str(exc)
    return result


def _commit_chunk(chunk: list[tuple[Job | JobRef, list[GpuRequest]]], result: BatchResult) -> None:
    node_ids = sorted({r.node.pk for _, requests in chunk for r in requests})
    nodes = {n.pk: n for n in Node.objects.select_for_update().filter(pk__in=node_ids).order_by("pk")
             .defer(*NODE_JSON)}
    tenant_ids = sorted({job.tenant_id for job, _ in chunk})
    tenants_lock(tenant_ids)
    pending = set(Job.objects.select_for_update().filter(pk__in=[job.pk for job, _ in chunk],
                                                         state=JobState.PENDING).values_list("pk", flat=True))
    pools = {n.pool_id for n in nodes.values()}
    usable = {tenant_id: usable_pool_ids(tenant_id=tenant_id, pool_ids=pools) for tenant_id in tenant_ids}
    # Plain rows: a chunk's nodes hold a few thousand GPUs, and model instances of them (with their
    # models) were a fifth of the chunk's time.
    gpus = {(node_id, index): GpuRow(pk, index, health, compute_units or Decimal(0), model or "")
            for node_id, index, pk, health, compute_units, model in Gpu.objects.filter(node_id__in=node_ids)
            .values_list("node_id", "index", "pk", "health", "model__compute_units",
                         Coalesce("model__name", "model_name"))}
    wanted = {gpus[r.node.pk, index].pk for _, requests in chunk for r in requests for index in r.gpu_indices
              if (r.node.pk, index) in gpus}
    taken = held_slots(wanted)  # only the GPUs the chunk asks for: a full cluster holds tens of thousands
    room = {tenant_id: QuotaRoom(tenant_id) for tenant_id in tenant_ids}
    epochs = {pk: node.epoch for pk, node in nodes.items()}
    now = timezone.now()

    # Plain rows, no model instances (broker/rows.py fields_insert): allocations, their slots, events.
    allocations: list[dict[str, int]] = []
    slices: list[list[tuple[GpuRow, list[int]]]] = []  # the (GPU, slots) of each allocation, in order
    events: list[dict[str, Any]] = []
    placed: list[int] = []
    for job, requests in chunk:
        if job.pk not in pending:
            state = Job.objects.filter(pk=job.pk).values_list("state", flat=True).first() or "deleted"
            result.refused[job.pk] = f"The job is {state}, not {JobState.PENDING} any more."
            continue
        why, chosen = _check(job, requests, nodes, usable[job.tenant_id], gpus, taken)
        if why is None:
            why = room[job.tenant_id].take([(gpu.compute_units, len(picks)) for gpu, picks in chosen])
        if why is not None:
            result.refused[job.pk] = why
            continue
        for req, picks in zip(requests, _by_request(requests, chosen)):
            epochs[req.node.pk] += 1
            allocations.append({"job_id": job.pk, "node_id": req.node.pk, "epoch": epochs[req.node.pk]})
            slices.append(picks)
        for gpu, slots in chosen:
            taken[gpu.pk].update(slots)
        events.append({"job_id": job.pk, "kind": "state", "reason_code": "PLACED", "message": "Placed on " + ", ".join(
            f"{r.node.name}[{','.join(map(str, r.gpu_indices))}]" for r in requests),
            "data": {"from": JobState.PENDING, "to": JobState.PLACED,
                     "placements": [{"node": r.node.name, "gpus": list(r.gpu_indices), "milli": r.milli}
                                    for r in requests]}})
        placed.append(job.pk)
    if not placed:
        return
    # COPY with ids drawn first (broker/rows.py): bulk_create's compiled INSERT and its RETURNING were
    # most of what was left of a 5,000-placement commit.
    allocation_ids = fields_insert(Allocation, allocations, with_ids=True)
    # One row per (allocation, GPU), its slots as a mask, as plain tuples. The partial unique indexes still
    # refuse a slot held twice (IntegrityError: the chunk rolls back).
    mask_of = AllocationSlice.mask_of
    values_insert(AllocationSlice, ("allocation", "gpu", "mask", "slots", "active"),
                  [(allocation_id, gpu.pk, mask_of(slots), len(slots), True)
                   for allocation_id, picks in zip(allocation_ids, slices) for gpu, slots in picks], integers=True)
    changed = [(epochs[pk], pk) for pk in nodes if epochs[pk] != nodes[pk].epoch]  # never empty: a job was placed
    rows_update(Node, ["epoch"], changed)  # bulk_update's CASE WHEN per node took 0.1 s a chunk
    for epoch, pk in changed:
        nodes[pk].epoch = epoch
    updated = Job.objects.filter(pk__in=placed, state=JobState.PENDING).update(
        state=JobState.PLACED, updated_at=now, pending_reason_code="", pending_reason="", pending_reason_data={})
    if updated != len(placed):  # the rows are locked: only a bug gets here
        raise IntegrityError("placed jobs changed state under their row locks")
    fields_insert(JobEvent, events)
    # Billing fixes each allocation's price in this same transaction (an allocation is never left
    # without one by a crash between two transactions).
    allocations_placed.send(sender=Allocation, allocations=[
        PlacedAllocation(pk, row["node_id"], nodes[row["node_id"]].pool_id, picks[0][0].model if picks else "")
        for pk, row, picks in zip(allocation_ids, allocations, slices)])
    result.placed.extend(placed)


def _check(job: Job | JobRef, requests: list[GpuRequest], nodes: dict[int, Node], usable: set[int],
           gpus: dict[tuple[int, int], GpuRow], taken: dict[int, set[int]]) -> tuple[str | None, list[tuple[GpuRow, list[int]]]]:
    """allocation_commit's checks for one job; (why not, None) or (None, the slots each GPU gives)."""
    if not requests:
        return "Nothing to allocate.", []
    chosen: list[tuple[GpuRow, list[int]]] = []
    for req in requests:
        node = nodes[req.node.pk]
        if node.pool_id not in usable:
            return f"Node {node.name} is in a pool this team may not use.", []
        if node.state != NodeState.ONLINE:
            return f"Node {node.name} is {node.state}.", []
        wanted = [gpus.get((node.pk, index)) for index in dict.fromkeys(req.gpu_indices)]
        if any(gpu is None for gpu in wanted):
            return f"Node {node.name} has no GPU index among {list(req.gpu_indices)}.", []
        if any(gpu.health == GpuHealth.FAILED for gpu in wanted):
            return f"A requested GPU on {node.name} has failed.", []
        count = Gpu.slots_for(req.milli)
        for gpu in wanted:
            # Held, or picked by this job already (a GPU named twice): one set, not a scan of the picks per slot.
            held = taken[gpu.pk].union(*(picks for g, picks in chosen if g.pk == gpu.pk))
            free = [s for s in range(Gpu.SLOTS) if s not in held]
            if len(free) < count:
                return f"GPU {gpu.index} on {node.name} does not have the share requested free.", []
            chosen.append((gpu, free[:count]))
    return None, chosen


def _by_request(requests: list[GpuRequest], chosen: list[tuple[GpuRow, list[int]]]) -> list[list[tuple[GpuRow, list[int]]]]:
    """Split the chosen (GPU, slots) back per request, in request order."""
    out, position = [], 0
    for req in requests:
        n = len(dict.fromkeys(req.gpu_indices))
        out.append(chosen[position:position + n])
        position += n
    return out


def pending_reasons_set(*, reasons: dict[int, tuple[str, str, dict[str, Any]]]) -> int:
    """Record why each pending job waits, writing only what changed; an event only when the code
    changed. Returns how many rows were written.

    Plain statements, no model instances: the jobs' three columns by `rows_update` (bulk_update's CASE
    WHEN per job and field took longest), the events as field rows. On SQLite each chunk holds the one
    write lock that every submission waits for, so chunks are small there (REASON_CHUNK)."""
    written = 0
    ids = sorted(reasons)
    size = REASON_CHUNK.get(connection.vendor, REASON_CHUNK_DEFAULT)
    columns = ("pending_reason_code", "pending_reason", "pending_reason_data")
    data_field = Job._meta.get_field("pending_reason_data")
    for start in range(0, len(ids), size):
        part = ids[start:start + size]
        with transaction.atomic():
            current = {pk: (code, message, data) for pk, code, message, data in Job.objects.filter(
                pk__in=part, state=JobState.PENDING).values_list(
                    "pk", "pending_reason_code", "pending_reason", "pending_reason_data")}
            changed = [pk for pk in part if pk in current and current[pk] != reasons[pk]]
            if not changed:
                continue
            locked = dict(Job.objects.select_for_update().filter(pk__in=changed, state=JobState.PENDING)
                          .values_list("pk", "pending_reason_code"))
            rows, events = [], []
            for pk in changed:
                if pk not in locked:
                    continue  # left PENDING since the read: its reason is no longer ours to write
                code, message, data = reasons[pk]
                if locked[pk] != code:
                    events.append({"job_id": pk, "kind": "pending_reason", "reason_code": code, "message": message,
                                   "data": data})
                rows.append((code, message, data_field.get_db_prep_save(data, connection), pk))
            rows_update(Job, columns, rows)
            fields_insert(JobEvent, events)
            written += len(rows)
    return written
