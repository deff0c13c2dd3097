"""What can go wrong talking to the API, as exceptions. Each API error keeps the status, the parsed
body and the request id the server logged it under (`X-Request-ID`)."""
from __future__ import annotations

from typing import Any


class WhaleZenError(Exception):
    """Base of every error this package raises."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class Unreachable(WhaleZenError):
    """No answer: connection refused, DNS failure, TLS failure or a timeout."""

    def __init__(self, message: str, *, url: str = "", timed_out: bool = False) -> None:
        super().__init__(message)
        self.url = url
        self.timed_out = timed_out


class SpecError(WhaleZenError):
    """A spec file this client refuses before sending it (unreadable, not YAML/JSON, anchors, too deep)."""


class ApiError(WhaleZenError):
    """The server answered with an error status."""

    def __init__(self, message: str, *, status: int, body: Any = None, request_id: str | None = None,
                 method: str = "", path: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.body = body
        self.request_id = request_id
        self.method = method
        self.path = path

    @property
    def detail(self) -> str:
        """The server's own words: `detail`, or the field errors flattened into one line."""
        return describe_body(self.body) or f"HTTP {self.status}"


class BadRequest(ApiError):
    """400: the body or a parameter is wrong. `fields` maps dotted field paths to their reasons, e.g.
    `{"resources.gpus": ["Ensure this value is less than or equal to 64."]}`."""

    @property
    def fields(self) -> dict[str, list[str]]:
        return flatten_field_errors(self.body)


class AuthError(ApiError):
    """401: no token, or a wrong, expired or revoked one."""


class Forbidden(ApiError):
    """403: the token's user may not do this (a viewer, a read-only token, another member's job)."""


class NotFound(ApiError):
    """404: no such object for this team (another team's objects answer exactly like missing ones)."""


class NotSupported(NotFound):
    """404 on a route this server does not have (an older server, or a feature not installed)."""

    def __init__(self, feature: str, **kwargs: Any) -> None:
        super().__init__(f"this server has no {feature} API", **kwargs)
        self.feature = feature


class Conflict(ApiError):
    """409: not possible in the object's current state (cancelling a finished job, moving a pending one)."""


class Throttled(ApiError):
    """429: too many requests; `retry_after` is in seconds when the server said."""

    def __init__(self, message: str, *, retry_after: float | None = None, **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.retry_after = retry_after


class ServerError(ApiError):
    """5xx: the server failed (its log has the traceback under `request_id`)."""


def flatten_field_errors(body: Any, prefix: str = "") -> dict[str, list[str]]:
    """`{"resources": {"gpus": ["..."]}}` -> `{"resources.gpus": ["..."]}`; list positions become indices."""
    out: dict[str, list[str]] = {}
    if isinstance(body, dict):
        for key, value in body.items():
            if key == "code" and not prefix:
                continue  # a machine-readable code beside the message, not a field
            path = f"{prefix}.{key}" if prefix else str(key)
            if isinstance(value, list) and all(isinstance(v, str) for v in value):
                out.setdefault(path, []).extend(value)
            elif isinstance(value, str):
                out.setdefault(path, []).append(value)
            else:
                out.update(flatten_field_errors(value, path))
    elif isinstance(body, list):
        if all(isinstance(v, str) for v in body):
            if body:
                out.setdefault(prefix or "body", []).extend(body)
        else:
            for index, value in enumerate(body):
                if value:  # DRF lists an empty object for each good item of a list
                    out.update(flatten_field_errors(value, f"{prefix}.{index}" if prefix else str(index)))
    elif body is not None:
        out.setdefault(prefix or "body", []).append(str(body))
    return out


def describe_body(body: Any) -> str:
    """One line from an error body: its `detail`, or `field: reason; field: reason`."""
    if isinstance(body, str):  # not JSON: a proxy's page, a plain-text answer; never a whole page
        text = " ".join(body.split())
        return "" if text.startswith("<") else (text if len(text) <= 200 else text[:199] + "…")
    if isinstance(body, dict) and isinstance(body.get("detail"), str) and len(body) <= 3:
        return body["detail"]
    fields = flatten_field_errors(body)
    return "; ".join(" ".join(reasons) if path in _UNNAMED else f"{path}: {' '.join(reasons)}"
                     for path, reasons in fields.items())


_UNNAMED = {"detail", "non_field_errors"}
