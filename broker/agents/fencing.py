"""Reads: may a requeued job start again, or may its old copy still be running somewhere?

When a node is marked LOST, or the broker gives up on a cloud instance's node (`node_give_up`), its
jobs are requeued at once (their GPUs elsewhere can be reserved), but the released allocations are
flagged `stop_unconfirmed`: nothing said their processes ended. The
job's new placement is handed to its node as a `start` only once every such old copy is confirmed
stopped, or once `WHALEZEN_FENCE_WAIT_SECONDS` have passed since the release. An old copy is
confirmed stopped when its agent
- reported a final state for it (`stopped`, `exited`, `failed`, `refused`): it comes back, finds the
  allocation gone from its assignment list (the epoch changed) and stops it, or it had ended;
- heartbeated after the release without listing it among its processes;
- registered again after the release (a restarted agent kills what its predecessor left before it
  registers), or its cloud instance was terminated with the provider's confirmation.

An operator may also confirm that a LOST node is powered off (`node_confirm_powered_off`, the
Node admin action "confirm powered off"): its old copies count as stopped from then on.

Why the wait is bounded, and what that bound covers: a node is only marked LOST after the broker
itself has been up and hearing nothing from it for the whole heartbeat-loss period (see
`broker.scheduler.outage`), so its agent is dead or cut off from the broker. A dead agent runs
nothing; an agent that gets through again within the wait confirms as above, before the new copy
starts; and an agent cut off for longer stops its jobs itself once the broker has accepted no
heartbeat from it for `WHALEZEN_AGENT_FENCE_AFTER_SECONDS` (agent/selffence.py). The default wait
is that fence-after plus the LOST limit plus two heartbeats: it starts at the release, itself at
least a LOST limit after the last heartbeat the agent counts from, so the agent has fenced (and
its stop grace passed) before the new copy starts. A broker outage shorter than the fence-after
(10 minutes must restart no job) stops nothing on the agents. What the bound does not cover: an
agent that runs no code at all (SIGSTOPped, a frozen VM) while its jobs run on, a fence-after of 0
on the agents, or agents configured with a longer fence-after than the broker.
"""
from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime, timedelta

from django.conf import settings
from django.utils import timezone

from broker.agents.models import AssignmentReport, NodeAgent
from broker.inventory.models import CloudInstance, InstanceState
from broker.jobs.models import Allocation

# Agent reports after which no process of that allocation runs any more.
FINAL_REPORT_STATES = frozenset({"stopped", "exited", "failed", "refused"})


def agent_fence_after_seconds() -> int:
    """After how long without reaching the broker agents stop their jobs (0: never); what agents use."""
    return int(getattr(settings, "WHALEZEN_AGENT_FENCE_AFTER_SECONDS", 900))


def fence_wait_seconds() -> int:
    """How long a requeued job's new start waits at most for its old copy's stop to be confirmed."""
    from broker.agents.services import heartbeat_seconds, lost_after_seconds  # one definition of each

    explicit = getattr(settings, "WHALEZEN_FENCE_WAIT_SECONDS", None)
    if explicit is not None:
        return int(explicit)
    fence_after = agent_fence_after_seconds()
    if fence_after <= 0:  # agents never fence themselves: no wait is safe; keep the old bound
        return 2 * lost_after_seconds()
    return fence_after + lost_after_seconds() + 2 * heartbeat_seconds()


def unconfirmed_copies(*, job_ids: Iterable[int], now: datetime | None = None) -> dict[int, list[Allocation]]:
    """Per job id, its released allocations whose process may still run (empty: free to start)."""
    now = now or timezone.now()
    ids = set(job_ids)
    if not ids:
        return {}
    since = now - timedelta(seconds=fence_wait_seconds())
    candidates = list(Allocation.objects.filter(job_id__in=ids, active=False, stop_unconfirmed=True,
                                                released_at__gt=since).select_related("node"))
    if not candidates:
        return {}
    reports = dict(AssignmentReport.objects.filter(allocation__in=candidates).values_list("allocation_id", "state"))
    node_ids = {a.node_id for a in candidates}
    agents = {a.node_id: a for a in NodeAgent.objects.filter(node_id__in=node_ids)}
    terminated = set(CloudInstance.objects.filter(node_id__in=node_ids, state=InstanceState.TERMINATED)
                     .values_list("node_id", flat=True))
    open_copies: dict[int, list[Allocation]] = {}
    for allocation in candidates:
        if not _stop_confirmed(allocation, reports.get(allocation.pk), agents.get(allocation.node_id),
                               allocation.node_id in terminated):
            open_copies.setdefault(allocation.job_id, []).append(allocation)
    return open_copies


def _stop_confirmed(allocation: Allocation, report_state: str | None, agent: NodeAgent | None,
                    instance_terminated: bool) -> bool:
    if report_state in FINAL_REPORT_STATES or instance_terminated:
        return True
    released = allocation.released_at
    if agent is None or released is None:
        return agent is None  # no agent ever ran on that node: nothing can be running there
    if agent.registered_at > released:
        return True
    heard = allocation.node.last_heartbeat_at
    if heard is not None and heard > released:
        listed = {str(p.get("assignment_id")) for p in agent.processes or [] if isinstance(p, dict)}
        return str(allocation.pk) not in listed
    return False
