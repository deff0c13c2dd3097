"""Who is calling and for which tenant: resolved once per request by authentication."""
from __future__ import annotations

from dataclasses import dataclass

from broker.tenancy.models import ApiToken, Membership, Role, Tenant, TokenScope


@dataclass(frozen=True)
class TenantContext:
    tenant: Tenant
    membership: Membership
    token: ApiToken | None  # None for a browser session

    @property
    def can_write(self) -> bool:
        if not self.membership.can_write:
            return False
        return self.token is None or TokenScope.WRITE in self.token.scopes

    @property
    def is_admin(self) -> bool:
        return self.membership.role == Role.ADMIN
