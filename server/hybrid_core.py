"""The cache engine for a hybrid model: the hybrid tree over three pools (FULL KV, SWA KV, recurrent states).

Same contract as `CacheCore` (every batch is validated whole before anything changes; one event loop, no
locks), plus what the components need: FULL slots come with their SWA twins (radixd's translation, so a worker
addresses both pools from the FULL slots), a request holds state slots, a match can copy the tree's state into
the request's own slot (copy-on-write: the tree's state is never written), and every free the tree returns is
executed per pool. Namespaces (extra_key / cache_salt) are the tree's separate roots. With a host tier
(`hybrid_tiers.HybridHostTier`), what the device evicts is copied down first and a match loads a longer host
prefix back before it answers.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from .core import CacheCore, InsertOutcome, Item
from .hybrid_tiers import TRANSIT, HybridHostTier, HybridShelf
from .errors import BadRequest, Conflict, Exhausted
from .pools.allocator import FREE, HELD, TREE, SlotAllocator
from .pools.hybrid import SwaTranslation
from .sessions import Session
from .tree.components import MAMBA, SWA
from .tree.errors import InvalidInput
from .tree.hybrid import HybridMatch, HybridTree

_NONE = -1


class HybridCore(HybridShelf, CacheCore):
    """A CacheCore whose tree is a HybridTree; `swa` translates FULL slots to the SWA pool, `states` allocates
    the state pool."""

    hybrid = True

    def __init__(self, tree: HybridTree, allocator: SlotAllocator, instance_id: str, device_pools: list,
                 swa: Optional[SwaTranslation] = None, swa_pool=None, states: Optional[SlotAllocator] = None,
                 state_pool=None, layout=None, max_batch_tokens: int = 1 << 24,
                 host_tier: Optional[HybridHostTier] = None):
        CacheCore.__init__(self, tree, allocator, instance_id, device_pools, max_batch_tokens=max_batch_tokens)
        self.swa, self.swa_pool = swa, swa_pool
        self.states, self.state_pool = states, state_pool
        self.layout = layout
        self.host_tier = host_tier

    def all_pools(self) -> list:
        own = self.device_pools + [p for p in (self.swa_pool, self.state_pool) if p is not None]
        return own + (self.host_tier.pools() if self.host_tier is not None else [])

    def take_records(self) -> tuple[list, int]:
        """The event hub's feed with a host tier: the device tree's events (GPU), then the host tree's (CPU)."""
        return self.tree.take_events() + self.host_tier.tree.take_events(), 0

    def snapshot_records(self) -> list:
        """Both trees' snapshots, in the order their events are fed."""
        return self.tree.snapshot_records() + self.host_tier.tree.snapshot_records()

    def _evict(self, full: int = 0, swa: int = 0, mamba: int = 0):
        """Evict on the device; with a host tier, what goes is copied down before its slots are freed."""
        r = self.tree.evict(full, swa, mamba)
        if r.victims and self.host_tier is not None:
            self.host_tier.demote(r.victims, self)
        self._apply(r.frees)
        return r

    # ---------------------------------------------------------------- sessions
    def end_session(self, s: Session) -> tuple[int, int]:
        receipts = list(s.receipts)
        for r in receipts:
            if self.tree.has_receipt(r):
                self.tree.unlock(r)
        held = self.alloc.held_by(s.owner)
        self._free_full(held)
        if self.states is not None:
            self.states.move(self.states.held_by(s.owner), HELD, FREE, check=False)
        self.sessions.remove(s)
        return len(receipts), int(held.size)

    # -------------------------------------------------------------- allocation
    async def alloc_slots(self, s: Session, sizes: list[int], states: int = 0):
        """Whole FULL pages per size, each with its SWA twins, and `states` state slots; all held by the
        session. Returns (FULL slots per size, their SWA slots, state slots, (evicted FULL, SWA, states))."""
        if states and self.states is None:
            raise BadRequest("mamba_states: this model has no state layers")
        pages = self._pages_for_batch(sizes)
        if self.swa is not None and pages * self.alloc.page_size > self.swa.swa_capacity:
            raise Exhausted(f"batch needs {pages * self.alloc.page_size} SWA slots, the SWA pool has "
                            f"{self.swa.swa_capacity}")
        if states > self.states_capacity:
            raise Exhausted(f"batch needs {states} state slots, the state pool has {self.states_capacity}")

        async def attempt():
            self.sessions.get(s.session_id)  # (again after a wait: a session that ended meanwhile gets nothing)
            evicted = self._room(pages, pages if self.swa is not None else 0, states)
            full = self.alloc.alloc_many(sizes, s.owner)
            twins = [self.swa.assign(a) for a in full] if self.swa is not None else []
            held = self.states.alloc(states, s.owner) if states else np.zeros(0, np.int64)
            return full, twins, held, evicted
        return await self.pressure.alloc(attempt, lambda: self._held_by_others(s))

    def _held_by_others(self, s: Session) -> int:
        """FULL and state slots other sessions hold: what a short Alloc may ask back."""
        n = super()._held_by_others(s)
        if self.states is not None:
            n += self.states.counts[HELD] - int(self.states.held_by(s.owner).size)
        return n

    @property
    def states_capacity(self) -> int:
        return self.states.capacity if self.states is not None else 0

    def free_slots(self, s: Session, slots: np.ndarray, states: Optional[np.ndarray] = None,
                   swa_only: bool = False) -> tuple[int, int]:
        """Held FULL slots (with their twins), or with swa_only only their SWA twins; and held state slots."""
        self._check_held(s, slots)
        if swa_only and self.swa is None:
            raise BadRequest("swa_only: this model has no sliding-window layers")
        if states is not None and states.size:
            if self.states is None:
                raise BadRequest("states: this model has no state layers")
            self._check_states(s, states)
        if swa_only:
            freed = self.swa.release(slots)
        else:
            self._free_full(slots)
            freed = int(slots.size)
        n = 0
        if states is not None and states.size:
            self.states.move(states, HELD, FREE, s.owner, check=False)
            n = int(states.size)
        return freed, n

    def _check_states(self, s: Session, states: np.ndarray, what: str = "states") -> None:
        self._check_held(s, states, what, self.states)

    # ------------------------------------------------------------------ insert
    def _validate_items(self, s: Session, items: list[Item], chains: bool = False) -> None:
        super()._validate_items(s, items, chains)
        page = self.alloc.page_size
        donated = []
        for i, it in enumerate(items):
            n = len(it.tokens) - len(it.tokens) % page
            if it.swa_evicted_seqlen:
                if self.swa is None:
                    raise BadRequest(f"item {i}: swa_evicted_seqlen {it.swa_evicted_seqlen}, but this model has "
                                     "no sliding-window layers")
                if it.swa_evicted_seqlen % page or it.swa_evicted_seqlen > n:
                    raise BadRequest(f"item {i}: swa_evicted_seqlen {it.swa_evicted_seqlen} is not a page-aligned "
                                     f"length within the item's {n} page-aligned tokens")
            if self.swa is not None:  # what the tree will say has SWA KV must have it
                lo = max(it.prev_prefix_len, it.swa_evicted_seqlen)
                if n > lo and (self.swa.map[it.indices[lo:n:page] // page] == _NONE).any():  # one slot a page
                    raise BadRequest(f"item {i}: positions from {lo} on lost their SWA twins (Free swa_only) but "
                                     f"swa_evicted_seqlen is {it.swa_evicted_seqlen}: raise it to cover them")
            if self.states is None:
                if it.mamba_value is not None:
                    raise BadRequest(f"item {i}: mamba_value given, but this model has no state layers")
                continue
            if it.mamba_value is None:
                raise BadRequest(f"item {i}: this model has state layers: every insert donates a state "
                                 "(mamba_value)")
            donated.append(it.mamba_value)
        if donated:
            arr = np.asarray(donated, dtype=np.int64)
            if len(np.unique(arr)) != arr.size:
                raise BadRequest("mamba_value: a state slot is donated twice in one request")
            if int(arr.min()) < 0 or int(arr.max()) >= self.states.capacity:
                raise BadRequest(f"mamba_value: state slot outside [0, {self.states.capacity})")
            self._check_states(s, arr, "mamba_value")

    def _insert_one(self, s: Session, it: Item, chunked: bool = False) -> tuple[InsertOutcome, np.ndarray]:
        page = self.alloc.page_size
        n = len(it.tokens) - len(it.tokens) % page
        keyed = it.indices[:n]
        if self.swa is not None and it.swa_evicted_seqlen > it.prev_prefix_len:
            self.swa.release(keyed[it.prev_prefix_len:it.swa_evicted_seqlen])  # twins the request still had
        donated = -1
        if it.mamba_value is not None:
            donated = it.mamba_value
            if chunked:  # the request keeps running on its own state: the tree gets a copy (a fork)
                self._room(0, 0, 1)
                fork = self.states.alloc(1, s.owner)
                self.state_pool.copy(np.array([donated]), fork)
                donated = int(fork[0])
        r = self.tree.insert(it.tokens[:n], keyed, prev_prefix_len=it.prev_prefix_len, namespace=it.ns,
                             swa_evicted_seqlen=it.swa_evicted_seqlen, mamba_value=donated, count_hit=not chunked)
        freed = r.frees.full_slots()
        self._apply(r.frees)
        fresh = keyed[it.prev_prefix_len:]
        fresh = fresh[self.alloc.state[fresh] == HELD]  # what the tree did not free (freed slots are FREE now)
        self.alloc.move(fresh, HELD, TREE, s.owner, check=False)
        if donated >= 0:
            d = np.array([donated], dtype=np.int64)
            if r.mamba_exist:
                self.states.move(d, HELD, FREE, s.owner, check=False)
            else:
                self.states.move(d, HELD, TREE, s.owner, check=False)
        if r.backup_len and self.host_tier is not None:  # (write_through: every prefix; selective: a hot one)
            self.host_tier.back_up(it.tokens[:r.backup_len], it.ns, self)
        out = InsertOutcome(r.prefix_len, r.node_id, int(freed.size), int(fresh.size))
        out.mamba_exist = r.mamba_exist
        return out, it.indices[n:]

    def _reserve_unfinished(self, items: list[Item]) -> None:
        """Every donated state is forked into the tree: room for all the forks up front, so a shortage refuses
        the whole batch instead of leaving its first items applied."""
        forks = sum(1 for it in items if it.mamba_value is not None)
        if forks:
            self._room(0, 0, forks)

    def _free_tail(self, s: Session, tail: np.ndarray) -> None:
        self._free_full(tail)

    def _relock(self, it: Item):
        m = self.tree.match_prefix(it.tokens, it.ns)
        return m, self.tree.lock(m.node_id)

    # ------------------------------------------------------------ match / lock
    def match_hybrid(self, s: Optional[Session], items: list[tuple]) -> list[tuple[HybridMatch, int, int]]:
        """Match (lock, and copy the state into a slot of the request's own) per item: (tokens, ns, lock,
        mamba_cow, skip_mamba). Returns (match, receipt, the request's state slot or -1)."""
        for i, (tokens, ns, lock, cow, _) in enumerate(items):
            if (lock or cow) and s is None:
                raise BadRequest("lock and mamba_cow need a session (attach first)")
            if cow and self.states is None:
                raise BadRequest(f"item {i}: mamba_cow, but this model has no state layers")
        if self.host_tier is not None:  # a longer host prefix comes back first, so the match below finds it
            for tokens, ns, *_ in items:
                try:
                    self.host_tier.load(tokens, ns, self)
                except InvalidInput as e:
                    raise BadRequest(str(e)) from None
        cows = sum(1 for it in items if it[3])
        if cows:
            if cows > self.states.capacity:
                raise Exhausted(f"{cows} state slots asked for, the state pool has {self.states.capacity}")
            self._room(0, 0, cows)  # before matching: eviction must not take a state this batch matches
        out = []
        for tokens, ns, lock, cow, skip in items:
            try:
                m = self.tree.match_prefix(tokens, ns)
            except InvalidInput as e:
                raise BadRequest(str(e)) from None
            receipt = 0
            if lock:
                receipt = self.tree.lock(m.node_id, skip_mamba=skip)
                self.sessions.add_receipt(s, receipt)
            slot = -1
            if cow:
                own = self.states.alloc(1, s.owner)
                if m.mamba_src >= 0:
                    self.state_pool.copy(np.array([m.mamba_src]), own)
                slot = int(own[0])
            out.append((m, receipt, slot))
        return out

    def match(self, s, items):
        return [(m, r) for m, r, _ in self.match_hybrid(s, [(t, ns, lock, False, False) for t, ns, lock in items])]

    def swa_twins(self, full_slots: np.ndarray) -> np.ndarray:
        """The SWA pool slots of these FULL slots (-1 where SWA keeps nothing); empty without SWA."""
        if self.swa is None:
            return np.zeros(0, np.int64)
        return self.swa.translate(full_slots)

    def _check_receipts(self, s: Session, receipts: list[int]) -> None:
        if len(set(receipts)) != len(receipts):
            raise BadRequest("a receipt appears twice in one request")
        for r in receipts:
            self.sessions.take_receipt(s, r, check_only=True)

    def unlock(self, s: Session, receipts: list[int], swa_only: bool = False) -> None:
        self._check_receipts(s, receipts)
        if not swa_only:
            for r in receipts:
                self._release(s, r)
            return
        if self.swa is None:
            raise BadRequest("swa_only: this model has no sliding-window layers")
        for r in receipts:
            if self.tree.swa_released(r):
                raise Conflict(f"receipt {r:#x} already released its SWA window")
        for r in receipts:
            self._apply(self.tree.release_swa(r))

    async def load_back(self, s: Session, items: list[Item]):
        raise Conflict("a hybrid model loads its host prefix back inside MatchPrefix: there is no separate "
                       "LoadBack" if self.host_tier is not None else "the host tier is off (start the server with "
                       "--host-slots, --host-mem or --host-ratio)")

    # ------------------------------------------------------------ whole cache
    async def evict(self, num_tokens: int, host_tokens: int = 0, swa_tokens: int = 0,
                    mamba_states: int = 0) -> tuple[int, int, int, int]:
        if host_tokens and self.host_tier is None:
            raise Conflict("the host tier is off: host_tokens must be 0")
        if swa_tokens and self.swa is None:
            raise BadRequest("swa_tokens: this model has no sliding-window layers")
        if mamba_states and self.states is None:
            raise BadRequest("mamba_states: this model has no state layers")
        r = self._evict(num_tokens, swa_tokens, mamba_states)
        host = self.host_tier.evict(host_tokens) if host_tokens else 0
        return r.full, host, r.swa, r.mamba

    def reset(self) -> int:
        from .tree.errors import LocksHeld
        try:
            held = self.tree.reset()
        except LocksHeld as e:
            raise Conflict(f"cannot reset: {e}") from None
        full = held[self.tree.FULL]
        self._free_full(full)
        if self.states is not None and held[MAMBA].size:
            self.states.move(held[MAMBA], TREE, FREE, check=False)
        if self.host_tier is not None:
            self.host_tier.reset()
        return int(full.size)

    def stats(self) -> dict[str, int]:
        out = super().stats()
        t = self.tree
        if self.swa is not None:
            held = self._held_pages_with_twins()
            out.update(swa_capacity_tokens=self.swa.swa_capacity, swa_free_tokens=self.swa.free_slots,
                       swa_held_tokens=held * self.alloc.page_size, swa_evictable_tokens=t.evictable[SWA],
                       swa_protected_tokens=t.protected[SWA])
        if self.states is not None:
            c = self.states.counts
            out.update(mamba_capacity=self.states.capacity, mamba_free=c[FREE], mamba_held=c[HELD],
                       mamba_evictable=t.evictable[MAMBA], mamba_protected=t.protected[MAMBA])
        if self.host_tier is not None:
            out.update(self.host_tier.stats())
        return out

    def _held_pages_with_twins(self) -> int:
        p = self.alloc.page_size
        mapped = np.flatnonzero(self.swa.map != _NONE)
        return int((self.alloc.state[mapped * p] == HELD).sum())

    def check(self) -> list[str]:
        """The hybrid tree's checker, then conservation per pool and agreement between the tree and the pools."""
        bad = self.check_pools("device")
        held = self.tree.held()
        p = self.alloc.page_size
        if self.swa is not None:
            bad += [f"swa: {v}" for v in self.swa.check()]
            tree_pages = np.unique(held[SWA] // p)
            if tree_pages.size and (self.swa.map[tree_pages] == _NONE).any():
                bad.append("a page the tree holds SWA KV for has no SWA page")
            mapped = np.flatnonzero(self.swa.map != _NONE)
            stray = np.setdiff1d(mapped, tree_pages)
            if stray.size and (self.alloc.state[stray * p] != HELD).any():
                bad.append("an SWA page is mapped from a FULL page neither the tree (with SWA) nor a session holds")
            if (self.swa.free_slots + tree_pages.size * p + stray.size * p) != self.swa.swa_capacity:
                bad.append("SWA free + tree + held != capacity")
        owners = set(np.unique(self.alloc.owner[self.alloc.state == HELD]).tolist())
        if self.states is not None:
            owners |= set(np.unique(self.states.owner[self.states.state == HELD]).tolist())
        live = {s.owner for s in self.sessions}
        if owners - live:
            bad.append(f"slots held by ended sessions {sorted(owners - live)}")
        if self.sessions.receipt_count != self.tree.num_receipts:
            bad.append(f"sessions own {self.sessions.receipt_count} receipts, the tree has {self.tree.num_receipts}")
        if sum(self.alloc.counts) != self.alloc.capacity:
            bad.append("free + tree + held + in_flight != capacity")
        if self.host_tier is not None:
            bad += self.host_tier.check()
            transit = (self.alloc.owner == TRANSIT).any()
            if transit or (self.states is not None and (self.states.owner == TRANSIT).any()):
                bad.append("device slots left in transit by a load-back")
        return bad
