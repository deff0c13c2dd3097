"""Request ids, and the API's JSON error shape for errors nothing else handled.

Every response carries `X-Request-ID` (a sane incoming one is kept, so a proxy's id follows the request
through our logs; otherwise a new one). Under /api/, clients parse JSON: an unhandled exception answers
`500 {"detail": ..., "request_id": ...}` (never Django's HTML page, also with DJANGO_DEBUG=1 on a developer's
machine) and its traceback is logged with the request id; a database that is locked or busy answers 503
with Retry-After, since the same request can succeed a moment later. Any other non-JSON error page
Django itself makes under /api/ (a 404 with DEBUG on, a 400 for a bad Host) is turned into the same
shape.
"""
from __future__ import annotations

import logging
import re
import uuid
from collections.abc import Callable

from django.db import OperationalError
from django.http import HttpRequest, HttpResponse, JsonResponse

logger = logging.getLogger("broker.api")

HEADER = "X-Request-ID"
_SANE_ID = re.compile(r"^[A-Za-z0-9._:-]{8,128}$")
API_PREFIX = "/api/"
RETRY_AFTER_SECONDS = 2
_BUSY_WORDS = ("database is locked", "database table is locked", "database is busy", "lock timeout",
               "could not obtain lock")


def request_id_of(request: HttpRequest) -> str:
    """The id of this request (set by the middleware; a fresh one if it did not run)."""
    rid = getattr(request, "request_id", None)
    if rid is None:
        rid = request.request_id = uuid.uuid4().hex
    return rid


def _is_busy(exc: BaseException) -> bool:
    return isinstance(exc, OperationalError) and any(word in str(exc).lower() for word in _BUSY_WORDS)


def _is_json(response: HttpResponse) -> bool:
    return response.get("Content-Type", "").split(";")[0].strip().endswith("json")


class RequestIdMiddleware:
    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]):
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        incoming = request.META.get("HTTP_X_REQUEST_ID", "")
        request.request_id = incoming if _SANE_ID.match(incoming) else uuid.uuid4().hex
        response = self.get_response(request)
        if request.path.startswith(API_PREFIX) and response.status_code >= 400 and not _is_json(response):
            # Made by Django outside the views (inner middleware, URL resolution, DEBUG pages).
            response = self._json_error(request, response.status_code,
                                        "Internal server error." if response.status_code >= 500
                                        else (response.reason_phrase or "Error") + ".")
        response[HEADER] = request.request_id
        return response

    def process_exception(self, request: HttpRequest, exception: Exception) -> HttpResponse | None:
        """Exceptions the views (DRF's handler included) did not turn into a response."""
        if not request.path.startswith(API_PREFIX):
            return None  # the admin and other pages keep Django's handling
        rid = request_id_of(request)
        if _is_busy(exception):
            logger.warning("database busy on %s %s (request %s): %s", request.method, request.path, rid,
                           exception)
            response = self._json_error(request, 503, "The database is busy; retry shortly.")
            response["Retry-After"] = str(RETRY_AFTER_SECONDS)
            return response
        logger.error("unhandled error on %s %s (request %s)", request.method, request.path, rid,
                     exc_info=exception)
        return self._json_error(request, 500, "Internal server error.")

    @staticmethod
    def _json_error(request: HttpRequest, status: int, detail: str) -> JsonResponse:
        return JsonResponse({"detail": detail, "request_id": request_id_of(request)}, status=status)
