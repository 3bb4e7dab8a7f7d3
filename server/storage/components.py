"""The L3 tier behind a hybrid model's host tier: each component of a prefix as store objects its page-hash chain
names (SPEC-tiers R4 for the tier, R5 for the components).

Objects: one per page of FULL KV (layer-major, as the plain tier stores a page), one per page of SWA KV (the window
that ends where a prefix ends) and one per state (every state layer's conv and temporal state as of a page's end),
each kind under a format tag of its own, so no object is ever read as another model's or another kind's.
  * write: what the host tier takes (a demotion, a write-through) goes to the store behind it, from a copy of the
    bytes made at once (the host slots may be reused before the write ends), on one I/O thread; pages the store
    already holds are skipped. With `--storage-write-policy write_back` a prefix goes when the host tier evicts
    it instead (the leaf's own pages, the window ending there, its state), as the plain tier does.
  * read: before a match, the store is asked how far the request's prefix can be restored: FULL pages contiguous
    from what the host holds, the SWA window before the end, a state at the end (a Mamba model); the deepest such
    end is fetched into new host slots on I/O threads and inserted into the host tree, whose load-back then brings
    it to the device inside the match. The prefetch policies apply: best_effort answers at once (a later match
    finds it), wait_complete waits, timeout waits at most prefetch_timeout_ms.
A store that fails costs misses, never errors: the failure is counted and the store left alone for a growing
back-off (0.5 s doubling to 8 s), as in the plain tier.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Optional

import numpy as np

from ..errors import Exhausted
from ..pools.allocator import FREE, HELD
from ..transfer.pages import chunk_view
from ..tree import hashes as _hashes
from ..tree.components import MAMBA, SWA
from ..tree.tree import as_int32
from .base import Store, StoreError
from .keys import page_keys
from .tier import PREFETCH_POLICIES, STORAGE_WRITE_POLICIES, Traffic

log = logging.getLogger("radixd.storage")

FULL = "full"
KINDS = (FULL, SWA, MAMBA)


class ComponentStorage(Traffic):
    """Host tier <-> store traffic of a hybrid model: writes behind the host tier, prefetches before a match."""

    def __init__(self, stores: dict[str, Store], host: Any, fmts: dict[str, str], prefetch_threshold: int = 256,
                 prefetch_policy: str = "best_effort", prefetch_timeout_ms: int = 1000,
                 write_policy: str = "write_through"):
        if prefetch_policy not in PREFETCH_POLICIES:
            raise ValueError(f"unknown prefetch policy {prefetch_policy!r}")
        if write_policy not in STORAGE_WRITE_POLICIES:
            raise ValueError(f"unknown storage write policy {write_policy!r}")
        # write_back: a prefix goes to the store when the host tier evicts it, not when the host takes it
        self.write_back = write_policy == "write_back"
        self.stores, self.host, self.fmts = stores, host, fmts
        self.store = next(iter(stores.values()))  # (what GetInfo describes: every kind is on the same URL)
        self.page = host.alloc.page_size
        self._pb = self.page * 4
        self.prefetch_threshold = prefetch_threshold
        self.prefetch_policy = prefetch_policy
        self.prefetch_timeout = prefetch_timeout_ms / 1000
        self._full = chunk_view(host.kv_pool) if FULL in stores else None  # [pages, layers x kinds, chunk]
        self._swa = chunk_view(host.swa_pool) if SWA in stores else None
        self._put_io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="radixd-l3-put")
        self._get_io = ThreadPoolExecutor(max_workers=2, thread_name_prefix="radixd-l3-get")
        self._lock = threading.Lock()
        self._puts = 0  # write batches queued or running
        self.prefetches: dict[tuple, asyncio.Task] = {}  # (namespace, key) -> its fetch
        self.in_flight: Counter = Counter()  # host slots fetches hold until their insert: "full", "swa", "states"
        self.errors: Counter = Counter()
        self.outcomes: Counter = Counter()
        self.bytes = {"put": 0, "get": 0}
        self.pages = {"put": 0, "get": 0, "put_skipped": 0}
        self.by_kind: Counter = Counter()  # "put_full", "get_mamba"...: objects per component
        self.hit_tokens = 0
        self.observe: Optional[Callable[[str, float], None]] = None  # (call, seconds) for the latency histogram

    # ------------------------------------------------------------- the store
    def _timed(self, what: str, fn: Callable, *args) -> Any:
        """One store call on an I/O thread; any failure is a StoreError (counted by the caller)."""
        t0 = time.perf_counter()
        try:
            out = fn(*args)
        except StoreError:
            raise
        except Exception as e:  # a client library bug or an unexpected disconnect: still only a miss
            raise StoreError("error", f"{type(e).__name__}: {e}") from e
        if self.observe is not None:
            self.observe(what, time.perf_counter() - t0)
        self._backoff = 0.0
        return out

    def _keys(self, kind: str, ns: tuple[str, str], digests: bytes) -> list[str]:
        return page_keys(self.fmts[kind], ns[0], digests)

    def _digests(self, key: bytes, ns: tuple[str, str]) -> bytes:
        """The page-hash chain of a prefix (the tree's own: the cache_salt seeds it)."""
        return _hashes.chain(key, self._pb, _hashes.salt_seed(ns[1]))

    def _state_bytes(self, slot: int) -> np.ndarray:
        return np.concatenate([np.ascontiguousarray(v[slot]).view(np.uint8).reshape(-1)
                               for v in self.host.state_pool.views.values()])

    def _set_state(self, slot: int, buf: np.ndarray) -> None:
        off = 0
        for v in self.host.state_pool.views.values():
            n = v[slot].nbytes
            v[slot] = buf[off:off + n].view(v.dtype).reshape(v[slot].shape)
            off += n

    # --------------------------------------------------------------- writes
    def backup(self, ns: tuple[str, str], key: bytes, start: int, floor: int, full: np.ndarray, state: int) -> None:
        """The host tier took key's prefix: FULL pages from `start` in host slots `full`, the SWA window from
        `floor` (the twins of those slots), the state in host slot `state` (-1: none). Their bytes are copied now
        and written on the I/O thread."""
        if not self.available:
            self.errors["skipped_down"] += 1
            return
        p = self.page
        end = len(key) // 4
        digs = self._digests(key, ns)
        batch = []
        if self._full is not None and end > start:
            pages = (full[::p] // p).tolist()
            batch.append((FULL, self._keys(FULL, ns, digs[start // p * 32:end // p * 32]),
                          [np.array(self._full[x]).reshape(-1) for x in pages]))  # (copies, never views)
        if self._swa is not None and end > floor:
            twins = (self.host.swa.translate(full[floor - start:])[::p] // p).tolist()
            batch.append((SWA, self._keys(SWA, ns, digs[floor // p * 32:end // p * 32]),
                          [np.array(self._swa[x]).reshape(-1) for x in twins]))
        if state >= 0 and MAMBA in self.stores:
            batch.append((MAMBA, self._keys(MAMBA, ns, digs[end // p * 32 - 32:end // p * 32]),
                          [self._state_bytes(state)]))
        if batch:
            with self._lock:
                self._puts += 1
            self._put_io.submit(self._put, batch)

    def _put(self, batch: list) -> None:
        try:
            for kind, keys, vals in batch:
                store = self.stores[kind]
                try:
                    have = self._timed("exists", store.exists, keys)
                    todo = [i for i, h in enumerate(have) if not h]
                    n = self._timed("put", store.put, [keys[i] for i in todo], [vals[i] for i in todo]) \
                        if todo else 0
                except StoreError as e:
                    self._failed(e.kind, str(e))
                    return
                with self._lock:
                    self.pages["put"] += n
                    self.pages["put_skipped"] += len(keys) - len(todo)
                    self.bytes["put"] += sum(int(vals[i].nbytes) for i in todo[:n])
                    self.by_kind[f"put_{kind}"] += n
        finally:
            with self._lock:
                self._puts -= 1

    # ------------------------------------------------------------- prefetch
    async def fetch(self, items: list[tuple], dev: Any) -> None:
        """Before a match of these (tokens, namespace): fetch what the store restores beyond both tiers."""
        ops = []
        for tokens, ns in items:
            arr = as_int32(tokens)
            n = len(arr) - len(arr) % self.page
            if not n or not self.available:
                continue
            key = arr[:n].tobytes()
            have = max(self.host.tree.cached_prefix_len(key, ns), dev.tree.cached_prefix_len(key, ns))
            if n - have < max(self.prefetch_threshold, self.page):
                continue
            op = self.prefetches.get((ns, key))
            if op is None:
                op = self.prefetches[(ns, key)] = asyncio.ensure_future(self._fetch(key, ns, dev))
                op.add_done_callback(lambda _, k=(ns, key): self.prefetches.pop(k, None))
            ops.append(op)
        if not ops or self.prefetch_policy == "best_effort":
            return
        if self.prefetch_policy == "wait_complete":
            await asyncio.wait([asyncio.shield(op) for op in ops])
        else:
            await asyncio.wait([asyncio.shield(op) for op in ops], timeout=self.prefetch_timeout)

    async def _fetch(self, key: bytes, ns: tuple[str, str], dev: Any) -> None:
        try:
            self.outcomes[await self._fetch_one(key, ns, dev)] += 1
        except StoreError as e:
            self._failed(e.kind, str(e))
            self.outcomes["error"] += 1
        except Exception:  # a bug here must not take the match down: the match goes on without L3
            log.exception("L3 prefetch failed")
            self.outcomes["error"] += 1

    async def _fetch_one(self, key: bytes, ns: tuple[str, str], dev: Any) -> str:
        host, p = self.host, self.page
        loop = asyncio.get_running_loop()
        total = len(key) // 4 // p
        hhave = host.tree.cached_prefix_len(key, ns) // p
        lo = max(hhave, dev.tree.cached_prefix_len(key, ns) // p)
        wp = host.tree.swa.tail_len // p if host.swa is not None else 0
        digs = self._digests(key, ns)
        q0 = min(hhave, max(lo + 1 - wp, 0)) if host.swa is not None else hhave  # the lowest page any end fetches
        plan = {FULL: q0, SWA: max(lo + 1 - wp, 0), MAMBA: lo}  # first page each kind is asked about
        ok: dict[str, np.ndarray] = {}
        for kind, first in plan.items():
            if kind not in self.stores:
                continue
            keys = self._keys(kind, ns, digs[first * 32:total * 32])
            got = await loop.run_in_executor(self._get_io, self._timed, "exists", self.stores[kind].exists, keys)
            ok[kind] = np.zeros(total, bool)
            ok[kind][first:] = got
        best = None
        for e in range(total, lo, -1):  # the deepest end every component can restore
            floor = max(e - wp, 0) if host.swa is not None else e
            start = min(hhave, floor)
            if FULL in ok and not ok[FULL][start:e].all():
                continue
            if SWA in ok and not ok[SWA][floor:e].all():
                continue
            if MAMBA in ok and not ok[MAMBA][e - 1]:
                continue
            best = (e, floor, start)
            break
        if best is None or (best[0] - lo) * p < max(self.prefetch_threshold, p):
            return "miss"
        e, floor, start = best
        try:
            host._room(e - start, e - floor if host.swa is not None else 0, 1 if host.states is not None else 0)
        except Exhausted:
            return "no_room"
        from ..hybrid_tiers import TRANSIT
        new = host.alloc.alloc((e - start) * p, TRANSIT)
        twins = host.swa.assign(new[(floor - start) * p:]) if host.swa is not None else None
        state = int(host.states.alloc(1, TRANSIT)[0]) if host.states is not None else -1
        held = Counter(full=new.size, swa=(e - floor) * p if twins is not None else 0, states=int(state >= 0))
        self.in_flight.update(held)
        want = []  # (kind, keys, buffers)
        if FULL in self.stores:
            want.append((FULL, self._keys(FULL, ns, digs[start * 32:e * 32]),
                         [np.empty(self._full.shape[1] * self._full.shape[2], np.uint8) for _ in range(e - start)]))
        if SWA in self.stores:
            want.append((SWA, self._keys(SWA, ns, digs[floor * 32:e * 32]),
                         [np.empty(self._swa.shape[1] * self._swa.shape[2], np.uint8) for _ in range(e - floor)]))
        if MAMBA in self.stores:
            want.append((MAMBA, self._keys(MAMBA, ns, digs[e * 32 - 32:e * 32]),
                         [np.empty(host.state_pool.slot_bytes, np.uint8)]))
        whole = True
        try:
            for kind, keys, bufs in want:
                n = await loop.run_in_executor(self._get_io, self._timed, "get", self.stores[kind].get, keys, bufs)
                with self._lock:
                    self.pages["get"] += n
                    self.bytes["get"] += sum(int(b.nbytes) for b in bufs[:n])
                    self.by_kind[f"get_{kind}"] += n
                whole &= n == len(keys)
        except BaseException:
            self._give_back(new, state, held)
            raise
        if not whole:  # (evicted from the store since it said it had them)
            self._give_back(new, state, held)
            return "truncated"
        if host.tree.cached_prefix_len(key[:start * p * 4], ns) < start * p:
            self._give_back(new, state, held)  # the host evicted what this fetch continues while it ran
            return "dropped"
        self.in_flight.subtract(held)
        for kind, _, bufs in want:
            if kind == FULL:
                for x, b in zip((new[::p] // p).tolist(), bufs):
                    self._full[x] = b.reshape(self._full.shape[1:])
            elif kind == SWA:
                for x, b in zip((twins[::p] // p).tolist(), bufs):
                    self._swa[x] = b.reshape(self._swa.shape[1:])
            else:
                self._set_state(state, bufs[0])
        r = host.tree.insert(key[:e * p * 4], np.concatenate([np.full(start * p, -1, np.int64), new]),
                             prev_prefix_len=start * p, swa_evicted_seqlen=floor * p if host.swa is not None else 0,
                             mamba_value=state, namespace=ns)
        host._apply(r.frees)
        host._adopt(new, state, r.mamba_exist)
        self.hit_tokens += (e - lo) * p
        return "completed"

    def _give_back(self, new: np.ndarray, state: int, held: Counter) -> None:
        from ..hybrid_tiers import TRANSIT
        self.in_flight.subtract(held)
        self.host._free_full(new, whole_pages=True)
        if state >= 0:
            self.host.states.move(np.array([state]), HELD, FREE, TRANSIT, check=False)

    # ------------------------------------------------------------- lifecycle
    @property
    def busy(self) -> bool:
        """Any store traffic queued or running."""
        return bool(self.prefetches or self._puts)

    async def drain(self) -> None:
        """Wait for every write and prefetch (shutdown)."""
        while self.busy:
            if self.prefetches:
                await asyncio.wait(list(self.prefetches.values()))
            else:
                await asyncio.get_running_loop().run_in_executor(None, self._put_io.submit(lambda: None).result)

    def close(self) -> None:
        self._put_io.shutdown(wait=True)
        self._get_io.shutdown(wait=True)
        for s in self.stores.values():
            s.close()

    def check(self) -> list[str]:
        return []

    def stats(self) -> dict[str, int]:
        """Counters for GetStats and the metrics page (the plain tier's names)."""
        return dict(storage_hit_tokens_total=self.hit_tokens, storage_put_pages_total=self.pages["put"],
                    storage_get_pages_total=self.pages["get"], storage_put_skipped_pages_total=self.pages["put_skipped"],
                    storage_put_bytes_total=self.bytes["put"], storage_get_bytes_total=self.bytes["get"],
                    storage_errors_total=sum(self.errors.values()), prefetches_in_flight=len(self.prefetches))
