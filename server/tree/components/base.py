"""What every auxiliary component shares: its LRU list and the hooks the hybrid tree calls."""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional

from ..events import REMOVED as REMOVED_EVENT, STORED as STORED_EVENT

if TYPE_CHECKING:
    from ..hybrid import HNode, HybridFrees, HybridTree

FULL, SWA, MAMBA = "full", "swa", "mamba"


class Lru:
    """Doubly linked recency list (head = most recent), threaded through two slots of each node (no dict: the C
    match moves nodes by pointer), with the insert-after and skip-locked walks the seeds' eviction order depends
    on (a heap cannot place a split fragment beside its sibling). head and tail are sentinel nodes from `end`."""

    __slots__ = ("head", "tail", "lock", "p", "n", "size")

    def __init__(self, lock_attr: str, prev_attr: str, next_attr: str, end: Callable[[], object]):
        self.head, self.tail = end(), end()
        self.p, self.n = prev_attr, next_attr
        setattr(self.head, next_attr, self.tail)
        setattr(self.tail, prev_attr, self.head)
        self.lock = lock_attr
        self.size = 0

    def __contains__(self, node) -> bool:
        return getattr(node, self.p) is not None and node is not self.tail

    def __len__(self) -> int:
        return self.size

    def _link_after(self, p, node) -> None:
        P, N = self.p, self.n
        n = getattr(p, N)
        setattr(node, P, p)
        setattr(node, N, n)
        setattr(p, N, node)
        setattr(n, P, node)

    def _unlink(self, node) -> None:
        P, N = self.p, self.n
        p, n = getattr(node, P), getattr(node, N)
        if p is None:
            raise KeyError(f"{node!r} is not in this LRU")
        setattr(p, N, n)
        setattr(n, P, p)
        setattr(node, P, None)
        setattr(node, N, None)

    def remove(self, node) -> None:
        self._unlink(node)
        self.size -= 1

    def insert_mru(self, node) -> None:
        self._link_after(self.head, node)
        self.size += 1

    def insert_after(self, p, node) -> None:
        self._link_after(p, node)
        self.size += 1

    def reset_mru(self, node) -> None:
        self._unlink(node)
        self._link_after(self.head, node)

    def reset_path_mru(self, node, budget: float, has: Callable) -> None:
        """Move node and its ancestors within `budget` tokens to the front, node first (most recent); a root
        (any namespace's) ends the walk."""
        after = self.head
        used = 0
        P = self.p
        while node.parent is not None and used < budget:
            if has(node):
                if getattr(node, P) is not after:  # already in place (a repeated hit): nothing to move
                    self._unlink(node)
                    self._link_after(after, node)
                after = node
            used += node.n
            node = node.parent

    def prev_unlocked(self, node) -> Optional[object]:
        """The next older node whose lock for this component is 0 (None at the end)."""
        P, lock = self.p, self.lock
        x = getattr(node, P)
        while getattr(x, lock):
            x = getattr(x, P)
        return None if x is self.head else x

    def oldest_unlocked(self):
        return self.prev_unlocked(self.tail)

    def order(self) -> list:
        """Most recent first (for the checker and tests)."""
        N = self.n
        out, x = [], getattr(self.head, N)
        while x is not self.tail:
            out.append(x)
            x = getattr(x, N)
        return out


class Component:
    """Hooks of one auxiliary component. Defaults are a component that holds nothing."""

    name = ""
    lock_attr = ""
    link_attrs = ("", "")  # the node slots that thread this component's LRU (prev, next)
    internal_priority = 0  # FULL is 2; an internal eviction cascades to components of lower or equal priority

    def __init__(self, tree: "HybridTree"):
        self.tree = tree
        self.lru = Lru(self.lock_attr, *self.link_attrs, tree._sentinel)

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
