"""Backups (device -> host) and load-backs (host -> device) as plans: the tree decides, the engine copies.

Mixed into RadixTree; every method here runs on the tree's own state and stays pure (no I/O, no copies).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import numpy as np

from .errors import InvalidInput, StateConflict, UnknownReceipt
from .events import CPU, GPU
from .node import Node
from .results import _EMPTY, BackupAction, FreedSlots, LoadBackPlan, _slots

if TYPE_CHECKING:
    from .tree import TokenInput


class BackupOp:
    __slots__ = ("nodes", "committed", "write_back")

    def __init__(self, node: Node, write_back: bool):
        self.nodes = [node]  # root-first; a split inserts the upper fragment before the lower
        self.committed = False
        self.write_back = write_back


class LoadOp:
    __slots__ = ("node", "dev", "slots")

    def __init__(self, node: Node, dev: Node):
        self.node = node  # the deepest node to load; host-locked
        self.dev = dev  # its deepest device-resident ancestor; device-locked until finish
        self.slots: Optional[np.ndarray] = None

class TransferMixin:
    """Backup and load-back plans of RadixTree (see the tree's module docstring for the protocol)."""

    # --------------------------------------------------------------- backups
    def _start_backup(self, node: Node, write_back: bool) -> BackupAction:
        ack = self._mint()
        node.pending = ack
        self._hfix(node)
        self._dlock(node)
        self._backups[ack] = BackupOp(node, write_back)
        return BackupAction(ack, (node.id,), np.frombuffer(node.value, dtype="<i4"), write_back)

    def _backup_chain(self, node: Node) -> tuple[BackupAction, ...]:
        """Write-through backs up parent-first (R1.12): one action per unbacked ancestor, then the node."""
        chain = []
        walker = node
        while walker.parent is not None and walker.host_value is None and not walker.pending:
            chain.append(walker)
            walker = walker.parent
        return tuple(self._start_backup(nd, False) for nd in reversed(chain))

    def _backup_op(self, ack: int) -> BackupOp:
        self._own(ack, "backup ack")
        op = self._backups.get(ack)
        if op is None:
            raise UnknownReceipt(f"backup ack {ack:#x} is unknown or already finished")
        return op

    def commit_backup(self, ack: int, host_slots: TokenInput) -> None:
        """The engine allocated host slots and started the copy: the nodes are backed up from now on."""
        op = self._backup_op(ack)
        if op.committed:
            raise StateConflict(f"backup ack {ack:#x} is already committed")
        hs = self._as_int32(host_slots).tobytes()
        total = sum(len(nd.value) for nd in op.nodes)
        if len(hs) != total:
            raise InvalidInput(f"{len(hs) // 4} host slots for a backup of {total // 4} tokens")
        top = op.nodes[0].parent
        if self._through and top.parent is not None and top.host_value is None:
            raise StateConflict(f"backup ack {ack:#x}: the parent is not backed up (write-through is parent-first)")
        off = 0
        for nd in op.nodes:
            size = len(nd.value)
            nd.host_lock_ref += 1  # the copy still writes the host slots: protect them until finish
            self._set_host(nd, hs[off:off + size])
            off += size
            if self.write_back:
                self._coexist.add(nd)
        op.committed = True
        self.counters.backup_tokens += total >> 2

    def finish_backup(self, ack: int) -> FreedSlots:
        """The copy completed: unlock and publish; a write-back is demoted now (device slots returned)."""
        op = self._backup_op(ack)
        if not op.committed:
            raise StateConflict(f"backup ack {ack:#x} was never committed")
        del self._backups[ack]
        for nd in op.nodes:
            nd.pending = 0
            self._bunlock(nd)
            if self._ev is not None:
                self._stored(nd, CPU)  # the backup is acknowledged: the pages are on host now
        self._dunlock(op.nodes[-1])
        freed: list[bytes] = []
        if op.write_back:
            for nd in reversed(op.nodes):  # deepest first: each demotion can make its parent a D-leaf
                if nd in self._leaves:
                    freed.append(self._demote(nd))
        return FreedSlots(_slots(freed), _EMPTY)

    def abort_backup(self, ack: int) -> FreedSlots:
        """The copy failed or was never started: undo it; returns the slots the caller must free."""
        op = self._backup_op(ack)
        deeper = []
        if self._through:  # descendants backed up after this node must go too, or host closure breaks
            stack = list(op.nodes[-1].children.values())
            while stack:
                nd = stack.pop()
                if nd.host_value is not None or nd.pending:
                    if not nd.pending or nd.value is None:
                        raise StateConflict(f"backup ack {ack:#x}: descendant {nd.id:#x} already finished its "
                                            "backup; abort in reverse order of completion")
                    deeper.append(nd.pending)
                stack.extend(nd.children.values())
        host: list[bytes] = []
        dev: list[bytes] = []
        for other in dict.fromkeys(deeper):
            if other in self._backups:
                r = self._undo_backup(other)
                host.append(r.host.tobytes())
        r = self._undo_backup(ack)
        host.append(r.host.tobytes())
        dev.append(r.device.tobytes())
        return FreedSlots(_slots(dev), _slots(host))

    def _undo_backup(self, ack: int) -> FreedSlots:
        op = self._backups.pop(ack)
        host: list[bytes] = []
        for nd in op.nodes:
            nd.pending = 0
            if op.committed:
                host.append(nd.host_value)
                self._set_host(nd, None)
                nd.host_lock_ref -= 1
            self._hfix(nd)
        self._dunlock(op.nodes[-1])
        dev = _EMPTY
        if op.write_back:  # eviction wanted these slots: drop the unbacked subtree if nothing pins it (R1.23)
            r = self._drop_subtree(op.nodes[0])
            dev = r.device
            host.append(r.host.tobytes())
        return FreedSlots(dev, _slots(host))

    def _drop_subtree(self, top: Node) -> FreedSlots:
        """Delete an unbacked device node and its host-only descendants unless something there is pinned."""
        stack, sub = [top], []
        while stack:
            nd = stack.pop()
            if nd.lock_ref or nd.host_lock_ref or nd.pending or nd.loading:
                return FreedSlots(_EMPTY, _EMPTY)
            sub.append(nd)
            stack.extend(nd.children.values())
        dev: list[bytes] = []
        host: list[bytes] = []
        for nd in reversed(sub):  # children before parents
            if self._ev is not None:
                if nd.host_value is not None:
                    self._removed(nd, CPU)
                if nd.value is not None:
                    self._removed(nd, GPU)
            if nd.value is not None:
                dev.append(nd.value)
                self.evictable_size -= len(nd.value) >> 2
            if nd.host_value is not None:
                host.append(nd.host_value)
                self._set_host(nd, None)
            self._unlink(nd)
        d, h = _slots(dev), _slots(host)
        self.counters.evicted_tokens_device += d.size
        self.counters.evicted_tokens_host += h.size
        self._tombstone(top.parent)
        return FreedSlots(d, h)

    def _unlink(self, node: Node) -> None:
        self._drop_leaf(node)
        self._drop_hleaf(node)
        self._coexist.discard(node)
        del node.parent.children[node.key[:self._page_b]]
        del self._nodes[node.id]

    def _tombstone(self, node: Node) -> None:
        """After a child went: the parent may now be a leaf of either tier, or an empty namespace root."""
        if node.parent is None:
            if node.lock_ref == 0:
                self._prune_root(node)
            return
        self._sync(node)

    def _demote(self, node: Node) -> bytes:
        """Drop a backed-up D-leaf's device copy; it stays cached host-only (R3.7)."""
        value = node.value
        size = len(value) >> 2
        self._drop_leaf(node)
        node.value = None
        self._hfix(node)
        self.evictable_size -= size
        self.counters.evicted_tokens_device += size
        self.counters.demoted_tokens += size
        if self._ev is not None:
            self._removed(node, GPU)
        if self._is_hleaf(node):
            self._add_hleaf(node)
        parent = node.parent
        if parent.parent is not None and self._is_leaf(parent) and parent not in self._leaves:
            self._add_leaf(parent)
        return value

    # ------------------------------------------------------------- load-back
    def load_back(self, node_id: int, mem_quota: Optional[int] = None,
                  device_free: Optional[int] = None) -> LoadBackPlan:
        """Plan loading the evicted segment above node (all or nothing); locks it until commit/finish/abort.

        Refused (op 0, locks untouched) below load_back_threshold, when `kv_tokens > mem_quota -
        newly_protected` (R2.7), when another load-back already pins the segment, or when `device_free`
        plus what is evictable outside the path cannot hold it.
        """
        node = self._node(node_id)
        if mem_quota is not None and mem_quota < 0:
            raise InvalidInput(f"mem_quota {mem_quota} is negative")
        if device_free is not None and device_free < 0:
            raise InvalidInput(f"device_free {device_free} is negative")
        if node.value is not None:
            return LoadBackPlan(0, (), _EMPTY, 0, "resident")
        seg = []
        dev = node
        while dev.value is None:
            seg.append(dev)
            dev = dev.parent
        seg.reverse()
        ids = tuple(nd.id for nd in seg)
        host = _slots([nd.host_value for nd in seg])
        if any(nd.loading for nd in seg):
            return LoadBackPlan(0, ids, host, 0, "pinned")
        kv = int(host.size)
        if kv < self.load_back_threshold:
            return LoadBackPlan(0, ids, host, 0, "threshold")
        newly = 0
        walker = dev
        while walker.parent is not None:
            if walker.lock_ref == 0:
                newly += len(walker.value) >> 2
            walker = walker.parent
        if mem_quota is not None and kv > mem_quota - newly:
            return LoadBackPlan(0, ids, host, 0, "quota")
        evict = max(0, kv - device_free) if device_free is not None else 0
        if evict > self.evictable_size - newly:
            return LoadBackPlan(0, ids, host, evict, "no_room")
        op = self._mint()
        self._dlock(dev)
        self._hlock(node)
        for nd in seg:
            nd.loading = op
        self._loads[op] = LoadOp(node, dev)
        return LoadBackPlan(op, ids, host, evict)

    def _load_op(self, op: int) -> LoadOp:
        self._own(op, "load-back op")
        lo = self._loads.get(op)
        if lo is None:
            raise UnknownReceipt(f"load-back op {op:#x} is unknown or already finished")
        return lo

    def _segment(self, op: int, lo: LoadOp) -> list[Node]:
        seg = []
        nd = lo.node
        while nd is not lo.dev:
            seg.append(nd)
            nd = nd.parent
        seg.reverse()
        return seg

    def commit_load_back(self, op: int, device_slots: TokenInput) -> np.ndarray:
        """The engine allocated device slots and started the copy; returns the whole path's device slots."""
        lo = self._load_op(op)
        if lo.slots is not None:
            raise StateConflict(f"load-back op {op:#x} is already committed")
        slots = self._as_int32(device_slots)
        seg = self._segment(op, lo)
        total = sum(len(nd.host_value) for nd in seg) >> 2
        if slots.size != total:
            raise InvalidInput(f"{slots.size} device slots for a load-back of {total} tokens")
        lo.slots = slots.copy()
        return np.concatenate([self.path_values(lo.dev), lo.slots])

    def finish_load_back(self, op: int) -> int:
        """The copy completed: the segment is device-resident, and `op` is now a receipt locking the path."""
        lo = self._load_op(op)
        if lo.slots is None:
            raise StateConflict(f"load-back op {op:#x} was never committed")
        del self._loads[op]
        vb = lo.slots.tobytes()
        off = 0
        for nd in self._segment(op, lo):
            size = len(nd.host_value)
            nd.value = vb[off:off + size]
            off += size
            nd.loading = 0
            self._hfix(nd)
            self.evictable_size += size >> 2
            self._drop_hleaf(nd)
            if self._ev is not None:
                self._stored(nd, GPU)
            if self.write_back:
                self._coexist.add(nd)
        self.counters.load_back_tokens += off >> 2
        self._drop_leaf(lo.dev)
        self._dlock(lo.node)
        self._dunlock(lo.dev)
        self._hunlock(lo.node)
        self._receipts[op] = (lo.node, None)
        return op

    def abort_load_back(self, op: int) -> np.ndarray:
        """Undo a planned or failed load-back; returns the device slots (if committed) the caller frees."""
        lo = self._load_op(op)
        del self._loads[op]
        for nd in self._segment(op, lo):
            nd.loading = 0
            self._hfix(nd)
        self._dunlock(lo.dev)
        self._hunlock(lo.node)
        return lo.slots if lo.slots is not None else _EMPTY
