"""The scheduling cycle as the broker runs it: snapshot → `scheduling.schedule` → commit the plan.

Each step of the commit is its own transaction through the job services, so a plan made from a
snapshot that went stale (a job cancelled, a GPU taken meanwhile) loses only the conflicting parts;
they are simply reconsidered next cycle.
"""
from __future__ import annotations

import logging
import os
import socket
import uuid
from dataclasses import dataclass, field
from datetime import timedelta

from django.conf import settings
from django.db import transaction
from django.db.models import F, Q
from django.utils import timezone

from broker.inventory.models import Node, PoolKind
from broker.jobs.checkpoints import committed_checkpoint
from broker.jobs.migration import migration_request, open_migration
from broker.jobs.models import Job, MigrationCause
from broker.jobs.services import GpuRequest, JobError, allocation_commit, job_set_pending_reason, job_transition
from broker.jobs.states import JobState
from broker.provisioning.offers import OfferRef, cloud_offers, pool_launch_limits
from broker.provisioning.services import InstanceCapReached, launch_request
from broker.scheduler.models import CycleLease, CycleRecord
from providers.local.processes import process_start_time
from broker.scheduler.snapshot import tenant_snapshot
from broker.tenancy.models import Tenant
from scheduling import model as sm
from scheduling.engine import schedule
from scheduling.moves import MoveRules, cycle_wanted, move_policy

log = logging.getLogger(__name__)
# The engine's moves (defragmentation for a blocked job, consolidation off costly rented capacity) are
# applied as checkpointed migrations (broker.jobs.migration) under scheduling.moves' rules, the ones the
# cost week's simulator applies too: at most max_moves_per_cycle per cycle, never a job that has run
# less than min_run_before_move_s since it (re)started, consolidation cycles with nothing pending at
# most every consolidation_interval_s.
MOVE_RULES = MoveRules(
    min_run_before_preempt_s=float(getattr(settings, "WHALEZEN_MIN_RUN_BEFORE_PREEMPT_SECONDS", 600)),
    min_run_before_move_s=float(getattr(settings, "WHALEZEN_MIN_RUN_BEFORE_MOVE_SECONDS", 600)),
    max_moves_per_cycle=int(getattr(settings, "WHALEZEN_MAX_MOVES_PER_CYCLE", 4)),
    consolidation_interval_s=float(getattr(settings, "WHALEZEN_CONSOLIDATION_INTERVAL_SECONDS", 60)),
)
BROKER_POLICY = move_policy(MOVE_RULES)


def preemption_grace_seconds() -> float:
    """How long a preempted job with checkpoints has to commit one before it is stopped anyway (like a
    Slurm `--signal` lead time)."""
    return float(getattr(settings, "WHALEZEN_PREEMPTION_GRACE_SECONDS", 120))
# A chunk of 200 holds the write lock for well under a second even on a loaded machine.
PENDING_REASONS_PER_TRANSACTION = 200


@dataclass
class CycleOutcome:
    ran: bool
    placed: list[int] = field(default_factory=list)
    moved: list[int] = field(default_factory=list)  # moves the engine planned, begun this cycle
    preempted: list[int] = field(default_factory=list)
    conflicts: list[str] = field(default_factory=list)
    launched: list[int] = field(default_factory=list)
    plan: sm.Plan | None = None


_HOST = socket.gethostname()[:24]


def lease_holder_name() -> str:
    """`host|pid|process start time|random`: unique per cycle, and it says which process holds it."""
    pid = os.getpid()
    return f"{_HOST}|{pid}|{process_start_time(pid)}|{uuid.uuid4().hex[:12]}"


def _holder_died_here(holder: str) -> bool:
    """Whether `holder` was a process of this machine that no longer runs (pid and start time, so a
    reused pid is not mistaken for it). A holder elsewhere, or of another form, may be alive."""
    parts = holder.split("|")
    if len(parts) != 4 or parts[0] != _HOST or not parts[1].isdigit():
        return False
    return str(process_start_time(int(parts[1]))) != parts[2]


def _lease_acquire(tenant: Tenant, holder: str) -> int | None:
    """Take the tenant's cycle lease if free, expired, or held by a process of this machine that died
    (a worker SIGKILLed mid-cycle: its restarted successor need not wait out the lease, up to
    WHALEZEN_CYCLE_LEASE_SECONDS, before it schedules again); the cycle number, or None when another
    runs."""
    now = timezone.now()
    lease, _ = CycleLease.objects.get_or_create(tenant=tenant)
    takeable = Q(expires_at__isnull=True) | Q(expires_at__lt=now)
    if lease.holder and _holder_died_here(lease.holder):
        takeable |= Q(holder=lease.holder)  # compare-and-set: only if that dead holder still has it
    taken = CycleLease.objects.filter(takeable, tenant=tenant).update(
        holder=holder, expires_at=now + timedelta(seconds=settings.WHALEZEN_CYCLE_LEASE_SECONDS), cycles=F("cycles") + 1)
    if not taken:
        return None
    return CycleLease.objects.get(tenant=tenant).cycles


def _lease_release(tenant: Tenant, holder: str) -> None:
    CycleLease.objects.filter(tenant=tenant, holder=holder).update(expires_at=None, holder="")


def scheduling_cycle_run(*, tenant: Tenant, policy: sm.Policy = BROKER_POLICY) -> CycleOutcome:
    holder = lease_holder_name()
    cycle_number = _lease_acquire(tenant, holder)
    if cycle_number is None:
        return CycleOutcome(ran=False)
    try:
        if not _cycle_wanted(tenant=tenant, policy=policy):
            return CycleOutcome(ran=True)
        offers, offer_index = cloud_offers(tenant=tenant)
        snapshot = tenant_snapshot(tenant=tenant, seed=cycle_number, offers=offers,
                                   launch_limits=pool_launch_limits(tenant=tenant))
        plan = schedule(snapshot, policy)
        outcome = plan_commit(tenant=tenant, plan=plan, offer_index=offer_index)
        CycleRecord.objects.create(
            tenant=tenant, pending_jobs=len(snapshot.pending), placed_jobs=len(outcome.placed),
            preempted_jobs=len(outcome.preempted), conflicts=len(outcome.conflicts), method=plan.solver.method,
            proven_optimal=plan.solver.proven_optimal, solve_seconds=plan.solver.solve_seconds,
            objective=plan.solver.objective, note="; ".join(outcome.conflicts)[:2000],
        )
        return outcome
    finally:
        _lease_release(tenant, holder)


def plan_commit(*, tenant: Tenant, plan: sm.Plan, offer_index: dict[str, OfferRef] | None = None) -> CycleOutcome:
    outcome = CycleOutcome(ran=True, plan=plan)
    jobs = {str(j.pk): j for j in Job.objects.filter(tenant=tenant, pk__in=_job_ids(plan))}
    nodes = {str(n.pk): n for n in Node.objects.filter(tenant=tenant)}

    for preemption in plan.preemptions:
        victim = jobs.get(preemption.victim_job_id)
        if victim is None:
            continue
        if open_migration(victim) is not None:
            continue  # already being checkpointed for a move or an earlier preemption
        if victim.state == JobState.RUNNING and victim.checkpoint_uri:
            # Ask it to checkpoint first; it is requeued once that is committed, or at the grace's end.
            grace = preemption_grace_seconds()
            try:
                migration_request(job=victim, cause=MigrationCause.PREEMPTION,
                                  deadline=timezone.now() + timedelta(seconds=grace),
                                  message=f"Preempted for job {preemption.for_job_id}: checkpoint requested; "
                                          f"it stops within {grace:.0f} s.")
                outcome.preempted.append(victim.pk)
            except JobError as exc:
                outcome.conflicts.append(f"preempt {preemption.victim_job_id}: {exc}")
            continue
        try:
            with transaction.atomic():
                resume = committed_checkpoint(victim)
                how = (f"it resumes from step {resume.step}, its last committed checkpoint" if resume is not None
                       else "it has no checkpoint and restarts from the beginning")
                victim = job_transition(job=victim, to=JobState.PREEMPTED, reason_code="PREEMPTED",
                                        message=f"Preempted for job {preemption.for_job_id}; {how} "
                                                f"({preemption.lost_work_s:,.0f} s of work lost).",
                                        data={"for_job": preemption.for_job_id, "lost_work_s": preemption.lost_work_s},
                                        stop_unconfirmed=True)
                job_transition(job=victim, to=JobState.PENDING, reason_code="REQUEUED",
                               message="Re-queued after preemption.")
            outcome.preempted.append(victim.pk)
        except JobError as exc:
            outcome.conflicts.append(f"preempt {preemption.victim_job_id}: {exc}")

    for move in plan.migrations:
        _apply_move(move=move, job=jobs.get(move.job_id), nodes=nodes, outcome=outcome)

    for placement in plan.placements:
        job = jobs.get(placement.job_id)
        if job is None or any(part.node_id is None for part in placement.parts):
            continue  # launch placements are committed with their launch below
        requests = [GpuRequest(node=nodes[part.node_id], gpu_indices=part.gpu_indices, milli=part.gpu_milli)
                    for part in placement.parts if part.node_id in nodes]
        if len(requests) != len(placement.parts):
            outcome.conflicts.append(f"job {job.pk}: a node of the plan is not this tenant's")
            continue
        try:
            allocation_commit(job=job, requests=requests)
            outcome.placed.append(job.pk)
        except JobError as exc:
            outcome.conflicts.append(f"job {job.pk}: {exc}")

    for launch in plan.launches:
        ref = (offer_index or {}).get(launch.offer_id)
        if ref is None:
            outcome.conflicts.append(f"launch {launch.launch_id}: unknown offer {launch.offer_id}")
            continue
        try:
            result = launch_request(launch=launch, ref=ref, plan=plan, jobs=jobs)
            outcome.placed.extend(result.jobs)
            outcome.launched.extend(i.pk for i in result.instances)
            held_back, cap_message = result.held_back, result.held_back_reason
        except InstanceCapReached as exc:
            held_back, cap_message = [int(j) for j in launch.job_ids if str(j).isdigit()], str(exc)
        except JobError as exc:
            outcome.conflicts.append(f"launch {launch.launch_id}: {exc}")
            continue
        if held_back:
            # The pool's cap, checked under its lock, refused what the plan wanted: the jobs wait.
            outcome.conflicts.append(f"launch {launch.launch_id}: {cap_message}")
            for job in Job.objects.filter(pk__in=held_back, state=JobState.PENDING):
                job_set_pending_reason(job=job, code=sm.ReasonCode.OFFER_QUOTA.value, message=cap_message,
                                       data={"pool": ref.pool.name, "max_instances": ref.pool.max_instances})

    # Reasons in chunks, one transaction each: one per job took SQLite's write lock thousands of times a
    # cycle and starved the web server's writers (bench/submit_load.py: about 2x the submissions per second at 32 threads).
    pending = [(jobs[job_id], reason) for job_id, reason in plan.pending.items() if job_id in jobs]
    for start in range(0, len(pending), PENDING_REASONS_PER_TRANSACTION):
        with transaction.atomic():
            for job, reason in pending[start:start + PENDING_REASONS_PER_TRANSACTION]:
                job_set_pending_reason(job=job, code=reason.code.value, message=reason.message,
                                       data=_json_safe(dict(reason.data)))
    return outcome


_MOVE_CAUSES = {"defragmentation": MigrationCause.DEFRAGMENTATION, "cheaper": MigrationCause.CONSOLIDATION,
                "consolidation": MigrationCause.CONSOLIDATION}


def _apply_move(*, move: sm.Migration, job: Job | None, nodes: dict[str, Node], outcome: CycleOutcome) -> None:
    """One move the engine planned, started as a checkpointed migration to the node it chose."""
    if job is None or job.state != JobState.RUNNING or open_migration(job) is not None:
        return
    target = nodes.get(move.to.node_id or "")
    if target is None:  # a move onto an instance still to launch: not carried out by the broker yet
        outcome.conflicts.append(f"move {job.pk}: target {move.to.launch_id or move.to.node_id} is not a node")
        return
    cause = _MOVE_CAUSES.get(move.reason.split(":")[0].strip().lower(), MigrationCause.DEFRAGMENTATION)
    why = f" to make room for job {move.for_job_id}" if move.for_job_id else ""
    try:
        migration_request(job=job, cause=cause, target_node=target.name,
                          message=f"Moving to {target.name} ({cause.label.lower()}{why}): checkpoint requested.")
        outcome.moved.append(job.pk)
    except JobError as exc:
        outcome.conflicts.append(f"move {job.pk}: {exc}")


def _job_ids(plan: sm.Plan) -> set[int]:
    ids = {p.job_id for p in plan.placements} | set(plan.pending)
    ids |= {p.victim_job_id for p in plan.preemptions}
    ids |= {m.job_id for m in plan.migrations}
    return {int(i) for i in ids if str(i).isdigit()}


def _json_safe(value):
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_json_safe(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)


def _running_on_rented(tenant_filter: Q) -> Q:
    return tenant_filter & Q(state=JobState.RUNNING, allocations__active=True) & ~Q(
        allocations__node__pool__kind=PoolKind.ONPREM)


def _cycle_wanted(*, tenant: Tenant, policy: sm.Policy, rules: MoveRules = MOVE_RULES) -> bool:
    """scheduling.moves.cycle_wanted for one tenant: something pending, or consolidation due."""
    if Job.objects.filter(tenant=tenant, state=JobState.PENDING).exists():
        return True
    last = CycleRecord.objects.filter(tenant=tenant).values_list("started_at", flat=True).first()
    return cycle_wanted(
        pending=False, running_on_rented=Job.objects.filter(_running_on_rented(Q(tenant=tenant))).exists(),
        seconds_since_last_cycle=None if last is None else (timezone.now() - last).total_seconds(),
        rules=rules, policy=policy)


def tenants_to_schedule(policy: sm.Policy = BROKER_POLICY) -> list[Tenant]:
    """Tenants a cycle is due for (scheduling.moves.cycle_wanted): pending jobs, or (consolidating) jobs
    on rented capacity and no cycle for consolidation_interval_s."""
    pending = set(Job.objects.filter(state=JobState.PENDING).values_list("tenant_id", flat=True).distinct())
    candidates = Q(pk__in=pending)
    if policy.consolidation:
        candidates |= Q(jobs__in=Job.objects.filter(_running_on_rented(Q())))
    # A pending job wants a cycle already; only consolidation candidates ask cycle_wanted (the interval).
    return [tenant for tenant in Tenant.objects.filter(candidates).distinct()
            if tenant.pk in pending or _cycle_wanted(tenant=tenant, policy=policy)]
