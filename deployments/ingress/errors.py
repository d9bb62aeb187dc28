"""Client-visible failures and their gRPC and HTTP status codes."""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from deployments.ingress.validation import InvalidRequest
from router.types import Shed


@dataclass(frozen=True, slots=True)
class Status:
    grpc_code: grpc.StatusCode
    http_status: int
    openai_type: str


class ServiceError(Exception):
    """An error with a message fit for the client (no internals)."""

    status = Status(grpc.StatusCode.INTERNAL, 500, "internal_error")

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Unauthenticated(ServiceError):
    status = Status(grpc.StatusCode.UNAUTHENTICATED, 401, "authentication_error")


class PermissionDenied(ServiceError):
    """The API key does not allow what the request names (another tenant)."""

    status = Status(grpc.StatusCode.PERMISSION_DENIED, 403, "permission_error")


class AlreadyInFlight(ServiceError):
    status = Status(grpc.StatusCode.ALREADY_EXISTS, 409, "invalid_request_error")


class NotFound(ServiceError):
    status = Status(grpc.StatusCode.NOT_FOUND, 404, "invalid_request_error")


class DeadlineMissed(ServiceError):
    status = Status(grpc.StatusCode.DEADLINE_EXCEEDED, 504, "timeout_error")


OVERLOADED = Status(grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "rate_limit_error")


class Overloaded(ServiceError):
    """Every engine replica is at capacity (Serve's own back pressure). A request
    the router sheds arrives as the router's ``Shed``, with the same status."""

    status = OVERLOADED


UNAVAILABLE = Status(grpc.StatusCode.UNAVAILABLE, 503, "server_error")


class EngineUnavailable(ServiceError):
    status = UNAVAILABLE


INVALID = Status(grpc.StatusCode.INVALID_ARGUMENT, 400, "invalid_request_error")


# Failures whose message is fit for the client as it stands.
CLIENT_ERRORS = (InvalidRequest, ServiceError, Shed)


def status_of(exc: BaseException) -> Status:
    if isinstance(exc, InvalidRequest):
        return INVALID
    if isinstance(exc, Shed):
        return UNAVAILABLE if exc.reason == "closing" else OVERLOADED
    if isinstance(exc, ServiceError):
        return exc.status
    return ServiceError.status
