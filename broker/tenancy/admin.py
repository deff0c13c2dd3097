from django.contrib import admin

from broker.tenancy.models import ApiToken, Membership, Quota, Tenant


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
