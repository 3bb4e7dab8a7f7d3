"""Mooncake Store as the L3 tier: zero-copy puts and gets straight from and into the host pool."""
from __future__ import annotations

import ctypes
import socket
from urllib.parse import urlsplit

import numpy as np

from ..config import parse_bytes
from ..quiet import native_stderr
from .base import Store, StoreError

ERRORS = {-200: "no_space", -600: "invalid", -704: "not_found", -705: "exists", -706: "leased",
          -900: "unavailable"}


def _addr(arr: np.ndarray) -> int:
    return arr.__array_interface__["data"][0]


class MooncakeStore(Store):
    """`mooncake://MASTER_HOST:PORT?segment=256MiB&buffer=64MiB&protocol=tcp&metadata=P2PHANDSHAKE&host=IP`.

    `segment` is the memory this server lends to the store (0 when dedicated store nodes hold the data);
    `buffer` the client's transfer buffer. The host pool is registered once, so pages move without copies
    (pages of a layer-first host pool are staged through a registered buffer).
    """

    scheme = "mooncake"

    def __init__(self, url: str, page_bytes: int, query: dict[str, str]):
        super().__init__(page_bytes)
        parts = urlsplit(url)
        if not parts.hostname or not parts.port:
            raise ValueError(f"storage URL {url!r}: give the master address (mooncake://HOST:PORT)")
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as e:
            raise ValueError(f"storage URL {url!r}: the Mooncake client is not installed ({e}); "
                             "pip install mooncake-transfer-engine-non-cuda (CPU) or mooncake-transfer-engine") from None
        try:
            segment = parse_bytes(query.get("segment", "256MiB"))
            buffer = parse_bytes(query.get("buffer", "64MiB"))
        except ValueError as e:
            raise ValueError(f"storage URL {url!r}: {e}") from None
        self.master = f"{parts.hostname}:{parts.port}"
        try:  # the client retries a missing master for about 90 s, logging as it goes: ask first, briefly
            socket.create_connection((parts.hostname, parts.port), timeout=3).close()
        except OSError as e:
            raise ValueError(f"storage URL {url!r}: no Mooncake master answers at {self.master} "
                             f"({e.strerror or e}); start it first") from None
        self.store = MooncakeDistributedStore()
        with native_stderr() as said:  # the client's own log lines stay out of the server's one-line refusals
            rc = self.store.setup(query.get("host", "127.0.0.1"), query.get("metadata", "P2PHANDSHAKE"), segment,
                                  buffer, query.get("protocol", "tcp"), query.get("rdma_devices", ""), self.master)
        if rc != 0:
            raise ValueError(f"storage URL {url!r}: cannot set up the Mooncake client (code {rc}"
                             f"{': ' + said.last_line if said.last_line else ''})")
        self._regions: list[tuple[int, int]] = []

    def register(self, buf: np.ndarray) -> None:
        base, size = _addr(buf), buf.nbytes
        rc = self.store.register_buffer(base, size)
        if rc != 0:
            raise StoreError("register", f"mooncake: register_buffer failed (code {rc})")
        self._regions.append((base, base + size))

    def _registered(self, arrs: list[np.ndarray]) -> bool:
        for a in arrs:
            p = _addr(a)
            if not any(lo <= p and p + a.nbytes <= hi for lo, hi in self._regions):
                return False
        return True

    @staticmethod
    def _fail(what: str, code: int) -> StoreError:
        return StoreError(ERRORS.get(code, "error"), f"mooncake {what}: code {code}")

    def exists(self, keys: list[str]) -> list[bool]:
        res = self.store.batch_is_exist(keys)
        if any(r < 0 for r in res) and not any(r == 1 for r in res):
            raise self._fail("batch_is_exist", min(res))
        return [r == 1 for r in res]

    def put(self, keys: list[str], pages: list[np.ndarray]) -> int:
        if self._registered(pages):
            res = self.store.batch_put_from(keys, [_addr(p) for p in pages], [p.nbytes for p in pages])
            bad = [r for r in res if r < 0]
            if bad and len(bad) == len(res):
                raise self._fail("batch_put_from", bad[0])
            return sum(1 for r in res if r >= 0)
        rc = self.store.put_batch(keys, [memoryview(p) for p in pages])
        if rc < 0:
            raise self._fail("put_batch", rc)
        return len(keys)

    def get(self, keys: list[str], outs: list[np.ndarray]) -> int:
        if self._registered(outs):
            res = self.store.batch_get_into(keys, [_addr(o) for o in outs], [o.nbytes for o in outs])
            got = 0
            for r in res:
                if r != self.page_bytes:
                    break
                got += 1
            if not got and res and res[0] < 0 and res[0] not in (-704,):
                raise self._fail("batch_get_into", res[0])
            return got
        vals = self.store.get_batch(keys)
        got = 0
        for v, out in zip(vals, outs):
            if not v or len(v) != self.page_bytes:
                break
            ctypes.memmove(_addr(out), v, self.page_bytes)
            got += 1
        return got

    def close(self) -> None:
        self.store.close()

    def describe(self) -> str:
        return f"mooncake://{self.master}"
