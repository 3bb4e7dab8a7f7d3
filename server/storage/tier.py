"""The L3 tier in the engine: backs host pages up to a shared store and prefetches them back (SPEC-tiers 4).

The tree names pages by their frozen digest chain and decides where fetched pages go (`insert_host`); this
module talks to the store on its own threads, so the event loop never waits on it. A store that fails or
hangs costs misses, never errors: each failure is counted, and after one the store is left alone for a
growing back-off (0.5 s doubling to 8 s) before the next call tries it again.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np

from ..pools.allocator import FREE, IN_FLIGHT, TREE
from ..transfer.pages import chunk_view
from ..tree import hashes as _hashes
from .base import Store, StoreError
from .keys import page_keys

log = logging.getLogger("radixd.storage")

PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")
STORAGE_WRITE_POLICIES = ("write_through", "write_back")
OUTCOMES = ("completed", "truncated", "miss", "no_room", "dropped", "error", "skipped", "timed_out")
MAX_PUT_PAGES = 256  # pages per batched store call
MAX_PREFETCHES = 64  # prefetches in flight at once; more are skipped (the store is the bottleneck then)
WAIT_CAP = 30.0  # wait_complete never holds a match longer than this


@dataclass
class Prefetch:
    """One L3 -> host fetch below an anchor node; `done` is set when its pages are in the tree (or not)."""

    key: tuple
    ns: tuple[str, str]
    anchor: int
    receipt: int
    tokens: np.ndarray  # the key beyond the anchor, page aligned
    digests: bytes
    done: asyncio.Event = field(default_factory=asyncio.Event)
    slots: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # host slots being written
    outcome: str = ""
    loaded: int = 0  # tokens inserted into the tree
    started: float = field(default_factory=time.perf_counter)
    after: Optional["Prefetch"] = None  # a fetch this one continues: it plans its pages once that one ended
    request: Optional[np.ndarray] = None  # with `after`: the whole request, matched again then
    want: int = 0  # tokens the request wants beyond its cached prefix (this fetch's `length`)

    @property
    def length(self) -> int:
        """Tokens this prefetch may bring (before the store said how many it holds)."""
        return self.want or int(self.tokens.size)


@dataclass
class Joined:
    """A request whose pages a running fetch already brings: its `done`, and the tokens it covers."""

    op: Prefetch
    length: int

    @property
    def done(self) -> asyncio.Event:
        return self.op.done


class Traffic:
    """What every L3 tier shares: the back-off after a store failure, and waiting for its traffic to end."""

    store: Store
    errors: Counter
    _down_until = 0.0
    _backoff = 0.0

    @property
    def available(self) -> bool:
        """False while backing off after a failure."""
        return time.monotonic() >= self._down_until

    def _failed(self, kind: str, msg: str) -> None:
        self.errors[kind] += 1
        if not self._backoff:
            log.warning("storage %s failed (%s): %s; backing off", self.store.describe(), kind, msg)
        self._backoff = min(max(self._backoff * 2, 0.5), 8.0)
        self._down_until = time.monotonic() + self._backoff

    @property
    def busy(self) -> bool:
        raise NotImplementedError

    async def drain(self) -> None:
        raise NotImplementedError

    async def idle(self, timeout: float) -> bool:
        """Wait up to timeout for every queued write and running prefetch to end; True if none is left."""
        try:
            await asyncio.wait_for(self.drain(), timeout)
        except asyncio.TimeoutError:
            pass
        return not self.busy


class StorageTier(Traffic):
    """Host <-> store traffic for one server: batched backups, deduplicated prefetches, counters."""

    def __init__(self, store: Store, host: Any, fmt: str, write_policy: str = "write_through",
                 prefetch_threshold: int = 256, prefetch_policy: str = "best_effort",
                 prefetch_timeout_ms: int = 1000):
        if write_policy not in STORAGE_WRITE_POLICIES:
            raise ValueError(f"unknown storage write policy {write_policy!r}")
        if prefetch_policy not in PREFETCH_POLICIES:
            raise ValueError(f"unknown prefetch policy {prefetch_policy!r}")
        self.store, self.host, self.tree, self.fmt = store, host, host.tree, fmt
        self.write_back = write_policy == "write_back"
        self.prefetch_threshold = prefetch_threshold
        self.prefetch_policy = prefetch_policy
        self.prefetch_timeout = prefetch_timeout_ms / 1000
        self.page = host.page
        self._pages = chunk_view(host.host_pool)  # [pages, layers x kinds, chunk]
        self._contiguous = host.host_pool.spec.layout == "page_first"
        self.page_bytes = int(self._pages.shape[1] * self._pages.shape[2])
        if self._contiguous:
            store.register(host.host_pool.views["pages"].view(np.uint8).reshape(-1))
        self._put_io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="radixd-l3-put")
        self._get_io = ThreadPoolExecutor(max_workers=2, thread_name_prefix="radixd-l3-get")
        self._puts: list[tuple[tuple[str, str], np.ndarray, bytes]] = []  # (ns, host slots, digests) queued
        self._put_task: Optional[asyncio.Task] = None
        self._putting = np.zeros(0, np.int64)  # host slots the running put batch reads
        self.prefetches: dict[tuple, Prefetch] = {}
        self._serial = 0  # names each fetch in `prefetches`
        self._down_until = 0.0
        self._backoff = 0.0
        self.errors: Counter = Counter()
        self.outcomes: Counter = Counter()
        self.bytes = {"put": 0, "get": 0}
        self.pages = {"put": 0, "get": 0, "put_skipped": 0}
        self.observe: Optional[Callable[[str, float], None]] = None  # (call, seconds) for the latency histogram
        self.hit_tokens = 0
        self.on_change: Optional[Callable[[], None]] = None  # tree changed outside an RPC (events flush)

    # ------------------------------------------------------------- the store
    async def _call(self, pool: ThreadPoolExecutor, what: str, fn: Callable, *args) -> Any:
        """Run one store call on an I/O thread; a StoreError (or any crash of the client) starts a back-off."""
        t0 = time.perf_counter()
        try:
            out = await asyncio.get_running_loop().run_in_executor(pool, fn, *args)
        except StoreError as e:
            self._failed(e.kind, str(e))
            raise
        except Exception as e:  # a client library bug or an unexpected disconnect: still only a miss
            self._failed("error", f"{type(e).__name__}: {e}")
            raise StoreError("error", str(e)) from e
        if self.observe is not None:
            self.observe(what, time.perf_counter() - t0)
        if self._backoff:
            log.info("storage %s answers again", self.store.describe())
        self._backoff = 0.0
        return out

    def _view(self, slots: np.ndarray) -> list[np.ndarray]:
        """Contiguous uint8 views (page_first) or gathered copies (layer_first) of the pages of slots."""
        pages = (slots[::self.page] // self.page).tolist()
        if self._contiguous:
            return [self._pages[p].reshape(-1) for p in pages]
        return [np.ascontiguousarray(self._pages[p]).reshape(-1) for p in pages]

    def keys(self, ns: tuple[str, str], digests: bytes) -> list[str]:
        """Store keys of pages with these digests in a namespace."""
        return page_keys(self.fmt, ns[0], digests)

    # --------------------------------------------------------------- backups
    def backup(self, ns: tuple[str, str], host_slots: np.ndarray, digests: bytes) -> None:
        """Queue host pages for the store (their slots stay allocated until the write ends)."""
        if not self.available:
            self.errors["skipped_down"] += 1
            return
        slots = np.asarray(host_slots, dtype=np.int64)
        self.host.pin_reads(slots)
        self._puts.append((ns, slots, digests))
        if self._put_task is None or self._put_task.done():
            self._put_task = asyncio.get_running_loop().create_task(self._put_loop())

    def spill(self, spilled) -> None:
        """Write-back: host pages about to be evicted go to the store first."""
        for ns, slots, digests in spilled:
            self.backup(ns, slots, digests)

    async def _put_loop(self) -> None:
        while self._puts:
            batch, n = [], 0
            while self._puts and n < MAX_PUT_PAGES:
                batch.append(self._puts.pop(0))
                n += batch[-1][1].size // self.page
            slots = np.concatenate([b[1] for b in batch])
            keys = [k for ns, _, d in batch for k in self.keys(ns, d)]
            self._putting = slots
            try:
                if self.available:
                    await self._put_batch(keys, slots)
                else:
                    self.errors["skipped_down"] += 1
            except StoreError:
                pass  # counted in _call
            finally:
                self._putting = np.zeros(0, np.int64)
                self.host.unpin_reads(slots)

    async def _put_batch(self, keys: list[str], slots: np.ndarray) -> None:
        have = await self._call(self._put_io, "exists", self.store.exists, keys)
        want = [i for i, h in enumerate(have) if not h]
        self.pages["put_skipped"] += len(keys) - len(want)
        if not want:
            return
        pages = self._view(slots)
        stored = await self._call(self._put_io, "put", self.store.put, [keys[i] for i in want],
                                  [pages[i] for i in want])
        self.pages["put"] += stored
        self.bytes["put"] += stored * self.page_bytes
        if stored < len(want):
            self.errors["partial_put"] += 1

    # -------------------------------------------------------------- prefetch
    def maybe_prefetch(self, ns: tuple[str, str], tokens: np.ndarray, matched: int, host_hit: int,
                       best_node: int, threshold: Optional[int] = None) -> Optional[Prefetch | Joined]:
        """Start (or join) a fetch of what lies beyond the cached prefix, if it is long enough.

        A running fetch is joined only when it brings every page this request wants; when it brings the
        first of them only, a second fetch continues it (it plans once the first ended), so no request is
        told of pages nobody fetches."""
        threshold = self.prefetch_threshold if threshold is None else threshold
        start = matched + host_hit
        end = tokens.size - tokens.size % self.page
        if end - start < max(threshold, self.page) or self.tree.bigram:
            return None
        anchor, rest, digests = self._plan(ns, tokens, start, end, best_node)
        op, covered = self._covering(ns, digests)
        if op is not None and covered * self.page == rest.size:
            return Joined(op, int(rest.size))
        if not self.available:
            self.outcomes["skipped"] += 1
            return None
        if len(self.prefetches) >= MAX_PREFETCHES:
            self.outcomes["skipped"] += 1
            return None
        receipt = self.tree.lock(anchor)  # the anchor stays put while the pages travel
        self._serial += 1
        fresh = Prefetch((ns, digests[:32], self._serial), ns, anchor, receipt, rest, digests, after=op,
                         want=int(rest.size))
        if op is not None:
            fresh.request = np.array(tokens[:end], dtype=np.int32)
        self.prefetches[fresh.key] = fresh
        asyncio.get_running_loop().create_task(self._prefetch(fresh, threshold))
        return fresh

    def _plan(self, ns: tuple[str, str], tokens: np.ndarray, start: int, end: int,
              best_node: int) -> tuple[int, np.ndarray, bytes]:
        """The anchor node below which tokens[start:end] would go, those tokens, and their page digests."""
        anchor = best_node if start else self.tree.root_id(ns)
        _, prior = self.tree.chain_prior(anchor)
        rest = np.ascontiguousarray(tokens[start:end], dtype="<i4")
        return anchor, rest, _hashes.chain(rest.tobytes(), self.page * 4, prior)

    def _covering(self, ns: tuple[str, str], digests: bytes) -> tuple[Optional[Prefetch], int]:
        """The running fetch that brings the longest run of these pages from the first one, and that run."""
        best, most = None, 0
        want = np.frombuffer(digests, np.uint8).reshape(-1, 32)
        for op in self.prefetches.values():
            if op.ns != ns:
                continue
            at = op.digests.find(digests[:32])
            while at >= 0 and at % 32:
                at = op.digests.find(digests[:32], at + 1)
            if at < 0:
                continue
            have = np.frombuffer(op.digests, np.uint8, offset=at).reshape(-1, 32)
            n = min(len(have), len(want))
            diff = np.flatnonzero((have[:n] != want[:n]).any(axis=1))
            run = int(diff[0]) if diff.size else n
            if run > most:
                best, most = op, run
        return best, most

    async def _prefetch(self, op: Prefetch, threshold: int) -> None:
        try:
            if op.after is not None:
                await op.after.done.wait()
                if not self._replan(op):
                    op.outcome = "completed"  # another fetch (or an insert) brought every page meanwhile
                    return
                threshold = self.page  # the request as a whole passed the threshold
            op.outcome = await self._fetch(op, threshold)
        except StoreError:
            op.outcome = "error"
        except Exception:  # a bug must not leak the anchor lock or host slots
            log.exception("prefetch failed")
            op.outcome = "error"
        finally:
            if op.slots.size:
                self.host.host_alloc.move(op.slots, IN_FLIGHT, FREE, check=False)
                op.slots = np.zeros(0, np.int64)
            self.tree.unlock(op.receipt)
            del self.prefetches[op.key]
            self.outcomes[op.outcome] += 1
            op.done.set()
            if self.on_change is not None:
                self.on_change()

    def _replan(self, op: Prefetch) -> bool:
        """A continuing fetch, once the one it continues ended: what is still missing; False if nothing."""
        tokens = op.request
        m = self.tree.match_prefix(tokens, op.ns)
        start = m.matched_len + m.host_hit_len
        if start >= tokens.size:
            return False
        anchor, op.tokens, op.digests = self._plan(op.ns, tokens, start, tokens.size, m.best_node_id)
        receipt = self.tree.lock(anchor)
        self.tree.unlock(op.receipt)
        op.anchor, op.receipt = anchor, receipt
        return True

    async def _fetch(self, op: Prefetch, threshold: int) -> str:
        keys = self.keys(op.ns, op.digests)
        n = len(keys)
        if self.host.host_alloc.free_pages() < n:
            # Room must be made (host pages evicted) or the fetch shrunk: ask the store first, so a miss
            # never costs cached pages. With room to spare, the get alone answers (one round trip).
            have = await self._call(self._get_io, "exists", self.store.exists, keys)
            n = 0
            while n < len(have) and have[n]:
                n += 1
            if n * self.page < threshold or not n:
                return "miss"
            if not self.host.host_room(n * self.page):
                n = min(n, self.host.host_alloc.free_pages())
                if n * self.page < threshold or not n:
                    return "no_room"
        op.slots = self.host._take(self.host.host_alloc, n * self.page)
        outs = self._view(op.slots) if self._contiguous else \
            [np.empty(self.page_bytes, np.uint8) for _ in range(n)]
        got = await self._call(self._get_io, "get", self.store.get, keys[:n], outs)
        if not self._contiguous:
            for p, buf in zip((op.slots[::self.page] // self.page)[:got].tolist(), outs):
                self._pages[p][...] = buf.reshape(self._pages.shape[1:])
        self.pages["get"] += got
        self.bytes["get"] += got * self.page_bytes
        if got * self.page < threshold or not got:
            return "miss"
        ntok = got * self.page
        r = self.tree.insert_host(op.anchor, op.tokens[:ntok], op.slots[:ntok], op.digests[:got * 32])
        adopted = r.adopted.astype(np.int64)
        if adopted.size:
            self.host.host_alloc.move(adopted, IN_FLIGHT, TREE, check=False)
        keep = np.ones(op.slots.size, bool)  # everything but the adopted range is freed in _prefetch's finally:
        keep[r.prefix_len:r.prefix_len + adopted.size] = False  # duplicates, dropped pages, pages not read
        op.slots = op.slots[keep]
        op.loaded = int(adopted.size)
        self.hit_tokens += op.loaded
        if r.dropped.size:
            return "dropped"
        return "completed" if got * self.page == op.tokens.size else "truncated"

    async def wait(self, ops: list[Prefetch], policy: Optional[str] = None) -> None:
        """Hold a match as the prefetch policy says: not at all, until done (capped), or until the timeout."""
        policy = policy or self.prefetch_policy
        pending = [op for op in ops if not op.done.is_set()]
        if not pending or policy == "best_effort":
            return
        limit = WAIT_CAP if policy == "wait_complete" else self.prefetch_timeout
        waits = [asyncio.ensure_future(op.done.wait()) for op in pending]
        done, late = await asyncio.wait(waits, timeout=limit)
        for w in late:
            w.cancel()
        self.outcomes["timed_out"] += len(late)

    # ---------------------------------------------------------------- state
    @property
    def host_in_flight(self) -> int:
        """Host slots being written by fetches (in flight in the host allocator)."""
        return sum(int(op.slots.size) for op in self.prefetches.values())

    @property
    def busy(self) -> bool:
        """Any store traffic queued or running."""
        return bool(self.prefetches or self._puts or (self._put_task is not None and not self._put_task.done()))

    async def drain(self) -> None:
        """Wait for every queued write and running prefetch (shutdown)."""
        while self.busy:
            waits = [op.done.wait() for op in self.prefetches.values()]
            if self._put_task is not None and not self._put_task.done():
                waits.append(self._put_task)
            await asyncio.gather(*waits, return_exceptions=True)

    def close(self) -> None:
        self._put_io.shutdown(wait=True)
        self._get_io.shutdown(wait=True)
        self.store.close()

    def check(self) -> list[str]:
        """Pinned reads match queued and running writes; prefetch slots are in flight."""
        bad = []
        expect = np.zeros_like(self.host._readers)
        for _, slots, _ in self._puts:
            np.add.at(expect, slots, 1)
        if self._putting.size:
            np.add.at(expect, self._putting, 1)
        if not np.array_equal(expect, self.host._readers):
            bad.append("storage: host read pins do not match the queued and running L3 writes")
        for op in self.prefetches.values():
            if op.slots.size and (self.host.host_alloc.state[op.slots] != IN_FLIGHT).any():
                bad.append("storage: a prefetch's host slots are not in flight")
            if not self.tree.has_receipt(op.receipt):
                bad.append("storage: a prefetch lost its anchor lock")
        return bad

    def stats(self) -> dict[str, int]:
        """Counters for GetStats and the metrics page."""
        out = dict(storage_hit_tokens_total=self.hit_tokens, storage_put_pages_total=self.pages["put"],
                   storage_get_pages_total=self.pages["get"], storage_put_skipped_pages_total=self.pages["put_skipped"],
                   storage_put_bytes_total=self.bytes["put"], storage_get_bytes_total=self.bytes["get"],
                   storage_errors_total=sum(self.errors.values()), prefetches_in_flight=len(self.prefetches))
        return out
