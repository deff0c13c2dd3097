"""Which teams a billing read covers: the caller's own team, or, for a platform admin, any or all.

A platform admin is a Django superuser: the operator who runs `/admin/` and owns the platform's pools and
cloud accounts. Through the API they use a token of any team they belong to (the platform's own team, for
instance) and add `?team=<slug>` to read that team's costs and statements, or `?team=all` for every team
(finance's view of the whole platform). Anyone else may name only their own team: any other name is a 403
whether that team exists or not, so team names cannot be probed.
"""
from __future__ import annotations

from django.contrib.auth.models import AbstractBaseUser, AnonymousUser
from rest_framework import exceptions

from broker.tenancy.models import Tenant
from broker.tenancy.context import TenantContext

ALL_TEAMS = "all"
MAX_SLUG = 64


def is_platform_admin(user: AbstractBaseUser | AnonymousUser | None) -> bool:
    return bool(user is not None and user.is_active and getattr(user, "is_superuser", False))


def billing_teams(*, team: str | None, ctx: TenantContext, user) -> list[Tenant]:
    """The teams a read covers, in slug order. Raises PermissionDenied (403) for a team the caller may not
    read, ValidationError (400, field `team`) for a platform admin's unknown team."""
    if team in (None, "") or team == ctx.tenant.slug:
        return [ctx.tenant]
    if not is_platform_admin(user):
        raise exceptions.PermissionDenied("Only platform admins may read another team's costs; leave out `team` "
                                          "for your own.")
    if team == ALL_TEAMS:
        return list(Tenant.objects.order_by("slug"))
    found = Tenant.objects.filter(slug=str(team)[:MAX_SLUG]).first()
    if found is None:
        raise exceptions.ValidationError({"team": [f"No team {str(team)[:40]!r}: give a team's slug or "
                                                   f"{ALL_TEAMS!r}."]})
    return [found]


def reads_whole_team(*, ctx: TenantContext, user) -> bool:
    """A team admin, or a platform admin: every job's costs and the idle lines, and the statements."""
    return ctx.is_admin or is_platform_admin(user)
