"""Rate limits on the agent routes (DRF throttles counted by broker/api/throttling.py): anonymous
registration per client address, the other calls per node. A 429 carries Retry-After; the agent treats it like an outage and backs off.

Rates are settings read at each request (`WHALEZEN_AGENT_*_RATE`, "<count>/<s|min|hour|day>"), so an
operator can change them without code and a test can override them.
"""
from __future__ import annotations

from django.conf import settings

from broker.api.throttling import WindowRateThrottle

# A real agent heartbeats and pulls its assignments every 5 s (12 a minute each); status reports
# come in bursts (an outbox flushed after an outage), and a throttled report just waits its turn.
DEFAULT_RATES = {
    "register": "30/min",  # per client address: the demo starts 7 agents on one address at once
    "heartbeat": "60/min",
    "assignments": "60/min",
    "status": "600/min",
}


class _AgentThrottle(WindowRateThrottle):
    route = ""

    def get_rate(self) -> str:
        self.scope = f"agent_{self.route}"
        return getattr(settings, f"WHALEZEN_AGENT_{self.route.upper()}_RATE", DEFAULT_RATES[self.route])


class AgentRegisterThrottle(_AgentThrottle):
    """Per client address (REMOTE_ADDR, or the address proxies vouch for: REST_FRAMEWORK NUM_PROXIES)."""

    route = "register"

    def get_cache_key(self, request, view) -> str:
        return self.cache_format % {"scope": self.scope, "ident": self.get_ident(request)}


class _PerNodeThrottle(_AgentThrottle):
    """Per node (its token names one node): one stolen or looping token cannot flood the broker."""

    def get_cache_key(self, request, view) -> str | None:
        node = request.auth
        return self.cache_format % {"scope": self.scope, "ident": f"node:{node.pk}"} if node is not None else None


class AgentHeartbeatThrottle(_PerNodeThrottle):
    route = "heartbeat"


class AgentAssignmentsThrottle(_PerNodeThrottle):
    route = "assignments"


class AgentStatusThrottle(_PerNodeThrottle):
    route = "status"
