"""Eviction policies as heap sort keys: the smallest key is evicted first. A one-field key is the bare number, not a
1-tuple: the leaf heap compares keys on every push and pop, and a nested tuple costs it a second comparison level."""
from __future__ import annotations

from typing import Any, Callable, TYPE_CHECKING

if TYPE_CHECKING:
    from .node import Node

PolicyKey = Callable[["Node"], Any]  # a number or a tuple, the same kind for every node

# Default hits (inserts that touched a node) after which SLRU moves it out of probation, as SGLang.
DEFAULT_SLRU_THRESHOLD = 2


def _slru(threshold: int) -> PolicyKey:
    return lambda n: (n.hit_count >= threshold, n.last_access)


POLICIES: dict[str, PolicyKey] = {
    "lru": lambda n: n.last_access,
    "mru": lambda n: -n.last_access,
    "fifo": lambda n: n.created,
    "filo": lambda n: -n.created,
    "lfu": lambda n: (n.hit_count, n.last_access),
    "priority": lambda n: (n.priority, n.last_access),
    "slru": _slru(DEFAULT_SLRU_THRESHOLD),
}


def policy_key(name: str, slru_threshold: int = DEFAULT_SLRU_THRESHOLD) -> PolicyKey:
    """Return the sort-key function for an eviction policy name."""
    if name not in POLICIES:
        raise ValueError(f"unknown eviction policy {name!r}; choose one of {sorted(POLICIES)}")
    if name == "slru":
        if slru_threshold < 1:
            raise ValueError("slru_threshold must be >= 1")
        return _slru(slru_threshold)
    return POLICIES[name]
