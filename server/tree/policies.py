"""Eviction policies as heap sort keys: the smallest key is evicted first."""
from __future__ import annotations

from typing import Callable, TYPE_CHECKING

if TYPE_CHECKING:
    from .node import Node

PolicyKey = Callable[["Node"], tuple]

# A node with at least this many hits leaves SLRU's probationary segment.
SLRU_PROTECTED_HITS = 2

POLICIES: dict[str, PolicyKey] = {
    "lru": lambda n: (n.last_access,),
    "mru": lambda n: (-n.last_access,),
    "fifo": lambda n: (n.created,),
    "filo": lambda n: (-n.created,),
    "lfu": lambda n: (n.hit_count, n.last_access),
    "priority": lambda n: (n.priority, n.last_access),
    "slru": lambda n: (n.hit_count >= SLRU_PROTECTED_HITS, n.last_access),
}


def policy_key(name: str) -> PolicyKey:
    """Return the sort-key function for an eviction policy name."""
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; choose one of {sorted(POLICIES)}") from None
