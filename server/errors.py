"""Service-level errors carrying the gRPC status they map to; raising one never changes state."""
from __future__ import annotations

import grpc


class ServiceError(Exception):
    """An error with a precise gRPC status code."""

    code = grpc.StatusCode.INTERNAL

    def __init__(self, message: str, code: grpc.StatusCode | None = None):
        super().__init__(message)
        if code is not None:
            self.code = code


class BadRequest(ServiceError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(ServiceError):
    code = grpc.StatusCode.NOT_FOUND


class Conflict(ServiceError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class Exhausted(ServiceError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Denied(ServiceError):
    code = grpc.StatusCode.PERMISSION_DENIED
