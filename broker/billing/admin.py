from django.contrib import admin

from broker.billing.models import BillingMonth, BudgetAlert, ChargebackRate, UsageRecord


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
    list_display = ["tenant", "month", "threshold_pct", "spent_usd", "budget_usd", "created_at"]
