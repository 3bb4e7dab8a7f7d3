"""The tree node: packed key/value bytes, tier values kept apart for the host tier."""
from __future__ import annotations

from typing import Optional


class Node:
    """One radix edge; `key` is packed tokens, `value` packed int32 device slots (None = not on device)."""

    __slots__ = (
        "id", "parent", "children", "key", "value", "host_value", "lock_ref",
        "last_access", "created", "hit_count", "priority", "hver", "ns",
    )

    def __init__(self, node_id: int, parent: Optional["Node"], key: bytes, value: Optional[bytes],
                 tick: int, priority: int, ns: tuple[str, str]):
        self.id = node_id
        self.parent = parent
        self.children: dict[bytes, Node] = {}
        self.key = key
        self.value = value
        self.host_value: Optional[bytes] = None
        self.lock_ref = 0
        self.last_access = tick
        self.created = tick
        self.hit_count = 0
        self.priority = priority
        self.hver = 0  # bumped whenever this node's heap entry goes stale
        self.ns = ns

    @property
    def num_tokens(self) -> int:
        """Token positions on this edge (values are int32, 4 bytes each)."""
        return len(self.value) // 4 if self.value is not None else len(self.host_value or b"") // 4

    def __repr__(self) -> str:
        return f"Node(id={self.id:#x}, tokens={self.num_tokens}, lock_ref={self.lock_ref}, children={len(self.children)})"
