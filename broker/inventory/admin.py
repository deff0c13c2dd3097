from django.contrib import admin, messages

from broker.agents.services import AgentError, node_confirm_powered_off
from broker.inventory.models import CloudInstance, Gpu, GpuModel, Node, Pool, PoolGrant
from broker.inventory.services import pool_join_token_issue


@admin.register(GpuModel)
class GpuModelAdmin(admin.ModelAdmin):
    list_display = ["name", "vendor", "memory_gb", "compute_units", "peak_dense_tflops", "nvlink"]
    search_fields = ["name"]


class PoolGrantInline(admin.TabularInline):
    """Teams the pool is shared with (besides its owner); `manage.py pool_share` does the same."""

    model = PoolGrant
    extra = 0
    autocomplete_fields = ["tenant"]
    readonly_fields = ["created_at"]


@admin.register(PoolGrant)
class PoolGrantAdmin(admin.ModelAdmin):
    list_display = ["pool", "tenant", "created_at"]
    list_filter = ["tenant"]
    autocomplete_fields = ["tenant"]
    readonly_fields = ["created_at"]


@admin.register(Pool)
class PoolAdmin(admin.ModelAdmin):
    list_display = ["name", "tenant", "kind", "region", "gpu_hour_rate_usd", "marginal_cost_usd_per_gpu_hour",
                    "cpu_rate_usd_per_core_hour", "memory_rate_usd_per_gib_hour", "enabled", "join_token_prefix"]
    list_filter = ["kind", "tenant"]
    exclude = ["join_token_hash"]
    readonly_fields = ["join_token_prefix"]
    actions = ["issue_join_token"]
    inlines = [PoolGrantInline]

    @admin.action(description="Issue a new agent join token (shown once)")
    def issue_join_token(self, request, queryset):
        for pool in queryset:
            token = pool_join_token_issue(pool=pool)
            self.message_user(request, f"Join token for {pool}: {token}", messages.WARNING)


class GpuInline(admin.TabularInline):
    model = Gpu
    extra = 0
    fields = ["index", "model_name", "memory_mb", "nvlink_island", "numa_node", "health", "utilization_pct",
              "memory_used_mb"]


@admin.register(Node)
class NodeAdmin(admin.ModelAdmin):
    list_display = ["name", "pool", "tenant", "state", "last_heartbeat_at"]
    list_filter = ["state", "pool__kind", "tenant"]
    exclude = ["token_hash"]
    inlines = [GpuInline]
    actions = ["confirm_powered_off"]

    @admin.action(description="Confirm powered off (its jobs restart elsewhere at once)")
    def confirm_powered_off(self, request, queryset):
        # The jobs of a LOST node wait for its agent to confirm their old copies stopped, or for the
        # fence wait; the person who knows the machine is off lets them go now (docs/scheduling.md).
        for node in queryset:
            try:
                released = node_confirm_powered_off(node=node, by=request.user)
            except AgentError as err:
                self.message_user(request, str(err), messages.ERROR)
                continue
            self.message_user(request, f"Node {node.name} confirmed powered off: {len(released)} job(s) no longer "
                              "wait for it.", messages.SUCCESS)


@admin.register(CloudInstance)
class CloudInstanceAdmin(admin.ModelAdmin):
    list_display = ["request_key", "provider_id", "instance_type", "zone", "spot", "state", "hourly_price_usd"]
    list_filter = ["state", "spot"]
