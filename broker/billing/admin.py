from django.contrib import admin

from broker.billing.models import BillingMonth, BudgetAlert, ChargebackRate, OnDemandPrice, UsageRecord, UserBudget


@admin.register(UsageRecord)
class UsageRecordAdmin(admin.ModelAdmin):
    """Read-only: usage records are append-only."""

    list_display = ["key", "tenant", "day", "kind", "job_id", "gpu_model", "provider", "seconds", "amount_usd"]
    list_filter = ["kind", "provider", "month"]
    search_fields = ["key", "job_name", "user"]

    def has_change_permission(self, request, obj=None) -> bool:
        return False

    def has_delete_permission(self, request, obj=None) -> bool:
        return False

    def has_add_permission(self, request) -> bool:
        return False


@admin.register(ChargebackRate)
class ChargebackRateAdmin(admin.ModelAdmin):
    list_display = ["pool", "gpu_model", "rate_usd_per_gpu_hour"]


@admin.register(BillingMonth)
class BillingMonthAdmin(admin.ModelAdmin):
    list_display = ["tenant", "month", "closed_at"]
    readonly_fields = ["tenant", "month", "closed_at", "statement"]


@admin.register(BudgetAlert)
class BudgetAlertAdmin(admin.ModelAdmin):
    list_display = ["tenant", "user", "month", "threshold_pct", "spent_usd", "budget_usd", "created_at"]


@admin.register(UserBudget)
class UserBudgetAdmin(admin.ModelAdmin):
    list_display = ["tenant", "user", "monthly_budget_usd", "updated_at"]
    list_filter = ["tenant"]


@admin.register(OnDemandPrice)
class OnDemandPriceAdmin(admin.ModelAdmin):
    """Read-only: the day's recorded prices are what the savings report compares against."""

    list_display = ["tenant", "day", "gpu_model", "usd_per_gpu_hour", "offer"]
    list_filter = ["tenant", "gpu_model"]

    def has_change_permission(self, request, obj=None) -> bool:
        return False

    def has_add_permission(self, request) -> bool:
        return False
