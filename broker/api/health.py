"""/healthz: is the service doing its job, not only answering?

Besides the database, it checks that the periodic sweeps that keep the service moving still run: a
dead beat or worker leaves the web server up while nothing is scheduled and no node is marked LOST.
A sweep is stale when its last recorded run is older than three of its periods (beat schedule in
settings); the grace for a service that just started counts from when this web process started.
Anonymous and probed often: one query, on a table with a row per periodic task.
"""
from __future__ import annotations

from datetime import datetime, timedelta

from django.conf import settings
from django.http import HttpRequest, JsonResponse
from django.utils import timezone

from broker.ops.models import PeriodicRun

# check name in the answer -> the Celery task that must keep running
SWEEPS = {"scheduler": "scheduler.sweep", "lost_nodes": "agents.mark_lost"}
STALE_AFTER_PERIODS = 3
# When this web process loaded its URLs (at start, or at its first request at the latest): for three
# periods after it, "never ran" or "last ran before the restart" is not a failure.
PROCESS_STARTED_AT: datetime = timezone.now()


def _periods() -> dict[str, float]:
    """Task name -> period in seconds, from the beat schedule (numbers or timedeltas)."""
    periods = {}
    for entry in getattr(settings, "CELERY_BEAT_SCHEDULE", {}).values():
        schedule = entry.get("schedule")
        if isinstance(schedule, timedelta):
            periods[entry["task"]] = schedule.total_seconds()
        elif isinstance(schedule, (int, float)):
            periods[entry["task"]] = float(schedule)
    return periods


def _sweep_check(last: datetime | None, period: float, now: datetime) -> tuple[bool, str]:
    """(healthy, what to say) for one sweep."""
    since = max(last, PROCESS_STARTED_AT) if last is not None else PROCESS_STARTED_AT
    limit = STALE_AFTER_PERIODS * period
    if last is None:
        waited = (now - since).total_seconds()
        if waited > limit:
            return False, f"stale: no run in the {waited:.0f} s since the web server started (period {period:g} s)"
        return True, f"starting: no run yet (period {period:g} s)"
    ago = (now - last).total_seconds()
    if (now - since).total_seconds() > limit:
        return False, f"stale: last run {ago:.0f} s ago (period {period:g} s)"
    return True, f"ok: last run {ago:.0f} s ago (period {period:g} s)"


def healthz(request: HttpRequest) -> JsonResponse:
    """200 when the database answers and the sweeps run; 503 naming what is wrong. Unauthenticated,
    for load balancers and `serve`."""
    try:
        last_runs = dict(PeriodicRun.objects.filter(name__in=SWEEPS.values()).values_list("name", "last_run_at"))
    except Exception as exc:  # any database failure means "not healthy"
        return JsonResponse({"status": "error", "checks": {"database": f"error: {exc.__class__.__name__}"}},
                            status=503)
    checks, healthy = {"database": "ok"}, True
    now, periods = timezone.now(), _periods()
    for check, task in SWEEPS.items():
        if task not in periods:
            checks[check] = "not scheduled"  # a deployment without this sweep: nothing to expect
            continue
        ok, said = _sweep_check(last_runs.get(task), periods[task], now)
        healthy, checks[check] = healthy and ok, said
    return JsonResponse({"status": "ok" if healthy else "error", "checks": checks}, status=200 if healthy else 503)
