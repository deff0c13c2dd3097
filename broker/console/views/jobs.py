"""The jobs list and the job page, with its cancel / checkpoint / migrate buttons.

Reads go through the API's own pieces where they hold a rule: the list filter is the API's `JobFilter`
(same fields, same messages), checkpoints and migrations are shaped by the API's serializers, the cost
is billing's `cost_report` (members see the cost of their own jobs only, as on /api/v1/costs/). The
buttons call the services the API calls (broker/api/jobs.py), with the same arguments; a refusal they
raise (JobError and its kinds) is shown on the page with the status the API would answer.

Live parts poll every 5 s. The poll sends the digest of what it shows; an unchanged answer is a 204,
which htmx does not swap, so the page (focus, a screen reader's place) only moves when something did.
"""
from __future__ import annotations

import hashlib
import re
from datetime import timedelta
from typing import Any, Callable

from django.contrib import messages
from django.core.paginator import Paginator
from django.db.models import Prefetch
from django.http import Http404, HttpRequest, HttpResponse, QueryDict
from django.shortcuts import redirect, render
from django.template.loader import render_to_string
from django.utils import timezone
from django.utils.safestring import mark_safe
from django.views.decorators.http import require_POST

from broker.api.jobs import CheckpointOutSerializer, JobFilter, MigrateRequestSerializer, MigrationOutSerializer
from broker.billing.selectors import cost_report
from broker.console.access import console_page, refuse, team_object_or_404
from broker.console.forms import PRIORITY_CHOICES, STATE_CHOICES, flat_errors, migrate_target
from broker.inventory.models import NodeState
from broker.inventory.selectors import nodes_usable_by, pools_usable_by
from broker.jobs import checkpoints, services
from broker.jobs.migration import migration_request, open_migration
from broker.jobs.models import Allocation, Checkpoint, Job, JobEvent, Migration
from broker.jobs.services import JobError
from broker.jobs.states import TERMINAL_STATES, JobState

PAGE_SIZE = 25
EVENTS_SHOWN = 100  # the newest ones; the API's events route pages through all of them
ROWS_SHOWN = 20  # checkpoints, migrations
REASON_ROWS = 40
INT_MAX = 2**63 - 1  # a larger id is no job (and SQLite would raise on it)
MAY_NOT_CHANGE = "Members change only their own jobs: ask its owner or a team admin."


# -- reads ------------------------------------------------------------------------------------------
def _gpus_text(job: Job) -> str:
    if job.compute_units is not None:
        text = f"{job.compute_units.normalize():f} CU"
    elif job.gpu_milli < 1000:
        text = f"{job.gpu_milli / 1000:g} of a GPU"
    else:
        text = f"{job.gpu_count} GPU{'s' if job.gpu_count != 1 else ''}"
    if job.node_count > 1:
        text += f" × {job.node_count} nodes"
    return text


def reason_words(job: Job) -> str:
    """The engine's sentence without the code it starts with ("INSUFFICIENT_GPUS: 0/2 nodes fit..."),
    which the page shows beside it already."""
    message, code = job.pending_reason or "", job.pending_reason_code
    return message[len(code) + 1:].strip() if code and message.startswith(code + ":") else message


def _active_allocations(job: Job) -> list[Allocation]:
    return [a for a in job.allocations.all() if a.active]


def _where(job: Job) -> list[dict[str, Any]]:
    """Node, pool and GPU indices of each active allocation (the API's AllocationOutSerializer, plus pool)."""
    return [{"node": a.node.name, "pool": a.node.pool.name, "epoch": a.epoch,
             "gpus": sorted({s.gpu.index for s in a.slices.all() if s.active}),
             "models": sorted({s.gpu.model_name for s in a.slices.all() if s.active})}
            for a in _active_allocations(job)]


def _with_allocations(queryset):
    active = Allocation.objects.filter(active=True).select_related("node__pool").prefetch_related("slices__gpu")
    return queryset.select_related("owner").prefetch_related(Prefetch("allocations", queryset=active))


_ACRONYMS = {"gpu": "GPU", "gpus": "GPUs", "cpu": "CPU", "cu": "CU", "nvlink": "NVLink", "id": "id"}


def _label(key: str, *, first: bool = True) -> str:
    words = [_ACRONYMS.get(w.lower(), w) for w in key.replace("_", " ").split()]
    if first and words and words[0] == words[0].lower():
        words[0] = words[0].capitalize()
    return " ".join(words) or key


def _scalar(value: Any) -> str:
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def reason_rows(data: Any, prefix: str = "") -> list[tuple[str, str]]:
    """The engine's reason numbers (pending_reason_data) as (label, value) rows: nested objects become
    "Rejections › gpu count", lists of plain values one comma-separated cell."""
    rows: list[tuple[str, str]] = []
    if isinstance(data, dict):
        if not data and prefix:
            return [(prefix, "none")]
        for key, value in data.items():
            label = f"{prefix} › {_label(str(key), first=False)}" if prefix else _label(str(key))
            rows += reason_rows(value, label)
    elif isinstance(data, list):
        if all(not isinstance(v, (dict, list)) for v in data):
            rows.append((prefix or "Values", ", ".join(_scalar(v) for v in data) or "none"))
        else:
            for index, value in enumerate(data):
                rows += reason_rows(value, f"{prefix} {index + 1}".strip())
    else:
        rows.append((prefix or "Value", _scalar(data)))
    return rows[:REASON_ROWS]


def _cost(request: HttpRequest, job: Job) -> dict[str, Any] | None:
    """What the job has cost so far (stored usage plus the live remainder), as billing reports it.
    None where the caller may not see it: the API shows members the costs of their own jobs only."""
    console = request.console
    if not console.is_admin and job.owner_id != request.user.pk:
        return None
    today = timezone.now().date()
    rows = cost_report(tenant=console.tenant, start=job.created_at.date(), end=today + timedelta(days=1),
                       group_by=["job"], user=None if console.is_admin else request.user.get_username(),
                       job_id=job.pk)  # this job's lines only, not the team's whole period on every poll
    row = next((r for r in rows if r["job"] == job.pk), None)
    return row or {"cost": "0.00", "gpu_hours": 0.0, "avg_gpu_utilisation": None}


def _output_tail(job: Job) -> str:
    """The newest output tail an agent reported (in an event's data), as `whalezen logs` reads it."""
    for data in (JobEvent.objects.filter(job=job, data__has_key="output_tail")
                 .order_by("-created_at", "-id").values_list("data", flat=True)[:5]):
        if isinstance(data, dict) and isinstance(data.get("output_tail"), str):
            return data["output_tail"]
    return ""


def _live_context(request: HttpRequest, job: Job) -> dict[str, Any]:
    events = list(JobEvent.objects.filter(job=job).order_by("-created_at", "-id")[:EVENTS_SHOWN])[::-1]
    ckpts = Checkpoint.objects.filter(job=job).select_related("allocation__node").order_by("-step", "-id")
    moves = Migration.objects.filter(job=job).select_related("checkpoint")
    waiting = job.state == JobState.PENDING
    return {
        "job": job, "gpus_text": _gpus_text(job), "where": _where(job), "finished": job.state in TERMINAL_STATES,
        "reason": {"code": job.pending_reason_code, "message": reason_words(job),
                   "rows": reason_rows(job.pending_reason_data or {})} if waiting else None,
        "events": events, "events_total": JobEvent.objects.filter(job=job).count(),
        "checkpoints": CheckpointOutSerializer(ckpts[:ROWS_SHOWN], many=True).data,
        "migrations": MigrationOutSerializer(moves[:ROWS_SHOWN], many=True).data,
        "cost": _cost(request, job), "output_tail": _output_tail(job),
    }


def _actions_context(request: HttpRequest, job: Job) -> dict[str, Any]:
    console = request.console
    mine = console.may_change(owner_id=job.owner_id)
    running = job.state == JobState.RUNNING
    has_uri = bool(job.checkpoint_uri)
    moving = open_migration(job) is not None
    return {
        "can_write": console.can_write, "may_change": mine,
        "can_cancel": mine and job.state not in TERMINAL_STATES,
        "can_checkpoint": mine and has_uri and job.state in (JobState.RUNNING, JobState.CHECKPOINTING),
        "can_migrate": mine and has_uri and running and not moving,
        "has_checkpoint_uri": has_uri, "moving": moving,
        "pools": list(pools_usable_by(console.tenant).filter(enabled=True).order_by("name")
                      .values_list("name", flat=True).distinct()),
        "nodes": list(nodes_usable_by(console.tenant).filter(state=NodeState.ONLINE).order_by("name")
                      .values_list("name", flat=True)[:200]),
    }


# -- live fragments ---------------------------------------------------------------------------------
_CSRF_VALUE = re.compile(r'name="csrfmiddlewaretoken" value="[^"]*"')


def _digest(html: str) -> str:
    # Without the CSRF token, which Django masks afresh on every render: the token the page already
    # holds stays valid, so an answer that differs only there is "unchanged".
    return hashlib.sha256(_CSRF_VALUE.sub("", html).encode()).hexdigest()[:20]


def _poll_url(request: HttpRequest) -> str:
    query: QueryDict = request.GET.copy()
    query.pop("digest", None)
    return request.path + (f"?{query.urlencode()}" if query else "")


def _live(request: HttpRequest, wrapper: str, inner: str, context: dict[str, Any], *, poll: bool = True,
          status: int = 200) -> tuple[str, bool]:
    """The live part rendered (`inner` inside `wrapper`, which polls with the inner part's digest), and
    whether the poller already shows exactly this."""
    body = render_to_string(inner, context, request=request)
    digest = _digest(body)
    unchanged = bool(request.htmx) and request.GET.get("digest") == digest
    html = render_to_string(wrapper, {**context, "body": mark_safe(body), "digest": digest, "poll": poll,
                                      "poll_url": _poll_url(request)}, request=request)
    return html, unchanged


def _priority_choices(chosen: str) -> list[tuple[str, str]]:
    """The named priorities, plus the number in the URL when it is another one (the API filters any)."""
    if chosen.isascii() and chosen.isdigit() and len(chosen) < 6 and chosen not in dict(PRIORITY_CHOICES):
        return [*PRIORITY_CHOICES, (chosen, chosen)]
    return PRIORITY_CHOICES


# -- the list ---------------------------------------------------------------------------------------
@console_page
def jobs_list(request: HttpRequest) -> HttpResponse:
    queryset = _with_allocations(Job.objects.filter(tenant=request.console.tenant)).order_by("-id")
    mine = request.GET.get("owner") == "mine"
    if mine:
        queryset = queryset.filter(owner=request.user)
    # The API's filter, so a bad value reads as it does there ("Select a valid choice...").
    filters = JobFilter(data=request.GET, queryset=queryset)
    valid = filters.is_valid()
    page = Paginator(filters.qs if valid else queryset.none(), PAGE_SIZE).get_page(request.GET.get("page"))
    context = {"nav": "jobs", "page": page, "filters": filters, "errors": filters.errors if not valid else {},
               "mine": mine, "states": STATE_CHOICES, "chosen_states": request.GET.getlist("state"),
               "priorities": _priority_choices(request.GET.get("priority", "")),
               "chosen_priority": request.GET.get("priority", ""),
               "name": request.GET.get("name", ""),
               "rows": [{"job": job, "gpus": _gpus_text(job), "where": _where(job), "reason": reason_words(job)}
                        for job in page]}
    tbody, unchanged = _live(request, "console/partials/jobs_tbody.html", "console/partials/jobs_rows.html", context)
    status = 200 if valid else 400
    if request.htmx and request.htmx.target == "jobs-rows":
        return HttpResponse(status=204) if unchanged and valid else HttpResponse(tbody, status=status)
    return render(request, "console/jobs.html", {**context, "tbody": mark_safe(tbody)}, status=status)


# -- the job page -----------------------------------------------------------------------------------
def _job_or_404(request: HttpRequest, pk: int) -> Job:
    if pk > INT_MAX:
        raise Http404("No such job in your team.")
    return team_object_or_404(_with_allocations(Job.objects.all()), request, pk=pk)


def _job_page(request: HttpRequest, job: Job, *, error: str = "", error_field: str = "",
              status: int = 200) -> HttpResponse:
    """The page, or one of its two live parts: the job's state and records (`job-live`), and the
    buttons (`job-actions`), which poll apart so a move target being chosen is only reset when what
    the buttons may do changed (the job started running, a move began)."""
    finished = job.state in TERMINAL_STATES
    target = request.htmx.target if request.htmx else None
    parts: dict[str, str] = {}
    for name, wrapper, inner, context_of in (
            ("job-live", "job_live.html", "job_live_body.html", _live_context),
            ("job-actions", "job_actions_live.html", "job_actions.html", _actions_context)):
        if target in (None, name):
            context = {"job": job, "error_field": error_field, **context_of(request, job)}
            html, unchanged = _live(request, f"console/partials/{wrapper}", f"console/partials/{inner}", context,
                                    poll=not finished)
            if target == name:
                if unchanged:
                    return HttpResponse(status=204)
                # 286: htmx swaps it, then stops polling (a finished job's page does not change again).
                return HttpResponse(html, status=286 if finished else 200)
            parts[name] = mark_safe(html)
    return render(request, "console/job.html", {"nav": "jobs", "job": job, "live": parts["job-live"],
                                                "actions": parts["job-actions"], "action_error": error},
                  status=status)


@console_page
def job_page(request: HttpRequest, pk: int) -> HttpResponse:
    return _job_page(request, _job_or_404(request, pk))


def _error_status(exc: JobError) -> int:
    """As broker/api/errors.py maps a JobError."""
    if exc.code == "throttled":
        return 429
    return 409 if exc.code in ("conflict", "illegal_transition") else 400


def _act(request: HttpRequest, pk: int, act: Callable[[Job], str]) -> HttpResponse:
    job = _job_or_404(request, pk)  # another team's job: 404 before anything else
    if not request.console.may_change(owner_id=job.owner_id):
        return refuse(request, MAY_NOT_CHANGE)
    try:
        done = act(job)
    except JobError as exc:
        job = _job_or_404(request, pk)
        return _job_page(request, job, error=str(exc), error_field=exc.field, status=_error_status(exc))
    messages.success(request, done)
    return redirect("console:job", pk=job.pk)


@console_page
@require_POST
def job_cancel(request: HttpRequest, pk: int) -> HttpResponse:
    def act(job: Job) -> str:
        services.job_cancel(job=job, by=request.user)
        return f"Job {job.pk} cancelled."

    return _act(request, pk, act)


@console_page
@require_POST
def job_checkpoint(request: HttpRequest, pk: int) -> HttpResponse:
    def act(job: Job) -> str:
        checkpoints.checkpoint_request(job=job, reason_code="USER_CHECKPOINT",
                                       message=f"Checkpoint requested by {request.user}.")
        return "Checkpoint requested: the job is CHECKPOINTING until one is committed."

    return _act(request, pk, act)


@console_page
@require_POST
def job_migrate(request: HttpRequest, pk: int) -> HttpResponse:
    def act(job: Job) -> str:
        target = migrate_target(str(request.POST.get("target", "")))
        if target is None:
            raise JobError("Choose a node, a pool, or anywhere else.", field="target")
        node, pool = target
        body = MigrateRequestSerializer(data={k: v for k, v in (("node", node), ("pool", pool)) if v})
        if not body.is_valid():  # the API's limits on a name (e.g. at most 200 characters)
            raise JobError("; ".join(f"{p}: {m}" for p, m in flat_errors(body.errors)), field="target")
        migration_request(job=job, target_node=body.validated_data.get("node", ""),
                          target_pool=body.validated_data.get("pool", ""), message="")
        where = node or (f"pool {pool}" if pool else "another node")
        return f"Moving to {where}: a checkpoint was requested; the move follows once it is committed."

    return _act(request, pk, act)
