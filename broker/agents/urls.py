"""Mounted at /api/v1/agent/ (see broker/urls.py)."""
from django.urls import path, re_path, register_converter

from broker.agents.views import AssignmentsView, HeartbeatView, RegisterView, StatusView, UploadDownloadView


class AssignmentIdConverter:
    """ASCII digits only (`str.isdigit()` also accepts '²'), and at most 18 of them, so every id
    that matches fits a 64-bit primary key; anything else is an unknown URL (404)."""

    regex = "[0-9]{1,18}"

    def to_python(self, value: str) -> int:
        return int(value)

    def to_url(self, value: int) -> str:
        return str(value)


register_converter(AssignmentIdConverter, "assignment_id")

app_name = "agents"
urlpatterns = [
    path("register", RegisterView.as_view(), name="register"),
    path("heartbeat", HeartbeatView.as_view(), name="heartbeat"),
    path("assignments", AssignmentsView.as_view(), name="assignments"),
    path("assignments/<assignment_id:assignment_id>/status", StatusView.as_view(), name="status"),
    # A job's upload:<id> file (agent/fetch_upload.py); the id is 32 lowercase hex digits, else 404.
    re_path(r"^uploads/(?P<upload_id>[0-9a-f]{32})$", UploadDownloadView.as_view(), name="upload"),
]
