from django.contrib import admin

from broker.agents.models import AssignmentReport, NodeAgent


@admin.register(NodeAgent)
class NodeAgentAdmin(admin.ModelAdmin):
    list_display = ["node", "backend", "driver_version", "registered_at", "missed_heartbeats"]
    readonly_fields = ["agent_key", "last_telemetry", "processes"]


@admin.register(AssignmentReport)
class AssignmentReportAdmin(admin.ModelAdmin):
    list_display = ["allocation", "state", "reason", "exit_code", "updated_at"]
