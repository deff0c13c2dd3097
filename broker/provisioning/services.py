"""Cloud instances: request them for a plan's launches, provision them idempotently, fail over on
capacity/quota errors, hand their GPUs to the waiting jobs when their agent registers, and retire them.

Leak rules (DESIGN.md): the CloudInstance row and its idempotency key are committed BEFORE any cloud
call; every resource is tagged at creation; an instance is only TERMINATED once the provider says so.
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import uuid
from dataclasses import dataclass, field
from datetime import timedelta
from decimal import Decimal

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from broker.inventory.models import CloudInstance, InstanceState, Node, NodeState, OfferBlock, Pool
from broker.jobs.models import Job
from broker.jobs.services import GpuRequest, JobError, allocation_commit, job_transition, jobs_requeue_on_node
from broker.jobs.states import ACTIVE_STATES, JobState
from broker.provisioning.factory import provider_for_pool
from broker.provisioning.offers import LIVE_INSTANCE_STATES, OfferRef, pool_instances_capped
from broker.tenancy import tokens
from providers.base import InstanceRef, InstanceState as ProviderState, ProviderError, ProvisionRequest, \
    derive_request_key
from scheduling import model as sm

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LaunchResult:
    instances: list[CloudInstance]
    jobs: list[int]
    # Jobs of the plan's instances the pool's cap refused (they stay PENDING), and why.
    held_back: list[int] = field(default_factory=list)
    held_back_reason: str = ""


class InstanceCapReached(JobError):
    """The pool already runs as many instances as its max_instances allows: nothing is launched."""

    def __init__(self, message: str) -> None:
        super().__init__(message, field="pool", code="conflict")


def _cap_message(pool: Pool, live: int, wanted: int) -> str:
    return (f"OFFER_QUOTA: pool {pool.name} allows {pool.max_instances} instance(s) at once and has {live}; "
            f"{wanted} more were planned. The job waits for one to be freed.")


def instance_join_token(instance: CloudInstance) -> str:
    """The one-time join token of an instance's agent. Derived, not stored, so a retried launch sends
    byte-identical user-data (AWS refuses a reused ClientToken whose parameters changed)."""
    mac = hmac.new(settings.SECRET_KEY.encode(), f"join:{instance.request_key}".encode(), hashlib.sha256)
    return f"wzi_{instance.request_key[-8:].rjust(8, '0')}_{mac.hexdigest()}"


def instance_join_token_consume(*, instance: CloudInstance, join_token: str) -> bool:
    """Use up an instance's one-time join token: True for exactly one caller, ever.

    Compare-and-set on the stored hash, inside the caller's registration transaction: of two
    registrations presenting the token at once, one changes the row and the other finds it changed.
    """
    digest = tokens.digest(join_token)
    return CloudInstance.objects.filter(pk=instance.pk, join_token_hash=digest,
                                        state__in=LIVE_INSTANCE_STATES).update(join_token_hash="") == 1


def launch_request(*, launch: sm.Launch, ref: OfferRef, plan: sm.Plan, jobs: dict[str, Job]) -> LaunchResult:
    """Record `launch.count` instances for a plan's launch and move its jobs to PROVISIONING (one transaction).

    The pool's `max_instances` is a hard limit on money: the pool row is locked and its instances
    counted in the same transaction, so two cycles committing at once cannot pass it together
    (the plan was made from a snapshot that may be stale). Instances beyond the cap are not
    recorded and their jobs stay PENDING (`held_back`); none left at all raises InstanceCapReached.
    The provider is called afterwards, by `instance_provision`, outside this transaction.
    """
    offer = ref.offer
    price = offer.spot_per_hour if launch.spot and offer.spot_per_hour else offer.on_demand_per_hour
    parts_by_instance: dict[int, list[dict]] = {}
    for job_id in launch.job_ids:
        placement = plan.placement_for(job_id)
        for part in placement.parts if placement else ():
            if part.launch_id == launch.launch_id:
                parts_by_instance.setdefault(part.instance, []).append(
                    {"job_id": int(job_id), "gpu_indices": list(part.gpu_indices), "milli": part.gpu_milli})
    created: list[CloudInstance] = []
    moved: list[int] = []
    with transaction.atomic():
        pool = Pool.objects.select_for_update().get(pk=ref.pool.pk)
        live = pool_instances_capped(pool=pool)
        allowed = min(launch.count, max(0, pool.max_instances - live))
        if allowed == 0:
            raise InstanceCapReached(_cap_message(pool, live, launch.count))
        held_back = sorted({part["job_id"] for i, parts in parts_by_instance.items() if i >= allowed
                            for part in parts})
        launching = {part["job_id"] for i, parts in parts_by_instance.items() if i < allowed for part in parts}
        if launching & set(held_back):  # a gang over instances on both sides of the cap: all or nothing
            raise InstanceCapReached(_cap_message(pool, live, launch.count))
        # One id for the instances of this launch: a gang over several of them starts when all have
        # registered (`instance_node_registered`), and only these are its siblings.
        launch_group = uuid.uuid4().hex[:12]
        for i in range(allowed):
            allocation_id = f"launch-{uuid.uuid4().hex[:12]}"
            key = derive_request_key(allocation_id=allocation_id, attempt=1, provider=pool.kind,
                                     instance_type=offer.instance_type, zone=offer.zone)
            instance = CloudInstance.objects.create(
                tenant=pool.tenant, pool=pool, request_key=key, instance_type=offer.instance_type, zone=offer.zone,
                spot=launch.spot, hourly_price_usd=Decimal(str(price)), node_name=f"{pool.name}-{key[-12:]}",
                placements=parts_by_instance.get(i, []), tags={"allocation": allocation_id, "launch": launch_group},
                offer={"region": offer.region, "zone": offer.zone, "instance_type": offer.instance_type,
                       "gpu_model": offer.gpu_model, "gpu_count": offer.gpu_count,
                       "on_demand_per_hour": offer.on_demand_per_hour, "spot_per_hour": offer.spot_per_hour},
            )
            instance.join_token_hash = tokens.digest(instance_join_token(instance))
            instance.save(update_fields=["join_token_hash"])
            created.append(instance)
            for part in instance.placements:
                job = jobs[str(part["job_id"])]
                if job.state == JobState.PENDING:
                    job = job_transition(job=job, to=JobState.PLACED, reason_code="LAUNCH",
                                         message=f"Launching {offer.instance_type} in {offer.zone or offer.region} "
                                                 f"({'spot' if launch.spot else 'on-demand'}, ${price:.2f}/h).",
                                         data={"instance": instance.pk, "offer": instance.offer})
                if job.state == JobState.PLACED:
                    jobs[str(part["job_id"])] = job_transition(
                        job=job, to=JobState.PROVISIONING, reason_code="PROVISIONING",
                        message=f"Waiting for instance {instance.node_name}.", data={"instance": instance.pk})
                    moved.append(job.pk)
        ids = [i.pk for i in created]
        transaction.on_commit(lambda: _enqueue_provision(ids))
    if held_back:
        log.warning("pool %s at its cap of %d: %d planned instance(s) not launched", pool.name, pool.max_instances,
                    launch.count - allowed)
    return LaunchResult(instances=created, jobs=moved, held_back=held_back,
                        held_back_reason=_cap_message(pool, live, launch.count) if held_back else "")


def _enqueue_provision(instance_ids: list[int]) -> None:
    from broker.provisioning.tasks import provision_instance

    for instance_id in instance_ids:
        provision_instance.delay(instance_id)


def instance_provision(*, instance: CloudInstance) -> CloudInstance:
    """Ask the provider for the instance. Safe to call again: the same request key never makes a second one."""
    if instance.state not in (InstanceState.REQUESTED, InstanceState.PENDING):
        return instance
    provider = provider_for_pool(instance.pool)
    offer = instance.offer
    request = ProvisionRequest(
        request_key=instance.request_key, allocation_id=instance.tags.get("allocation", str(instance.pk)),
        attempt=instance.attempt, region=offer.get("region", instance.pool.region), zone=instance.zone,
        instance_type=instance.instance_type, agent_server_url=settings.WHALEZEN_PUBLIC_URL,
        agent_join_token=instance_join_token(instance), node_name=instance.node_name, spot=instance.spot,
        gpu_model=offer.get("gpu_model", ""), gpu_count=int(offer.get("gpu_count", 0)),
        extra_tags=(("whalezen:tenant", instance.tenant.slug), ("whalezen:pool", str(instance.pool.pk))),
    )
    try:
        info = provider.provision(request)
    except ProviderError as exc:
        if exc.kind.value == "transient":
            CloudInstance.objects.filter(pk=instance.pk).update(last_error=str(exc))
            raise  # the task retries with the same key
        return instance_failed(instance=instance, error=exc)
    CloudInstance.objects.filter(pk=instance.pk, state__in=[InstanceState.REQUESTED, InstanceState.PENDING]).update(
        provider_id=info.ref.instance_id, zone=info.ref.zone or instance.zone,
        state=InstanceState.RUNNING if info.state == ProviderState.RUNNING else InstanceState.PENDING, last_error="")
    instance.refresh_from_db()
    return instance


def instance_failed(*, instance: CloudInstance, error: ProviderError) -> CloudInstance:
    """The launch failed for good: block the place when moving helps, and send the jobs back to the queue."""
    now = timezone.now()
    with transaction.atomic():
        if error.retry_elsewhere:
            OfferBlock.objects.create(
                pool=instance.pool, region=instance.offer.get("region", ""), zone=instance.zone,
                instance_type=instance.instance_type, reason=str(error),
                until=now + timedelta(seconds=settings.WHALEZEN_OFFER_BLOCK_SECONDS))
        CloudInstance.objects.filter(pk=instance.pk).update(state=InstanceState.FAILED, last_error=str(error),
                                                            terminated_at=now)
        for job in Job.objects.filter(pk__in=[p["job_id"] for p in instance.placements],
                                      state=JobState.PROVISIONING):
            try:
                job_transition(job=job, to=JobState.PENDING, reason_code="LAUNCH_FAILED",
                               message=f"Launching {instance.instance_type} in {instance.zone} failed ({error.kind.value}"
                                       f"{': ' + error.code if error.code else ''}); "
                                       + ("trying another place." if error.retry_elsewhere else "re-queued."),
                               data={"instance": instance.pk, "error": error.kind.value, "code": error.code})
            except JobError:
                pass  # cancelled meanwhile
    instance.refresh_from_db()
    return instance


def instance_node_registered(*, node: Node) -> list[int]:
    """A cloud instance's agent registered `node`: give the waiting jobs their GPUs and start them.

    A gang launched over several instances starts when the last of them has registered, with every
    part at once: started on the first alone it would run short of its nodes, and the others' parts
    would find it no longer waiting. The job's row lock orders two instances registering at once, so
    the later one sees the earlier and starts the gang."""
    instance = CloudInstance.objects.filter(pool=node.pool, node_name=node.name).first()
    if instance is None:
        return []
    CloudInstance.objects.filter(pk=instance.pk).update(node=node, state=InstanceState.RUNNING)
    started = []
    for job_id in dict.fromkeys(part["job_id"] for part in instance.placements):
        with transaction.atomic():
            job = Job.objects.select_for_update().filter(pk=job_id, state=JobState.PROVISIONING).first()
            if job is None:
                continue
            requests = _gang_requests(job_id=job_id, instance=instance, node=node)
            if requests is None:
                continue  # other instances of its gang are still coming up
            try:
                allocation_commit(job=job, requests=requests, expected_state=JobState.PROVISIONING,
                                  to_state=JobState.STARTING)
                started.append(job.pk)
            except JobError as exc:
                job_transition(job=job, to=JobState.PENDING, reason_code="LAUNCH_FAILED",
                               message=f"Instance {node.name} came up but could not take the job: {exc}")
    return started


def _gang_requests(*, job_id: int, instance: CloudInstance, node: Node) -> list[GpuRequest] | None:
    """The GPUs every instance of the same launch holds for the job, or None while one of them has no
    registered node yet. `instance` is the one `node` just registered for. Instances of an earlier
    launch that still list the job (its gang was placed again after a boot timeout) are not its
    siblings: their `placements` are never cleared."""
    requests = []
    group = instance.tags.get("launch")
    siblings = [] if not group else (
        CloudInstance.objects.filter(pool=instance.pool, state__in=LIVE_INSTANCE_STATES, tags__launch=group)
        .exclude(pk=instance.pk).select_related("node"))
    holders = [(instance, node)] + [(other, other.node) for other in siblings
                                    if any(part["job_id"] == job_id for part in other.placements)]
    for holder, holder_node in holders:
        if holder_node is None or (holder is not instance and holder.state != InstanceState.RUNNING):
            return None
        requests += [GpuRequest(node=holder_node, gpu_indices=tuple(part["gpu_indices"]), milli=part["milli"])
                     for part in holder.placements if part["job_id"] == job_id]
    return requests


def instance_terminate(*, instance: CloudInstance, reason: str) -> CloudInstance:
    """Ask the provider to terminate; the row says TERMINATED only when the provider confirms."""
    if instance.state in (InstanceState.TERMINATED, InstanceState.FAILED) and not instance.provider_id:
        return instance
    CloudInstance.objects.filter(pk=instance.pk).update(state=InstanceState.TERMINATING, last_error=reason)
    if instance.node_id:
        from broker.agents.services import node_give_up  # the agents app owns node tokens

        # Given up from now on, not only once the provider confirms: no job may be placed on it meanwhile.
        node_give_up(node=instance.node, reason=f"instance {instance.node_name} is being terminated: {reason}")
    if not instance.provider_id:
        return instance
    provider = provider_for_pool(instance.pool)
    info = provider.terminate(InstanceRef(provider=instance.pool.kind, region=instance.offer.get("region", ""),
                                          zone=instance.zone, instance_id=instance.provider_id))
    if info.state == ProviderState.TERMINATED:
        CloudInstance.objects.filter(pk=instance.pk).update(state=InstanceState.TERMINATED,
                                                            terminated_at=timezone.now())
        if instance.node_id:
            Node.objects.filter(pk=instance.node_id).update(state=NodeState.OFFLINE)
            jobs_requeue_on_node(node_id=instance.node_id, reason_code="INSTANCE_TERMINATED",
                                 message=f"Instance {instance.node_name} was terminated ({reason}); re-queued.")
    instance.refresh_from_db()
    return instance


def idle_instances(*, idle_seconds: int) -> list[CloudInstance]:
    """Running instances whose node has held no job for `idle_seconds` and that nobody waits for, and
    at once those whose node is LOST."""
    cutoff = timezone.now() - timedelta(seconds=idle_seconds)
    # A LOST node's instance is given up for good (its jobs went elsewhere, it never comes back): kept
    # for nothing, and its termination confirms their old copies stopped (broker.agents.fencing).
    idle = list(CloudInstance.objects.filter(state=InstanceState.RUNNING, node__state=NodeState.LOST))
    for instance in (CloudInstance.objects.filter(state=InstanceState.RUNNING, created_at__lt=cutoff)
                     .exclude(node__state=NodeState.LOST).select_related("node")):
        waiting = Job.objects.filter(pk__in=[p["job_id"] for p in instance.placements],
                                     state=JobState.PROVISIONING).exists()
        busy = instance.node_id and instance.node.allocations.filter(active=True, job__state__in=ACTIVE_STATES).exists()
        recently = instance.node_id and instance.node.allocations.filter(released_at__gt=cutoff).exists()
        if not waiting and not busy and not recently:
            idle.append(instance)
    return idle
