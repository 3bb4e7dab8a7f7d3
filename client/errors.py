"""Client exceptions, one per gRPC status the server uses."""
from __future__ import annotations

import grpc


class RadixdError(Exception):
    """Base class; `code` is the gRPC status."""

    code = grpc.StatusCode.UNKNOWN


class InvalidArgument(RadixdError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(RadixdError):
    code = grpc.StatusCode.NOT_FOUND


class FailedPrecondition(RadixdError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhausted(RadixdError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class PermissionDenied(RadixdError):
    code = grpc.StatusCode.PERMISSION_DENIED


class Unauthenticated(RadixdError):
    code = grpc.StatusCode.UNAUTHENTICATED


class Unavailable(RadixdError):
    code = grpc.StatusCode.UNAVAILABLE


class ServerRestarted(RadixdError):
    """The server behind the target is a new instance: sessions, receipts and pool mappings are void."""

    code = grpc.StatusCode.FAILED_PRECONDITION


_BY_CODE = {c.code: c for c in (InvalidArgument, NotFound, FailedPrecondition, ResourceExhausted, PermissionDenied,
                                Unauthenticated, Unavailable)}


def from_rpc_error(e: grpc.RpcError) -> RadixdError:
    """Map a grpc.RpcError to the matching exception class."""
    code = e.code() if hasattr(e, "code") else grpc.StatusCode.UNKNOWN
    cls = _BY_CODE.get(code, RadixdError)
    err = cls(f"{code.name}: {e.details() if hasattr(e, 'details') else e}")
    err.code = code
    return err
