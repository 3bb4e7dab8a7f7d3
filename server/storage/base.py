"""The store interface the L3 tier speaks, and `open_store(url)`.

A store holds one object per page under a string key. Every call is blocking and runs on one of the
tier's I/O threads, never on the event loop. A store that fails raises StoreError (the tier counts it
and treats the call as a miss); it never raises anything else for a store-side problem.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from urllib.parse import parse_qs, urlsplit

import numpy as np


class StoreError(Exception):
    """The store did not answer or refused; `kind` names the class of failure for the error counters."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


class Store(ABC):
    """Pages in, pages out; keys are opaque strings, values are whole pages of `page_bytes`."""

    scheme = ""

    def __init__(self, page_bytes: int):
        self.page_bytes = page_bytes

    def register(self, buf: np.ndarray) -> None:
        """The host pool's memory, for stores that read and write it in place (no-op elsewhere)."""

    @abstractmethod
    def exists(self, keys: list[str]) -> list[bool]:
        """Which keys the store holds."""

    @abstractmethod
    def put(self, keys: list[str], pages: list[np.ndarray]) -> int:
        """Store each contiguous uint8 page under its key; returns how many were stored."""

    @abstractmethod
    def get(self, keys: list[str], outs: list[np.ndarray]) -> int:
        """Read pages into the contiguous uint8 buffers in order; returns how many consecutive pages from
        the first were read whole (a missing or short page ends the run)."""

    def close(self) -> None:
        """Release connections."""

    def describe(self) -> str:
        """Where the store is, secrets hidden (for logs)."""
        return self.scheme


def _query(url: str) -> dict[str, str]:
    return {k: v[-1] for k, v in parse_qs(urlsplit(url).query).items()}


def open_store(url: str, page_bytes: int) -> Store:
    """file:///DIR, valkey:// | redis:// (+unix:///PATH, +cluster://HOST:PORT), mooncake://MASTER."""
    scheme = urlsplit(url).scheme.lower()
    if scheme == "file":
        from .file import FileStore
        return FileStore(url, page_bytes)
    if scheme.split("+")[0] in ("redis", "rediss", "valkey", "valkeys"):
        from .kv import KeyValueStore
        return KeyValueStore(url, page_bytes, _query(url))
    if scheme == "mooncake":
        from .mooncake import MooncakeStore
        return MooncakeStore(url, page_bytes, _query(url))
    raise ValueError(f"unknown storage URL {url!r}: use file:///DIR, valkey://HOST:PORT, redis://HOST:PORT, "
                     "valkey+unix:///SOCKET, redis+cluster://HOST:PORT or mooncake://MASTER_HOST:PORT")
