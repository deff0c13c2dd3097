"""Who is looking at a console page, for which team, and what they may do there.

Every console view is wrapped in `console_page`: the visitor must be logged in (else the login page),
must belong to a team (else a page that says so), and the team is the one chosen in the session among
the user's memberships (the first by default). The same `TenantContext` the API builds is set on the
request, so `broker.tenancy.permissions.tenant_context` and the API's serializers see the same caller.
Writes (any non-GET) need a writing role: a viewer's POST is a 403 page, before the view runs.
Objects are looked up through the team (`team_object_or_404`): another team's id is a 404.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import wraps
from typing import Callable

from django.contrib.auth.views import redirect_to_login
from django.db.models import Model, QuerySet
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import render

from broker.tenancy.context import TenantContext
from broker.tenancy.models import Membership
from broker.tenancy.permissions import may_change

SESSION_TEAM_KEY = "console_team_id"

# Everything the console loads comes from this server (air-gapped): no other origin is allowed, no
# inline script; styles only from our stylesheet (Chart.js and htmx set styles through the CSSOM).
CONTENT_SECURITY_POLICY = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                           "connect-src 'self'; font-src 'self'; object-src 'none'; base-uri 'self'; "
                           "form-action 'self'; frame-ancestors 'none'")


@dataclass(frozen=True)
class Console:
    """The page's caller: their team context and every team they may switch to."""

    ctx: TenantContext
    memberships: tuple[Membership, ...]

    @property
    def tenant(self):
        return self.ctx.tenant

    @property
    def can_write(self) -> bool:
        return self.ctx.can_write

    @property
    def is_admin(self) -> bool:
        return self.ctx.is_admin

    def may_change(self, *, owner_id: int | None) -> bool:
        return may_change(self.ctx, owner_id=owner_id)


def console_of(request: HttpRequest) -> Console | None:
    memberships = tuple(Membership.objects.select_related("tenant").filter(user=request.user).order_by("id"))
    if not memberships:
        return None
    chosen = request.session.get(SESSION_TEAM_KEY)
    membership = next((m for m in memberships if m.tenant_id == chosen), memberships[0])
    return Console(ctx=TenantContext(tenant=membership.tenant, membership=membership, token=None),
                   memberships=memberships)


def with_policy(response: HttpResponse) -> HttpResponse:
    response.setdefault("Content-Security-Policy", CONTENT_SECURITY_POLICY)
    response.setdefault("Cache-Control", "no-store")  # pages hold a team's data: never cached
    return response


def console_page(view: Callable | None = None, *, admin: bool = False) -> Callable:
    """Wrap a console view: login, team, role (`admin=True`: tenant admins only, for reads too)."""

    def decorate(func: Callable) -> Callable:
        @wraps(func)
        def wrapped(request: HttpRequest, *args, **kwargs) -> HttpResponse:
            if not request.user.is_authenticated:
                return redirect_to_login(request.get_full_path())
            console = console_of(request)
            if console is None:
                return with_policy(render(request, "console/no_team.html", status=403))
            request.console = console
            request._whalezen_tenant_ctx = console.ctx  # what tenant_context() returns for this request
            if admin and not console.is_admin:
                return refuse(request, "Only a team admin may do this.")
            if request.method not in ("GET", "HEAD", "OPTIONS") and not console.can_write:
                return refuse(request, "Your role in this team is viewer: viewers read, they do not change anything.")
            return with_policy(func(request, *args, **kwargs))

        return wrapped

    return decorate(view) if view is not None else decorate


def refuse(request: HttpRequest, reason: str) -> HttpResponse:
    """403 with the reason, as a fragment for htmx (it swaps it in place) or as a whole page."""
    template = "console/partials/refused.html" if request.headers.get("HX-Request") else "console/refused.html"
    return with_policy(render(request, template, {"reason": reason}, status=403))


def team_object_or_404(queryset: QuerySet, request: HttpRequest, *, tenant_field: str = "tenant", **lookup) -> Model:
    """One object of the caller's team; any other team's (or none) is a 404, never a 403."""
    try:
        return queryset.get(**{tenant_field: request.console.tenant}, **lookup)
    except (queryset.model.DoesNotExist, ValueError):
        raise Http404("No such object in your team.") from None
