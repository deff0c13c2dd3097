from django.contrib import admin

from broker.tenancy.models import ApiToken, FairShareUsage, Membership, Quota, TeamQuota, Tenant


class MembershipInline(admin.TabularInline):
    model = Membership
    extra = 0
    autocomplete_fields = ["user"]


class QuotaInline(admin.StackedInline):
    model = Quota
    can_delete = False


@admin.register(Tenant)
class TenantAdmin(admin.ModelAdmin):
    list_display = ["slug", "name", "created_at"]
    search_fields = ["slug", "name"]
    inlines = [QuotaInline, MembershipInline]


@admin.register(TeamQuota)
class TeamQuotaAdmin(admin.ModelAdmin):
    """Per-flavor quotas of owned capacity (`manage.py quota_set` does the same); the form runs the
    model's clean(): a known flavor, limits >= 0, lending <= nominal."""

    list_display = ["tenant", "flavor", "nominal", "borrowing_limit", "lending_limit", "updated_at"]
    list_filter = ["flavor", "tenant"]
    search_fields = ["tenant__slug", "flavor"]


@admin.register(FairShareUsage)
class FairShareUsageAdmin(admin.ModelAdmin):
    """Read-only: the scheduler decays and adds to these every cycle."""

    list_display = ["tenant", "flavor", "decayed_hours", "updated_at"]
    list_filter = ["flavor", "tenant"]

    def has_add_permission(self, request) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False


@admin.register(Membership)
class MembershipAdmin(admin.ModelAdmin):
    list_display = ["user", "tenant", "role"]
    list_filter = ["role", "tenant"]


@admin.register(Quota)
class QuotaAdmin(admin.ModelAdmin):
    list_display = ["tenant", "max_gpus", "max_compute_units", "monthly_budget_usd", "max_pending_jobs"]


@admin.register(ApiToken)
class ApiTokenAdmin(admin.ModelAdmin):
    list_display = ["prefix", "name", "tenant", "user", "created_at", "expires_at", "last_used_at", "revoked_at"]
    list_filter = ["tenant"]
    # The secret hash is never shown or edited; tokens are created through the API or seed_demo.
    exclude = ["secret_hash"]
    readonly_fields = ["prefix", "created_at", "last_used_at"]
