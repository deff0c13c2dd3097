"""Writes for the agent protocol: register a node, store heartbeats, apply status reports, mark
silent nodes LOST. Views and tasks are thin and call these.

Job state changes go through `broker.jobs.services.job_transition` (compare-and-set). A report
about an allocation that is no longer active is recorded but moves nothing: the job has moved on
(requeued, restarted elsewhere), and an old process's exit must not touch its new incarnation.
"""
from __future__ import annotations

import hmac
import ipaddress
import logging
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.contrib.auth.base_user import AbstractBaseUser
from django.db import IntegrityError, connection, transaction
from django.db.models import F
from django.utils import timezone

from broker.agents.gang import gang_parts, is_gang, part_data, part_label
from broker.agents.models import AssignmentReport, NodeAgent
from broker.inventory.models import CloudInstance, Gpu, GpuHealth, Node, NodeState, Pool
from broker.inventory.services import gpu_model_resolve
from broker.jobs.models import Allocation, Job
from broker.jobs.migration import migration_job_running, migration_source_stopped
from broker.jobs.services import (IllegalTransition, StaleState, event_append, job_requeue, job_transition,
                                  jobs_requeue_on_node)
from broker.jobs.states import TERMINAL_STATES, JobState
from broker.rows import row_update
from broker.tenancy import tokens

log = logging.getLogger(__name__)


def heartbeat_seconds() -> int:
    return int(getattr(settings, "WHALEZEN_AGENT_HEARTBEAT_SECONDS", 5))


def lost_after_seconds() -> int:
    """Silence after which a node is LOST: six missed heartbeats by default."""
    return int(getattr(settings, "WHALEZEN_NODE_LOST_AFTER_SECONDS", 6 * heartbeat_seconds()))


class AgentError(Exception):
    status = 400

    def __init__(self, message: str, *, field: str = "detail") -> None:
        super().__init__(message)
        self.field = field


class JoinRefused(AgentError):
    status = 401


class NameTaken(AgentError):
    status = 409


class GpuTaken(AgentError):
    status = 409


class ReportRejected(AgentError):
    status = 409


class AssignmentUnknown(AgentError):
    status = 404


class ConfirmRefused(AgentError):
    """A node the broker hears from cannot be confirmed powered off."""
    status = 409


class ConfirmForbidden(AgentError):
    status = 403


# -- registration --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Registration:
    node: Node
    token: str  # plaintext node token: returned to the agent once, stored only as a hash
    created: bool


def _join_target(join_token: str) -> tuple[Pool, CloudInstance | None]:
    """The pool a join token admits to: a pool's join token, or a cloud instance's one-time token.

    An instance token admits only while its instance is live and the token unused; it is consumed
    (compare-and-set) in the registration's transaction by `instance_join_token_consume`.
    """
    digest = tokens.digest(join_token)
    if join_token.startswith("wzi_"):
        from broker.provisioning.offers import LIVE_INSTANCE_STATES  # the provisioning app owns instances

        instance = (CloudInstance.objects.select_related("pool")
                    .filter(join_token_hash=digest, state__in=LIVE_INSTANCE_STATES).first())
        if instance is not None and hmac.compare_digest(instance.join_token_hash, digest) and instance.pool.enabled:
            return instance.pool, instance
        raise JoinRefused("Invalid join token.")
    prefix = tokens.split_prefix(join_token)
    if prefix:
        for pool in Pool.objects.filter(join_token_prefix=prefix, enabled=True).exclude(join_token_hash=""):
            if tokens.matches(join_token, pool.join_token_hash):
                return pool, None
    raise JoinRefused("Invalid join token.")


def agent_register(*, data: dict[str, Any], remote_addr: str | None = None) -> Registration:
    """Create the node (or re-admit it) and its GPUs; issue a new node token.

    The same agent (same `agent_key`) registering again gets the same node and a fresh token (its
    first answer may have been lost). Another agent may take over a node name only while that node
    has no agent yet (pre-created by an admin or the demo seed) or is LOST/OFFLINE, and never the
    node of a cloud instance the broker gave up on. A cloud instance's one-time token works once.

    The node's address (what a gang's peers connect to) is the one the agent advertises, else
    `remote_addr`, the address its registration came from.
    """
    from broker.provisioning.services import instance_join_token_consume

    pool, instance = _join_target(data["join_token"])
    name = instance.node_name if instance is not None and instance.node_name else data["name"]
    now = timezone.now()
    issued = tokens.issue("wzn")
    with transaction.atomic():
        # First, so two registrations with one instance token cannot both win; a refusal further
        # down rolls the consumption back with everything else.
        if instance is not None and not instance_join_token_consume(instance=instance,
                                                                    join_token=data["join_token"]):
            raise JoinRefused("Invalid join token.")
        node = Node.objects.select_for_update().filter(pool=pool, name=name).first()
        created = node is None
        _refuse_duplicate_gpus(pool=pool, name=name, gpus=data["gpus"])
        if node is None:
            node = Node(tenant=pool.tenant, pool=pool, name=name, state=NodeState.ONLINE)
        else:
            if node_given_up(node) is not None:
                raise NameTaken(f"Node {name} in pool {pool.name} belongs to a cloud instance the broker gave up "
                                "on; it cannot be registered again.", field="name")
            agent = NodeAgent.objects.filter(node=node).first()
            same_agent = agent is not None and hmac.compare_digest(agent.agent_key, data["agent_key"])
            if agent is not None and not same_agent and node.state in (NodeState.ONLINE, NodeState.DRAINING):
                raise NameTaken(f"Node {name} in pool {pool.name} belongs to another agent that is still "
                                f"{node.state}; start this agent with another --name.", field="name")
            if agent is not None and not same_agent:
                # The previous agent's processes are gone with it (the machine was reinstalled).
                jobs_requeue_on_node(node_id=node.pk, reason_code="NODE_REREGISTERED",
                                 message=f"Node {name} was taken over by a new agent.")
            if node.state in (NodeState.LOST, NodeState.OFFLINE):
                node.state = NodeState.ONLINE  # DRAINING is an admin's decision: it stays
        node.hostname = data.get("hostname") or ""
        node.cpu_milli = data.get("cpu_milli") or 0
        node.memory_mb = data.get("memory_mb") or 0
        # Replaced, not merged: the agent's labels are the node's labels, so a bad or stale key
        # (an old "simulated") goes away at the next registration.
        node.labels = dict(data.get("labels") or {})
        # Replaced too: the runtimes the agent found now are the ones image jobs may use.
        node.container_runtimes = list(data.get("container_runtimes") or [])
        node.address = data.get("address") or _peer_address(remote_addr)
        node.token_prefix, node.token_hash = issued.prefix, issued.digest
        node.agent_version = data.get("agent_version") or ""
        node.topology = {**(data.get("topology") or {}),
                         "gpus_summary": [{k: g.get(k) for k in ("index", "nvlink_island", "nvlink_peers", "numa_node",
                                                                 "cpu_affinity", "pci_bus_id")}
                                          for g in data["gpus"]]}
        node.last_heartbeat_at = now
        node.save()
        # Every (re-)registration starts a new epoch: answers from before it are stale.
        Node.objects.filter(pk=node.pk).update(epoch=F("epoch") + 1)
        try:
            with transaction.atomic():  # a savepoint: the database's answer to a race is a 409 too
                _upsert_gpus(node, data["gpus"], now)
        except IntegrityError:
            raise GpuTaken("A GPU UUID of this node is already registered to another node; remove that node "
                           "before registering the GPU here.", field="gpus") from None
        NodeAgent.objects.update_or_create(node=node, defaults={
            "agent_key": data["agent_key"], "backend": data.get("backend") or "",
            "driver_version": data.get("driver_version") or "",
            "cuda_driver_version": data.get("cuda_driver_version") or "",
            "job_isolation": data.get("job_isolation") or "", "metrics_url": data.get("metrics_url") or "",
            "registered_at": now, "missed_heartbeats": 0, "last_error": "",
        })
    node.refresh_from_db()
    if instance is not None:
        _hand_over_cloud_instance(node)
    log.info("node %s registered in pool %s (%d GPUs, %s)", node.name, pool.name, len(data["gpus"]),
             "new" if created else "re-admitted")
    return Registration(node=node, token=issued.plaintext, created=created)


def _peer_address(remote_addr: str | None) -> str:
    """REMOTE_ADDR as the server saw it, only if it is an IP address (a proxy in front may set it
    to anything): behind NAT or a proxy it is not the node's own, which --advertise-address fixes."""
    try:
        return str(ipaddress.ip_address((remote_addr or "").strip()))
    except ValueError:
        return ""


def _refuse_duplicate_gpus(*, pool: Pool, name: str, gpus: list[dict[str, Any]]) -> None:
    """A GPU UUID names one physical GPU: one already registered to another node (of any tenant)
    was copied, or the machine was moved without its old node being removed. The answer says
    neither that node's name nor its tenant."""
    uuids = {g["uuid"]: g["index"] for g in gpus if g.get("uuid")}
    taken = (Gpu.objects.filter(uuid__in=list(uuids)).exclude(node__pool=pool, node__name=name)
             .values_list("uuid", flat=True).first())
    if taken is not None:
        raise GpuTaken(f"GPU {uuids[taken]} ({taken}) is already registered to another node; remove that node "
                       "before registering the GPU here.", field="gpus")


def _upsert_gpus(node: Node, gpus: list[dict[str, Any]], now: datetime) -> None:
    # UUIDs are unique across all GPUs: forget this node's first, so GPUs renumbered between two
    # registrations (index 0 now has index 1's UUID) never collide with their own old rows.
    Gpu.objects.filter(node=node).exclude(uuid="").update(uuid="")
    existing = {g.index: g for g in Gpu.objects.filter(node=node)}
    unknown: set[str] = set()
    for info in gpus:
        model_name = info.get("model") or ""
        numa_node = info.get("numa_node")  # optional: null when NVML and sysfs could not tell
        values = {
            "uuid": info.get("uuid") or "",
            "model": gpu_model_resolve(model_name) if model_name else None,
            "model_name": model_name[:64],
            "memory_mb": info.get("memory_mb") or 0,
            "nvlink_island": info.get("nvlink_island"),
            "numa_node": numa_node if numa_node is not None and numa_node >= 0 else None,  # -1: sysfs "none"
            "pci_bus_id": info.get("pci_bus_id") or "",
            "mig_mode": info.get("mig_mode") == "enabled",
            "last_seen_at": now,
        }
        if model_name and values["model"] is None:
            unknown.add(model_name[:64])
        gpu = existing.pop(info["index"], None)
        if gpu is None:
            Gpu.objects.create(node=node, index=info["index"], **values)
        else:
            Gpu.objects.filter(pk=gpu.pk).update(**values)
    for name in sorted(unknown):  # reported, not guessed: jobs that ask for a model never land on these GPUs
        log.warning("node %s: GPU model %r is not in the catalogue; jobs that ask for a GPU model will not be placed "
                    "on it until an admin adds the model or an alias (admin: GPU models)", node.name, name)
    # GPUs the node no longer reports (fell off the bus before the agent started, removed): keep the
    # rows (allocations point at them) but never schedule on them.
    Gpu.objects.filter(pk__in=[g.pk for g in existing.values()]).update(health=GpuHealth.FAILED)


def _hand_over_cloud_instance(node: Node) -> None:
    """A cloud instance's agent is up: the provisioning service gives it the jobs waiting for it."""
    from broker.provisioning.services import instance_node_registered  # the provisioning app owns this

    instance_node_registered(node=node)


# -- nodes the broker gave up on -----------------------------------------------------------------
def node_given_up(node: Node) -> str | None:
    """Why the broker gave up on `node` for good, or None.

    Only a cloud instance's node is ever given up: once its instance is being terminated, gone or
    failed, or the node was LOST/OFFLINE (its jobs were already restarted elsewhere), nothing that
    presents its old credentials may bring it back and be handed jobs (issue 8: a re-registered
    instance took over a healthy instance's job). On-prem nodes come back from LOST by themselves.
    """
    return given_up_reason(node_state=node.state,
                           instance_state=CloudInstance.objects.filter(node=node).values_list("state", flat=True).first())


def given_up_reason(*, node_state: str, instance_state: str | None) -> str | None:
    """`node_given_up` from what was read: the node's state and its cloud instance's (None: it has none).
    The agents' authentication reads both with the node, in the one query every agent call makes."""
    from broker.provisioning.offers import LIVE_INSTANCE_STATES

    if instance_state is None:
        return None
    if instance_state not in LIVE_INSTANCE_STATES:
        return f"its cloud instance is {instance_state}"
    if node_state in (NodeState.LOST, NodeState.OFFLINE):  # callers pass a row they just read
        return f"the node is {node_state}"
    return None


def node_give_up(*, node: Node, reason: str) -> bool:
    """Retire a cloud instance's node for good: revoke its node token (every call with it answers 401
    from now on), take it out of scheduling (OFFLINE unless already LOST) and requeue what it ran.
    Safe to call twice; True when this call revoked the token.

    The requeued jobs' old copies are `stop_unconfirmed` (broker.agents.fencing): a given-up
    instance may still be running them, and its revoked token can no longer say it stopped them.
    The provider confirming the instance terminated releases their next start at once."""
    from broker.agents.fencing import fence_wait_seconds

    with transaction.atomic():
        revoked = Node.objects.filter(pk=node.pk).exclude(token_hash="").update(token_prefix="", token_hash="") == 1
        moved = Node.objects.filter(pk=node.pk, state__in=[NodeState.ONLINE, NodeState.DRAINING]).update(
            state=NodeState.OFFLINE, epoch=F("epoch") + 1) == 1
        if moved:
            jobs_requeue_on_node(node_id=node.pk, reason_code="NODE_RETIRED", stop_unconfirmed=True,
                                 message=f"Node {node.name} was retired ({reason}); the job restarts elsewhere "
                                         "once the provider confirms the instance terminated (at most "
                                         f"{fence_wait_seconds()} s).")
    if revoked:
        log.warning("node %s retired for good: %s; its node token is revoked", node.name, reason)  # pragma: no mutate
    return revoked


def node_confirm_powered_off(*, node: Node, by: AbstractBaseUser) -> list[int]:
    """A person says `node` is powered off: the copies of jobs it ran count as stopped, so their new
    placements start at once instead of after the fence wait (broker.agents.fencing). Returns the
    ids of the jobs that no longer wait for it.

    For a platform operator (superuser) or an admin of the node's tenant, and only for a node the
    broker does not hear from (LOST or OFFLINE): an ONLINE node's agent says itself what it runs.
    Their word stands in for the agent's; each job's events name who gave it.
    """
    from broker.tenancy.models import Membership, Role

    if not (getattr(by, "is_superuser", False)
            or Membership.objects.filter(tenant_id=node.tenant_id, user_id=by.pk, role=Role.ADMIN).exists()):
        raise ConfirmForbidden("Only a platform operator or an admin of the node's tenant may confirm that a "
                               "node is powered off.")
    with transaction.atomic():
        node = Node.objects.select_for_update().get(pk=node.pk)
        if node.state not in (NodeState.LOST, NodeState.OFFLINE):
            raise ConfirmRefused(f"Node {node.name} is {node.state}: its agent reports what it runs. Only a LOST "
                                 "or OFFLINE node can be confirmed powered off.", field="state")
        held = list(Allocation.objects.filter(node=node, active=False, stop_unconfirmed=True).select_related("job"))
        Allocation.objects.filter(pk__in=[a.pk for a in held]).update(stop_unconfirmed=False)
        jobs = {a.job_id: a.job for a in held if a.job.state not in TERMINAL_STATES}
        for job in jobs.values():
            event_append(job=job, kind="operator", reason_code="NODE_CONFIRMED_OFF",
                         message=f"{by} confirmed that node {node.name} is powered off: the job's copy there counts "
                                 "as stopped and it may start elsewhere at once.",
                         data={"node": node.name, "by": str(by)})
    log.warning("%s confirmed node %s powered off; %d job(s) no longer wait for it", by, node.name, len(jobs))  # pragma: no mutate
    return sorted(jobs)


# -- heartbeats ----------------------------------------------------------------------------------
# Gpu column <- what a heartbeat's reading says (mig_mode apart: it is kept unless the reading says).
_READING_COLUMNS: tuple[tuple[str, Any], ...] = (
    ("utilization_pct", lambda r: r.get("utilization_pct")),
    ("memory_used_mb", lambda r: r.get("memory_used_mb")),
    ("temperature_c", lambda r: r.get("temperature_c")),
    ("power_w", lambda r: r.get("power_w")),
    ("ecc_errors", lambda r: r.get("ecc_uncorrected") or 0),
    ("health", lambda r: r["health"]),
    ("held_outside", lambda r: bool(r.get("held_outside"))),
)
_MIG_MODES = {"enabled": True, "disabled": False}


def _telemetry_write(*, node_id: int, readings: list[dict[str, Any]], now: datetime) -> None:
    """One parameterised UPDATE per reading, keyed by the node and the GPU's index, sent as one
    executemany: no read of the GPU rows first, no model instances (Django's bulk_update built a CASE WHEN
    per column and GPU: 45% of a heartbeat's CPU in bench.service). A reading of an index the node did not
    register matches no row."""
    if not readings:
        return
    field, quote = Gpu._meta.get_field, connection.ops.quote_name
    columns = [field(name) for name, _ in _READING_COLUMNS]
    mig, seen = quote(field("mig_mode").column), field("last_seen_at").get_db_prep_save(now, connection)
    sets = ", ".join([f"{quote(c.column)} = %s" for c in columns]
                     + [f"{quote(field('last_seen_at').column)} = %s", f"{mig} = COALESCE(%s, {mig})"])
    rows = [[c.get_db_prep_save(value(reading), connection) for c, (_, value) in zip(columns, _READING_COLUMNS)]
            + [seen, _MIG_MODES.get(reading.get("mig_mode")), node_id, reading["index"]] for reading in readings]
    with connection.cursor() as cursor:
        cursor.executemany(f"UPDATE {quote(Gpu._meta.db_table)} SET {sets} "
                           f"WHERE {quote(field('node').column)} = %s AND {quote(field('index').column)} = %s", rows)


def agent_heartbeat(*, node: Node, data: dict[str, Any]) -> dict[str, Any]:
    """Store the node's telemetry per GPU; bring a LOST on-prem node back ONLINE. Returns the answer body.

    Every node calls this every few seconds, so it is three statements in the common case: the node's
    stamp (with its epoch), its GPUs' readings, its agent's last words."""
    now = timezone.now()
    agent_version = data.get("agent_version") or node.agent_version
    came_back = False
    with transaction.atomic():
        # The node's stamp, with the epoch it has at this moment, unless it is LOST (broker/rows.py: the
        # statements of this function are written by hand, as every node calls it every few seconds).
        epoch = row_update(Node, {"last_heartbeat_at": now, "agent_version": agent_version}, {"pk": node.pk},
                           unless={"state": NodeState.LOST}, returning="epoch")
        if epoch is None:
            # LOST: an on-prem node comes back ONLINE. A cloud instance's node never does (node_given_up;
            # the authentication refuses its token already, this is the second lock on the same door).
            came_back = Node.objects.filter(pk=node.pk, state=NodeState.LOST, instance__isnull=True).update(
                state=NodeState.ONLINE, last_heartbeat_at=now, agent_version=agent_version) == 1
            if not came_back:
                Node.objects.filter(pk=node.pk).update(last_heartbeat_at=now, agent_version=agent_version)
        _telemetry_write(node_id=node.pk, readings=data.get("telemetry", []), now=now)
        metrics = {"metrics_url": data["metrics_url"]} if "metrics_url" in data else {}
        row_update(NodeAgent, {"last_telemetry": data.get("telemetry", []), "processes": data.get("processes", []),
                               "missed_heartbeats": data.get("missed_heartbeats") or 0,
                               "last_error": data.get("last_error") or "", **metrics}, {"node": node.pk})
    if data.get("interruption"):
        from broker.agents.interruptions import node_interruption_notice

        node_interruption_notice(node=node, notice=data["interruption"])
        epoch = None  # the notice may requeue the node's jobs: the answer reads the epoch after it
    if came_back:
        log.warning("node %s is back after being marked LOST", node.name)  # pragma: no mutate
    if epoch is None:
        epoch = Node.objects.filter(pk=node.pk).values_list("epoch", flat=True).get()
    return {"epoch": epoch, "lost": came_back, "heartbeat_seconds": heartbeat_seconds()}


# -- status reports ------------------------------------------------------------------------------
def agent_report_status(*, node: Node, allocation_id: int, data: dict[str, Any]) -> AssignmentReport | None:
    """Record a report and move the job; None when the job had already finished.

    A finished job's history is closed: a late or replayed report (`running` after SUCCEEDED)
    records nothing the user sees, and the 200 answer makes the agent drop it from its outbox.
    """
    allocation = Allocation.objects.select_related("job").filter(pk=allocation_id, node=node).first()
    if allocation is None:
        raise AssignmentUnknown(f"No assignment {allocation_id} on this node.")
    if data["epoch"] != allocation.epoch:
        raise ReportRejected(f"Assignment {allocation_id} is at epoch {allocation.epoch}, not {data['epoch']}.",
                             field="epoch")
    if Job.objects.filter(pk=allocation.job_id, state__in=TERMINAL_STATES).exists():
        return None
    state, reason = data["state"], data.get("reason") or ""
    if state == "checkpoint_written":
        # Not a state of the process: the report it replaces (running, exited...) must stay as it is.
        _record_checkpoint(allocation=allocation, checkpoint=data["checkpoint"])
        return AssignmentReport.objects.filter(allocation=allocation).first()
    report, _ = AssignmentReport.objects.update_or_create(allocation=allocation, defaults={
        "state": state, "reason": reason, "exit_code": data.get("exit_code"),
        "message": data.get("message") or "", "pid": data.get("pid"),
    })
    job = allocation.job
    event_append(job=job, kind="agent", reason_code=f"AGENT_{state.upper()}",
                 message=f"{part_label(allocation, node)}: {data.get('message') or state}",
                 data={"node": node.name, "allocation": allocation.pk, "state": state, "reason": reason,
                       **part_data(allocation),
                       "exit_code": data.get("exit_code"), "pid": data.get("pid"),
                       **({"output_tail": data["output_tail"]} if data.get("output_tail") else {})})
    failed_gpus = {int(k): v for k, v in (data.get("failed_gpus") or {}).items()}
    if failed_gpus:
        # Do not wait for the next heartbeat: nothing new may be placed on these GPUs.
        Gpu.objects.filter(node=node, index__in=list(failed_gpus)).update(health=GpuHealth.FAILED)
    if allocation.active:
        if state == "failed" and failed_gpus:
            reasons = "; ".join(f"GPU {i}: {', '.join(r) or 'FAILED'}" for i, r in sorted(failed_gpus.items()))
            job_requeue(job=job, reason_code="GPU_FAILED",
                     message=f"{node.name}: the job died with its GPU ({reasons}); it restarts elsewhere.")
        else:
            _apply_report(job=job, allocation=allocation, state=state, reason=reason,
                          message=data.get("message") or state, node=node)
    return report


def _record_checkpoint(*, allocation: Allocation, checkpoint: dict[str, Any]) -> None:
    """A checkpoint from the allocation the job holds now; one from an older run is still recorded
    (the files are the job's), but only its current run's checkpoints answer a request."""
    from broker.jobs.checkpoints import CheckpointRefused, checkpoint_reported

    try:
        checkpoint_reported(allocation=allocation, step=checkpoint["step"], uri=checkpoint["uri"],
                            manifest_sha256=checkpoint["manifest_sha256"],
                            request_id=checkpoint.get("request_id"))
    except CheckpointRefused as exc:
        raise AgentError(str(exc), field=exc.field) from exc


# Reports of a part that has started (its process ran): a gang is RUNNING once every part has one.
_STARTED_REPORTS = ("running", "exited", "checkpoint_requested")


def _apply_report(*, job: Job, allocation: Allocation, state: str, reason: str, message: str, node: Node) -> None:
    if not is_gang(job):
        _apply_part_report(job=job, allocation=allocation, state=state, reason=reason, message=message, node=node)
        return
    with transaction.atomic():
        # The parts of a gang report at the same moment: the job row's lock makes each one see the
        # reports committed before it, so the last "running" (or "exited") always moves the job.
        Job.objects.select_for_update().filter(pk=job.pk).first()
        _apply_part_report(job=job, allocation=allocation, state=state, reason=reason, message=message, node=node)


def _apply_part_report(*, job: Job, allocation: Allocation, state: str, reason: str, message: str,
                       node: Node) -> None:
    """One part's report moves the job. A gang's part that fails, cannot start or stops on its own
    takes the whole job with it: the job's allocations are released, which withdraws the other
    parts' assignments, and their agents stop them at their next sync (agent/loop.py)."""
    job.refresh_from_db()
    who = part_label(allocation, node)  # "rank 1 of 2 on node-b", or the node's name for one node
    before_running = (JobState.PLACED, JobState.PROVISIONING, JobState.STARTING)
    waiting = _parts_not_started(job) if is_gang(job) and state == "running" else []
    if state == "running" and job.state in before_running and waiting:
        # All parts start together: the job is RUNNING only once every one of them runs.
        _advance(job, [JobState.STARTING], reason_code="GANG_STARTING",
                 message=f"{who} is running; waiting for {', '.join(waiting)} to start.")
    elif state == "running" and job.state in before_running:
        _advance(job, [JobState.STARTING, JobState.RUNNING], reason_code="AGENT_RUNNING",
                 message=f"Running on {node.name}." if not is_gang(job) else
                 f"Running on all {job.node_count} nodes.",
                 on_the_way=("AGENT_STARTED", f"{who} started the job's process."))
        job.refresh_from_db()
        if job.state == JobState.RUNNING:
            migration_job_running(job=job)
    elif state in ("stopped", "failed") and job.state == JobState.MIGRATING and migration_source_stopped(
            job=job, allocation=allocation):
        pass  # the moved job's source is down: it is being placed on its target
    elif state == "exited":
        others = (Allocation.objects.filter(job=job, active=True).exclude(pk=allocation.pk)
                  .exclude(agent_report__state="exited"))
        if not others.exists():  # a gang job succeeds when every node's part exited cleanly
            steps = [JobState.STARTING, JobState.SUCCEEDED] if job.state in before_running else [JobState.SUCCEEDED]
            _advance(job, steps, reason_code="JOB_EXITED", message=f"Exited with code 0 on {node.name}." if not
                     is_gang(job) else f"Every rank exited with code 0 (the last: {who}).")
    elif state == "failed" and reason in ("agent_crashed", "not_running"):
        job_requeue(job=job, reason_code="AGENT_RESTARTED", message=f"{who}: {message}. Restarting the job.")
    elif state == "failed" and is_gang(job):
        _advance(job, [JobState.FAILED], reason_code="JOB_FAILED",
                 message=f"{who} failed: {message}. The other ranks are stopped.",
                 data={"node": node.name, "reason": reason, **part_data(allocation)})
    elif state == "failed":
        _advance(job, [JobState.FAILED], reason_code="JOB_FAILED", message=f"{node.name}: {message}.")
    elif state == "stopped" and job.state != JobState.MIGRATING:
        # The broker did not take this allocation away (it is still active), yet the process ended:
        # the agent shut down or the node re-registered. The job goes back to the queue.
        job_requeue(job=job, reason_code="AGENT_STOPPED_JOB", message=f"{who}: {message}.")
    elif state == "refused" and reason == "invalid":
        # The assignment itself is unusable (no command, bad env...): another node would refuse it
        # too, so requeueing would only loop.
        _advance(job, [JobState.FAILED], reason_code="ASSIGNMENT_INVALID",
                 message=f"{who} cannot run this job: {message}.", data=part_data(allocation) or None)
    elif state == "refused":
        job_requeue(job=job, reason_code="ASSIGNMENT_REFUSED", message=f"{who} refused the job: {message}.")


def _parts_not_started(job: Job) -> list[str]:
    """"rank 1 (node-b)" for each part of a gang that has not reported its process started."""
    parts = gang_parts(job)
    started = set(AssignmentReport.objects.filter(allocation__in=parts, state__in=_STARTED_REPORTS)
                  .values_list("allocation_id", flat=True))
    return [f"rank {rank} ({part.node.name})" for rank, part in enumerate(parts) if part.pk not in started]


def _advance(job: Job, steps: list[str], *, reason_code: str, message: str,
             data: dict[str, Any] | None = None, on_the_way: tuple[str, str] | None = None) -> None:
    """Take `steps` in order; stop quietly at the first one the state machine or a race refuses
    (a duplicate report, or someone else moved the job first). `on_the_way`: the reason code and
    message of the steps before the last, where those are not what the last one says (a job passes
    STARTING on its way to RUNNING: two "Running on" lines would read as two starts)."""
    for number, target in enumerate(steps, start=1):
        if job.state == target:
            continue
        code, text = on_the_way if on_the_way and number < len(steps) else (reason_code, message)
        try:
            job = job_transition(job=job, to=target, reason_code=code, message=text, data=data)
        except (IllegalTransition, StaleState):
            return


# -- the lost-node sweep -------------------------------------------------------------------------
def nodes_mark_lost(*, now: datetime | None = None) -> list[Node]:
    """Mark LOST every agent node silent for longer than `lost_after_seconds()` while the broker was
    up, and requeue its jobs; their old copies are fenced (broker.agents.fencing).

    The broker's own outages do not count against nodes (broker.scheduler.outage): after the worker
    or the web server was down, every node gets the full limit again from the broker's return.
    Safe to run twice at once: the compare-and-set on (state, last_heartbeat_at) lets one caller win
    per node. Nodes that never heartbeated (simulated inventory without an agent) are left alone.
    """
    from broker.agents.fencing import fence_wait_seconds
    from broker.scheduler import outage

    now = now or timezone.now()
    limit = lost_after_seconds()
    cutoff = now - timedelta(seconds=limit)
    resumed_at = outage.sweep_resumption(now=now, limit_s=limit)
    if outage.in_grace(resumed_at=resumed_at, now=now, limit_s=limit):
        return []
    silent_nodes = list(Node.objects.filter(state__in=[NodeState.ONLINE, NodeState.DRAINING],
                                            last_heartbeat_at__lt=cutoff))
    if not silent_nodes:
        return []
    anyone_heard = Node.objects.filter(state__in=[NodeState.ONLINE, NodeState.DRAINING],
                                       last_heartbeat_at__gte=cutoff).exists()
    if not anyone_heard and not outage.agents_way_in_answers():
        # Every agent silent at once and the web server they talk to not answering: the broker is
        # down in front of them. Their grace starts when it answers again.
        outage.broker_unreachable_record(now=now)
        return []
    lost = []
    for node in silent_nodes:
        marked = Node.objects.filter(pk=node.pk, state=node.state, last_heartbeat_at__lt=cutoff).update(
            state=NodeState.LOST, epoch=F("epoch") + 1)
        if marked != 1:
            continue
        silent = int((now - max(node.last_heartbeat_at, resumed_at or node.last_heartbeat_at)).total_seconds())
        requeued = jobs_requeue_on_node(
            node_id=node.pk, reason_code="NODE_LOST", stop_unconfirmed=True,
            message=f"Node {node.name} sent no heartbeat for {silent} s (limit {limit} s); the job restarts "
                    "elsewhere from its last committed checkpoint, once its copy there is confirmed stopped "
                    f"(at most {fence_wait_seconds()} s).")
        log.warning("node %s marked LOST after %d s of silence; %d job(s) requeued", node.name, silent, len(requeued))  # pragma: no mutate
        node.refresh_from_db()
        lost.append(node)
    return lost
