from __future__ import annotations

from broker.api.throttling import WindowRateThrottle
from broker.tenancy.permissions import tenant_context


class JobSubmitThrottle(WindowRateThrottle):
    """Limits job submissions per API token (per user for browser sessions)."""

    scope = "job_submit"

    def get_cache_key(self, request, view) -> str | None:
        ctx = tenant_context(request)
        if ctx is None:
            return None
        ident = f"token:{ctx.token.pk}" if ctx.token is not None else f"user:{request.user.pk}"
        return self.cache_format % {"scope": self.scope, "ident": ident}
