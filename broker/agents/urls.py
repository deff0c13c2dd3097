"""Mounted at /api/v1/agent/ (see broker/urls.py)."""
from django.urls import path

from broker.agents.views import AssignmentsView, HeartbeatView, RegisterView, StatusView

app_name = "agents"
urlpatterns = [
    path("register", RegisterView.as_view(), name="register"),
    path("heartbeat", HeartbeatView.as_view(), name="heartbeat"),
    path("assignments", AssignmentsView.as_view(), name="assignments"),
    path("assignments/<str:assignment_id>/status", StatusView.as_view(), name="status"),
]
