from __future__ import annotations

from rest_framework.throttling import SimpleRateThrottle

from broker.tenancy.permissions import tenant_context


class JobSubmitThrottle(SimpleRateThrottle):
    """Limits job submissions per API token (per user for browser sessions)."""

    scope = "job_submit"

    def get_cache_key(self, request, view) -> str | None:
        ctx = tenant_context(request)
        if ctx is None:
            return None
        ident = f"token:{ctx.token.pk}" if ctx.token is not None else f"user:{request.user.pk}"
        return self.cache_format % {"scope": self.scope, "ident": ident}
