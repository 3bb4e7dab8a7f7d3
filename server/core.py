"""The cache engine: tree + slot allocator + pools + sessions; executes what the tree decides.

Every public method validates its whole batch first and only then mutates, so an error changes nothing.
It is synchronous and owned by one event loop: no locks.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from .errors import BadRequest, Conflict, Denied, Exhausted, NotFound
from .pools.allocator import FREE, HELD, TREE, SlotAllocator, SlotError
from .pools.pool import KVPool
from .pressure import Pressure
from .sessions import Session, SessionTable
from .tiers import HostTier, LoadBack
from .tree import RadixTree
from .tree.errors import ForeignHandle, InvalidInput, LocksHeld, StaleHandle, UnknownReceipt

Namespace = tuple[str, str]


@dataclass
class Item:
    """One decoded insert / finished item."""

    tokens: np.ndarray  # int32
    indices: np.ndarray  # int64
    ns: Namespace
    prev_prefix_len: int = 0
    priority: int = 0
    receipt: int = 0
    mem_quota: Optional[int] = None
    swa_evicted_seqlen: int = 0  # hybrid models only (hybrid_core.py)
    mamba_value: Optional[int] = None


@dataclass
class InsertOutcome:
    prefix_len: int
    node_id: int
    freed_duplicates: int
    adopted: int
    backups: tuple[int, ...] = ()  # transfer ids of the backups this insert started
    mamba_exist: bool = False  # hybrid: the prefix kept its own state, the donated one was freed


def decode_tokens(raw: bytes, what: str = "tokens") -> np.ndarray:
    """Packed little-endian int32 token ids; negative ids are malformed."""
    if len(raw) % 4:
        raise BadRequest(f"{what}: {len(raw)} bytes is not a whole number of int32 tokens")
    arr = np.frombuffer(raw, dtype="<i4")
    if arr.size and int(arr.min()) < 0:
        raise BadRequest(f"{what}: token ids must be >= 0 (found {int(arr.min())})")
    return arr


def token_key(raw: bytes, item: int) -> bytes:
    """Request item `item`'s packed tokens themselves, refused as decode_tokens refuses them: the tree keys on
    these bytes, so a match builds no array (a negative little-endian int32 has its last byte's top bit set)."""
    if len(raw) % 4 or not raw[3::4].isascii():
        decode_tokens(raw, f"item {item} tokens")  # raises, naming the fault
    return raw


def decode_slots(raw: bytes, capacity: int, what: str = "indices") -> np.ndarray:
    """Packed little-endian int64 slot indices, each in [0, capacity)."""
    if len(raw) % 8:
        raise BadRequest(f"{what}: {len(raw)} bytes is not a whole number of int64 slot indices")
    arr = np.frombuffer(raw, dtype="<i8")
    if arr.size:
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi >= capacity:
            raise BadRequest(f"{what}: slot index {lo if lo < 0 else hi} outside [0, {capacity})")
    return arr


def _tree_error(e: Exception) -> Exception:
    if isinstance(e, (StaleHandle, UnknownReceipt)):
        return NotFound(str(e))
    if isinstance(e, (ForeignHandle, LocksHeld)):
        return Conflict(str(e))
    if isinstance(e, InvalidInput):
        return BadRequest(str(e))
    return e


class CacheCore:
    """Owns the tree, the device-slot allocator, the pools and the session table."""

    def __init__(self, tree: RadixTree, allocator: SlotAllocator, instance_id: str,
                 device_pools: Optional[list[KVPool]] = None, host_pool: Optional[KVPool] = None,
                 host_allocator: Optional[SlotAllocator] = None, max_batch_tokens: int = 1 << 24,
                 host: Optional[HostTier] = None):
        self.tree = tree
        self.host = host  # the host tier's executor; None when the tree is device-only
        self.alloc = allocator
        self.instance_id = instance_id
        self.device_pools = device_pools or []
        self.host_pool = host_pool
        self.host_alloc = host_allocator
        self.sessions = SessionTable()
        self.events = None  # the EventHub when KV events are on
        self.storage = None  # the L3 tier (server/storage) when --storage is given
        self.expired_receipts = 0  # released by --lock-lease-seconds
        self.storage_format = ""
        self.pressure = Pressure(instance_id, shared=False, grace=0)  # serve() puts up the shared one
        if host is not None:
            host.on_load_done = self._load_landed
            host.engine.listeners.append(self._transfer_landed)
        self.max_batch_tokens = max_batch_tokens

    # ------------------------------------------------------------ sessions
    def _load_landed(self, op: int, session_id: str, ok: bool, orphaned: bool) -> None:
        """A failed load-back's receipt never came to be: the session no longer owns it."""
        if not ok and not orphaned:
            s = self.sessions.find(session_id)
            if s is not None:
                self.sessions.take_receipt(s, op)

    def all_pools(self) -> list:
        """Every pool this core owns (closed at shutdown)."""
        return self.device_pools + ([self.host_pool] if self.host_pool else [])

    def attach_events(self, hub) -> None:
        self.events = hub

    def _transfer_landed(self, t) -> None:
        """Tell the session whose request the copy served, on its Attach stream; publish its events."""
        if self.events is not None:
            self.events.flush()
        s = self.sessions.find(t.owner) if t.owner else None
        if s is not None:
            s.events.put_nowait(t)

    def session(self, session_id: str) -> Session:
        return self.sessions.get(session_id)

    def attach(self, client_name: str) -> Session:
        return self.sessions.create(client_name)

    def end_session(self, s: Session) -> tuple[int, int]:
        """Release every receipt and held slot of a session; returns (receipts, slots) released."""
        receipts = list(s.receipts)
        for r in receipts:
            if self.tree.has_receipt(r):
                self.tree.unlock(r)
            elif self.host is not None and r in self.host.loads:
                self.host.orphan(r)  # the copy still writes its slots: released when it lands
        held = self.alloc.held_by(s.owner)
        self.alloc.move(held, HELD, FREE, s.owner, check=False)
        self.sessions.remove(s)
        return len(receipts), int(held.size)

    def expire_leases(self, lease: float) -> int:
        """Release receipts held longer than `lease` seconds (opt-in, for hung clients); tell their sessions."""
        n = 0
        for r, s in self.sessions.older_than(lease):
            if not self.tree.has_receipt(r):
                continue  # a load-back still in flight: its receipt is not the tree's yet
            self.sessions.expire(s, r)
            self.tree.unlock(r)
            s.events.put_nowait(("expired", r))
            n += 1
        self.expired_receipts += n
        return n

    # ---------------------------------------------------------- allocation
    def _make_room(self, pages: int) -> int:
        """Evict until `pages` are free; all or nothing up front (never evicts needlessly). Backed-up
        leaves are demoted (their device slots come back at once); write-back waits elsewhere."""
        short = pages - self.alloc.free_pages()
        if short <= 0:
            return 0
        p = self.alloc.page_size
        if short * p > self.tree.evictable_size:
            raise Exhausted(f"need {pages} free pages, {self.alloc.free_pages()} free and only "
                            f"{self.tree.evictable_size} evictable tokens")
        evicted = 0
        while self.alloc.free_pages() < pages:
            r = self.tree.evict((pages - self.alloc.free_pages()) * p)
            if not r.evicted_tokens:
                raise Exhausted(f"need {pages} free pages; eviction freed too little")
            self.alloc.move(r.freed.astype(np.int64), TREE, FREE, check=False)
            evicted += r.evicted_tokens
        return evicted

    def _pages_for_batch(self, sizes: list[int]) -> int:
        """The pages a batch of allocations needs; refused up front when the batch could never fit."""
        total = sum(sizes)
        if total > self.max_batch_tokens:
            raise BadRequest(f"batch asks for {total} tokens, more than the limit {self.max_batch_tokens}")
        pages = sum(self.alloc.pages_for(n) for n in sizes)
        if pages > self.alloc.capacity // self.alloc.page_size:
            raise Exhausted(f"batch needs {pages} pages, the pool has {self.alloc.capacity // self.alloc.page_size}")
        return pages

    async def alloc_slots(self, s: Session, sizes: list[int]) -> tuple[list[np.ndarray], int]:
        """Whole pages for each size, held by the session; evicts unlocked leaves when short (and, under
        write-back, waits for the write-backs that eviction needs)."""
        pages = self._pages_for_batch(sizes)

        async def attempt():
            self.sessions.get(s.session_id)  # (again after a wait: a session that ended meanwhile gets nothing)
            if self.host is not None:
                evicted = await self.host.make_device_room(pages)
                self.sessions.get(s.session_id)  # the session may have ended while we waited
            else:
                evicted = self._make_room(pages)
            return self.alloc.alloc_many(sizes, s.owner), evicted
        return await self.pressure.alloc(attempt, lambda: self._held_by_others(s))

    def _held_by_others(self, s: Session) -> int:
        """Device slots other sessions hold (stocks among them): what a short Alloc may ask back."""
        return self.alloc.counts[HELD] - int(self.alloc.held_by(s.owner).size)

    def free_slots(self, s: Session, slots: np.ndarray) -> int:
        self._check_held(s, slots)
        self.alloc.move(slots, HELD, FREE, s.owner, check=False)
        return int(slots.size)

    def _check_held(self, s: Session, slots: np.ndarray, what: str = "indices",
                    alloc: Optional[SlotAllocator] = None) -> None:
        """Every slot held by this session (in `alloc`, the device allocator by default), else PERMISSION_DENIED."""
        try:
            (alloc or self.alloc).validate(slots, HELD, s.owner)
        except SlotError as e:
            raise Denied(f"{what}: {e}") from None

    # -------------------------------------------------------------- insert
    def _chained(self, items: list[Item], i: int) -> int:
        """The earlier item of the same CacheUnfinished whose tokens and slots item i's prefix below prev_prefix_len
        is (a request's chunks published in one call: in its namespace, within what that item inserts), or -1. That
        item is inserted and locked before item i runs (an insert ignores the slots of its prefix), and item i takes
        over its lock."""
        it, n = items[i], items[i].prev_prefix_len
        if it.receipt or not n:
            return -1
        for j in range(i - 1, -1, -1):
            e = items[j]
            npos = max(len(e.tokens) - 1, 0) if self.tree.bigram else len(e.tokens)
            if e.ns == it.ns and npos - npos % self.tree.page_size >= n and len(e.indices) >= n and \
                    e.tokens[:n].tobytes() == it.tokens[:n].tobytes() and np.array_equal(e.indices[:n], it.indices[:n]):
                return j
        return -1

    def _validate_items(self, s: Session, items: list[Item], chains: bool = False) -> None:
        """Every item well-formed and its slots the session's; with `chains` (CacheUnfinished) an item without a
        receipt may extend an earlier item of the call (`_chained`)."""
        claimed: list[np.ndarray] = []
        for i, it in enumerate(items):
            n = len(it.tokens)
            npos = max(n - 1, 0) if self.tree.bigram else n  # bigram keys are token pairs
            page = self.tree.page_size
            whole = -(-npos // page) * page  # Alloc hands out whole pages: the last one may come along whole
            if not (len(it.indices) in (n, npos) or npos < len(it.indices) <= whole):
                raise BadRequest(f"item {i}: {len(it.indices)} indices for {n} tokens (at most {whole}: "
                                 "the tokens' pages)")
            aligned = npos - npos % self.tree.page_size
            if not 0 <= it.prev_prefix_len <= aligned:
                raise BadRequest(f"item {i}: prev_prefix_len {it.prev_prefix_len} outside [0, {aligned}]")
            if it.prev_prefix_len and not (chains and self._chained(items, i) >= 0):
                try:
                    cached = self.tree.cached_prefix_len(it.tokens, it.ns)
                except InvalidInput as e:
                    raise BadRequest(f"item {i}: {e}") from None
                if cached < it.prev_prefix_len:
                    raise BadRequest(f"item {i}: prev_prefix_len {it.prev_prefix_len} exceeds the cached prefix "
                                     f"({cached} tokens)")
                try:
                    self.alloc.validate(it.indices[:it.prev_prefix_len], TREE)
                except SlotError as e:
                    raise Denied(f"item {i}: indices below prev_prefix_len must be the tree's own slots: {e}") from None
            claimed.append(it.indices[it.prev_prefix_len:])
        if claimed:
            self._check_held(s, np.concatenate(claimed), "indices beyond prev_prefix_len")

    def _insert_one(self, s: Session, it: Item, chunked: bool = False) -> tuple[InsertOutcome, np.ndarray]:
        keyed = it.indices[:len(it.tokens)]  # beyond: the rest of the last page (the tail with the others)
        r = self.tree.insert(it.tokens, keyed, it.ns, it.prev_prefix_len, it.priority, chunked=chunked)
        if r.duplicates.size:
            self.alloc.move(r.duplicates.astype(np.int64), HELD, FREE, s.owner, check=False)
        if r.adopted_len:
            adopted = it.indices[r.prefix_len:r.prefix_len + r.adopted_len]
            self.alloc.move(adopted, HELD, TREE, s.owner, check=False)
        started = ()
        if r.backups:  # write-through: copies start now, the tree is told when each lands
            started = tuple(t.id for t in self.host.run_backups(r.backups))
        tail = it.indices[r.prefix_len + r.adopted_len:]
        return InsertOutcome(r.prefix_len, r.node_id, int(r.duplicates.size), r.adopted_len, started), tail

    def insert(self, s: Session, items: list[Item]) -> list[InsertOutcome]:
        """Adopt held slots into the tree; duplicates are freed; the unaligned tail stays held."""
        self._validate_items(s, items)
        return [self._insert_one(s, it)[0] for it in items]

    def cache_finished(self, s: Session, items: list[Item]) -> list[InsertOutcome]:
        """Insert, free the tail and release the old receipt: a finished request leaves nothing held."""
        self._validate_items(s, items)
        self._check_receipts(s, [it.receipt for it in items if it.receipt])
        out = []
        for it in items:
            res, tail = self._insert_one(s, it)
            self._free_tail(s, tail)
            if it.receipt:
                self._release(s, it.receipt)
            out.append(res)
        return out

    def cache_unfinished(self, s: Session, items: list[Item]):
        """Chunked prefill: insert, release the old receipt, re-match and re-lock, item by item. An item may extend
        an earlier one of the call (a request's next chunk, without a receipt): it takes over that item's lock, whose
        receipt comes back as 0."""
        self._validate_items(s, items, chains=True)
        self._check_receipts(s, [it.receipt for it in items if it.receipt])
        self._reserve_unfinished(items)
        out = []
        for i, it in enumerate(items):
            res, _ = self._insert_one(s, it, chunked=True)
            if it.receipt:
                self._release(s, it.receipt)
            m, receipt = self._relock(it)
            self.sessions.add_receipt(s, receipt)
            j = self._chained(items, i)
            if j >= 0 and out[j][2]:  # (its lock protected this item's prefix until now)
                self._release(s, out[j][2])
                out[j] = (out[j][0], out[j][1], 0)
            out.append((res, m, receipt))
        return out

    def _reserve_unfinished(self, items: list[Item]) -> None:
        """Make room for whatever the batch will allocate, before any item is applied (a plain model: nothing)."""

    def _free_tail(self, s: Session, tail: np.ndarray) -> None:
        """A finished request's slots beyond its last whole page go back to the pool."""
        if tail.size:
            self.alloc.move(tail, HELD, FREE, s.owner, check=False)

    def _relock(self, it: Item):
        """A checkpointed request's new prefix, matched and locked."""
        m = self.tree.match_prefix(it.tokens, it.ns)
        return m, self.tree.lock(m.best_node_id)

    # --------------------------------------------------------- match / lock
    def match(self, s: Optional[Session], items: list[tuple[np.ndarray, Namespace, bool]]):
        """Match (and atomically lock) each key; returns (MatchResult, receipt) per item."""
        if s is None and any(lock for _, _, lock in items):
            raise NotFound("lock=true needs a session (attach first)")
        out = []
        for tokens, ns, lock in items:
            try:
                m = self.tree.match_prefix(tokens, ns)
            except InvalidInput as e:
                raise BadRequest(str(e)) from None
            receipt = 0
            if lock:  # protects the device prefix and the host extension, so a load-back finds both
                receipt = self.tree.lock(m.best_node_id)
                self.sessions.add_receipt(s, receipt)
            out.append((m, receipt))
        return out

    async def match_storage(self, s: Optional[Session], items: list[tuple[np.ndarray, Namespace, bool]]):
        """Match with L3: start prefetches beyond each cached prefix, wait as the policy says, then match
        (and lock) for real; returns (MatchResult, receipt, prefetch_len) per item."""
        st = self.storage
        ops = []
        if st.prefetch_policy != "best_effort":
            for tokens, ns, _ in items:
                try:
                    m = self.tree.match_prefix(tokens, ns)
                except InvalidInput as e:
                    raise BadRequest(str(e)) from None
                ops.append(st.maybe_prefetch(ns, tokens, m.matched_len, m.host_hit_len, m.best_node_id))
            await st.wait([op for op in ops if op is not None])
            if s is not None:
                self.sessions.get(s.session_id)  # the session may have ended while we waited
        out = []
        for i, (m, r) in enumerate(self.match(s, items)):
            op = ops[i] if ops else None
            if op is None or op.done.is_set():
                tokens, ns, _ = items[i]
                op = st.maybe_prefetch(ns, tokens, m.matched_len, m.host_hit_len, m.best_node_id)
            out.append((m, r, op.length if op is not None and not op.done.is_set() else 0))
        return out

    async def prefetch(self, items: list[tuple[np.ndarray, Namespace]], wait: bool) -> list[tuple[int, int]]:
        """Start L3 fetches for queued requests; with wait, hold until done (policy-bounded)."""
        if self.storage is None:
            return [(0, 0)] * len(items)
        ops = []
        for tokens, ns in items:
            try:
                m = self.tree.match_prefix(tokens, ns)
            except InvalidInput as e:
                raise BadRequest(str(e)) from None
            ops.append(self.storage.maybe_prefetch(ns, tokens, m.matched_len, m.host_hit_len, m.best_node_id))
        if wait:
            policy = self.storage.prefetch_policy
            await self.storage.wait([op for op in ops if op is not None],
                                    "wait_complete" if policy == "best_effort" else policy)
        out = []
        for (tokens, ns), op in zip(items, ops):
            length = op.length if op is not None else 0
            cached = 0
            if wait:
                m = self.tree.match_prefix(tokens, ns)
                cached = m.matched_len + m.host_hit_len
            out.append((length, cached))
        return out

    def lock(self, s: Session, node_ids: list[int]) -> list[int]:
        for nid in node_ids:
            try:
                self.tree._node(nid)
            except (StaleHandle, ForeignHandle) as e:
                raise _tree_error(e) from None
        receipts = []
        for nid in node_ids:
            r = self.tree.lock(nid)
            self.sessions.add_receipt(s, r)
            receipts.append(r)
        return receipts

    def _check_receipts(self, s: Session, receipts: list[int]) -> None:
        if len(set(receipts)) != len(receipts):
            raise BadRequest("a receipt appears twice in one request")
        for r in receipts:
            self.sessions.take_receipt(s, r, check_only=True)
            if self.tree.is_loading(r):
                raise Conflict(f"receipt {r:#x} belongs to a load-back still in flight (WaitTransfers first)")

    def _release(self, s: Session, receipt: int) -> None:
        self.sessions.take_receipt(s, receipt)
        self.tree.unlock(receipt)

    def unlock(self, s: Session, receipts: list[int]) -> None:
        self._check_receipts(s, receipts)
        for r in receipts:
            self._release(s, r)

    # ------------------------------------------------------------- load-back
    async def load_back(self, s: Session, items: list[Item]) -> list[LoadBack]:
        """Bring each receipt's host segment back to device; the new receipt replaces the old one."""
        for i, it in enumerate(items):
            if it.mem_quota is not None and it.mem_quota < 0:
                raise BadRequest(f"item {i}: mem_quota {it.mem_quota} is negative")
        self._check_receipts(s, [it.receipt for it in items])
        if self.host is None:
            raise Conflict("the host tier is off (start the server with --host-slots, --host-mem or --host-ratio)")
        out = []
        for it in items:
            if it.receipt not in s.receipts:
                raise NotFound(f"receipt {it.receipt:#x} was released while this batch waited")
            lb = await self.host.load_back(s.session_id, self.tree.receipt_anchor(it.receipt), it.mem_quota)
            if not self.sessions.alive(s):
                if lb.receipt:
                    self.host.orphan(lb.receipt)
                raise NotFound("the session ended during the load-back")
            if lb.receipt:
                self.sessions.add_receipt(s, lb.receipt)
                self._release(s, it.receipt)
            else:  # refused or nothing to load: the device prefix, the same receipt
                prefix = self.tree.resident_prefix(self.tree.receipt_anchor(it.receipt))
                lb = LoadBack(prefix.astype(np.int64), 0, it.receipt, None, lb.reason)
            out.append(lb)
        return out

    # ----------------------------------------------------------- whole cache
    async def evict(self, num_tokens: int, host_tokens: int = 0) -> tuple[int, int]:
        """Evict device tokens (waiting for write-backs) and host tokens; returns both counts."""
        if self.host is not None and self.tree.write_back and num_tokens:
            target = self.alloc.free_pages() + self.alloc.pages_for(num_tokens)
            dev = await self.host.make_device_room(target, partial=True)  # what it can, like write-through
        else:
            r = self.tree.evict(num_tokens)
            self.alloc.move(r.freed.astype(np.int64), TREE, FREE, check=False)
            dev = r.evicted_tokens
        host = self.host.evict_host(host_tokens) if self.host is not None and host_tokens else 0
        return dev, host

    def reset(self) -> int:
        if self.host is not None and (self.host.loads or self.host.backups):
            raise Conflict("cannot reset: transfers are in flight")
        if self.storage is not None and self.storage.busy:
            raise Conflict("cannot reset: L3 prefetches or writes are in flight")
        try:
            freed = self.tree.reset()
        except LocksHeld as e:
            raise Conflict(f"cannot reset: {e}") from None
        self.alloc.move(freed.device.astype(np.int64), TREE, FREE, check=False)
        if self.host is not None:
            self.host._free(self.host_alloc, freed.host)
        return int(freed.device.size)

    def stats(self) -> dict[str, int]:
        c = self.alloc.counts
        t = self.tree
        out = dict(
            capacity_tokens=self.alloc.capacity, free_tokens=c[FREE], cached_tokens=t.cached_tokens,
            evictable_tokens=t.evictable_size, protected_tokens=t.protected_size, held_tokens=c[HELD],
            in_flight_tokens=c[3], num_nodes=t.num_nodes, sessions=len(self.sessions),
            hit_tokens_total=t.counters.hit_tokens, queried_tokens_total=t.counters.queried_tokens,
            evicted_tokens_total=t.counters.evicted_tokens_device, receipts=t.num_receipts,
            host_capacity_tokens=self.host_alloc.capacity if self.host_alloc else 0,
            host_free_tokens=self.host_alloc.counts[FREE] if self.host_alloc else 0,
            host_cached_tokens=t.host_cached_tokens, host_evictable_tokens=t.host_evictable_size,
            host_protected_tokens=t.host_protected_size,
            host_in_flight_tokens=self.host_alloc.counts[3] if self.host_alloc else 0,
            host_hit_tokens_total=t.counters.host_hit_tokens, backup_tokens_total=t.counters.backup_tokens,
            load_back_tokens_total=t.counters.load_back_tokens,
            host_evicted_tokens_total=t.counters.evicted_tokens_host,
            transfers_in_flight=len(self.host.engine.active) if self.host else 0,
            transfer_failures_total=self.host.failed_transfers if self.host else 0,
        )
        if self.storage is not None:
            out.update(self.storage.stats())
        return out

    def check(self) -> list[str]:
        """Tree checker + slot conservation + cross-structure agreement, all from scratch."""
        bad = [f"tree: {v}" for v in self.tree.check()]
        bad += [f"allocator: {v}" for v in self.alloc.check()]
        c = self.alloc.counts
        if c[TREE] != self.tree.cached_tokens:
            bad.append(f"allocator has {c[TREE]} tree-owned slots, the tree caches {self.tree.cached_tokens} tokens")
        owned = self.tree.all_device_values().astype(np.int64)
        if owned.size and (self.alloc.state[owned] != TREE).any():
            bad.append("a slot the tree owns is not in the allocator's tree state")
        if self.tree.cached_tokens != self.tree.evictable_size + self.tree.protected_size:
            bad.append("cached != evictable + protected")
        held_owners = set(np.unique(self.alloc.owner[self.alloc.state == HELD]).tolist())
        live = {s.owner for s in self.sessions}
        if held_owners - live:
            bad.append(f"slots held by ended sessions {sorted(held_owners - live)}")
        loading = 0
        if self.host is not None:
            bad += self.host.check()
            loading = sum(1 for lo in self.host.loads.values() if not lo.orphaned)
        if self.storage is not None:
            loading -= len(self.storage.prefetches)  # each prefetch holds the server's own anchor lock
        if self.sessions.receipt_count != self.tree.num_receipts + loading:
            bad.append(f"sessions own {self.sessions.receipt_count} receipts, the tree has {self.tree.num_receipts} "
                       f"and {loading} load-backs are in flight")

        if sum(c) != self.alloc.capacity:
            bad.append("free + tree + held + in_flight != capacity")
        return bad
