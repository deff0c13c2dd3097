"""google-api-core exceptions and failed Compute operations -> ProviderError."""
from __future__ import annotations

from typing import Any

from google.api_core import exceptions as gexc
from google.auth import exceptions as auth_exc

from providers.base import ErrorKind, ProviderError

# Operation error codes (operation.error.errors[].code).
_CAPACITY_CODES = {
    "ZONE_RESOURCE_POOL_EXHAUSTED", "ZONE_RESOURCE_POOL_EXHAUSTED_WITH_DETAILS", "RESOURCE_POOL_EXHAUSTED",
    "STOCKOUT", "RESOURCE_NOT_AVAILABLE",
}
_QUOTA_CODES = {"QUOTA_EXCEEDED", "quotaExceeded", "QUOTA_LIMIT"}
_AUTH_CODES = {"PERMISSION_DENIED", "forbidden", "UNAUTHORIZED"}
_TRANSIENT_CODES = {"INTERNAL_ERROR", "SERVICE_UNAVAILABLE", "rateLimitExceeded", "RATE_LIMIT_EXCEEDED"}
ALREADY_EXISTS_CODES = {"alreadyExists", "RESOURCE_ALREADY_EXISTS"}


def map_operation_error(errors: list[Any]) -> ProviderError:
    """A finished operation with `error.errors`: the first code decides the kind."""
    code = errors[0].code if errors else "UNKNOWN"
    message = "; ".join(e.message for e in errors) or code
    if code in _CAPACITY_CODES:
        return ProviderError(ErrorKind.CAPACITY, message, provider="gcp", code=code)
    if code in _QUOTA_CODES:
        return ProviderError(ErrorKind.QUOTA, message, provider="gcp", code=code)
    if code in _AUTH_CODES:
        return ProviderError(ErrorKind.AUTH, message, provider="gcp", code=code)
    if code in _TRANSIENT_CODES:
        return ProviderError(ErrorKind.TRANSIENT, message, provider="gcp", code=code)
    return ProviderError(ErrorKind.BAD_REQUEST, message, provider="gcp", code=code)


def _reasons(exc: gexc.GoogleAPICallError) -> set[str]:
    reasons: set[str] = set()
    for item in getattr(exc, "errors", None) or []:
        if isinstance(item, dict) and item.get("reason"):
            reasons.add(item["reason"])
    return reasons


def map_api_error(exc: Exception) -> ProviderError:
    name = type(exc).__name__
    if isinstance(exc, auth_exc.GoogleAuthError) and not isinstance(exc, auth_exc.TransportError):
        # Credentials missing, expired or refused on refresh. The message may name the
        # credential source; we keep only the class name.
        return ProviderError(ErrorKind.AUTH, f"GCP credentials rejected ({name})", provider="gcp", code=name)
    if isinstance(exc, gexc.GoogleAPICallError):
        reasons = _reasons(exc)
        message = exc.message or name
        if reasons & _QUOTA_CODES:
            return ProviderError(ErrorKind.QUOTA, message, provider="gcp", code=sorted(reasons)[0])
        if reasons & {"rateLimitExceeded", "userRateLimitExceeded"} or isinstance(exc, gexc.TooManyRequests):
            return ProviderError(ErrorKind.TRANSIENT, message, provider="gcp", code=name)
        if isinstance(exc, (gexc.Unauthorized, gexc.Forbidden)):
            return ProviderError(ErrorKind.AUTH, message, provider="gcp", code=name)
        if isinstance(exc, gexc.NotFound):
            return ProviderError(ErrorKind.NOT_FOUND, message, provider="gcp", code=name)
        if isinstance(exc, (gexc.BadRequest, gexc.Conflict, gexc.MethodNotAllowed)):
            return ProviderError(ErrorKind.BAD_REQUEST, message, provider="gcp", code=name)
        return ProviderError(ErrorKind.TRANSIENT, message, provider="gcp", code=name)  # 5xx and others
    if isinstance(exc, gexc.RetryError | gexc.DeadlineExceeded):
        return ProviderError(ErrorKind.TRANSIENT, name, provider="gcp", code=name)
    # requests' ConnectionError/Timeout and google.auth transport errors
    return ProviderError(ErrorKind.TRANSIENT, name, provider="gcp", code=name)
