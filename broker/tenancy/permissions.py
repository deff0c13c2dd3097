"""Permissions: a caller must belong to a tenant; viewers and read-only tokens cannot write."""
from __future__ import annotations

from rest_framework import permissions
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


class IsTenantMember(permissions.BasePermission):
    message = "You do not belong to a tenant, or your role or token does not allow this."

    def has_permission(self, request: Request, view) -> bool:
        ctx = tenant_context(request)
        if ctx is None:
            return False
        if request.method in permissions.SAFE_METHODS:
            return True
        return ctx.can_write


class IsTenantAdmin(IsTenantMember):
    message = "Only a tenant admin may do this."

    def has_permission(self, request: Request, view) -> bool:
        return super().has_permission(request, view) and tenant_context(request).is_admin
