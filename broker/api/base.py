"""The one place where API reads are scoped to the caller's tenant."""
from __future__ import annotations

from django.db.models import QuerySet
from rest_framework import viewsets

from broker.tenancy.context import TenantContext
from broker.tenancy.permissions import tenant_context


class TenantScopedMixin:
    """Every queryset is filtered on `tenant_field` = the caller's tenant; other tenants' rows are 404."""

    tenant_field = "tenant"

    @property
    def ctx(self) -> TenantContext:
        ctx = tenant_context(self.request)
        assert ctx is not None, "IsTenantMember runs before any queryset is built"
        return ctx

    def scope(self, queryset: QuerySet) -> QuerySet:
        return queryset.filter(**{self.tenant_field: self.ctx.tenant})

    def get_queryset(self) -> QuerySet:
        if getattr(self, "swagger_fake_view", False):  # schema generation has no tenant
            return self.queryset.none()
        return self.scope(self.queryset.all())


class TenantReadOnlyViewSet(TenantScopedMixin, viewsets.ReadOnlyModelViewSet):
    pass
