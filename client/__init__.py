"""radixd client: sync and asyncio gRPC clients plus zero-copy pool mapping.

Imports are lazy so `radixd.client.pools` works where only torch/cupy (no matching protobuf) is present.
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "CacheClient": "client", "AsyncCacheClient": "client", "Match": "codec", "Inserted": "codec",
    "MappedPools": "codec", "RadixdError": "errors", "InvalidArgument": "errors", "NotFound": "errors",
    "FailedPrecondition": "errors", "ResourceExhausted": "errors", "PermissionDenied": "errors",
    "Unauthenticated": "errors", "Unavailable": "errors", "ServerRestarted": "errors",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
