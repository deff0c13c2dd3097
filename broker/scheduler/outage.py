"""Was the broker itself down? The lost-node sweep must not blame nodes for the broker's own silence.

Issue 8 item 6: the broker was killed for about 50 s while its agents ran on; the restarted broker
found every heartbeat older than the limit and marked the node LOST. Seen from the database, the
broker being down looks exactly like every node going quiet, so the sweep keeps its own clock:

- Each run of the lost-node sweep is recorded (`ops.PeriodicRun`, the row /healthz also reads). A
  gap between two runs longer than the heartbeat-loss limit means the worker or its beat was down:
  the broker resumed at this run.
- Agents reach the broker through the web server, which can be down while the worker runs. When
  every agent node is silent past the limit at once, the sweep asks the URL the agents use
  (`WHALEZEN_BROKER_PROBE_URL`) whether it answers at all; if it does not, the broker is down in
  front of the agents, nothing is marked, and the resumption moves to now.
- After a resumption a node is judged from max(its last heartbeat, resumption + the agents' retry
  cap): during an outage agents back off (up to `WHALEZEN_AGENT_RETRY_CAP_SECONDS`, the agent's
  backoff cap), so the first heartbeat after the broker's return can come that much later.
So an outage of any length marks no live node LOST: each gets a full heartbeat-loss period,
counted from when it could first reach the broker again.
"""
from __future__ import annotations

import logging
import urllib.error
import urllib.request
from datetime import datetime, timedelta

from django.conf import settings
from django.db import transaction

from broker.ops.models import PeriodicRun

log = logging.getLogger(__name__)
LOST_SWEEP = "agents.mark_lost"
PROBE_TIMEOUT_S = 2.0


def agent_retry_cap_seconds() -> int:
    """Longest an agent waits between two attempts to reach a broker that is down (its backoff cap)."""
    return int(getattr(settings, "WHALEZEN_AGENT_RETRY_CAP_SECONDS", 60))


def sweep_resumption(*, now: datetime, limit_s: float, name: str = LOST_SWEEP) -> datetime | None:
    """Record a run of the sweep `name` at `now`; when the broker last came back (None: never seen down).

    A first run ever has nothing to compare with and reports no outage.
    """
    with transaction.atomic():
        clock = PeriodicRun.objects.select_for_update().filter(name=name).first()
        if clock is None:
            PeriodicRun.objects.get_or_create(name=name, defaults={"last_run_at": now})
            return None
        gap = (now - clock.last_run_at).total_seconds()
        if gap > limit_s:
            log.warning("sweep %s did not run for %.0f s (limit %.0f s): the broker was down; nodes get %.0f s "
                        "from now before any is marked LOST", name, gap, limit_s, limit_s + agent_retry_cap_seconds())
            clock.resumed_at, clock.outage_seconds = now, gap
        clock.last_run_at = max(clock.last_run_at, now)
        clock.save(update_fields=["last_run_at", "resumed_at", "outage_seconds"])
        return clock.resumed_at


def broker_unreachable_record(*, now: datetime, name: str = LOST_SWEEP) -> None:
    """The agents' way in does not answer at `now`: grace for their nodes counts from no earlier."""
    with transaction.atomic():
        clock = PeriodicRun.objects.select_for_update().filter(name=name).first()
        if clock is None:
            PeriodicRun.objects.get_or_create(name=name, defaults={"last_run_at": now, "resumed_at": now})
            return
        if clock.resumed_at is None or clock.resumed_at < now:
            clock.resumed_at = now
            clock.save(update_fields=["resumed_at"])


def in_grace(*, resumed_at: datetime | None, now: datetime, limit_s: float) -> bool:
    """Is `now` too soon after the broker's return to blame any node for its silence?"""
    if resumed_at is None:
        return False
    return now < resumed_at + timedelta(seconds=limit_s + agent_retry_cap_seconds())


def probe_url() -> str:
    url = getattr(settings, "WHALEZEN_BROKER_PROBE_URL", None)
    if url is None:
        url = settings.WHALEZEN_PUBLIC_URL.rstrip("/") + "/healthz"
    return url


def agents_way_in_answers() -> bool:
    """Does the web server the agents talk to answer at all? Any HTTP status counts (a 503 from
    /healthz is an answer); a refused or timed-out connection does not. No URL set: assume yes."""
    url = probe_url()
    if not url:
        return True
    try:
        with urllib.request.urlopen(url, timeout=PROBE_TIMEOUT_S):  # noqa: S310 (our own URL, from settings)
            return True
    except urllib.error.HTTPError:
        return True
    except (OSError, ValueError) as exc:  # URLError, refused, timeout, malformed URL
        log.warning("the broker's agent endpoint %s does not answer (%s): no node is blamed for its silence",
                    url, exc)
        return False
