"""Valkey / Redis (single node or cluster) as the L3 store, through redis-py: pipelined EXISTS and SET, MGET."""
from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit

import numpy as np

from .base import Store, StoreError

_OURS = ("timeout_ms", "ttl")  # query parameters radixd reads; the rest go to redis-py


class KeyValueStore(Store):
    """`valkey://HOST:PORT[/DB]`, `valkey+unix:///SOCKET`, `valkey+cluster://HOST:PORT` (redis:// alike).

    Query: `timeout_ms` (per call, default 2000), `ttl` (seconds a page lives, default: until the store's
    own eviction, e.g. `maxmemory-policy allkeys-lru`).
    """

    scheme = "valkey"

    def __init__(self, url: str, page_bytes: int, query: dict[str, str]):
        super().__init__(page_bytes)
        import redis
        from redis.cluster import RedisCluster
        self._errors = (redis.exceptions.RedisError, OSError)
        self._timeout_cls = (redis.exceptions.TimeoutError,)
        self._conn_cls = (redis.exceptions.ConnectionError, OSError)
        parts = urlsplit(url)
        base, _, mode = parts.scheme.lower().partition("+")
        secure = base.endswith("s")
        try:
            timeout = float(query.get("timeout_ms", 2000)) / 1000
            self.ttl = int(query["ttl"]) if "ttl" in query else None
        except ValueError:
            raise ValueError(f"storage URL {url!r}: timeout_ms and ttl must be numbers") from None
        rest = "&".join(p for p in parts.query.split("&") if p and p.split("=")[0] not in _OURS)
        opts = dict(socket_timeout=timeout, socket_connect_timeout=min(timeout, 1.0))
        self._where = f"{parts.scheme}://{parts.hostname or ''}{':' + str(parts.port) if parts.port else ''}" \
                      f"{parts.path if mode == 'unix' else ''}"
        if mode == "unix":
            if not parts.path:
                raise ValueError(f"storage URL {url!r}: give the socket path ({base}+unix:///PATH)")
            self.client = redis.Redis.from_url(f"unix://{parts.path}{'?' + rest if rest else ''}", **opts)
            self.cluster = False
        elif mode == "cluster":
            if not parts.hostname:
                raise ValueError(f"storage URL {url!r}: give a cluster node ({base}+cluster://HOST:PORT)")
            scheme = "rediss" if secure else "redis"
            try:  # a cluster client asks for the slot map at once
                self.client = RedisCluster.from_url(urlunsplit((scheme, parts.netloc, parts.path, rest, "")), **opts)
            except (redis.exceptions.RedisError, OSError) as e:
                raise ValueError(f"storage URL {url!r}: the store at {self._where} does not answer ({e})") from None
            self.cluster = True
        elif mode == "":
            if not parts.hostname:
                raise ValueError(f"storage URL {url!r}: give a host ({base}://HOST:PORT)")
            scheme = "rediss" if secure else "redis"
            self.client = redis.Redis.from_url(urlunsplit((scheme, parts.netloc, parts.path, rest, "")), **opts)
            self.cluster = False
        else:
            raise ValueError(f"storage URL {url!r}: unknown mode {mode!r} (use {base}://, {base}+unix://, "
                             f"{base}+cluster://)")
        try:  # at start the store must answer (later, a store that is down costs misses, never errors)
            self.client.ping()
        except self._errors as e:
            raise ValueError(f"storage URL {url!r}: the store at {self._where} does not answer ({e})") from None

    def _fail(self, e: Exception) -> StoreError:
        kind = "timeout" if isinstance(e, self._timeout_cls) else (
            "unavailable" if isinstance(e, self._conn_cls) else "error")
        return StoreError(kind, f"{self._where}: {e}")

    def exists(self, keys: list[str]) -> list[bool]:
        try:
            pipe = self.client.pipeline(transaction=False)
            for k in keys:
                pipe.exists(k)
            return [bool(x) for x in pipe.execute()]
        except self._errors as e:
            raise self._fail(e) from None

    def put(self, keys: list[str], pages: list[np.ndarray]) -> int:
        try:
            pipe = self.client.pipeline(transaction=False)
            for k, page in zip(keys, pages):
                pipe.set(k, memoryview(page), ex=self.ttl)
            return sum(1 for ok in pipe.execute() if ok)
        except self._errors as e:
            raise self._fail(e) from None

    def get(self, keys: list[str], outs: list[np.ndarray]) -> int:
        try:
            vals = self.client.mget_nonatomic(keys) if self.cluster else self.client.mget(keys)
        except self._errors as e:
            raise self._fail(e) from None
        got = 0
        for v, out in zip(vals, outs):
            if v is None or len(v) != self.page_bytes:
                break
            out[:] = np.frombuffer(v, dtype=np.uint8)
            got += 1
        return got

    def close(self) -> None:
        self.client.close()

    def describe(self) -> str:
        return self._where
