"""Writes for tenants, memberships and API tokens."""
from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from django.contrib.auth.models import AbstractBaseUser
from django.db import transaction
from django.utils import timezone

from broker.tenancy import tokens
from broker.tenancy.models import ApiToken, Membership, Quota, Role, Tenant, TokenScope


@dataclass(frozen=True)
class CreatedToken:
    token: ApiToken
    secret: str  # the only time the plaintext exists


def tenant_create(*, slug: str, name: str) -> Tenant:
    with transaction.atomic():
        tenant = Tenant.objects.create(slug=slug, name=name)
        Quota.objects.create(tenant=tenant)
    return tenant


def membership_add(*, tenant: Tenant, user: AbstractBaseUser, role: str = Role.MEMBER) -> Membership:
    membership, _ = Membership.objects.update_or_create(tenant=tenant, user=user, defaults={"role": role})
    return membership


def api_token_create(
    *,
    tenant: Tenant,
    user: AbstractBaseUser,
    name: str,
    scopes: list[str] | None = None,
    expires_at: datetime | None = None,
) -> CreatedToken:
    issued = tokens.issue("wz")
    token = ApiToken.objects.create(
        tenant=tenant,
        user=user,
        name=name,
        prefix=issued.prefix,
        secret_hash=issued.digest,
        scopes=sorted(set(scopes or [TokenScope.READ, TokenScope.WRITE])),
        expires_at=expires_at,
    )
    return CreatedToken(token=token, secret=issued.plaintext)


def api_token_revoke(*, token: ApiToken) -> ApiToken:
    """Idempotent: revoking twice keeps the first revocation time."""
    ApiToken.objects.filter(pk=token.pk, revoked_at__isnull=True).update(revoked_at=timezone.now())
    token.refresh_from_db()
    return token


def api_token_authenticate(*, presented: str) -> ApiToken | None:
    """The active token matching `presented`, or None. Records last use at most once a minute."""
    prefix = tokens.split_prefix(presented)
    if prefix is None:
        return None
    token = ApiToken.objects.select_related("tenant", "user").filter(prefix=prefix).first()
    if token is None or not tokens.matches(presented, token.secret_hash) or not token.is_active:
        return None
    now = timezone.now()
    if token.last_used_at is None or (now - token.last_used_at).total_seconds() > 60:
        ApiToken.objects.filter(pk=token.pk).update(last_used_at=now)
        token.last_used_at = now
    return token
