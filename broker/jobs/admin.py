from django.contrib import admin

from broker.jobs.models import Allocation, Checkpoint, Job, JobEvent


class JobEventInline(admin.TabularInline):
    model = JobEvent
    extra = 0
    can_delete = False
    readonly_fields = ["created_at", "kind", "reason_code", "message", "data"]


@admin.register(Job)
class JobAdmin(admin.ModelAdmin):
    list_display = ["id", "name", "tenant", "owner", "state", "priority", "gpu_count", "created_at"]
    list_filter = ["state", "tenant"]
    search_fields = ["name"]
    # State changes go through services (compare-and-set + event); the admin only reads them.
    readonly_fields = ["state", "pending_reason_code", "pending_reason"]
    inlines = [JobEventInline]


@admin.register(Allocation)
class AllocationAdmin(admin.ModelAdmin):
    list_display = ["id", "job", "node", "active", "epoch", "created_at", "released_at"]
    list_filter = ["active"]


@admin.register(Checkpoint)
class CheckpointAdmin(admin.ModelAdmin):
    list_display = ["id", "job", "uri", "step", "state", "created_at"]
