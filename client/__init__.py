"""radixd client: sync and asyncio gRPC clients plus zero-copy pool mapping."""
from .client import AsyncCacheClient, CacheClient
from .codec import Inserted, Match, MappedPools
from .errors import (
    FailedPrecondition, InvalidArgument, NotFound, PermissionDenied, RadixdError, ResourceExhausted,
    ServerRestarted, Unauthenticated, Unavailable,
)

__all__ = ["CacheClient", "AsyncCacheClient", "Match", "Inserted", "MappedPools", "RadixdError", "InvalidArgument",
           "NotFound", "FailedPrecondition", "ResourceExhausted", "PermissionDenied", "Unauthenticated",
           "Unavailable", "ServerRestarted"]
