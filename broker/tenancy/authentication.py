"""DRF authentication: `Authorization: Bearer <token>` for API clients."""
from __future__ import annotations

from rest_framework import authentication, exceptions
from rest_framework.request import Request

from broker.tenancy.context import TenantContext
from broker.tenancy.services import api_token_membership_authenticate


class BearerTokenAuthentication(authentication.BaseAuthentication):
    keyword = "Bearer"

    def authenticate(self, request: Request):
        header = authentication.get_authorization_header(request).decode("latin-1")
        if not header:
            return None
        parts = header.split()
        if parts[0].lower() != self.keyword.lower():
            return None
        if len(parts) != 2:
            raise exceptions.AuthenticationFailed("Authorization header must be 'Bearer <token>'.")
        found = api_token_membership_authenticate(presented=parts[1])
        if found is None:
            raise exceptions.AuthenticationFailed("Invalid, expired or revoked token.")
        token, membership = found
        if membership is None or not token.user.is_active:
            raise exceptions.AuthenticationFailed("The token's user no longer belongs to its tenant.")
        return token.user, TenantContext(tenant=token.tenant, membership=membership, token=token)

    def authenticate_header(self, request: Request) -> str:
        # Makes DRF answer 401 (not 403) to anonymous callers.
        return 'Bearer realm="api"'
