"""What every auxiliary component shares: its LRU list and the hooks the hybrid tree calls."""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional

from ..events import REMOVED as REMOVED_EVENT, STORED as STORED_EVENT

if TYPE_CHECKING:
    from ..hybrid import HNode, HybridFrees, HybridTree

FULL, SWA, MAMBA = "full", "swa", "mamba"


class _End:
    """An LRU sentinel: never locked, never a tree node."""

    __slots__ = ()
    slock = mlock = 0


class Lru:
    """Doubly linked recency list (head = most recent), with the insert-after and skip-locked walks the seeds'
    eviction order depends on (a heap cannot place a split fragment beside its sibling)."""

    __slots__ = ("prev", "next", "head", "tail", "lock")

    def __init__(self, lock_attr: str):
        self.head, self.tail = _End(), _End()
        self.prev: dict = {self.tail: self.head}
        self.next: dict = {self.head: self.tail}
        self.lock = lock_attr

    def __contains__(self, node) -> bool:
        return node in self.prev and not isinstance(node, _End)

    def __len__(self) -> int:
        return len(self.prev) - 1

    def _link_after(self, p, node) -> None:
        n = self.next[p]
        self.prev[node], self.next[node] = p, n
        self.next[p] = node
        self.prev[n] = node

    def remove(self, node) -> None:
        p, n = self.prev.pop(node), self.next.pop(node)
        self.next[p] = n
        self.prev[n] = p

    def insert_mru(self, node) -> None:
        self._link_after(self.head, node)

    def insert_after(self, p, node) -> None:
        self._link_after(p, node)

    def reset_mru(self, node) -> None:
        self.remove(node)
        self._link_after(self.head, node)

    def reset_path_mru(self, node, budget: float, has: Callable) -> None:
        """Move node and its ancestors within `budget` tokens to the front, node first (most recent); a root
        (any namespace's) ends the walk."""
        after = self.head
        used = 0
        prev = self.prev
        while node.parent is not None and used < budget:
            if has(node):
                if prev[node] is not after:  # already in place (a repeated hit): nothing to move
                    self.remove(node)
                    self._link_after(after, node)
                after = node
            used += node.n
            node = node.parent

    def prev_unlocked(self, node) -> Optional[object]:
        """The next older node whose lock for this component is 0 (None at the end)."""
        x = self.prev[node]
        lock = self.lock
        while getattr(x, lock):
            x = self.prev[x]
        return None if x is self.head else x

    def oldest_unlocked(self):
        return self.prev_unlocked(self.tail)

    def order(self) -> list:
        """Most recent first (for the checker and tests)."""
        out, x = [], self.next[self.head]
        while x is not self.tail:
            out.append(x)
            x = self.next[x]
        return out


class Component:
    """Hooks of one auxiliary component. Defaults are a component that holds nothing."""

    name = ""
    lock_attr = ""
    internal_priority = 0  # FULL is 2; an internal eviction cascades to components of lower or equal priority

    def __init__(self, tree: "HybridTree"):
        self.tree = tree
        self.lru = Lru(self.lock_attr)

    def has(self, node: "HNode") -> bool:
        raise NotImplementedError

    def size(self, node: "HNode") -> int:
        """Units this node's value counts for (tokens, or states)."""
        raise NotImplementedError

    def deepest(self, path: list, limit: int) -> int:
        """How many nodes of the matched path (root first) a match may keep: the deepest node at or above
        path[limit - 1] where this component accepts a match end (0: none)."""
        return limit

    def on_split(self, upper: "HNode", child: "HNode") -> None:
        pass

    def overlap(self, node: "HNode", plen: int, total: int, values, params, frees: "HybridFrees") -> int:
        return plen

    def commit(self, node: "HNode", new_leaf: bool, params, result) -> None:
        pass

    def refresh_match(self, node: "HNode") -> None:
        pass

    def native_rule(self) -> Optional[tuple]:
        """This component's deepest() and refresh_match() as data for the C match (server/tree/_hwalk.c); None:
        the tree matches in Python."""
        return None

    def refresh_insert(self, node: "HNode") -> None:
        pass

    def acquire(self, node: "HNode", receipt) -> None:
        pass

    def release(self, node: "HNode", receipt) -> None:
        pass

    def drop(self, node: "HNode", frees: "HybridFrees", tracker: dict) -> None:
        """Free this component's value on node (the caller decides when)."""
        raise NotImplementedError

    def evict_walk(self, request: int, tracker: dict, frees: "HybridFrees") -> None:
        """The seeds' per-component walk: oldest unlocked first; a D-leaf goes whole, an inner node loses this
        component and the ones below it."""
        tree = self.tree
        lru = self.lru
        cursor = lru.oldest_unlocked()
        name = self.name
        while True:
            if cursor is not None and cursor not in lru:
                cursor = lru.oldest_unlocked()
            if tracker[name] >= request or cursor is None:
                return
            x = cursor
            cursor = lru.prev_unlocked(x)
            if x in tree._leaves:
                tree._delete_leaf(x, frees, tracker)
                continue
            self.drop(x, frees, tracker)
            for comp in tree.aux:
                if comp is not self and comp.internal_priority <= self.internal_priority and comp.has(x):
                    comp.drop(x, frees, tracker)
            tree._update_leaf(x)

    def _credit(self, node: "HNode", locked: bool) -> None:
        """A value appeared on node: count it and make it the most recent."""
        self.lru.insert_mru(node)
        (self.tree.protected if locked else self.tree.evictable)[self.name] += self.size(node)
        self.tree._record(STORED_EVENT, self.name, node)
