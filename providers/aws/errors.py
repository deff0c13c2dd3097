"""EC2 error codes -> ProviderError. Capacity and quota make the broker block that zone/type and
fail over; auth and bad requests are permanent; throttling and 5xx are transient."""
from __future__ import annotations

from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    ConnectTimeoutError,
    EndpointConnectionError,
    NoCredentialsError,
    ReadTimeoutError,
)

from providers.base import ErrorKind, ProviderError

_CAPACITY = {
    "InsufficientInstanceCapacity", "InsufficientHostCapacity", "InsufficientReservedInstanceCapacity",
    "InsufficientCapacity", "InsufficientCapacityOnHost", "SpotMaxPriceTooLow",
    "InsufficientFreeAddressesInSubnet",
}
_QUOTA = {
    "InstanceLimitExceeded", "VcpuLimitExceeded", "MaxSpotInstanceCountExceeded",
    "VolumeLimitExceeded", "InsufficientAddressCapacity", "AddressLimitExceeded",
}
_AUTH = {
    "AuthFailure", "UnauthorizedOperation", "InvalidClientTokenId", "SignatureDoesNotMatch",
    "ExpiredToken", "RequestExpired", "OptInRequired", "Blocked", "PendingVerification",
    "AccessDenied", "AccessDeniedException",
}
_TRANSIENT = {
    "RequestLimitExceeded", "Throttling", "ThrottlingException", "InternalError", "InternalFailure",
    "ServiceUnavailable", "Unavailable",
}
# The request is fine but this zone cannot serve it: try another zone, no point retrying here.
_NOT_HERE = {"Unsupported", "InvalidAvailabilityZone"}


def map_client_error(exc: ClientError) -> ProviderError:
    code = exc.response.get("Error", {}).get("Code", "") or "Unknown"
    message = exc.response.get("Error", {}).get("Message", "") or code
    if code in _CAPACITY:
        kind, elsewhere = ErrorKind.CAPACITY, True
    elif code in _QUOTA:
        kind, elsewhere = ErrorKind.QUOTA, True
    elif code in _AUTH:
        kind, elsewhere = ErrorKind.AUTH, False
    elif code in _TRANSIENT:
        kind, elsewhere = ErrorKind.TRANSIENT, False
    elif code in _NOT_HERE:
        kind, elsewhere = ErrorKind.BAD_REQUEST, True
    elif code.startswith("InvalidInstanceID."):
        kind, elsewhere = ErrorKind.NOT_FOUND, False
    else:  # InvalidParameterValue, InvalidAMIID.*, IdempotentParameterMismatch, ...
        kind, elsewhere = ErrorKind.BAD_REQUEST, False
    return ProviderError(kind, message, retry_elsewhere=elsewhere, provider="aws", code=code)


def map_boto_error(exc: BotoCoreError) -> ProviderError:
    if isinstance(exc, NoCredentialsError):
        return ProviderError(ErrorKind.AUTH, "no AWS credentials configured", provider="aws", code="NoCredentials")
    if isinstance(exc, (EndpointConnectionError, ConnectTimeoutError, ReadTimeoutError)):
        # The call may or may not have reached EC2: retrying with the same key is safe.
        return ProviderError(ErrorKind.TRANSIENT, type(exc).__name__, provider="aws", code=type(exc).__name__)
    return ProviderError(ErrorKind.TRANSIENT, type(exc).__name__, provider="aws", code=type(exc).__name__)
