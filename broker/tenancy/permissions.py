"""Permissions: who may read and who may change what, for every API view.

The rule for changes (docs/job-spec.md, "Who may change a job"): a tenant admin may change any object
of the tenant; a member only the objects they own (their jobs, their tokens); a viewer, or any caller
with a read-only token, nothing. Another tenant's objects are never found (404, see broker/api/base.py),
so this only ever decides between callers of the same tenant.
"""
from __future__ import annotations

from typing import Any

from rest_framework import exceptions, permissions
from rest_framework.request import Request

from broker.tenancy.context import TenantContext
from broker.tenancy.models import Membership


def tenant_context(request: Request) -> TenantContext | None:
    """The caller's tenant context: from the token, or from the session user's (first) membership."""
    ctx = getattr(request, "_whalezen_tenant_ctx", None)
    if ctx is not None:
        return ctx
    if isinstance(request.auth, TenantContext):
        ctx = request.auth
    elif request.user and request.user.is_authenticated:
        membership = (
            Membership.objects.select_related("tenant").filter(user=request.user).order_by("id").first()
        )
        if membership is not None:
            ctx = TenantContext(tenant=membership.tenant, membership=membership, token=None)
    request._whalezen_tenant_ctx = ctx
    return ctx


def may_change(ctx: TenantContext, *, owner_id: int | None) -> bool:
    """Whether the caller may change one object of its tenant owned by user `owner_id` (None: no owner).

    The one place the rule lives: API views reach it through `IsTenantMember.has_object_permission`,
    and any other writer (the console, a CLI command) asks it the same way.
    """
    if not ctx.can_write:
        return False
    if ctx.is_admin:
        return True
    return owner_id is not None and owner_id == ctx.membership.user_id


class IsTenantMember(permissions.BasePermission):
    """Any member reads; writers (admins, members with a write token) write; objects by `may_change`.

    A view whose objects have an owner names its field in `owner_field` ("owner" for jobs, "user" for
    tokens); changing an object of a view that names none is for tenant admins only.
    """

    message = "You do not belong to a tenant, or your role or token does not allow this."

    def has_permission(self, request: Request, view) -> bool:
        ctx = tenant_context(request)
        if ctx is None:
            return False
        if request.method in permissions.SAFE_METHODS:
            return True
        return ctx.can_write

    def has_object_permission(self, request: Request, view, obj: Any) -> bool:
        if request.method in permissions.SAFE_METHODS:
            return True
        ctx = tenant_context(request)
        owner_field = getattr(view, "owner_field", None)
        owner_id = getattr(obj, f"{owner_field}_id", None) if owner_field else None
        if ctx is not None and may_change(ctx, owner_id=owner_id):
            return True
        kind = obj._meta.verbose_name
        if owner_field is None:
            raise exceptions.PermissionDenied(f"Only a tenant admin may change a {kind}.", code="not_admin")
        raise exceptions.PermissionDenied(
            f"This {kind} is another user's: members may change only their own {kind}s; "
            f"a tenant admin may change any {kind} of the tenant.",
            code="not_owner",
        )


class IsTenantAdmin(IsTenantMember):
    message = "Only a tenant admin may do this."

    def has_permission(self, request: Request, view) -> bool:
        return super().has_permission(request, view) and tenant_context(request).is_admin
