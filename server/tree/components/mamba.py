"""MAMBA (state-space / linear-attention state): one state slot per node, meaningful only at a match end.

Semantics follow SGLang 0.5.23's unified cache (SPEC-tiers R5.11-R5.15): a match ends at the deepest node with
a state; the state stays on the suffix of a split; an insert adopts the donated slot where the end node has no
state and reports `mamba_exist` otherwise (the caller frees the donated slot); a lock pins that node's state
only; eviction tombstones an inner node's state (no cascade) or deletes a whole D-leaf.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from .base import REMOVED_EVENT, MAMBA, Component

if TYPE_CHECKING:
    from ..hybrid import HNode, HybridFrees


class MambaComponent(Component):
    name = MAMBA
    lock_attr = "mlock"
    link_attrs = ("mprev", "mnext")
    internal_priority = 0

    def __init__(self, tree, chunk: int, max_states_per_path: int = -1):
        super().__init__(tree)
        if chunk < 1:
            raise ValueError("the mamba chunk size must be >= 1")
        if max_states_per_path == 0 or max_states_per_path < -1:
            raise ValueError("max_states_per_path is -1 (no cap) or >= 1")
        self.cap = max_states_per_path
        self.chunk = chunk
        self.trimmed = 0  # states the cap has dropped
        ps = tree.page_size
        a, b = chunk, ps
        while b:
            a, b = b, a % b
        self.grid = chunk * ps // a  # branching positions sit on both the chunk and the page grid

    def has(self, node: "HNode") -> bool:
        return node.mamba >= 0

    def size(self, node: "HNode") -> int:
        return 1

    def deepest(self, path: list, limit: int) -> int:
        for i in range(limit - 1, -1, -1):
            if path[i].mamba >= 0:
                return i + 1
        return 0

    def on_split(self, upper: "HNode", child: "HNode") -> None:
        upper.mamba, upper.mlock = -1, 0

    def refresh_match(self, node: "HNode") -> None:
        if node.mamba >= 0:
            self.lru.reset_mru(node)

    def native_rule(self) -> tuple:
        return ("mamba", self.lru.head)

    def commit(self, node: "HNode", new_leaf: bool, params, result) -> None:
        tree = self.tree
        if params.mamba_value is None or params.mamba_value < 0:
            raise ValueError("a tree with a MAMBA component needs mamba_value on every insert")
        if node.mamba < 0:
            node.mamba = int(params.mamba_value)
            self._credit(node, node.mlock > 0)
            if not new_leaf:
                node.atime = tree._clock_tick()
            if self.cap > 0:
                self._trim_path(node, result.frees)
            return
        self.lru.reset_mru(node)
        node.atime = tree._clock_tick()
        result.mamba_exist = True

    def _trim_path(self, tail: "HNode", frees: "HybridFrees") -> None:
        """The per-path cap (the Rust seed's R5.14): drop the shallowest states beyond it on tail's path,
        sparing the tail, locked states, forks and D-leaves (so it is a soft cap, as in SGLang)."""
        holders = []
        node = tail
        while node.parent is not None:
            if node.mamba >= 0:
                holders.append(node)
            node = node.parent
        excess = len(holders) - self.cap
        for node in reversed(holders):
            if excess <= 0 or node is tail:
                break
            if node.mlock or len(node.children) != 1 or node in self.tree._leaves:
                continue
            self.drop(node, frees, None)
            self.trimmed += 1
            excess -= 1

    def acquire(self, node: "HNode", receipt) -> None:
        if receipt.skip_mamba or node.parent is None:
            return
        if node.mlock == 0 and node.mamba >= 0:
            self.tree.evictable[MAMBA] -= 1
            self.tree.protected[MAMBA] += 1
        node.mlock += 1

    def release(self, node: "HNode", receipt) -> None:
        if receipt.skip_mamba or node.parent is None:
            return
        if node.mlock <= 0:
            raise AssertionError(f"MAMBA release below zero on node {node.id}")
        node.mlock -= 1
        if node.mlock == 0:
            if node.mamba >= 0:
                self.tree.evictable[MAMBA] += 1
                self.tree.protected[MAMBA] -= 1

    def drop(self, node: "HNode", frees: "HybridFrees", tracker) -> None:
        self.tree._record(REMOVED_EVENT, self.name, node)
        frees.mamba.append(node.mamba)
        self.tree.evictable[MAMBA] -= 1
        node.mamba = -1
        self.lru.remove(node)
        if tracker is not None:
            tracker[MAMBA] += 1
