"""One error shape for the API: 400 bodies map each bad field to a list of reasons."""
from __future__ import annotations

from typing import Any

from django.core.exceptions import RequestDataTooBig
from rest_framework import status
from rest_framework.exceptions import ValidationError
from rest_framework.response import Response
from rest_framework.views import exception_handler as drf_exception_handler

from broker.api.parsers import BodyError
from broker.jobs.services import JobError


def exception_handler(exc: Exception, context: dict[str, Any]) -> Response | None:
    if isinstance(exc, BodyError):
        return Response({"body": [str(exc.detail)]}, status=status.HTTP_400_BAD_REQUEST)
    if isinstance(exc, RequestDataTooBig):
        return Response({"body": ["Request body is too large."]}, status=status.HTTP_400_BAD_REQUEST)
    if isinstance(exc, JobError):
        code = status.HTTP_409_CONFLICT if exc.code in ("conflict", "illegal_transition") else status.HTTP_400_BAD_REQUEST
        if exc.code == "throttled":
            code = status.HTTP_429_TOO_MANY_REQUESTS
        return Response({exc.field: [str(exc)], "code": exc.code}, status=code)
    response = drf_exception_handler(exc, context)
    if response is not None and isinstance(exc, ValidationError) and isinstance(response.data, list):
        response.data = {"non_field_errors": response.data}
    return response


def not_found(request, exception=None):
    """Django's 404 handler: JSON under /api/ (clients parse it), Django's page elsewhere."""
    from django.http import JsonResponse
    from django.views.defaults import page_not_found

    if request.path.startswith("/api/"):
        return JsonResponse({"detail": "Not found."}, status=404)
    return page_not_found(request, exception)
