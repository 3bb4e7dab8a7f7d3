"""The host tier in the engine: executes the tree's backups, write-backs and load-backs with real copies.

The tree decides; this module allocates slots, submits copies to the transfer engine and reports each
completion back to the tree. Slots being written are `in_flight` in their allocator until the copy lands,
so `free + tree + held + in_flight == capacity` holds per pool at every moment.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from .errors import Exhausted
from .pools.allocator import FREE, HELD, IN_FLIGHT, NO_OWNER, TREE, SlotAllocator
from .pools.pool import KVPool
from .transfer.engine import Transfer, TransferEngine
from .tree import BackupAction, RadixTree
from .tree.results import FreedSlots


@dataclass
class LoadBack:
    """One item's answer: the whole path's device slots, what was loaded, the receipt and the copy."""

    indices: np.ndarray
    loaded_len: int
    receipt: int
    transfer: Optional[Transfer]
    reason: str = ""


@dataclass
class _Load:
    slots: np.ndarray
    transfer: Transfer
    session: str
    orphaned: bool = False  # its session ended while the copy ran: release the receipt on landing


class HostTier:
    """Backups (device -> host) and load-backs (host -> device) between one device pool and the host pool."""

    def __init__(self, tree: RadixTree, dev_alloc: SlotAllocator, dev_pool: KVPool, host_alloc: SlotAllocator,
                 host_pool: KVPool, engine: TransferEngine):
        self.tree, self.dev_alloc, self.dev_pool = tree, dev_alloc, dev_pool
        self.host_alloc, self.host_pool, self.engine = host_alloc, host_pool, engine
        self.page = dev_alloc.page_size
        self.backups: dict[int, tuple[Transfer, np.ndarray]] = {}  # ack -> copy, host slots it writes
        self.loads: dict[int, _Load] = {}  # load-back op (a receipt to be) -> state
        self._doomed: dict[int, np.ndarray] = {}  # transfer id -> host slots to free when that copy lands
        self.failed_transfers = 0
        self.skipped_backups = 0  # no host room: the node stays device-only
        self.bytes = {"d2h": 0, "h2d": 0}
        self.on_transfer: Optional[Callable[[Transfer], None]] = None
        self.on_load_done: Optional[Callable[[int, str, bool, bool], None]] = None  # op, session, ok, orphaned
        self.storage = None  # the L3 tier (server/storage) when one is configured
        self._readers = np.zeros(host_alloc.capacity, dtype=np.int32)  # L3 writes still reading each host slot
        self._deferred = np.zeros(host_alloc.capacity, dtype=bool)  # freed while read: free when the read ends

    # --------------------------------------------------------------- helpers
    def _free(self, alloc: SlotAllocator, slots: np.ndarray) -> None:
        """Free slots whatever their state, tree-owned or in flight (the caller keeps slots a copy still writes).
        Host slots an L3 write still reads stay in flight until that write ends."""
        if slots.size == 0:
            return
        slots = slots.astype(np.int64)
        if alloc is self.host_alloc and self.storage is not None:
            busy = self._readers[slots] > 0
            if busy.any():
                held = slots[busy]
                st = alloc.state[held]
                alloc.move(held[st == TREE], TREE, IN_FLIGHT, check=False)
                self._deferred[held] = True
                slots = slots[~busy]
        st = alloc.state[slots]
        for state in (TREE, IN_FLIGHT):
            part = slots[st == state]
            if part.size:
                alloc.move(part, state, FREE, check=False)

    def _take(self, alloc: SlotAllocator, tokens: int) -> np.ndarray:
        slots = alloc.alloc(tokens, NO_OWNER)
        alloc.move(slots, HELD, IN_FLIGHT, NO_OWNER, check=False)
        return slots

    def host_room(self, tokens: int) -> bool:
        """Make `tokens` host slots free, evicting host leaves in policy order; False if impossible."""
        pages = self.host_alloc.pages_for(tokens)
        short = pages - self.host_alloc.free_pages()
        if short > 0:
            self._evicted_host(self.tree.evict_host(short * self.page, spill=self._spill))
        return self.host_alloc.free_pages() >= pages

    def evict_host(self, tokens: int) -> int:
        r = self.tree.evict_host(tokens, spill=self._spill)
        self._evicted_host(r)
        return r.evicted_tokens

    @property
    def _spill(self) -> bool:
        return self.storage is not None and self.storage.write_back

    def _evicted_host(self, r) -> None:
        if r.spilled:
            self.storage.spill(r.spilled)  # pins the slots it reads before they are freed below
        self._free(self.host_alloc, r.freed)

    def pin_reads(self, slots: np.ndarray) -> None:
        """An L3 write starts reading these host slots: a free must wait for unpin_reads."""
        np.add.at(self._readers, slots, 1)

    def unpin_reads(self, slots: np.ndarray) -> None:
        """The L3 write is over: slots freed meanwhile go back to the allocator now."""
        np.subtract.at(self._readers, slots, 1)
        done = np.unique(slots[(self._readers[slots] == 0) & self._deferred[slots]])
        if done.size:
            self._deferred[done] = False
            self.host_alloc.move(done, IN_FLIGHT, FREE, check=False)

    @property
    def deferred_frees(self) -> int:
        """Host slots freed by the tree that an L3 write still reads."""
        return int(self._deferred.sum())

    # --------------------------------------------------------------- backups
    def run_backups(self, actions: tuple[BackupAction, ...] | list[BackupAction]) -> list[Transfer]:
        """Start each backup in order; the first without host room is dropped with every one after it."""
        started = []
        for i, a in enumerate(actions):
            if not self.host_room(a.tokens):
                for b in reversed(actions[i:]):
                    self._apply_abort(self.tree.abort_backup(b.ack))
                    self.skipped_backups += 1
                break
            hs = self._take(self.host_alloc, a.tokens)
            self.tree.commit_backup(a.ack, hs)
            t = self.engine.submit("d2h", self.dev_pool, a.device_slots, self.host_pool, hs,
                                   lambda t, ack=a.ack: self._backup_done(ack, t))
            self.backups[a.ack] = (t, hs)
            started.append(t)
        return started

    def _apply_abort(self, freed: FreedSlots) -> None:
        self._free(self.dev_alloc, freed.device)
        self._free(self.host_alloc, freed.host)

    def _backup_done(self, ack: int, t: Transfer) -> None:
        self._landed(t)
        doomed = self._doomed.pop(t.id, None)
        if doomed is not None:  # aborted with its parent while queued: only now is nobody writing these
            self._free(self.host_alloc, doomed)
            return
        _, hs = self.backups.pop(ack)
        if t.ok:
            to_l3 = self.storage is not None and not self.storage.write_back
            pages = self.tree.backup_pages(ack) if to_l3 else None
            freed = self.tree.finish_backup(ack)
            self.host_alloc.move(hs.astype(np.int64), IN_FLIGHT, TREE, check=False)
            self._free(self.dev_alloc, freed.device)  # write-back: demoted now that the host copy exists
            if pages is not None:
                self.storage.backup(pages[0], hs, pages[1])
            return
        self.failed_transfers += 1
        before = self.tree.pending_backups()
        freed = self.tree.abort_backup(ack)
        host = set(freed.host.tolist())
        for other in before - self.tree.pending_backups() - {ack}:  # descendants aborted with it
            ot, ohs = self.backups.pop(other)
            self._doomed[ot.id] = ohs
            host -= set(ohs.tolist())
        self._free(self.dev_alloc, freed.device)
        self._free(self.host_alloc, np.fromiter(host, dtype=np.int64, count=len(host)))

    # ------------------------------------------------------------ device room
    async def make_device_room(self, pages: int, partial: bool = False) -> int:
        """Evict until `pages` device pages are free, waiting for backups and write-backs in flight (their
        nodes are protected until the copy lands). All or nothing up front, unless `partial`: then as many
        as can be freed. Returns tokens evicted."""
        short = pages - self.dev_alloc.free_pages()
        pending = sum(t.tokens for t, _ in self.backups.values())
        if not partial and short > 0 and short * self.page > self.tree.evictable_size + pending:
            raise Exhausted(f"need {pages} free pages, {self.dev_alloc.free_pages()} free and only "
                            f"{self.tree.evictable_size} evictable tokens ({pending} more being backed up)")
        evicted = 0
        while self.dev_alloc.free_pages() < pages:
            want = (pages - self.dev_alloc.free_pages()) * self.page
            r = self.tree.evict(want)
            self._free(self.dev_alloc, r.freed)
            evicted += r.evicted_tokens
            started = self.run_backups(r.write_backs) if r.write_backs else []
            waiting = [t.id for t in started] or ([t.id for t, _ in self.backups.values()]
                                                  if not r.evicted_tokens else [])
            if waiting:
                await self.engine.wait(waiting, timeout=None)
                # a landed write-back demotes its node: those device slots are what this eviction freed (the
                # free count alone would also move with other clients' allocations meanwhile)
                evicted += sum(t.tokens for t in started if t.ok)
            elif not r.evicted_tokens:
                if partial:
                    break
                raise Exhausted(f"need {pages} free pages, {self.dev_alloc.free_pages()} free and nothing "
                                "left to evict")
        return evicted

    # ------------------------------------------------------------- load-back
    async def load_back(self, session: str, node_id: int, mem_quota: Optional[int]) -> LoadBack:
        """Plan, make room, allocate, commit and start the copy; the receipt covers the whole path."""
        plan = self.tree.load_back(node_id, mem_quota, self.dev_alloc.free_pages() * self.page)
        if not plan.op:
            return LoadBack(np.zeros(0, np.int64), 0, 0, None, plan.reason)
        try:
            await self.make_device_room(self.dev_alloc.pages_for(plan.tokens))
        except Exhausted:
            self.tree.abort_load_back(plan.op)
            return LoadBack(np.zeros(0, np.int64), 0, 0, None, "no_room")
        slots = self._take(self.dev_alloc, plan.tokens)
        path = self.tree.commit_load_back(plan.op, slots)
        t = self.engine.submit("h2d", self.host_pool, plan.host_slots, self.dev_pool, slots,
                               lambda t, op=plan.op: self._load_done(op, t), owner=session,
                               ipc=self.dev_pool.backend == "cuda")
        self.loads[plan.op] = _Load(slots, t, session)
        return LoadBack(path.astype(np.int64), plan.tokens, plan.op, t)

    def _load_done(self, op: int, t: Transfer) -> None:
        self._landed(t)
        lo = self.loads.pop(op)
        if t.ok:
            self.tree.finish_load_back(op)
            self.dev_alloc.move(lo.slots, IN_FLIGHT, TREE, check=False)
            if lo.orphaned:
                self.tree.unlock(op)
        else:
            self.failed_transfers += 1
            self._free(self.dev_alloc, self.tree.abort_load_back(op))
        if self.on_load_done is not None:
            self.on_load_done(op, lo.session, t.ok, lo.orphaned)

    def orphan(self, op: int) -> None:
        """The session that owns an in-flight load-back ended: release its receipt when the copy lands."""
        self.loads[op].orphaned = True

    def _landed(self, t: Transfer) -> None:
        if t.ok:
            self.bytes[t.direction] += t.nbytes
        if self.on_transfer is not None:
            self.on_transfer(t)

    # ---------------------------------------------------------------- checks
    def check(self) -> list[str]:
        """Host allocator vs tree, and in-flight slots vs the transfers that write them."""
        bad = [f"host allocator: {v}" for v in self.host_alloc.check()]
        owned = self.tree.all_host_values().astype(np.int64)
        writing = [hs for _, hs in self.backups.values()] + list(self._doomed.values())
        n_writing = sum(int(h.size) for h in writing) + self.deferred_frees
        if self.storage is not None:
            n_writing += self.storage.host_in_flight
            bad += self.storage.check()
        if self.host_alloc.counts[IN_FLIGHT] != n_writing:
            bad.append(f"host in_flight {self.host_alloc.counts[IN_FLIGHT]} != {n_writing} slots under copy, "
                       "fetch or L3 read")
        committed = sum(int(hs.size) for _, hs in self.backups.values())
        if self.host_alloc.counts[TREE] + committed != owned.size:
            bad.append(f"host allocator has {self.host_alloc.counts[TREE]} tree slots + {committed} in flight, "
                       f"the tree owns {owned.size}")
        if self.host_alloc.counts[HELD]:
            bad.append(f"{self.host_alloc.counts[HELD]} host slots are held (only the server allocates host)")
        loading = sum(int(lo.slots.size) for lo in self.loads.values())
        if self.dev_alloc.counts[IN_FLIGHT] != loading:
            bad.append(f"device in_flight {self.dev_alloc.counts[IN_FLIGHT]} != {loading} slots being loaded")
        if set(self.loads) != {op for op in self.loads if self.tree.is_loading(op)}:
            bad.append("a load-back the engine tracks is unknown to the tree")
        if set(self.backups) - self.tree.pending_backups():
            bad.append("a backup the engine tracks is unknown to the tree")
        return bad
