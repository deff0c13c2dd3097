"""HTTP endpoints of the agent protocol (docs/agent.md). Thin: validate, call a service, answer.

They are machine-to-machine and left out of the public OpenAPI document.
"""
from __future__ import annotations

from drf_spectacular.utils import extend_schema
from rest_framework import status
from rest_framework.negotiation import DefaultContentNegotiation
from rest_framework.permissions import AllowAny
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from broker.agents import serializers as s
from broker.agents.authentication import IsNodeAgent, NodeTokenAuthentication
from broker.agents.selectors import node_assignments
from broker.agents.services import AgentError, agent_heartbeat, agent_register, agent_report_status, heartbeat_seconds
from broker.agents.throttles import (AgentAssignmentsThrottle, AgentHeartbeatThrottle, AgentRegisterThrottle,
                                     AgentStatusThrottle)
from broker.api.fastcheck import FastCheck


def _error(err: AgentError) -> Response:
    body = {"detail": str(err)} if err.field == "detail" else {err.field: [str(err)], "detail": str(err)}
    return Response(body, status=err.status)


class _NodeView(APIView):
    authentication_classes = [NodeTokenAuthentication]
    permission_classes = [IsNodeAgent]


@extend_schema(exclude=True)
class RegisterView(APIView):
    authentication_classes: list = []
    permission_classes = [AllowAny]
    throttle_classes = [AgentRegisterThrottle]  # checked before the body is parsed

    def post(self, request: Request) -> Response:
        serializer = s.RegisterSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        try:
            registration = agent_register(data=serializer.validated_data, remote_addr=request.META.get("REMOTE_ADDR"))
        except AgentError as err:
            return _error(err)
        return Response({"node_id": str(registration.node.pk), "node_token": registration.token,
                         "heartbeat_seconds": heartbeat_seconds(), "epoch": registration.node.epoch},
                        status=status.HTTP_201_CREATED if registration.created else status.HTTP_200_OK)


# Every agent calls this every few seconds: a plainly valid body is checked without DRF's per-field
# machinery, anything else by the serializer itself (broker/api/fastcheck.py).
_HEARTBEAT_CHECK = FastCheck(s.HeartbeatSerializer)


@extend_schema(exclude=True)
class HeartbeatView(_NodeView):
    throttle_classes = [AgentHeartbeatThrottle]

    def post(self, request: Request) -> Response:
        return Response(agent_heartbeat(node=request.auth, data=_HEARTBEAT_CHECK.validated(request.data)))


@extend_schema(exclude=True)
class AssignmentsView(_NodeView):
    throttle_classes = [AgentAssignmentsThrottle]

    def get(self, request: Request) -> Response:
        return Response(node_assignments(node=request.auth))


@extend_schema(exclude=True)
class StatusView(_NodeView):
    throttle_classes = [AgentStatusThrottle]

    def post(self, request: Request, assignment_id: int) -> Response:
        serializer = s.StatusSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        try:
            report = agent_report_status(node=request.auth, allocation_id=assignment_id,
                                         data=serializer.validated_data)
        except AgentError as err:
            return _error(err)
        if report is None:  # the job had finished: nothing recorded; 200 so the agent drops the report
            return Response({"ok": True, "state": serializer.validated_data["state"], "recorded": False})
        return Response({"ok": True, "state": report.state, "recorded": True})


class _AnyAccept(DefaultContentNegotiation):
    def select_renderer(self, request, renderers, format_suffix=None):
        return renderers[0], renderers[0].media_type


@extend_schema(exclude=True)
class UploadDownloadView(APIView):
    """An upload's blob, for the job that names it (agent/fetch_upload.py). The credential is the
    `Authorization: Upload <token>` of the job's assignment (broker/jobs/uploads.py): the job's own
    process fetches its files as the job user, who holds no node token."""

    authentication_classes: list = []
    permission_classes = [AllowAny]
    content_negotiation_class = _AnyAccept  # the blob whatever Accept says; errors in JSON

    def get(self, request: Request, upload_id: str):
        from django.http import FileResponse

        from broker.jobs.models import Upload
        from broker.jobs.uploads import UploadDenied, blob_path, upload_for_download

        scheme, _, token = request.META.get("HTTP_AUTHORIZATION", "").partition(" ")
        if scheme != "Upload" or not token.strip():
            return Response({"detail": "Send the job's download token: Authorization: Upload <token>."},
                            status=status.HTTP_403_FORBIDDEN)
        try:
            upload = upload_for_download(upload_id, token.strip())
            blob = blob_path(upload).open("rb")
        except UploadDenied as err:
            return Response({"detail": str(err)}, status=status.HTTP_403_FORBIDDEN)
        except (Upload.DoesNotExist, FileNotFoundError):
            return Response({"detail": "No such upload (deleted, or expired)."}, status=status.HTTP_404_NOT_FOUND)
        response = FileResponse(blob, content_type="application/gzip")
        response["Content-Length"] = str(upload.size_bytes)
        response["X-Content-SHA256"] = upload.sha256
        response["X-WhaleZen-Upload-Kind"] = upload.kind
        response["X-WhaleZen-Unpacked-Bytes"] = str(upload.unpacked_bytes)
        return response
