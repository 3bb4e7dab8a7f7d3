"""The tiers of a hybrid model's cache: what each tier's pools execute, and the host tier below the device one.

A tier (`HybridShelf`) is a hybrid tree over its own three slot spaces: FULL KV, the SWA twins of FULL pages
(radixd's translation) and recurrent states. The device tier is the `HybridCore`; the host tier is a second
hybrid tree over shared-memory pools of the same geometry, used as a victim cache:

  * demote (SPEC R5.10 backup, R5.14): a D-leaf the device evicts is copied to the host first: the FULL KV of
    what the host lacks of its prefix, the SWA KV of the run that ends at the leaf (one page-rounded window at
    most, all a load-back restores) and the leaf's state; the host tree takes it with the same insert rules
    (`swa_evicted_seqlen` below the run, `mamba_value` the copied state), so the host matches exactly where
    the copy can serve;
  * write-through (`--write-policy write_through`): every prefix the device tree takes is copied down the same
    way at once, so a later device eviction finds the host already holding it; `write_through_selective` copies
    a prefix once inserts have walked it `--write-through-threshold` times (2 by default: a shared prefix), the
    device tree counting (SPEC R1.3);
  * load back (R5.10): a match whose host prefix is longer than its device prefix copies the difference back
    (FULL KV, the SWA KV of the last window only, the state at the host match end) and inserts it into the
    device tree, inside the same MatchPrefix: hybrid clients see a deeper device hit and nothing else. The
    host match is locked while the device makes room, so the demotions that room causes cannot evict it.

Copies are synchronous (page copies on the CPU, one stream synchronize on a GPU): a hybrid tier has no
transfers in flight, so slot conservation is free + tree + held on every pool of every tier.
"""
from __future__ import annotations

from typing import Any, Optional

import numpy as np

from .errors import Exhausted
from .pools.allocator import FREE, HELD, TREE, SlotAllocator
from .pools.hybrid import SwaTranslation, copy_states
from .transfer.engine import copier_for
from .tree.components import MAMBA, SWA
from .tree.hybrid import HybridFrees, HybridTree, Victim
from .tree.tree import Namespace, TokenInput, as_int32

TRANSIT = 0x7FFFFFFF  # allocator owner of slots a tier copies into before its tree takes them


class HybridShelf:
    """One tier: executes its tree's frees on its pools and makes room by eviction."""

    tree: HybridTree
    alloc: SlotAllocator
    swa: Optional[SwaTranslation]
    states: Optional[SlotAllocator]

    def _free_full(self, slots: np.ndarray, whole_pages: bool = False) -> None:
        """FULL slots back to the pool, whoever held them (the tree, or a holder of duplicates); a free FULL
        page never keeps an SWA page."""
        if not slots.size:
            return
        st = self.alloc.state[slots]
        for state in (TREE, HELD):
            part = slots[st == state]
            if part.size:
                self.alloc.move(part, state, FREE, check=False)
        if self.swa is not None:
            self.swa.release(slots, whole_pages)

    def _apply(self, frees: HybridFrees) -> None:
        """Execute what a tree operation freed, per pool."""
        if self.swa is not None:
            for kept, incoming in frees.swa_moves:
                self.swa.move(kept, incoming)
        self._free_full(frees.full_slots(), whole_pages=True)  # their twins go with them
        if self.swa is not None and frees.swa:
            self.swa.release(frees._cat(frees.swa), whole_pages=True)  # twins whose FULL slots stay
        if frees.mamba:
            self.states.move(np.asarray(frees.mamba, dtype=np.int64), TREE, FREE, check=False)

    def _evict(self, full: int = 0, swa: int = 0, mamba: int = 0):
        r = self.tree.evict(full, swa, mamba)
        self._apply(r.frees)
        return r

    def _room(self, pages: int, swa_pages: int, states: int) -> tuple[int, int, int]:
        """Evict (FULL leaves, then SWA, then states) until the batch fits; all or nothing up front."""
        p = self.alloc.page_size
        ev = self.tree.evictable
        short = pages - self.alloc.free_pages()
        if short > 0 and short * p > ev[self.tree.FULL]:
            raise Exhausted(f"need {pages} free pages, {self.alloc.free_pages()} free and only "
                            f"{ev[self.tree.FULL]} evictable tokens")
        if self.swa is not None:
            sshort = swa_pages * p - self.swa.free_slots
            if sshort > 0 and sshort > ev[SWA]:  # FULL eviction frees SWA only where ev[SWA] counts it
                raise Exhausted(f"need {swa_pages * p} free SWA slots, {self.swa.free_slots} free and only "
                                f"{ev[SWA]} evictable SWA tokens")
        if states:
            mshort = states - self.states.free_slots
            if mshort > 0 and mshort > ev[MAMBA]:
                raise Exhausted(f"need {states} free state slots, {self.states.free_slots} free and only "
                                f"{ev[MAMBA]} evictable states")
        full = swa = mamba = 0
        while self.alloc.free_pages() < pages:
            r = self._evict(full=(pages - self.alloc.free_pages()) * p)
            if not r.full:
                raise Exhausted(f"need {pages} free pages; eviction freed too little")
            full += r.full
        if self.swa is not None:
            while self.swa.free_slots < swa_pages * p:
                r = self._evict(swa=swa_pages * p - self.swa.free_slots)
                if not r.swa:
                    raise Exhausted(f"need {swa_pages * p} free SWA slots; eviction freed too little")
                swa += r.swa
        while states and self.states.free_slots < states:
            r = self._evict(mamba=states - self.states.free_slots)
            if not r.mamba:
                raise Exhausted(f"need {states} free state slots; eviction freed too little")
            mamba += r.mamba
        return full, swa, mamba

    def _adopt(self, slots: np.ndarray, state: int, mamba_exist: bool) -> None:
        """Slots copied in for an insert: what the tree did not free is the tree's now."""
        slots = slots[self.alloc.state[slots] == HELD]
        self.alloc.move(slots, HELD, TREE, TRANSIT, check=False)
        if state >= 0:
            self.states.move(np.array([state]), HELD, FREE if mamba_exist else TREE, TRANSIT, check=False)

    def check_pools(self, what: str) -> list[str]:
        """Conservation per pool of this tier, and agreement between its tree and its allocators."""
        from .tree.hybrid_check import check_hybrid
        bad = [f"{what} tree: {v}" for v in check_hybrid(self.tree)]
        bad += [f"{what} allocator: {v}" for v in self.alloc.check()]
        held = self.tree.held()
        full = held[self.tree.FULL]
        if self.alloc.counts[TREE] != full.size:
            bad.append(f"{what}: allocator has {self.alloc.counts[TREE]} tree-owned slots, the tree holds {full.size}")
        if full.size and (self.alloc.state[full] != TREE).any():
            bad.append(f"{what}: a FULL slot the tree holds is not in the allocator's tree state")
        if self.states is not None:
            bad += [f"{what} states: {v}" for v in self.states.check()]
            if self.states.counts[TREE] != held[MAMBA].size:
                bad.append(f"{what}: state pool has {self.states.counts[TREE]} tree-owned slots, the tree holds "
                           f"{held[MAMBA].size}")
        return bad


class HybridHostTier(HybridShelf):
    """The host tier of a hybrid model: a hybrid tree over shared-memory FULL, SWA and state pools."""

    def __init__(self, tree: HybridTree, alloc: SlotAllocator, kv_pool: Any, swa: Optional[SwaTranslation] = None,
                 swa_pool: Any = None, states: Optional[SlotAllocator] = None, state_pool: Any = None,
                 load_back_threshold: int = 0):
        self.tree, self.alloc, self.kv_pool = tree, alloc, kv_pool
        self.storage = None  # the L3 tier behind this one (server/storage/components.py), with --storage
        self.swa, self.swa_pool = swa, swa_pool
        self.states, self.state_pool = states, state_pool
        self.threshold = load_back_threshold
        self.demoted_tokens = self.loaded_tokens = self.host_hit_tokens = 0
        self.skipped = 0  # victims the host had no room for
        self._copiers: dict = {}

    def _copy(self, src: Any, src_slots: np.ndarray, dst: Any, dst_slots: np.ndarray) -> None:
        if src_slots.size and src is not None:  # (None: a model with no full-attention layer has no FULL KV)
            key = (id(src), id(dst))
            c = self._copiers.get(key)
            if c is None:
                c = self._copiers[key] = copier_for(src, dst)
            c.copy(src_slots, dst_slots)

    # ---------------------------------------------------------------- device -> host
    def demote(self, victims: list[Victim], dev: HybridShelf) -> None:
        """Copy what the device evicts (before its slots are freed) into the host tree; best effort: a victim
        the host cannot make room for is dropped."""
        for v in victims:
            if self.tree.mamba is not None and v.mamba < 0:
                continue  # no state at its end: nothing a host match could end on
            try:
                self._demote_one(v, dev)
            except Exhausted:
                self.skipped += 1

    def prepare(self, dev: HybridShelf) -> None:
        """Build the page copiers both ways at start: the first demotion or load-back (or L3 fetch) must not import
        or set up inside an RPC (torch's import alone took over a second)."""
        for a, b in ((dev.device_pools[0] if dev.device_pools else None, self.kv_pool), (dev.swa_pool, self.swa_pool)):
            if a is not None and b is not None:
                for src, dst in ((a, b), (b, a)):
                    self._copiers[(id(src), id(dst))] = copier_for(src, dst)

    def back_up(self, tokens: TokenInput, ns: Namespace, dev: HybridShelf) -> None:
        """write_through(_selective): copy what the device serves of tokens' prefix now (every component, as a
        demotion does); best effort, as a demotion."""
        m = dev.tree.match_prefix(tokens, ns)
        if not m.matched_len or (self.tree.mamba is not None and m.mamba_src < 0):
            return
        floor = max(0, m.matched_len - dev.tree.swa.tail_len) if self.swa is not None else m.matched_len
        try:
            self._demote_one(Victim(ns, as_int32(tokens)[:m.matched_len].tobytes(), m.indices, floor, m.mamba_src),
                             dev)
        except Exhausted:
            self.skipped += 1

    def _demote_one(self, v: Victim, dev: HybridShelf) -> None:
        page = self.alloc.page_size
        end = len(v.full)
        if self.tree.cached_prefix_len(v.key, v.ns) >= end and \
                self.tree.match_prefix(v.key, v.ns).matched_len >= end:
            return  # the host serves all of it already (loaded back earlier and evicted again): nothing to copy
        floor = v.swa_floor if self.swa is not None else end
        for _ in range(3):  # making room may evict part of the host prefix this copy relies on: recount
            have = self.tree.cached_prefix_len(v.key, v.ns)
            start = min(have, floor)
            pages = (end - start) // page
            swa_pages = (end - floor) // page if self.swa is not None else 0
            states = 1 if self.tree.mamba is not None else 0
            if (self.alloc.free_pages() >= pages and (self.swa is None or self.swa.free_slots >= swa_pages * page)
                    and (not states or self.states.free_slots >= 1)):
                break
            self._room(pages, swa_pages, states)
        else:
            raise Exhausted("host tier: no room")
        new = self.alloc.alloc(end - start, TRANSIT) if pages else np.zeros(0, np.int64)
        self._copy(dev.device_pools[0] if dev.device_pools else None, v.full[start:], self.kv_pool, new)
        if self.swa is not None and end > floor:
            twins = self.swa.assign(new[floor - start:])
            self._copy(dev.swa_pool, dev.swa.translate(v.full[floor:]), self.swa_pool, twins)
        state = -1
        if self.tree.mamba is not None:
            state = int(self.states.alloc(1, TRANSIT)[0])
            copy_states(dev.state_pool, np.array([v.mamba]), self.state_pool, np.array([state]))
        if self.storage is not None and not self.storage.write_back:  # (the bytes are copied now: the slots may go
            self.storage.backup(v.ns, v.key, start, floor, new, state)  # before the write ends)
        slots = np.concatenate([np.full(start, -1, np.int64), new])
        r = self.tree.insert(v.key, slots, prev_prefix_len=start, swa_evicted_seqlen=floor if self.swa else 0,
                             mamba_value=state, namespace=v.ns)
        self._apply(r.frees)  # a recovered tombstone's twins move with the mapping: their bytes came with them
        self._adopt(new, state, r.mamba_exist)
        self.demoted_tokens += end - start

    # ---------------------------------------------------------------- host -> device
    def load(self, tokens: TokenInput, ns: Namespace, dev: Any) -> int:
        """Bring the host's longer prefix of tokens back to the device tree; returns tokens loaded (0: none)."""
        have = self.tree.cached_prefix_len(tokens, ns)  # a walk that touches nothing: most matches stop here
        if not have:
            return 0
        dm = dev.tree.match_prefix(tokens, ns)
        if have - dm.matched_len < max(self.threshold, 1):
            return 0
        hm = self.tree.match_prefix(tokens, ns)
        d, hl = dm.matched_len, hm.matched_len
        if hl - d < max(self.threshold, 1):
            return 0
        self.host_hit_tokens += hl - d
        page = self.alloc.page_size
        floor = max(d, hl - self.tree.swa.tail_len) if self.swa is not None else hl
        hr = self.tree.lock(hm.node_id)
        dr = dev.tree.lock(dm.node_id)
        try:
            pages = (hl - d) // page
            swa_pages = (hl - floor) // page if self.swa is not None else 0
            states = 1 if self.tree.mamba is not None else 0
            dev._room(pages, swa_pages, states)
            new = dev.alloc.alloc(hl - d, TRANSIT)
            self._copy(self.kv_pool, hm.indices[d:], dev.device_pools[0] if dev.device_pools else None, new)
            if self.swa is not None and hl > floor:
                twins = dev.swa.assign(new[floor - d:])
                self._copy(self.swa_pool, self.swa.translate(hm.indices[floor:]), dev.swa_pool, twins)
            state = -1
            if states:
                state = int(dev.states.alloc(1, TRANSIT)[0])
                copy_states(self.state_pool, np.array([hm.mamba_src]), dev.state_pool, np.array([state]))
            r = dev.tree.insert(as_int32(tokens)[:hl], np.concatenate([dm.indices, new]), prev_prefix_len=d,
                                swa_evicted_seqlen=floor if self.swa is not None else 0, mamba_value=state,
                                namespace=ns, count_hit=False)
            dev._apply(r.frees)
            dev._adopt(new, state, r.mamba_exist)
        except Exhausted:
            return 0
        finally:
            dev.tree.unlock(dr)
            self.tree.unlock(hr)
        self.loaded_tokens += hl - d
        return hl - d

    def _evict(self, full: int = 0, swa: int = 0, mamba: int = 0):
        """An eviction of the host tree; on a write-back L3 tier (its tree then reports victims), each prefix it
        deletes goes to the store first: the leaf's own FULL pages, the SWA window that ends there, its state."""
        r = self.tree.evict(full, swa, mamba)
        if self.storage is not None and self.storage.write_back:
            for v in r.victims:
                end = len(v.full)
                start = min(end - v.own, v.swa_floor if self.swa is not None else end)
                self.storage.backup(v.ns, v.key, start, v.swa_floor, v.full[start:], v.mamba)
        self._apply(r.frees)
        return r

    # ---------------------------------------------------------------- whole tier
    def evict(self, tokens: int) -> int:
        """Evict host tokens (whole leaves, oldest first)."""
        return self._evict(full=tokens).full if tokens > 0 else 0

    def reset(self) -> None:
        held = self.tree.reset()
        self._free_full(held[self.tree.FULL])
        if self.states is not None and held[MAMBA].size:
            self.states.move(held[MAMBA], TREE, FREE, check=False)

    def pools(self) -> list:
        return [p for p in (self.kv_pool, self.swa_pool, self.state_pool) if p is not None]

    def stats(self) -> dict[str, int]:
        t = self.tree
        ev, pr = t.evictable, t.protected
        out = dict(host_capacity_tokens=self.alloc.capacity, host_free_tokens=self.alloc.counts[FREE],
                   host_cached_tokens=ev[t.FULL] + pr[t.FULL], host_evictable_tokens=ev[t.FULL],
                   host_protected_tokens=pr[t.FULL], host_in_flight_tokens=0,
                   host_hit_tokens_total=self.host_hit_tokens, backup_tokens_total=self.demoted_tokens,
                   load_back_tokens_total=self.loaded_tokens,
                   host_evicted_tokens_total=self.tree.counters.evicted_tokens_device)
        if self.swa is not None:
            out.update(host_swa_capacity_tokens=self.swa.swa_capacity, host_swa_free_tokens=self.swa.free_slots,
                       host_swa_cached_tokens=ev[SWA] + pr[SWA])
        if self.states is not None:
            out.update(host_mamba_capacity=self.states.capacity, host_mamba_free=self.states.counts[FREE],
                       host_mamba_cached=ev[MAMBA] + pr[MAMBA])
        return out

    def check(self) -> list[str]:
        bad = self.check_pools("host")
        fetching = self.storage.in_flight if self.storage is not None else {"full": 0, "swa": 0, "states": 0}
        if self.swa is not None:
            bad += [f"host swa: {v}" for v in self.swa.check()]
            p = self.alloc.page_size
            pages = np.unique(self.tree.held()[SWA] // p)
            if pages.size and (self.swa.map[pages] < 0).any():
                bad.append("host: a page the host tree holds SWA KV for has no SWA page")
            if self.swa.free_slots + pages.size * p + fetching["swa"] != self.swa.swa_capacity:
                bad.append("host SWA free + tree + fetching != capacity")
        if self.alloc.counts[HELD] != fetching["full"] or \
                (self.states is not None and self.states.counts[HELD] != fetching["states"]):
            bad.append("host: slots held outside the tree and L3 fetches (a copy that never landed)")
        return bad
