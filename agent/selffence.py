"""Self-fencing: an agent cut off from the broker for too long stops its jobs by itself.

When a node goes quiet the broker marks it LOST after its heartbeat-loss limit and places its jobs
again; a new copy is started once the old one is confirmed stopped, or after a bounded wait
(`WHALEZEN_FENCE_WAIT_SECONDS`, by default this fence-after + the LOST limit + two heartbeats,
broker/agents/fencing.py). An agent that cannot reach the broker confirms nothing, so it honours
that bound itself: once the broker has accepted no heartbeat (nor a registration) from it for
`fence_after_s`, it stops every job it runs (SIGTERM, grace, SIGKILL, as for a broker stop) and
queues `stopped` reports with reason `fenced`, delivered when the broker answers again. Those two
calls are the ones by which the broker judges a node alive, so the agent's silence starts at most
one answer's delay after the broker's; the broker's wait starts a LOST limit later still (at the
release) and adds two heartbeats, which covers that delay, the stop grace and a loop tick.

The default, 900 s, is longer than a 10-minute broker outage plus the agents' 60 s backoff cap: a
broker that was down (rather than the node cut off) for that long restarts no job and the agents
stop none (issue 8 item 6). 0 turns self-fencing off; the broker's bounded wait then no longer
covers an agent cut off for longer than it.
"""
from __future__ import annotations

import logging
from collections.abc import Callable

from agent.jobs import JobRunner

log = logging.getLogger(__name__)

DEFAULT_FENCE_AFTER_S = 900.0
FENCED = "fenced"  # the `reason` of the stop reports (docs/agent.md, status reasons)


class SelfFence:
    """When the broker last accepted a call from this agent, and what to do after a long silence."""

    def __init__(self, fence_after_s: float, clock: Callable[[], float]) -> None:
        if not fence_after_s >= 0:  # also refuses NaN, which would never compare as "due"
            raise ValueError(f"fence-after must be 0 (never) or a positive number of seconds, not {fence_after_s}")
        self.fence_after_s = fence_after_s
        self._clock = clock
        # A starting agent counts as in contact: it runs nothing before it has reached the broker
        # (it stops what a predecessor left before its first call).
        self.last_contact = clock()
        self.fenced_at: float | None = None

    def log_setting(self) -> None:
        if self.fence_after_s:
            log.info("jobs are stopped if the broker accepts no call from this agent for %.0f s "
                     "(--fence-after-seconds)", self.fence_after_s)
        else:
            log.warning("self-fencing is off (--fence-after-seconds 0): cut off from the broker, jobs run on "
                        "and may run twice once the broker restarts them elsewhere")

    def contact(self) -> None:
        """The broker accepted a heartbeat or a registration just now."""
        now = self._clock()
        if self.fenced_at is not None:
            log.warning("broker reachable again %.0f s after the last accepted call; the jobs stopped at %.0f s "
                        "are reported `stopped` (fenced)", now - self.last_contact, self.fenced_at - self.last_contact)
            self.fenced_at = None
        self.last_contact = now

    def silence(self, now: float) -> float:
        return now - self.last_contact

    def due(self, now: float) -> bool:
        return self.fence_after_s > 0 and self.silence(now) >= self.fence_after_s

    def apply(self, runner: JobRunner, now: float) -> int:
        """Past fence-after: begin stopping every job not stopping already; how many it began to stop.

        Called at every step, so a job is stopped however the silence ended up this long; the
        runner's SIGKILL after the grace follows from its poll(), as for any other stop.
        """
        if not self.due(now):
            return 0
        to_stop = [aid for aid, job in runner.running.items() if job.stop_reason is None]
        if not to_stop:
            return 0
        reason = (f"the broker accepted no call from this agent for {self.silence(now):.0f} s "
                  f"(fence-after {self.fence_after_s:.0f} s): stopped so that the job cannot run twice "
                  "once the broker restarts it elsewhere")
        log.error("%s; stopping %d job(s): %s", reason, len(to_stop), ", ".join(to_stop))
        for assignment_id in to_stop:
            runner.stop(assignment_id, reason=reason, code=FENCED)
        if self.fenced_at is None:
            self.fenced_at = now
        return len(to_stop)


__all__ = ["DEFAULT_FENCE_AFTER_S", "FENCED", "SelfFence"]
