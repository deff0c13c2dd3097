"""One error shape for the API: 400 bodies map each bad field to a list of reasons.

Every error body goes through `exception_handler` (user and agent routes alike), which keeps it small
whatever the request held: each message and each key is cut to a short excerpt (DRF's ChoiceField
echoes the whole input: `"<input>" is not a valid choice.`, which once made a 312 MB answer), and at
most `MAX_ENTRIES` entries are kept per object or list. DRF's shapes are kept as they are; the
request's id is in every response's `X-Request-ID` header (broker/api/middleware.py).
"""
from __future__ import annotations

from typing import Any

from django.core.exceptions import RequestDataTooBig
from rest_framework import status
from rest_framework.exceptions import ErrorDetail, ValidationError
from rest_framework.response import Response
from rest_framework.views import exception_handler as drf_exception_handler

from broker.api.excerpts import ELLIPSIS, MESSAGE_CHARS, VALUE_CHARS, excerpt
from broker.api.parsers import BodyError
from broker.jobs.services import JobError

MAX_ENTRIES = 20  # per object or list of an error body; the rest are counted
MAX_ERROR_DEPTH = 40  # deeper than any body the parsers accept


def _short(text: Any, limit: int) -> Any:
    if isinstance(text, ErrorDetail):
        return ErrorDetail(excerpt(str(text), limit), code=text.code)
    return excerpt(text, limit) if isinstance(text, str) else text


def shorten(data: Any, depth: int = 0) -> Any:
    """`data` (an error body) with every string and key cut and long objects and lists trimmed."""
    if depth > MAX_ERROR_DEPTH:
        return ELLIPSIS
    if isinstance(data, dict):
        items = list(data.items())
        out: dict[Any, Any] = {}
        for key, value in items[:MAX_ENTRIES]:
            short_key = _short(key, VALUE_CHARS)
            value = shorten(value, depth + 1)
            if short_key in out and isinstance(out[short_key], list) and isinstance(value, list):
                out[short_key] = out[short_key] + value  # two long keys cut to the same excerpt
            else:
                out[short_key] = value
        if len(items) > MAX_ENTRIES:
            out[ELLIPSIS] = [f"{len(items) - MAX_ENTRIES} more fields with errors."]
        return out
    if isinstance(data, list):
        out_list = [shorten(value, depth + 1) for value in data[:MAX_ENTRIES]]
        if len(data) > MAX_ENTRIES:
            out_list.append(f"{len(data) - MAX_ENTRIES} more errors.")
        return out_list
    return _short(data, MESSAGE_CHARS)


def _response(exc: Exception, context: dict[str, Any]) -> Response | None:
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


def exception_handler(exc: Exception, context: dict[str, Any]) -> Response | None:
    response = _response(exc, context)
    if response is None:
        return None  # unhandled: the request-id middleware answers 500 in the JSON shape
    response.data = shorten(response.data)
    return response


def not_found(request, exception=None):
    """Django's 404 handler: JSON under /api/ (clients parse it), Django's page elsewhere."""
    from django.http import JsonResponse
    from django.views.defaults import page_not_found

    if request.path.startswith("/api/"):
        return JsonResponse({"detail": "Not found."}, status=404)
    return page_not_found(request, exception)
