"""The scheduling cycle as the broker runs it: snapshot → `scheduling.schedule` → commit the plan.

A cycle decides for one scheduling component: every team connected to the given one through shared
pools (broker.inventory.selectors.scheduling_components), on all the capacity they can reach, so one
decision covers the teams that compete for the same GPUs (a team that shares nothing is alone in its
component, as before). The component's lowest-id team holds the lease and the cycle's record.

Each step of the commit is its own transaction through the job services, so a plan made from a
snapshot that went stale (a job cancelled, a GPU taken meanwhile) loses only the conflicting parts;
they are simply reconsidered next cycle.
"""
from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Callable

from django.conf import settings
from django.db import transaction
from django.db.models import F, Q
from django.utils import timezone

from broker.inventory.models import OWNED_POOL_KINDS, Gpu, Node
from broker.inventory.selectors import pool_team_ids, scheduling_component, scheduling_components
from broker.jobs.checkpoints import committed_checkpoint
from broker.jobs.batch import NODE_JSON, JobRef, pending_reasons_set, placements_commit
from broker.jobs.migration import migration_request, open_migration
from broker.jobs.models import Job, MigrationCause
from broker.jobs.services import GpuRequest, JobError, job_set_pending_reason, job_transition
from broker.jobs.states import JobState
from broker.provisioning.offers import OfferRef, cloud_offers, pool_launch_limits
from broker.provisioning.services import InstanceCapReached, launch_request
from broker.scheduler.digest import cycle_inputs_digest
from broker.scheduler.models import CycleLease, CycleRecord
from providers.local.processes import process_start_time
from broker.scheduler.snapshot import component_snapshot
from broker.tenancy.models import CU_FLAVOR, TeamQuota, Tenant
from broker.tenancy.services import fair_share_usage_due, fair_share_usage_update
from scheduling import model as sm
from scheduling.collector import fewer_collections
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


@dataclass
class CycleOutcome:
    ran: bool
    placed: list[int] = field(default_factory=list)
    moved: list[int] = field(default_factory=list)  # moves the engine planned, begun this cycle
    preempted: list[int] = field(default_factory=list)
    conflicts: list[str] = field(default_factory=list)
    launched: list[int] = field(default_factory=list)
    plan: sm.Plan | None = None
    # Seconds per phase: snapshot (offers and the database read), solve (the engine), commit (moves,
    # placements, launches), reasons (pending reasons written).
    phases: dict[str, float] = field(default_factory=dict)
    # Nothing the decision depends on changed since the last cycle that found nothing to do: not decided again.
    unchanged: bool = False


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
    """One cycle for `tenant`'s scheduling component (every team sharing capacity with it)."""
    component = scheduling_component(tenant)
    lease_tenant = component[0]  # one lease per component, whichever of its teams asked for the cycle
    holder = lease_holder_name()
    cycle_number = _lease_acquire(lease_tenant, holder)
    if cycle_number is None:
        return CycleOutcome(ran=False)
    try:
        with fewer_collections():  # scheduling/collector.py: the snapshot's and the commit's rows live until it ends
            return _cycle_run(tenant=tenant, policy=policy, component=component, lease_tenant=lease_tenant,
                              holder=holder, cycle_number=cycle_number)
    finally:
        _lease_release(lease_tenant, holder)


def _cycle_run(*, tenant: Tenant, policy: sm.Policy, component: list[Tenant], lease_tenant: Tenant, holder: str,
               cycle_number: int) -> CycleOutcome:
    """The cycle under its component's lease."""
    # Every cycle, wanted or not, once a step has passed: the decay must follow the clock, not the
    # cycles that placed something (the held GPUs at each update stand for the step since the last).
    if fair_share_usage_due(tenants=component):
        fair_share_usage_update(tenants=component)
    if not _cycle_wanted(tenants=component, policy=policy):
        return CycleOutcome(ran=True)
    clock = time.perf_counter()
    digest = cycle_inputs_digest(tenant_ids=[t.pk for t in component])
    # Only a queue is not decided again: a cycle with nothing pending is a consolidation cycle, due by
    # the clock (scheduling.moves.cycle_wanted), and what it looks at changes with time alone.
    queued = Job.objects.filter(tenant__in=component, state=JobState.PENDING).exists()
    if queued and _unchanged_since_last_decision(lease_tenant, digest):
        return CycleOutcome(ran=True, unchanged=True, phases={
            "snapshot": time.perf_counter() - clock, "solve": 0.0, "commit": 0.0, "reasons": 0.0})
    offers, offer_index = cloud_offers(tenants=component)
    snapshot = component_snapshot(tenants=component, seed=cycle_number, offers=offers,
                                  launch_limits=pool_launch_limits(tenants=component))
    read = time.perf_counter()
    plan = schedule(snapshot, policy)
    solved = time.perf_counter()
    outcome = plan_commit(tenant=tenant, plan=plan, offer_index=offer_index, tenants=component)
    done = time.perf_counter()
    outcome.phases = {"snapshot": read - clock, "solve": solved - read,
                      "commit": done - solved - outcome.phases.get("reasons", 0.0),
                      "reasons": outcome.phases.get("reasons", 0.0)}
    teams = f"teams {', '.join(t.slug for t in component)}; " if len(component) > 1 else ""
    # One record per cycle (not per team): /metrics counts cycles and their solve times from these.
    CycleRecord.objects.create(
        tenant=lease_tenant, pending_jobs=len(snapshot.pending), placed_jobs=len(outcome.placed),
        preempted_jobs=len(outcome.preempted), conflicts=len(outcome.conflicts), method=plan.solver.method,
        proven_optimal=plan.solver.proven_optimal, solve_seconds=plan.solver.solve_seconds,
        objective=plan.solver.objective, note=(teams + "; ".join(outcome.conflicts))[:2000],
        phases={name: round(seconds, 6) for name, seconds in outcome.phases.items()},
    )
    # Remembered only when the cycle changed nothing: then the same inputs would decide the same again.
    idle = not (outcome.placed or outcome.preempted or outcome.moved or outcome.launched or outcome.conflicts)
    CycleLease.objects.filter(tenant=lease_tenant, holder=holder).update(
        inputs_digest=digest if idle else "", decided_at=timezone.now())
    return outcome


def cycle_refresh_seconds() -> float:
    """At most this long between two full decisions, even with unchanged inputs (time alone changes some)."""
    return float(getattr(settings, "WHALEZEN_CYCLE_REFRESH_SECONDS", 60))


def _unchanged_since_last_decision(lease_tenant: Tenant, digest: str) -> bool:
    lease = CycleLease.objects.filter(tenant=lease_tenant).values("inputs_digest", "decided_at").first()
    if not lease or lease["inputs_digest"] != digest or lease["decided_at"] is None:
        return False
    return (timezone.now() - lease["decided_at"]).total_seconds() < cycle_refresh_seconds()


def _preemption_words(*, preemption: sm.Preemption, for_job: Job | None, node: Node | None) -> tuple[str, dict]:
    """What a victim's events say about why it stops. A reclaim names the team that needs its share back
    and never that team's job (another team's job ids are not the victim's business); a priority
    preemption names the job of the victim's own team that takes its place."""
    if getattr(preemption, "cause", "priority") != "reclaim":
        return f"Preempted for job {preemption.for_job_id}", {"for_job": preemption.for_job_id}
    team = for_job.tenant.slug if for_job is not None else "another team"
    flavor = _reclaimed_flavor(for_job=for_job, node=node)
    return (f"Reclaimed for team {team}'s nominal {flavor} quota",
            {"cause": "reclaim", "for_team": team, "flavor": flavor})


def _reclaimed_flavor(*, for_job: Job | None, node: Node | None) -> str:
    """The quota flavor a reclaim gives back: the node's GPU model when the team has a quota of it, else
    compute units when it has a CU quota, else the model."""
    model = ""
    if node is not None:
        gpu = Gpu.objects.filter(node=node).select_related("model").order_by("index").first()
        model = (gpu.model.name if gpu.model else gpu.model_name) if gpu is not None else ""
    if for_job is not None:
        flavors = set(TeamQuota.objects.filter(tenant_id=for_job.tenant_id).values_list("flavor", flat=True))
        if model not in flavors and CU_FLAVOR in flavors:
            return "compute-unit"
    return model or "GPU"


def plan_commit(*, tenant: Tenant, plan: sm.Plan, offer_index: dict[str, OfferRef] | None = None,
                tenants: list[Tenant] | None = None) -> CycleOutcome:
    """Carry out a plan made for `tenant`'s component (`tenants`, looked up when not given): its jobs and
    nodes are looked up across the component, and a placement, launch or move on a pool the job's team
    may not use is refused (a conflict), whatever the plan says."""
    outcome = CycleOutcome(ran=True, plan=plan)
    component = tenants if tenants is not None else scheduling_component(tenant)
    tenant_ids = [t.pk for t in component]
    # Every job of the plan as a plain (id, team) row: placements and pending reasons need no more, and
    # 5,000 model instances with their tenants were 0.5 s of the commit (bench.service). Full instances
    # only for the few jobs that preemptions, moves and launches act on.
    slug_of = {t.pk: t.slug for t in component}
    refs = {str(pk): JobRef(pk, tenant_id) for pk, tenant_id in Job.objects.filter(
        tenant_id__in=tenant_ids, pk__in=_job_ids(plan)).values_list("pk", "tenant_id")}
    # The JSON columns none of these read are left to load on first use.
    jobs = {str(j.pk): j for j in Job.objects.filter(tenant_id__in=tenant_ids, pk__in=_acted_on_ids(plan))
            .select_related("tenant").defer("spec", "secret_env", "pending_reason_data", "gpu_alternatives")}
    nodes = {str(n.pk): n for n in Node.objects.filter(tenant_id__in=tenant_ids).defer(*NODE_JSON)}
    access = pool_team_ids({n.pool_id for n in nodes.values()}
                           | {ref.pool.pk for ref in (offer_index or {}).values()})

    def may_use(job: Job | JobRef, pool_id: int) -> bool:
        return job.tenant_id in access.get(pool_id, frozenset())

    for preemption in plan.preemptions:
        victim = jobs.get(preemption.victim_job_id)
        if victim is None:
            continue
        for_job = jobs.get(preemption.for_job_id)
        reclaim = getattr(preemption, "cause", "priority") == "reclaim"
        if not reclaim and for_job is not None and for_job.tenant_id != victim.tenant_id:
            # Only a reclaim may take another team's job (docs/quotas.md); a plan saying otherwise is wrong.
            outcome.conflicts.append(f"preempt {preemption.victim_job_id}: a priority preemption across teams")
            continue
        if open_migration(victim) is not None:
            continue  # already being checkpointed for a move or an earlier preemption
        why, why_data = _preemption_words(preemption=preemption, for_job=for_job,
                                          node=nodes.get(preemption.node_id))
        if victim.state == JobState.RUNNING and victim.checkpoint_uri:
            # Ask it to checkpoint first; it is requeued once that is committed, or at the grace's end.
            grace = preemption_grace_seconds()
            try:
                migration_request(job=victim, cause=MigrationCause.PREEMPTION,
                                  deadline=timezone.now() + timedelta(seconds=grace),
                                  message=f"{why}: checkpoint requested; it stops within {grace:.0f} s.")
                outcome.preempted.append(victim.pk)
            except JobError as exc:
                outcome.conflicts.append(f"preempt {preemption.victim_job_id}: {exc}")
            continue
        try:
            with transaction.atomic():
                resume = committed_checkpoint(victim)
                how = (f"it resumes from step {resume.step}, its last committed checkpoint" if resume is not None
                       else "it has no checkpoint and restarts from the beginning")
                victim = job_transition(job=victim, to=JobState.PREEMPTED,
                                        reason_code="RECLAIMED" if reclaim else "PREEMPTED",
                                        message=f"{why}; {how} ({preemption.lost_work_s:,.0f} s of work lost).",
                                        data={**why_data, "lost_work_s": preemption.lost_work_s},
                                        stop_unconfirmed=True)
                job_transition(job=victim, to=JobState.PENDING, reason_code="REQUEUED",
                               message="Re-queued: its borrowed capacity was reclaimed." if reclaim
                               else "Re-queued after preemption.")
            outcome.preempted.append(victim.pk)
        except JobError as exc:
            outcome.conflicts.append(f"preempt {preemption.victim_job_id}: {exc}")

    left: set[str] = set()  # nodes that moves already begun this cycle leave (plan order)
    for move in plan.migrations:
        _apply_move(move=move, job=jobs.get(move.job_id), nodes=nodes, outcome=outcome, may_use=may_use, jobs=jobs,
                    room_being_made=move.to.node_id in left)
        if int(move.job_id) in outcome.moved:
            left.add(move.from_node_id)

    on_nodes: list[tuple[JobRef, list[GpuRequest]]] = []
    for placement in plan.placements:
        job = refs.get(placement.job_id)
        if job is None or any(part.node_id is None for part in placement.parts):
            continue  # launch placements are committed with their launch below
        requests = [GpuRequest(node=nodes[part.node_id], gpu_indices=part.gpu_indices, milli=part.gpu_milli)
                    for part in placement.parts if part.node_id in nodes]
        if len(requests) != len(placement.parts):
            outcome.conflicts.append(f"job {job.pk}: a node of the plan is not one this cycle's teams reach")
            continue
        refused = [r.node.name for r in requests if not may_use(job, r.node.pool_id)]
        if refused:
            outcome.conflicts.append(f"job {job.pk}: team {slug_of[job.tenant_id]} may not use the pool of "
                                     f"{', '.join(refused)}")
            continue
        on_nodes.append((job, requests))
    # Set-based (broker/jobs/batch.py): one transaction per few hundred placements, allocation_commit's
    # checks for each; one commit per job took 135-230 s for 5,000 placements on PostgreSQL.
    committed = placements_commit(items=on_nodes)
    outcome.placed.extend(committed.placed)
    outcome.conflicts.extend(f"job {job_id}: {why}" for job_id, why in committed.refused.items())

    for launch in plan.launches:
        ref = (offer_index or {}).get(launch.offer_id)
        if ref is None:
            outcome.conflicts.append(f"launch {launch.launch_id}: unknown offer {launch.offer_id}")
            continue
        refused = [job_id for job_id in launch.job_ids
                   if job_id in refs and not may_use(refs[job_id], ref.pool.pk)]
        if refused:
            # Nothing is rented for a team the pool is not shared with: the whole launch waits.
            outcome.conflicts.append(f"launch {launch.launch_id}: pool {ref.pool.name} is not shared with the "
                                     f"team of job(s) {', '.join(refused)}")
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
    pending = [(refs[job_id], reason) for job_id, reason in plan.pending.items() if job_id in refs]
    listed = {str(i) for _, reason in pending for key in _JOB_LIST_KEYS
              if isinstance(reason.data.get(key), (list, tuple)) for i in reason.data[key]}
    team_of = {str(pk): tenant_id for pk, tenant_id in Job.objects.filter(
        pk__in=[int(i) for i in listed if i.isdigit()]).values_list("pk", "tenant_id")}
    started = time.perf_counter()
    written = {}
    for job, reason in pending:
        message, data = _reason_for_team(job=job, reason=reason, team_of=team_of)
        written[job.pk] = (reason.code.value, message, _json_safe(data))
    # Only reasons that changed are written (a cycle with nothing new writes nothing).
    pending_reasons_set(reasons=written)
    outcome.phases["reasons"] = time.perf_counter() - started
    return outcome


# Reason data that lists other jobs: the victims of a reclaim or preemption, the jobs moved to make room.
_JOB_LIST_KEYS = ("victims", "moved")


def _reason_for_team(*, job: Job | JobRef, reason: sm.Reason, team_of: dict[str, int]) -> tuple[str, dict]:
    """The engine's reason as the job's own team may read it: ids of another team's jobs (the borrowed
    jobs a reclaim stops, jobs a defragmentation moves off a shared node) are replaced by a count, in the
    data and in the sentence, which the engine writes as ", ".join(ids). Hostile tenancy (DESIGN.md):
    a team never learns another team's job ids."""
    message, data = reason.message, dict(reason.data)
    for key in _JOB_LIST_KEYS:
        ids = data.get(key)
        if not isinstance(ids, (list, tuple)):
            continue
        ids = [str(i) for i in ids]
        own = [i for i in ids if team_of.get(i) == job.tenant_id]
        foreign = len(ids) - len(own)
        if not foreign:
            continue
        data[key] = own
        data[f"{key}_of_other_teams"] = foreign
        shown = own + [f"{foreign} of another team"]
        message = message.replace(", ".join(ids), ", ".join(shown))
    return message, data


_MOVE_CAUSES = {"defragmentation": MigrationCause.DEFRAGMENTATION, "cheaper": MigrationCause.CONSOLIDATION,
                "consolidation": MigrationCause.CONSOLIDATION}


def _apply_move(*, move: sm.Migration, job: Job | None, nodes: dict[str, Node], outcome: CycleOutcome,
                may_use: Callable[[Job, int], bool] = lambda job, pool_id: True,
                jobs: dict[str, Job] | None = None, room_being_made: bool = False) -> None:
    """One move the engine planned, started as a checkpointed migration to the node it chose.
    `room_being_made`: a move begun before it in this plan leaves the target node (the engine frees
    an owned node that way for a rented job), so the target need not have room yet."""
    if job is None or job.state != JobState.RUNNING or open_migration(job) is not None:
        return
    target = nodes.get(move.to.node_id or "")
    if target is None:  # a move onto an instance still to launch: not carried out by the broker yet
        outcome.conflicts.append(f"move {job.pk}: target {move.to.launch_id or move.to.node_id} is not a node")
        return
    if not may_use(job, target.pool_id):
        outcome.conflicts.append(f"move {job.pk}: team {job.tenant.slug} may not use the pool of {target.name}")
        return
    cause = _MOVE_CAUSES.get(move.reason.split(":")[0].strip().lower(), MigrationCause.DEFRAGMENTATION)
    for_job = jobs.get(move.for_job_id or "") if jobs is not None else None
    if not move.for_job_id:
        why = ""
    elif for_job is not None and for_job.tenant_id != job.tenant_id:
        why = " to make room for another team's job"  # its id is not this team's business
    else:
        why = f" to make room for job {move.for_job_id}"
    try:
        migration_request(job=job, cause=cause, target_node=target.name, room_being_made=room_being_made,
                          message=f"Moving to {target.name} ({cause.label.lower()}{why}): checkpoint requested.")
        outcome.moved.append(job.pk)
    except JobError as exc:
        outcome.conflicts.append(f"move {job.pk}: {exc}")


def _acted_on_ids(plan: sm.Plan) -> set[int]:
    """The jobs a plan's preemptions, moves and launches act on (as Job instances)."""
    ids = {p.victim_job_id for p in plan.preemptions} | {p.for_job_id for p in plan.preemptions}
    ids |= {m.job_id for m in plan.migrations} | {m.for_job_id for m in plan.migrations if m.for_job_id}
    ids |= {job_id for launch in plan.launches for job_id in launch.job_ids}
    ids |= {p.job_id for p in plan.placements if any(part.node_id is None for part in p.parts)}
    return {int(i) for i in ids if str(i).isdigit()}


def _job_ids(plan: sm.Plan) -> set[int]:
    """Every job a plan names: those it acts on, those it places, those it leaves pending."""
    ids = {p.job_id for p in plan.placements} | set(plan.pending)
    return {int(i) for i in ids if str(i).isdigit()} | _acted_on_ids(plan)


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
        allocations__node__pool__kind__in=OWNED_POOL_KINDS)


def _cycle_wanted(*, tenants: list[Tenant], policy: sm.Policy, rules: MoveRules = MOVE_RULES) -> bool:
    """scheduling.moves.cycle_wanted for one component: something pending, or consolidation due."""
    ids = [t.pk for t in tenants]
    if Job.objects.filter(tenant_id__in=ids, state=JobState.PENDING).exists():
        return True
    last = CycleRecord.objects.filter(tenant_id__in=ids).values_list("started_at", flat=True).first()
    return cycle_wanted(
        pending=False, running_on_rented=Job.objects.filter(_running_on_rented(Q(tenant_id__in=ids))).exists(),
        seconds_since_last_cycle=None if last is None else (timezone.now() - last).total_seconds(),
        rules=rules, policy=policy)


def tenants_to_schedule(policy: sm.Policy = BROKER_POLICY) -> list[Tenant]:
    """One tenant per scheduling component a cycle is due for (scheduling.moves.cycle_wanted): pending
    jobs, or (consolidating) jobs on rented capacity and no cycle for consolidation_interval_s. The
    tenant named is the component's lowest-id team; its cycle covers the whole component."""
    pending = set(Job.objects.filter(state=JobState.PENDING).values_list("tenant_id", flat=True).distinct())
    candidates = set(pending)
    if policy.consolidation:
        candidates |= set(Job.objects.filter(_running_on_rented(Q())).values_list("tenant_id", flat=True).distinct())
    if not candidates:
        return []
    due: list[int] = []
    for members in scheduling_components(candidates):
        # A pending job wants a cycle already; only consolidation candidates ask cycle_wanted (the interval).
        if pending & set(members) or _cycle_wanted(tenants=list(Tenant.objects.filter(pk__in=members)),
                                                   policy=policy):
            due.append(members[0])
    by_id = Tenant.objects.in_bulk(due)
    return [by_id[tenant_id] for tenant_id in due]
