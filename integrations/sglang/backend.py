"""`RadixdRadixCache`: radixd as the shared tier behind SGLang's own radix tree (SGLang 0.5.23, FlexKV style).

SGLang keeps its tree and KV pool; radixd is the tier behind them that outlives the engine and that every
engine on the node shares (one radixd session per engine: a dead engine loses its locks within a second).
  queued           (wrapped around the scheduler's `_add_request_to_queue` when the backend is built inside
                   SGLang's scheduler) starts the request's radixd lookup, MatchPrefix with lock on a lookup
                   thread, batched with every request queued meanwhile (a LoadBack first, and its copy waited
                   for there, when radixd holds more on its host tier);
  admission        (wrapped around the scheduler's `get_new_batch_prefill`) a queued request whose lookup is still
                   out is held back from the pass while the engine has other work, as SGLang skips a request whose
                   storage prefetch is not done (vLLM's "ask again next step"); with nothing else to run, the pass
                   waits for it instead (up to `lookup_deadline_ms` after it started: then a miss);
  match_prefix     SGLang's own match, then radixd's answer: the queued lookup's (waited for, up to the deadline,
                   only where no pass held it back), or one started now; what radixd has beyond SGLang's device
                   prefix is reported as `host_hit_length`, so the scheduler calls init_load_back;
  copy ahead       (CPU, one rank) a queued request's hit is copied by the lookup thread, as soon as radixd answers,
                   into spare SGLang slots from a stock the backend takes from SGLang's allocator at a step's end
                   (counted as evictable; an evict that empties the tree hands them back): the admission pass puts
                   those slots into SGLang's tree as they are, so SGLang's own match finds the hit on the device (a
                   load-back that comes first takes them instead): no allocation and no copy on the scheduler thread;
  init_load_back   all or nothing: SGLang slots (evicting locally if short), the path inserted into SGLang's tree,
                   radixd's pages copied into SGLang's k_buffer / v_buffer: inside the hooked pass, with the pass's
                   other load-backs in one copy at its end (before the batch's forward, as HiCache starts a batch's
                   loads once it is formed); radixd's lock stays with the request (GPU: the copy is queued on the
                   scheduler's stream, not waited for, and a lock released before it ran waits for its event);
  checkpoint       SGLang's own bookkeeping; a finished request's path is pinned in SGLang's tree and looked up
                   in radixd on the lookup thread (unless its queued lookup already locked radixd's prefix, or the
                   local index said radixd has none of it); once radixd's prefix is known the store thread does
                   the rest with the step's other stores: the ids, slots from a stock of held radixd slots, the copy
                   (CPU: numpy, a page per index; GPU: on a side stream, after an event the scheduler recorded when
                   the request finished) and then one CacheFinished; the scheduler unpins the path once the copy is
                   over;
  end_step         (wrapped around the scheduler's `process_batch_result`) the step's stores go to radixd in one
                   round: one CacheFinished for all of them. SGLang has no tick for a backend, so the rest
                   progresses in end_step (without the hooks: in match_prefix and checkpoint), evict and
                   check_hicache_events (and `settle` finishes everything);
  on_release / release_aborted_request / reset  release every radixd lock the request (or cache) held.
No radixd call blocks the scheduler thread except a bounded wait for a lookup when the engine has nothing else
to run (or, without the hooks, in match_prefix), and an Alloc when the slot stock runs short. With radixd
started with --kv-events (and no L3 tier) the backend follows radixd's events into a local index
(client/events.py `LocalIndex`): a prompt radixd holds not even the first page of is a miss at once, with no
lookup at queue, match or store time (`local_index=False` turns it off).
Tensor parallelism: radixd's pool holds every rank's KV heads side by side; rank 0 alone talks to radixd and
broadcasts its decisions (SGLang's ranks call the cache in lockstep), every rank copies its own heads, and
a barrier orders the copies before rank 0 unlocks or publishes. With TP the calls stay synchronous (every
rank must see the same decision at the same call).
The namespace is SGLang's extra_key plus cache_salt; radixd's page size must equal SGLang's --page-size.
"""
from __future__ import annotations

import logging
import os
import sys
import threading
import time
from array import array
from collections import deque
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any, Optional

import numpy as np
import torch

from sglang.srt.mem_cache.base_prefix_cache import (EvictParams, EvictResult, InitLoadBackParams, InsertParams,
                                                    MatchPrefixParams, MatchResult)
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey

from radixd.client import CacheClient, RadixdError
from radixd.client.background import EMPTY, Lookups, Stores
from radixd.client.events import MEDIA, LocalIndex
from radixd.client.pools import populate_in_background
from radixd.server.config import DEFAULT_SOCKET

from .copies import load_rows, store_rows

try:  # (optional: the same copies by numpy without it)
    from radixd.client._pagecopy import copy_pages as _copy_pages_native
except ImportError:
    _copy_pages_native = None

if TYPE_CHECKING:
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams

log = logging.getLogger("radixd.sglang")
SUPPORTED_SGLANG = "0.5.23"


def _ids(tokens: Any) -> np.ndarray:
    """Token ids as radixd's int32, from SGLang's array('q') without a per-token loop (or from a list)."""
    if isinstance(tokens, array):
        return np.frombuffer(tokens, dtype=f"i{tokens.itemsize}").astype(np.int32) if len(tokens) else np.zeros(0, np.int32)
    return np.asarray(tokens, dtype=np.int32)


def _agree(a: Any, b: Any) -> bool:
    """Two token sequences (any int sequences) equal as far as the shorter goes."""
    n = min(len(a), len(b))
    if type(a) is array and type(b) is array and a.typecode == b.typecode:
        return a[:n] == b[:n]  # (SGLang's own ids, compared in C: no conversion on a cold scheduler thread)
    return _ids(a[:n]).tobytes() == _ids(b[:n]).tobytes()  # (a fifth of np.array_equal's time there)


def _byte_rows(ours: list[torch.Tensor], theirs: list[torch.Tensor], page: int) -> Optional[tuple[list, list]]:
    """numpy views of each CPU buffer as one row of bytes per page of slots (its last partial page left out),
    paired; None unless every pair has the same row (dtype and shape) and is row-contiguous."""
    def rows(t: torch.Tensor) -> Optional[np.ndarray]:
        if t.dim() < 1 or not t.is_contiguous():
            return None
        b = t.view(torch.uint8).numpy().reshape(t.shape[0], -1)
        return np.lib.stride_tricks.as_strided(b, (b.shape[0] // page, page * b.shape[1]), (page * b.strides[0], 1))
    a, b = [rows(t) for t in ours], [rows(t) for t in theirs]
    if any(x is None for x in a + b) or any(x.shape[1] != y.shape[1] or s.dtype != d.dtype
                                           for x, y, s, d in zip(a, b, ours, theirs)):
        return None
    return a, b


def _native_plans(ours: list[torch.Tensor], theirs: list[torch.Tensor], page: int) -> tuple[np.ndarray, np.ndarray]:
    """`copy_pages`' plans for buffers `_byte_rows` accepted: (radixd's into SGLang's, SGLang's into radixd's); each
    pair's page rows by address (the buffers must outlive the plans)."""
    def entry(s: torch.Tensor, d: torch.Tensor) -> list[int]:
        row = page * s[0].numel() * s.element_size()
        return [s.data_ptr(), s.shape[0] // page, d.data_ptr(), d.shape[0] // page, row]
    return (np.array([entry(t, o) for o, t in zip(ours, theirs)], dtype=np.int64).ravel(),
            np.array([entry(o, t) for o, t in zip(ours, theirs)], dtype=np.int64).ravel())


def _pages(slots: np.ndarray, page: int) -> Optional[np.ndarray]:
    """The page numbers of slots that are whole pages in order (as SGLang's and radixd's paged allocators hand
    them out), or None."""
    if len(slots) % page:
        return None
    first = slots[::page]
    at, off = np.divmod(first, page)
    if off.any() or page > 1 and \
            (first[:, None] + _offsets(page)).tobytes() != slots.astype(np.int64, copy=False).tobytes():
        return None  # (bytes compared: a third of the numpy calls of an elementwise check, on a cold thread)
    return at


@lru_cache(maxsize=None)
def _offsets(page: int) -> np.ndarray:
    return np.arange(page, dtype=np.int64)


def _copy_pages(src: list[np.ndarray], at: np.ndarray, dst: list[np.ndarray], to: np.ndarray) -> None:
    """dst[i][to] = src[i][at] for every buffer (rows of whole pages: one index per page, not per slot)."""
    for s, d in zip(src, dst):
        d[to] = np.take(s, at, axis=0)


def attached(cache: RadixCache, node: Any) -> bool:
    """Whether a node is still in the tree (a match's node may be evicted before its load-back)."""
    while node is not cache.root_node:
        parent = node.parent
        if parent is None or parent.children.get(node.key.child_key(cache.page_size)) is not node:
            return False
        node = parent
    return True


@dataclass(slots=True, eq=False)
class _Fetch:
    """A queued request's hit copied ahead by the lookup thread, into SGLang slots of the backend's spare stock (CPU):
    its load-back then takes the slots as they are, with no copy and no allocation on the scheduler thread."""

    slots: np.ndarray  # SGLang slots (int64) holding radixd's prefix[:len(slots)], root first
    gen: int  # the stock's generation (a reset hands every slot back to SGLang)


@dataclass(slots=True)
class _Marker:
    """From a match that found pages in radixd to its init_load_back: the lock and where the pages are."""

    receipt: int
    path: np.ndarray  # radixd device slots of the matched path, root first
    key: RadixKey  # snapshot of the matched key (the request's own key keeps growing)
    device_len: int  # SGLang's device prefix at match time
    fetch: Optional[_Fetch] = None  # the path's pages copied ahead, if they were


class _PathSlots:
    """A finished request's pinned path, as SGLang's nodes hold its slots (leaf first): joined and cut to its whole
    pages only where they are read, on the store thread (a torch.cat on the cache-cold scheduler thread cost ~10 us)."""

    __slots__ = ("values", "n")

    def __init__(self, values: list, n: int):
        self.values, self.n = values, n

    def __getitem__(self, at: slice) -> torch.Tensor:
        return torch.cat(self.values[::-1])[:self.n][at]


class _CopyJob:
    """A store's copy, SGLang's pages into radixd's slots, run by the store thread once it has planned the store
    (`Stores.store`) and before it publishes; the scheduler polls it as a CUDA event. On GPU it runs on the side
    stream once the scheduler's stream reached `after` (recorded when the request finished: its forward wrote the KV)."""

    __slots__ = ("cache", "src", "after", "done")

    def __init__(self, cache: "RadixdRadixCache", src: Any, after: Any = None):
        self.cache, self.src, self.after = cache, src, after  # src: SGLang's slots of the whole pages, root first
        self.done = False  # (no lock of its own: one condition per cache, taken by the store thread, not here)

    def __call__(self, start: int, dst: Optional[np.ndarray]) -> bool:
        """The pages from `start` on into radixd's slots `dst` (None: not stored); once only."""
        if self.done:
            return False
        try:
            if dst is None:
                return False
            src = self.src[start:start + len(dst)]
            if self.cache.cuda:
                self.cache._copy_gpu(src, dst, self.after)
            elif not self.cache._copy_cpu(True, np.asarray(src, dtype=np.int64), dst):
                self.cache._copy_slots(src, dst)
            self.cache.stored_tokens += len(dst)
            return True
        except Exception:  # (on the store thread) the pages are not published; the scheduler's poll ends
            log.exception("radixd store copy failed")
            return False
        finally:
            with self.cache._copied:
                self.done = True
                self.cache._copied.notify_all()

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        if not self.done:
            with self.cache._copied:
                self.cache._copied.wait_for(lambda: self.done)


@dataclass(slots=True)
class _Store:
    """A finished request's pages on their way into radixd: its path stays pinned until the copy is over."""

    job: _CopyJob
    node: Any


@dataclass(slots=True)
class _Plan:
    """A finished request's path, pinned in SGLang's tree until its radixd lookup lands and the copy is done."""

    sid: int
    node: Any
    src: Any  # SGLang slots of the whole pages, root first (a tensor, or `_PathSlots`)
    tokens: Any  # (SGLang's ids, as looked up)
    ns: dict
    asked: float
    job: _CopyJob


@dataclass(slots=True)
class _Asked:
    """A radixd lookup on its way for a request."""

    tokens: Any  # SGLang's ids as looked up (array('q'): the lookup thread converts them)
    at: float
    req: Any = None  # the queued request (held back from admission while this is out), if started at queue time


@dataclass(slots=True)
class _Hold:
    """What a request's lookup locked in radixd, kept until the request ends: its hit on every later match and
    the prefix its finished pages attach to (no second lookup)."""

    tokens: Any
    prefix: np.ndarray
    receipt: int
    fetch: Optional[_Fetch] = None  # its prefix copied ahead into spare SGLang slots (until a load-back takes them)


class RadixdRadixCache(RadixCache):
    """SGLang RadixCache with radixd behind it (see the module docstring)."""

    _spare_tokens = 0  # (read by evictable_size, which SGLang's constructor may call before ours ran)
    prefetch_tokens = 0

    def __init__(self, params: "CacheInitParams", tp_size: int = 1, tp_rank: int = 0, tp_group: Any = None,
                 target: Optional[str] = None, token: Optional[str] = None, load_back: bool = True,
                 lookup_deadline_ms: float = 200, slot_stock_tokens: int = 65536, local_index: bool = True,
                 prefetch_tokens: int = 16384):
        super().__init__(params)
        if tp_size > 1 and tp_group is None:
            raise ValueError("radixd backend: tensor parallelism needs the TP group (broadcast_object, barrier)")
        self.tp_size, self.tp_rank, self.group = tp_size, tp_rank, tp_group
        self.lead = tp_rank == 0  # the one rank that talks to radixd; the others follow its decisions
        self.target = target or os.environ.get("RADIXD_TARGET") or "unix://" + DEFAULT_SOCKET[len("unix:"):]
        self.load_back = load_back
        token = token or os.environ.get("RADIXD_TOKEN")
        self.client = CacheClient(self.target, token=token, name=f"sglang-{os.getpid()}", attach=self.lead)
        info = self.client.info()
        if info["page_size"] != self.page_size:
            raise ValueError(f"radixd backend: radixd's page size {info['page_size']} != SGLang's --page-size "
                             f"{self.page_size}; start radixd with --page-size {self.page_size}")
        kv = self.token_to_kv_pool_allocator.get_kvcache()
        self.k, self.v = kv.k_buffer, kv.v_buffer
        # the pool on this rank's GPU, else radixd's pool on another GPU it sees (one pool holds every rank's heads;
        # each rank's copies then index it on its own device and move the rows across)
        self.pools = self.client.map_pools(self.k[0].device, host=False, elsewhere=True)
        populate_in_background(self.pools.device)  # the first copy into each page takes no page fault
        dev = self.pools.device[0]
        d = dev.descriptor
        heads = self.k[0].shape[1]  # this rank's KV heads; radixd holds all ranks' side by side
        self.shard = slice(tp_rank * heads, (tp_rank + 1) * heads)
        want = (len(self.k), (heads * tp_size, self.k[0].shape[2]), self.k[0].dtype)
        have = (d.num_layers, (d.kv_heads, d.head_dim), dev.k_buffer[0].dtype if dev.k_buffer else None)
        if d.mla or want != have:
            raise ValueError(f"radixd backend: the KV geometry differs (layers, (kv heads of all TP ranks, head "
                             f"dim), dtype): SGLang "
                             f"has {want}, radixd has {have}; start radixd with matching --layers/--kv-heads/"
                             "--head-dim/--dtype (or --model-config)")
        self.rk, self.rv = dev.k_buffer, dev.v_buffer
        self.cuda = self.k[0].is_cuda
        self.stream = torch.cuda.Stream(device=self.k[0].device) if self.cuda else None
        # CPU, one rank: SGLang's and radixd's K and V as a row of bytes per page, copied by numpy a page per index
        # (torch's index ops per slot ran ~15 us each on a cold scheduler thread)
        self._rows = _byte_rows(self.k + self.v, self.rk + self.rv, self.page_size) \
            if not self.cuda and tp_size == 1 else None
        # the same copies checked and done in one native call (numpy's twenty-odd calls cost more than the bytes)
        self._native = _native_plans(self.k + self.v, self.rk + self.rv, self.page_size) \
            if self._rows is not None and _copy_pages_native is not None else None
        self.native_copies = 0  # copies done by the native call (tests)
        self._markers: dict[Any, _Marker] = {}
        self._stores: deque[_Store] = deque()
        self._copied = threading.Condition()  # a store's copy over (`_CopyJob.synchronize` waits on it)
        self.loaded_tokens = 0  # tokens copied in from radixd (for tests and logs)
        self.stored_tokens = 0
        self.rpcs = 0  # radixd calls made on the scheduler thread (for tests and benchmarks)
        self.idle_waited = 0.0  # seconds the scheduler waited for lookups with nothing else to run (benchmarks)
        self.copied_in = 0.0  # seconds the scheduler spent copying load-backs' KV into SGLang's pool (benchmarks)
        self.deadline = lookup_deadline_ms / 1000
        self.asynchronous = tp_size == 1  # with TP every rank must see the lead's decision at the same call
        self._asked: dict[Any, _Asked] = {}
        self._missed: dict[Any, float] = {}  # requests the local index called a miss when queued: when
        self._holds: dict[Any, _Hold] = {}
        self._loading: dict[Any, Any] = {}  # GPU: a request's load-back copy (its CUDA event), until its lock may go
        self._pending: list[tuple[Any, np.ndarray, torch.Tensor]] = []  # load-backs to copy at the pass's end
        self._admitting = False  # inside the hooked admission pass (its load-backs copied together at its end)
        self._after_copy: deque[tuple[Any, int]] = deque()  # (event, receipt): unlocked once the copy read the pages
        self._plans: list[_Plan] = []
        self._sid = 0
        self.stepped = False  # hooked: each step ends in end_step, which drains (match and checkpoint need not)
        # prefetch (CPU, one rank, whole-page native copies): a stock of spare SGLang slots, taken from its allocator
        # on the scheduler thread at the end of a step (never when that would squeeze the engine; a quarter of its
        # pool at most), into which the lookup thread copies a queued request's hit as soon as radixd answers, while
        # the engine runs its forward; the spare slots count as evictable (SGLang's admission and its leak check
        # see them) and an evict hands them back first
        self.prefetch_tokens = min(prefetch_tokens, self.token_to_kv_pool_allocator.size // 4) \
            if self._native is not None else 0
        self._spare: deque[int] = deque()  # spare pages (SGLang page numbers) not copied into
        self._fetches: dict[int, _Fetch] = {}  # copied-ahead hits no load-back took yet (id -> fetch)
        # (the two threads share the stock and `_fetches` by single deque and dict calls, atomic under the GIL; only
        # the lookup thread's copy ahead and the scheduler's reclaim take pages out, each holding `_copying`)
        self._copying = threading.Lock()
        self._spare_tokens = 0  # SGLang slots the backend holds: the stock and the fetches (scheduler thread only)
        self._gen = 0
        self.prefetched_tokens = 0  # load-back tokens that a copy ahead served (tests and benchmarks)
        self.copies_ahead = 0  # copies ahead made (by the lookup thread only)
        if self.asynchronous:
            self.stores = Stores(self.client, self.page_size, slot_stock_tokens, capacity=info["capacity_tokens"],
                                 prime=slot_stock_tokens // 4, pressure=info.get("pressure_segment", ""))
            self.lookups = Lookups(self.client, load_back, self.stores,
                                   prefetch=self._prefetch if self.prefetch_tokens else None, unfetch=self._unfetch)
            self.stores.first = self.lookups
        self.index: Optional[LocalIndex] = None  # misses answered with no round trip (radixd with --kv-events)
        if self.asynchronous and local_index and not info["storage"]:  # no event names an L3 tier's pages
            self.index = LocalIndex(self.client, self.target, self.page_size, token,
                                    MEDIA if load_back else ("GPU",))

    # ---------------------------------------------------------------- helpers
    def _ns(self, key: RadixKey) -> dict[str, str]:
        return dict(extra_key=key.extra_key or "", cache_salt=getattr(key, "cache_salt", None) or "")

    def _bcast(self, obj: Any) -> Any:
        """The lead rank's value on every rank (SGLang's TP ranks call the cache in lockstep)."""
        return obj if self.tp_size == 1 else self.group.broadcast_object(obj, src=0)

    def _barrier(self) -> None:
        if self.tp_size > 1:
            if self.cuda:
                torch.cuda.current_stream().synchronize()
            self.group.barrier()

    def _unlock(self, receipt: int) -> None:
        if receipt and self.asynchronous:
            self.stores.unlock(receipt)
        elif receipt and self.lead:
            try:
                self.rpcs += 1
                self.client.unlock([receipt])
            except RadixdError as e:
                log.warning("radixd unlock failed: %s", e)

    def _drop_marker(self, handle: Any) -> None:
        m = self._markers.pop(handle, None)
        if m is not None:
            self._unlock(m.receipt)

    def _drain(self, wait: bool = False) -> None:
        """Hand the stores whose radixd lookup landed to the store thread; unpin the paths whose copy is over (with
        wait: every store, its lookup waited for up to the deadline, and every load-back copied)."""
        if wait:
            self._flush_loads()
        if self._plans:
            self._copy_planned(wait)
        after = self._after_copy
        while after and (wait or after[0][0].query()):  # load-back copies in stream order
            event, receipt = after.popleft()
            event.synchronize()
            self._unlock(receipt)
        if wait and self.asynchronous:
            self.stores.flush()  # (the copies run in the store thread's next round)
        stores = self._stores
        while stores:  # copies complete in the order they were queued (one store thread)
            st = stores[0]
            if not wait and not st.job.query():
                break
            stores.popleft()
            st.job.synchronize()
            self.dec_lock_ref(st.node)

    def _publish(self, item: dict) -> None:
        """Lead rank (TP): the store's CacheFinished, here."""
        try:
            self.rpcs += 1
            self.client.cache_finished([item])
        except RadixdError as e:  # radixd refused or is gone: the pages are simply not shared
            log.warning("radixd publish failed: %s", e)
            try:
                self.client.free(item["indices"][item["prev_prefix_len"]:])
                self._unlock(item["receipt_id"])
            except RadixdError:
                pass

    # ------------------------------------------------------------- lifecycle
    def reset(self) -> None:
        if hasattr(self, "_markers"):  # (SGLang's constructor resets before ours ran)
            self._drain(wait=True)  # before SGLang's tree and slots go
            for h in list(self._markers):
                self._drop_marker(h)
            for h in list(self._asked) + list(self._holds):
                self._forget(h)
            self._missed.clear()
            self._drop_spare()  # (SGLang's reset frees every slot of its allocator, the spare ones too)
        super().reset()

    def settle(self) -> None:
        """Every store copied and published and every release done (tests, shutdown)."""
        self._drain(wait=True)
        if self.asynchronous:
            while not (self.lookups.idle() and self.stores.idle()):
                self.lookups.wait_idle(1.0)
                self.stores.wait_idle(1.0)

    def stocked_tokens(self) -> int:
        """radixd slots held ready for stores (they count as held in radixd's stats)."""
        return self.stores.stocked() if self.asynchronous else 0

    def shutdown(self) -> None:
        self._drain(wait=True)
        for h in list(self._markers):
            self._drop_marker(h)
        for h in list(self._asked) + list(self._holds):
            self._forget(h)
        self._drain(wait=True)  # (locks held back for a queued load-back copy)
        if self.index is not None:
            self.index.close()
        if self.asynchronous:
            self.lookups.close()
            self.stores.close()
        self._reclaim(self._spare_tokens)  # the spare slots back to SGLang's allocator
        self._rows = self._native = None  # (views and addresses of the pools about to be unmapped)
        self.pools.close()
        self.client.close()

    # ---------------------------------------------------------------- lookups
    def queued(self, req) -> None:
        """A request entered the waiting queue: start its radixd lookup so the answer is there at admission."""
        if self.disable or not self.asynchronous or req.finished() or self.is_eagle:
            return
        origin, out = req.origin_input_ids, req.output_ids
        n = len(origin) + len(out) - 1  # the scheduler's key: all but the last token, whole pages
        n -= n % self.page_size
        if n <= 0:
            return
        salt = req.cache_salt or ""
        index = self.index  # (asked straight: one call layer less on a cache-cold thread)
        if index is not None and index.known_miss(origin if len(origin) >= self.page_size else origin + out, salt,
                                                  req.extra_key or ""):
            if len(self._missed) > 65536:  # (its first page is all it hashes) (dropped at release; this bounds any
                self._missed.clear()  # that never are)
            self._missed[req.cache_request_handle] = time.monotonic()
            return
        ns = dict(extra_key=req.extra_key or "", cache_salt=salt)
        # SGLang's ids as they are (a slice: the request's own keep growing): the lookup thread converts them
        ids = origin[:n] if len(origin) >= n else np.concatenate([_ids(origin), _ids(out)])[:n]
        self._ask(req.cache_request_handle, ids, ns, req)

    def _known_miss(self, tokens: Any, ns: dict) -> bool:
        """radixd holds not even the first page of tokens (any int sequence), by the local index."""
        return self.index is not None and self.index.known_miss(tokens, ns["cache_salt"], ns["extra_key"])

    def _ask(self, handle: Any, tokens: Any, ns: dict, req: Any = None) -> None:
        if handle in self._asked or handle in self._holds:
            self._forget(handle)
        self._asked[handle] = _Asked(tokens, time.monotonic(), req)
        self.lookups.submit(handle, tokens, ns, prefetch=req is not None and self.prefetch_tokens > 0)

    def _forget(self, handle: Any) -> None:
        """The request is done with radixd: its lookup's lock goes (when it lands, if it is still out)."""
        if self._asked.pop(handle, None) is not None:
            self.lookups.drop(handle)
        hold = self._holds.pop(handle, None)
        if hold is not None:
            self._unfetch(hold.fetch)
            self._unlock_after_load(handle, hold.receipt)

    def _unlock_after_load(self, handle: Any, receipt: int) -> None:
        """Release a hold's lock, once the request's load-back copy (GPU, still queued) has read radixd's pages."""
        if any(h == handle for h, _, _ in self._pending):
            self._flush_loads()
        event = self._loading.pop(handle, None)
        if event is not None and not event.query():
            self._after_copy.append((event, receipt))
        else:
            self._unlock(receipt)

    def _collect(self, handle: Any, wait: float = 0.0) -> Optional[_Hold]:
        """The request's hold, taking its lookup's answer if it landed (within `wait`)."""
        asked = self._asked.get(handle)
        if asked is not None:
            res = self.lookups.take(handle, wait)
            if res is not None:
                del self._asked[handle]
                old = self._holds.pop(handle, None)
                if old is not None:
                    self._unfetch(old.fetch)
                    self._unlock_after_load(handle, old.receipt)
                fetch = self.lookups.fetched.pop(handle, None) if self.prefetch_tokens else None
                self._holds[handle] = _Hold(asked.tokens, res[0], res[1], fetch)  # (Lookups' slots: int64 already)
        return self._holds.get(handle)

    def hold_back(self, waiting: list, busy: bool) -> Optional[tuple[list, list]]:
        """Before the scheduler's admission pass: (the waiting queue less the requests to hold back, those requests)
        or None to hold none. Held back: queued requests whose radixd lookup is still out, within its deadline,
        while the engine has other work (`busy`, or other requests waiting), as vLLM's "ask again next step". With
        nothing else to run, their lookups are waited for here instead (up to the deadline; `idle_waited`)."""
        if not self._asked:
            return None
        out = []
        now = time.monotonic()
        for handle, asked in list(self._asked.items()):
            if asked.req is None or now - asked.at >= self.deadline:  # (past it: a miss at match)
                continue
            self._collect(handle)
            if handle in self._asked:
                out.append(asked)
        if not out:
            return None
        out_for = {id(a.req): a for a in out}
        held = [r for r in waiting if id(r) in out_for]  # (a request admitted already is not waited for)
        if not held:
            return None
        if not busy and len(held) == len(waiting):  # nothing else to run: wait for the answers (idle time)
            t = time.perf_counter()
            for r in held:
                left = self.deadline - (time.monotonic() - out_for[id(r)].at)
                self._collect(r.cache_request_handle, max(left, 0.0))
            self.idle_waited += time.perf_counter() - t
            return None
        return [r for r in waiting if id(r) not in out_for], held

    # ----------------------------------------------------------------- match
    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        base = super().match_prefix(params)
        req = params.req
        if self.disable or req is None or not len(params.key):
            return base
        if not self.stepped:
            self._drain()
        handle = req.cache_request_handle
        self._drop_marker(handle)  # asked again: the newer answer wins
        missed = self._missed.get(handle)
        if missed is not None and time.monotonic() - missed < self.deadline:  # the local index said miss when it
            return base  # was queued: trusted for the lookup deadline
        key = params.key.page_aligned(self.page_size)
        device_len = base.device_prefix_len
        if device_len >= len(key) or self.is_eagle:
            if self.asynchronous:
                self._collect(req.cache_request_handle)  # kept for the finished pages, if it is there
            return base
        path, receipt = None, 0
        if self.asynchronous:
            path, receipt = self._lookup(req.cache_request_handle, key, device_len)
        elif self.lead:
            path, receipt = self._radixd_match(key, device_len)
        path = self._bcast(path)
        if path is None:
            return base
        hit = len(path) - device_len
        # the ids in the scheduler's own type (array('q')), a copy (page_aligned copies unless pages are single tokens)
        snap = key if key is not params.key else key[:len(key)]
        hold = self._holds.get(handle) if self._fetches else None
        self._markers[handle] = _Marker(receipt, path, snap, device_len, hold.fetch if hold is not None else None)
        node = base.last_device_node
        return base._replace(last_host_node=node, best_match_node=node, host_hit_length=hit)

    def _lookup(self, handle: Any, key: RadixKey, device_len: int) -> tuple[Optional[np.ndarray], int]:
        """radixd's path for the key when it holds more than SGLang's device prefix: from the request's hold, or
        the lookup it started when it was queued (or one started now), waited for up to the deadline. The lock
        stays with the request's hold (the receipt returned is 0)."""
        self._missed.pop(handle, None)  # (a queue-time miss older than the deadline: asked afresh)
        tokens = key.raw_token_ids()  # (compared and looked up as they are: array('q'))
        hold = self._holds.get(handle)
        if hold is None or not _agree(hold.tokens, tokens):
            asked = self._asked.get(handle)
            if asked is None or not _agree(asked.tokens, tokens):
                if self._known_miss(tokens, self._ns(key)):
                    self._forget(handle)
                    return None, 0
                self._ask(handle, tokens[:], self._ns(key))  # none yet, or for other tokens (a copy: the key's
                # ids may be the request's own, which grow while the lookup thread reads them)
                asked = self._asked[handle]
            hold = self._collect(handle, max(self.deadline - (time.monotonic() - asked.at), 0.0))
            if handle in self._asked:
                self._forget(handle)
                log.info("radixd lookup took longer than %.0f ms: a miss", self.deadline * 1e3)
                return None, 0
        usable = min(len(hold.prefix), len(tokens))  # the two keys agree that far
        usable -= usable % self.page_size
        if usable <= device_len:
            return None, 0
        return hold.prefix[:usable], 0

    def _radixd_match(self, key: RadixKey, device_len: int) -> tuple[Optional[np.ndarray], int]:
        """radixd's locked path for the key when it holds more than SGLang's device prefix (lead rank, TP)."""
        tokens = _ids(key.raw_token_ids())
        try:
            self.rpcs += 1
            m = self.client.match_prefix(tokens, lock=True, **self._ns(key))
            path, receipt = m.indices, m.receipt_id
            if self.load_back and m.host_hit_len:
                lb = self.client.load_back(receipt)
                if lb.loaded_len:
                    _, failed = self.client.wait_transfers([lb.transfer_id])
                    if failed:
                        raise RadixdError(f"load-back transfer {lb.transfer_id} failed")
                path, receipt = lb.indices, lb.receipt_id
        except RadixdError as e:  # radixd down or refusing: SGLang's own answer stands
            log.warning("radixd match failed: %s", e)
            return None, 0
        if len(path) <= device_len:
            self._unlock(receipt)
            return None, 0
        return np.asarray(path, dtype=np.int64), receipt

    def init_load_back(self, params: InitLoadBackParams):
        """Copy radixd's pages into fresh SGLang slots and insert them: all `host_hit_length` tokens or none."""
        req = params.req
        last = params.best_match_node
        marker = self._markers.pop(req.cache_request_handle, None) if req is not None else None
        if marker is None:
            return 0, last
        try:
            n = params.host_hit_length
            if n <= 0 or marker.device_len + n > len(marker.path) or not attached(self, last):
                return 0, last  # (a node evicted since the match: its prefix is gone, so is the hit)
            end = marker.device_len + n
            slots = self._fetched(marker.fetch, marker.device_len, end) if marker.fetch is not None else None
            fetched = slots is not None  # (copied ahead: no allocation, no copy here)
            if slots is None:
                slots = self.token_to_kv_pool_allocator.alloc(n)  # (None, taking nothing, when short)
            if slots is None:
                self.inc_lock_ref(last)  # making room must not evict the prefix the pages continue
                try:
                    self.evict(EvictParams(num_tokens=n))
                finally:
                    self.dec_lock_ref(last)
                slots = self.token_to_kv_pool_allocator.alloc(n)
            if slots is None:
                return 0, last
            at = marker.path[marker.device_len:marker.device_len + n]
            dst = slots if slots.dtype == torch.int64 else slots.to(torch.int64)  # (SGLang's are int64)
            if not self.asynchronous:  # TP: every rank has its heads before the lead releases radixd's lock
                self._copy_in(at, dst)
                if self.cuda:
                    torch.cuda.current_stream().synchronize()
                self._barrier()
            value = torch.cat([self.path_device_indices(last)[:marker.device_len].to(torch.int64), dst]) \
                if marker.device_len else dst
            r = self.insert(InsertParams(key=marker.key if end == len(marker.key) else marker.key[:end], value=value,
                                         inserted_len=marker.device_len, priority=getattr(last, "priority", 0)))
            dup = min(max(r.prefix_len - marker.device_len, 0), n)
            if dup:  # inserted meanwhile by this engine: our slots there are duplicates
                self.token_to_kv_pool_allocator.free(dst[:dup])
            if fetched:
                self.prefetched_tokens += n
            elif self.asynchronous and dup < n:  # (the lock stays with the request's hold until the copy read it)
                self._load(req.cache_request_handle, at[dup:], dst[dup:])
            self.loaded_tokens += n
            return n, r.last_device_node
        finally:
            self._unlock(marker.receipt)

    def admission(self, waiting: list, busy: bool) -> Optional[tuple[list, list]]:
        """The scheduler's admission pass begins: its load-backs are copied together when it ends (`admitted`), before
        the batch's forward; the copied-ahead hits of the requests it may admit go into SGLang's tree first (SGLang's
        own match then finds them on the device: no load-back); returns `hold_back`'s answer."""
        held = self.hold_back(waiting, busy) if self._asked else None
        if self._fetches:
            self._insert_fetched(waiting if held is None else held[0])
        self._admitting = True
        return held

    def _insert_fetched(self, waiting: list) -> None:
        """Each waiting request's copied-ahead hit inserted into SGLang's tree as it is (its pages stay evictable until
        the request's match locks them; one evicted meanwhile is loaded back the usual way)."""
        holds = self._holds
        for r in waiting:
            hold = holds.get(r.cache_request_handle)
            f = hold.fetch if hold is not None else None
            if f is None or type(hold.tokens) is not array:  # (ids SGLang's key takes as they are)
                continue
            hold.fetch = None
            n = len(f.slots)
            slots = self._fetched(f, 0, n) if n <= len(hold.tokens) else None
            if slots is None:
                self._unfetch(f)
                continue
            res = self.insert(InsertParams(key=RadixKey(hold.tokens[:n], r.extra_key, cache_salt=r.cache_salt),
                                           value=slots))
            dup = min(res.prefix_len, n)
            if dup:  # (SGLang had the start of it already)
                self.token_to_kv_pool_allocator.free(slots[:dup])
            self.prefetched_tokens += n - dup
            self.loaded_tokens += n - dup

    def admitted(self) -> None:
        """The admission pass ended: its load-backs copied, as one."""
        self._admitting = False
        if self._pending:
            self._flush_loads()

    def _load(self, handle: Any, at: np.ndarray, dst: torch.Tensor) -> None:
        """A load-back's copy, radixd's slots `at` into SGLang's `dst`: now, or inside the hooked admission pass at
        its end with the pass's other loads in one copy (as HiCache starts a batch's loads once it is formed)."""
        self._pending.append((handle, at, dst))
        if not self._admitting:
            self._flush_loads()

    def _flush_loads(self) -> None:
        """The pending load-back copies, as one (GPU: queued on the scheduler's stream, an event after them that the
        requests' locks wait for)."""
        loads, self._pending = self._pending, []
        if not loads:
            return
        if len(loads) == 1:
            at, dst = loads[0][1], loads[0][2]
        else:
            at, dst = np.concatenate([a for _, a, _ in loads]), torch.cat([d for _, _, d in loads])
        t = time.perf_counter()
        if self._native is not None and _copy_pages_native(self._native[0], at, dst.numpy(), self.page_size):
            self.native_copies += 1  # (CPU, whole pages: the native copy called straight, no layer between)
        else:
            self._copy_in(at, dst)
        self.copied_in += time.perf_counter() - t
        if self.cuda:
            event = torch.cuda.Event()
            event.record()
            for handle, _, _ in loads:
                self._loading[handle] = event

    def _copy_in(self, at: np.ndarray, dst: torch.Tensor) -> None:
        """radixd's KV at slots `at` into SGLang's at `dst` (this rank's heads)."""
        if self.cuda or not self._copy_cpu(False, at, dst.numpy()):
            load_rows(self.k, self.v, self.rk, self.rv, at, dst, self.shard)

    # ------------------------------------------------------------- prefetch
    def _prefetch(self, prefix: np.ndarray) -> Optional[_Fetch]:
        """Lookup thread: a queued request's hit copied into spare SGLang slots now (the GIL let go), or None when the
        stock is short."""
        page = self.page_size
        k = len(prefix) // page
        spare = self._spare
        with self._copying:
            if not k or len(spare) < k:
                return None
            pages = [spare.popleft() for _ in range(k)]
            slots = (np.array(pages, dtype=np.int64)[:, None] * page + _offsets(page)).ravel()
            if not _copy_pages_native(self._native[0], prefix[:k * page], slots, page, nogil=True):
                spare.extend(pages)
                return None
            f = _Fetch(slots, self._gen)
            self._fetches[id(f)] = f
            self.copies_ahead += 1
            return f

    def _unfetch(self, f: Optional[_Fetch]) -> None:
        """A copied-ahead hit nobody will load: its slots back into the stock."""
        if f is not None and self._fetches.pop(id(f), None) is f and f.gen == self._gen:
            self._spare.extend((f.slots[::self.page_size] // self.page_size).tolist())

    def _fetched(self, f: _Fetch, start: int, end: int) -> Optional[torch.Tensor]:
        """The copied-ahead slots of the path's tokens [start, end) for a load-back (the rest back into the stock), or
        None when the fetch is gone (reclaimed by an evict) or short."""
        slots = f.slots
        if end > len(slots) or self._fetches.pop(id(f), None) is not f or f.gen != self._gen:
            return None
        if start or end < len(slots):  # (SGLang had the start of the path itself, or matched less of it)
            page = self.page_size
            rest = slots[::page] // page
            self._spare.extend(rest[:start // page].tolist() + rest[end // page:].tolist())
            slots = slots[start:end]
        self._spare_tokens -= end - start
        return torch.from_numpy(slots)

    def _restock(self) -> None:
        """End of a step: the spare stock topped up from SGLang's allocator once it fell under half (one allocation for
        several hits). A full pool gives up its least recently used cached pages for it, as long as the engine keeps
        at least as much room again (free or evictable); otherwise the stock waits."""
        want = self.prefetch_tokens - self._spare_tokens
        if want < self.prefetch_tokens // 2 or not want:
            return
        want -= want % self.page_size
        alloc = self.token_to_kv_pool_allocator
        if want <= 0:
            return
        free = alloc.available_size()
        if free + super().evictable_size() < 2 * want:
            return
        if free < want:
            self._flush_loads()  # (no slot freed with a copy into it still pending)
            RadixCache.evict(self, EvictParams(num_tokens=want - free))
            if alloc.available_size() < want:
                return
        slots = alloc.alloc(want)
        if slots is None:
            return
        self._spare.extend((slots.numpy()[::self.page_size] // self.page_size).tolist())
        self._spare_tokens += want

    def _reclaim(self, want: int) -> int:
        """Up to `want` spare tokens (whole pages) back to SGLang's allocator: the stock first, then copied-ahead hits no
        load-back took yet (their requests load the usual way); returns the tokens given back."""
        if want <= 0 or not self._spare_tokens:
            return 0
        page = self.page_size
        with self._copying:  # (a copy ahead in flight lands first)
            pages = []
            while self._spare and len(pages) * page < want:
                pages.append(self._spare.popleft())
            freed = [np.array(pages, dtype=np.int64)[:, None] * page + _offsets(page)] if pages else []
            got = len(pages) * page
            for key in list(self._fetches):
                if got >= want:
                    break
                f = self._fetches.pop(key, None)  # (one given back by the lookup thread meanwhile is in the stock)
                if f is not None:
                    freed.append(f.slots)
                    got += len(f.slots)
        if freed:
            self.token_to_kv_pool_allocator.free(torch.from_numpy(np.concatenate([x.ravel() for x in freed])))
        self._spare_tokens -= got
        return got

    def _drop_spare(self) -> None:
        """SGLang's allocator is being reset: every spare slot is its again, and a copy ahead in flight is void."""
        with self._copying:
            self._gen += 1
            self._spare.clear()
            self._fetches.clear()
        self._spare_tokens = 0

    def evictable_size(self) -> int:
        return super().evictable_size() + self._spare_tokens

    # ------------------------------------------------------------ checkpoint
    def checkpoint(self, req, *, up_to: int) -> None:
        """SGLang's own checkpoint; a finished request's new whole pages also go to radixd."""
        super().checkpoint(req, up_to=up_to)
        if self.disable or not req.finished():
            if not self.stepped:
                self._drain()
            return
        node = req.last_node
        if self.asynchronous and not self.cuda:  # (the path's slots as its nodes hold them: joined on the store thread)
            values, total, x, root = [], 0, node, self.root_node
            while x is not root:
                values.append(x.value)
                total += len(x.value)
                x = x.parent
            n = total - total % self.page_size
            indices = _PathSlots(values, n)
        else:
            indices = self.path_device_indices(node)
            if indices.dtype != torch.int64:  # (SGLang's are; a no-op conversion is a dispatch on a cold thread)
                indices = indices.to(torch.int64)
            n = len(indices) - len(indices) % self.page_size
        if n == 0:
            if not self.stepped:
                self._drain()
            return
        ns = dict(extra_key=req.extra_key or "", cache_salt=req.cache_salt or "")
        if self.asynchronous:
            self._checkpoint_async(req.cache_request_handle, node, indices if not self.cuda else indices[:n],
                                   req.full_untruncated_fill_ids[:n], ns)
            return
        tokens = _ids(req.full_untruncated_fill_ids[:n])
        plan, item = None, None
        if self.lead:
            plan, item = self._plan_store(tokens, n, ns)
        plan = self._bcast(plan)
        if plan is None:
            return
        have, slots = plan
        self.stored_tokens += n - have
        # (TP: every rank writes its heads, then the lead publishes)
        store_rows(self.k, self.v, self.rk, self.rv, indices[have:n], slots, self.shard)
        self._barrier()
        if self.lead:
            self._publish(item)

    def _checkpoint_async(self, handle: Any, node: Any, src: Any, raw: Any, ns: dict) -> None:
        """A finished request's store, handed to the store thread once radixd's prefix is known (its lookup's hold,
        or a miss; else when the lookup started here lands): that thread converts the ids, takes slots, copies and
        publishes, and the scheduler only pins the source pages until the copy is over."""
        self.inc_lock_ref(node)  # SGLang must not reuse the source slots before the copy is over
        after = None
        if self.cuda:  # the copy follows everything queued on the scheduler's stream so far (the forward)
            after = torch.cuda.Event()
            after.record()
        job = _CopyJob(self, src, after)
        hold = self._collect(handle)
        self._sid += 1
        key = ("store", self._sid)
        if hold is not None:  # attach to what its lookup locked (the store thread checks that they agree; its copy
            del self._holds[handle]  # follows any load-back copy, as `after` does)
            self._unfetch(hold.fetch)
            self._loading.pop(handle, None)
            self._hand_over(key, raw, hold.prefix, hold.receipt, ns, job, node, hold.tokens)
        elif handle in self._missed or self._known_miss(raw, ns):  # radixd has none of it (when it was queued, or
            # now): every page goes (pages stored meanwhile by another engine are deduplicated)
            self._forget(handle)
            self._hand_over(key, raw, EMPTY, 0, ns, job, node)
        else:  # look radixd up first
            self._forget(handle)
            self.lookups.submit(key, raw, ns, load_back=False)  # (raw: a slice of the request's ids, converted there)
            self._plans.append(_Plan(self._sid, node, src, raw, ns, time.monotonic(), job))
        if not self.stepped:
            self._drain()

    def _hand_over(self, key: Any, tokens: Any, prefix: np.ndarray, receipt: int, ns: dict, job: _CopyJob, node: Any,
                   lookup: Optional[np.ndarray] = None) -> None:
        self.stores.store(key, tokens, prefix, receipt, ns, job, lookup=lookup)
        self._stores.append(_Store(job, node))

    def _copy_gpu(self, src: torch.Tensor, dst: np.ndarray, after: Any) -> None:
        """GPU, on the store thread: SGLang's KV at src into radixd's slots dst, on the side stream once the
        scheduler's stream reached `after`; returns once the copy is over."""
        dev = self.k[0].device
        with torch.cuda.device(dev):  # (the current device is per thread)
            if after is not None:
                self.stream.wait_event(after)
            with torch.cuda.stream(self.stream):  # (radixd's pool may be on another GPU than this rank's)
                store_rows(self.k, self.v, self.rk, self.rv, src, np.asarray(dst), self.shard)
            self.stream.synchronize()

    def _copy_slots(self, src: Any, dst: Any) -> None:
        """CPU: SGLang's KV at slots src into radixd's at dst, slot by slot (torch's index ops)."""
        src, dst = torch.as_tensor(src, dtype=torch.int64), torch.as_tensor(dst, dtype=torch.int64)
        for i in range(len(self.k)):
            self.rk[i].index_copy_(0, dst, self.k[i].index_select(0, src))
            self.rv[i].index_copy_(0, dst, self.v[i].index_select(0, src))

    def _copy_cpu(self, out: bool, src: np.ndarray, dst: np.ndarray) -> bool:
        """CPU, one rank: SGLang's pages at src into radixd's at dst (`out`), or radixd's into SGLang's; False (nothing
        copied) unless both are whole pages."""
        if self._rows is None:
            return False
        if self._native is not None:  # (the store thread's copy lets the scheduler run meanwhile)
            done = _copy_pages_native(self._native[out], np.asarray(src, dtype=np.int64),
                                      np.asarray(dst, dtype=np.int64), self.page_size, nogil=out)
            self.native_copies += done
            return done
        a, b = _pages(src, self.page_size), _pages(dst, self.page_size)
        if a is None or b is None:
            return False
        ours, theirs = self._rows
        _copy_pages(ours if out else theirs, a, theirs if out else ours, b)
        return True

    def _copy_planned(self, wait: bool) -> None:
        """Planned stores whose radixd lookup landed, handed to the store thread. With `wait`, waits for the lookups
        up to the deadline; a store past the deadline is dropped."""
        keep = []
        for p in self._plans:
            left = self.deadline - (time.monotonic() - p.asked)
            key = ("store", p.sid)
            res = self.lookups.take(key, max(left, 0.0) if wait else 0.0)
            if res is not None:
                self._hand_over(key, p.tokens, np.asarray(res[0], dtype=np.int64), res[1], p.ns, p.job, p.node)
            elif left > 0 and not wait:
                keep.append(p)
            else:
                self.lookups.drop(key)
                log.info("radixd store lookup took longer than %.0f ms: not stored", self.deadline * 1e3)
                self.dec_lock_ref(p.node)
        self._plans = keep

    def _plan_store(self, tokens: np.ndarray, n: int, ns: dict) -> tuple[Optional[tuple], Optional[dict]]:
        """Lead rank (TP): lock radixd's prefix and hold slots for the rest; ((have, slots), the publish item)."""
        m = None
        try:
            self.rpcs += 2
            m = self.client.match_prefix(tokens, lock=True, **ns)
            have = m.matched_len
            if have >= n:
                self._unlock(m.receipt_id)
                return None, None
            slots = np.array(self.client.alloc(n - have), dtype=np.int64)  # writable: torch takes it as is
        except RadixdError as e:
            log.warning("radixd store skipped: %s", e)
            if m is not None:
                self._unlock(m.receipt_id)
            return None, None
        item = dict(tokens=tokens, indices=np.concatenate([m.indices, slots]), prev_prefix_len=have,
                    receipt_id=m.receipt_id, **ns)
        return (have, slots), item

    # ------------------------------------------------------ eviction, release
    def evict(self, params: EvictParams) -> EvictResult:
        self._flush_loads()  # (no slot freed and reused with a copy into it still pending)
        self._drain(wait=self.token_to_kv_pool_allocator.available_size() < params.num_tokens)
        r = super().evict(params)
        if r.num_tokens_evicted < params.num_tokens and self._spare_tokens:  # the tree ran dry: the spare slots too
            r.num_tokens_evicted += self._reclaim(params.num_tokens - r.num_tokens_evicted)
        return r

    def check_hicache_events(self) -> None:
        self._drain()

    def end_step(self) -> None:
        """The scheduler processed a step's results (its finished requests checkpointed): their stores go to
        radixd in one round."""
        if self.asynchronous:
            self._drain()
            self.stores.flush()
            if self.prefetch_tokens:
                self._restock()

    def on_release(self, req, *, checkpointed: bool) -> None:
        super().on_release(req, checkpointed=checkpointed)
        self._drop_marker(req.cache_request_handle)
        self._forget(req.cache_request_handle)
        self._missed.pop(req.cache_request_handle, None)

    def release_aborted_request(self, handle) -> None:
        super().release_aborted_request(handle)
        self._drop_marker(handle)
        self._forget(handle)
        self._missed.pop(handle, None)


def hook_scheduler(scheduler: Any, cache: RadixdRadixCache) -> None:
    """Have the scheduler tell the cache of every request it queues, of every admission pass and of the end of
    every step's results (SGLang has no hook for a backend there): lookups start at queue time, a request whose
    lookup is still out waits in the queue while the engine runs others, and a step's stores go in one round."""
    add, results = scheduler._add_request_to_queue, scheduler.process_batch_result
    prefill = getattr(scheduler, "get_new_batch_prefill", None)

    def add_request_to_queue(req, *args: Any, **kwargs: Any):
        out = add(req, *args, **kwargs)
        cache.queued(req)
        return out

    def process_batch_result(*args: Any, **kwargs: Any):
        try:
            return results(*args, **kwargs)
        finally:
            cache.end_step()

    def get_new_batch_prefill(running_batch, *args: Any, **kwargs: Any):
        busy = not running_batch.is_empty() or getattr(scheduler, "chunked_req", None) is not None
        held = cache.admission(scheduler.waiting_queue, busy)
        try:
            if held is None:
                return prefill(running_batch, *args, **kwargs)
            scheduler.waiting_queue = held[0]
            try:
                return prefill(running_batch, *args, **kwargs)
            finally:  # (the pass reassigns the queue: the held requests go back at its end)
                scheduler.waiting_queue.extend(held[1])
        finally:
            cache.admitted()
    scheduler._add_request_to_queue = add_request_to_queue
    scheduler.process_batch_result = process_batch_result
    if prefill is not None:
        scheduler.get_new_batch_prefill = get_new_batch_prefill
    cache.stores.stepped = cache.stepped = True


def _building_scheduler() -> Any:
    """The SGLang Scheduler whose constructor is building this cache (found on the call stack), or None."""
    frame = sys._getframe(1)
    while frame is not None:
        obj = frame.f_locals.get("self")
        if type(obj).__name__ == "Scheduler" and callable(getattr(obj, "_add_request_to_queue", None)) \
                and callable(getattr(obj, "process_batch_result", None)):
            return obj
        frame = frame.f_back
    return None


def refuse_hybrid(ctx) -> None:
    """A hybrid model fails at engine start in one line: its SWA KV and Mamba states live in pools the radixd
    service does not serve yet, and a plain backend would cache the FULL layers' view of them as if complete."""
    kinds = [k for k, on in (("sliding-window attention layers", getattr(ctx, "is_hybrid_swa", False)),
                             ("Mamba / linear-attention state layers", getattr(ctx, "is_hybrid_ssm", False))) if on]
    if kinds:
        raise ValueError(f"--radix-cache-backend radixd: this model has {' and '.join(kinds)}; the radixd "
                         "backend serves full-attention models only (drop --radix-cache-backend radixd to use "
                         "SGLang's own hybrid cache)")


def factory(ctx) -> RadixdRadixCache:
    """`--radix-cache-backend radixd`: build the cache from SGLang's TreeCacheBuildContext."""
    refuse_hybrid(ctx)
    cache = RadixdRadixCache(ctx.params, tp_size=ctx.tp_size, tp_rank=ctx.tp_rank, tp_group=ctx.tp_group)
    scheduler = _building_scheduler()
    if scheduler is not None and cache.asynchronous:
        hook_scheduler(scheduler, cache)
    elif cache.asynchronous:
        log.info("radixd backend: not built by SGLang's Scheduler; lookups start at the first match")
    return cache
