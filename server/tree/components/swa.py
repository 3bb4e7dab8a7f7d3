"""SWA (sliding-window attention): a node's SWA KV is its FULL slots' window twins, present or tombstoned.

The tree keeps only whether a node's SWA half exists (`node.swa`); the slots are the FULL slots' translation,
which the pool layer owns. Semantics follow SGLang 0.5.23's unified cache (SPEC-tiers R5.5-R5.9):
  * match: a node without SWA resets the coverage; a node is a valid end once the coverage since the last gap
    reaches the window;
  * a window lock walks up from the anchor, counting every node (tombstones too) until the window is covered;
    the node where it fills carries a uuid that marks where the release stops, and moves up on a split;
  * eviction tombstones inner nodes (and their MAMBA state), deletes whole D-leaves;
  * insert recovers tombstones inside the window from the request's own slots and tombstones what lies
    below `swa_evicted_seqlen`; a fresh leaf longer than one page-rounded window is split so a lock pins one.
"""
from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

from .base import REMOVED_EVENT, SWA, Component

if TYPE_CHECKING:
    from ..hybrid import HNode, HybridFrees

_uuids = itertools.count(1)


class SwaComponent(Component):
    name = SWA
    lock_attr = "slock"
    link_attrs = ("sprev", "snext")
    internal_priority = 1

    def __init__(self, tree, window: int):
        super().__init__(tree)
        if window < 1:
            raise ValueError("the sliding window must be >= 1 token")
        self.window = window
        ps = tree.page_size
        self.tail_len = -(-window // ps) * ps  # one window, page-rounded: what a fresh leaf is cut down to

    def has(self, node: "HNode") -> bool:
        return node.swa

    def size(self, node: "HNode") -> int:
        return node.n

    def deepest(self, path: list, limit: int) -> int:
        window = self.window
        covered = float("inf")  # no gap since the root: any node may end a match
        best = 0
        for i in range(limit):
            node = path[i]
            if not node.swa:
                covered = 0
                continue
            covered += node.n
            if covered >= window:
                best = i + 1
        return best

    def on_split(self, upper: "HNode", child: "HNode") -> None:
        upper.slock = child.slock
        upper.swa = child.swa
        upper.suuid, child.suuid = child.suuid, 0  # the boundary is the segment's older edge

    def refresh_match(self, node: "HNode") -> None:
        self.lru.reset_path_mru(node, self.window + self.tree.page_size, self.has)

    refresh_insert = refresh_match

    def native_rule(self) -> tuple:
        return ("swa", self.window, float(self.window + self.tree.page_size), self.lru.head)

    def _tombstone_tail(self, node: "HNode", start: int, end: int, floor: int):
        """Where node's SWA can live given the request's freed floor: None (nothing, or node has SWA already),
        else the start of the live part; node is split so it begins there."""
        if node.swa:
            return None
        live = max(start, floor)
        if live >= end:
            return None
        if live > start:
            self.tree._split(node, live - start)
        return live

    def overlap(self, node: "HNode", plen: int, total: int, values, params, frees: "HybridFrees") -> int:
        if params.prev_prefix_len >= total + plen:
            return plen
        live = self._tombstone_tail(node, total, total + plen, params.swa_evicted_seqlen)
        if live is None:
            return plen
        incoming = values[live - total:plen]
        if node.lock:  # the locked FULL stays; it takes the incoming slots' window twins, their FULL goes
            frees.swa_moves.append((node.full, incoming))
            frees.full.append(incoming)
        else:
            frees.full.append(node.full)  # same length: the FULL counters do not move
            node.full = incoming.copy()
        node.swa = True
        self._credit(node, node.slock > 0)
        return live - total

    def commit(self, node: "HNode", new_leaf: bool, params, result) -> None:
        if params.swa_branching_seqlen is not None:
            result.swa_branch_inserted = params.key_len >= params.swa_branching_seqlen
        if not new_leaf:
            return
        start = result.prefix_len
        live = self._tombstone_tail(node, start, start + node.n, params.swa_evicted_seqlen)
        if live is None:
            return
        older = None
        if node.slock == 0 and node.n > self.tail_len:
            older = self.tree._split(node, node.n - self.tail_len)
        for nd in (older, node):  # older fragment first, so the tail is the more recent
            if nd is not None:
                nd.swa = True
                self._credit(nd, nd.slock > 0)

    def acquire(self, node: "HNode", receipt) -> None:
        tree = self.tree
        window = self.window
        if tree._rules is not None:  # the same walk in C (server/tree/_hwalk.c)
            moved, at = tree._rules[0].swa_acquire(node, window)
            if moved:
                tree.evictable[SWA] -= moved
                tree.protected[SWA] += moved
            if at is not None and not at.suuid:
                at.suuid = next(_uuids)
            receipt.swa_uuid = at.suuid if at is not None else 0
            return
        covered, boundary = 0, 0
        cur = node
        while cur.parent is not None and covered < window:
            if cur.slock == 0 and cur.swa:
                n = cur.n
                tree.evictable[SWA] -= n
                tree.protected[SWA] += n
            cur.slock += 1
            covered += cur.n
            if covered >= window:
                if not cur.suuid:
                    cur.suuid = next(_uuids)
                boundary = cur.suuid
            cur = cur.parent
        receipt.swa_uuid = boundary

    def _unlock_walk(self, node: "HNode", uuid: int, frees=None) -> None:
        tree = self.tree
        if tree._rules is not None:  # the same walk in C; what follows a lock reaching 0 here, in walk order
            for cur in tree._rules[0].swa_release(node, uuid):
                self._unlocked(cur, frees)
            return
        cur = node
        while cur.parent is not None:
            if cur.slock <= 0:
                raise AssertionError(f"SWA release below zero on node {cur.id}")
            cur.slock -= 1
            if cur.slock == 0:
                self._unlocked(cur, frees)
            if uuid and cur.suuid == uuid:
                break
            cur = cur.parent

    def _unlocked(self, cur: "HNode", frees) -> None:
        """cur's window lock went to 0: it may be a leaf now, its SWA evictable (dropped now on a window release)."""
        tree = self.tree
        if not cur.children:  # a node with a child is never a leaf
            tree._update_leaf(cur)
        if cur.swa:
            n = cur.n
            tree.evictable[SWA] += n
            tree.protected[SWA] -= n
            if frees is not None and cur in tree._leaves:
                self.drop(cur, frees, None)

    def release(self, node: "HNode", receipt) -> None:
        self._unlock_walk(node, receipt.swa_uuid)

    def release_window(self, node: "HNode", receipt, frees: "HybridFrees") -> None:
        """Decode has left the window: drop the window lock now (the FULL lock stays)."""
        self._unlock_walk(node, receipt.swa_uuid, frees)

    def drop(self, node: "HNode", frees: "HybridFrees", tracker) -> None:
        n = node.n
        self.tree._record(REMOVED_EVENT, self.name, node)
        frees.swa.append(node.full)
        self.tree.evictable[SWA] -= n
        node.swa = False
        self.lru.remove(node)
        if tracker is not None:
            tracker[SWA] += n
