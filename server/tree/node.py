"""The tree node: packed key/value bytes, device and host values kept apart."""
from __future__ import annotations

from typing import Optional


class Node:
    """One radix edge.

    `key` is packed tokens; `value` packed int32 device slots (None: not on device); `host_value` packed
    int32 host slots (None: not on host). A non-root node at rest holds at least one of the two.
    """

    __slots__ = (
        "id", "parent", "children", "key", "value", "host_value", "lock_ref", "host_lock_ref",
        "last_access", "created", "hit_count", "priority", "dver", "hver", "ns", "pending", "loading", "hashes",
        "hpin", "hstate",
    )

    def __init__(self, node_id: int, parent: Optional["Node"], key: bytes, value: Optional[bytes],
                 tick: int, priority: int, ns: tuple[str, str]):
        self.id = node_id
        self.parent = parent
        self.children: dict[bytes, Node] = {}
        self.key = key
        self.value = value
        self.host_value: Optional[bytes] = None
        self.lock_ref = 0  # device locks: receipts at or below this node
        self.host_lock_ref = 0  # host locks: anchored on this node only
        self.last_access = tick
        self.created = tick
        self.hit_count = 0
        self.priority = priority
        self.dver = 0  # bumped whenever this node's device-heap entry goes stale
        self.hver = 0  # the same for the host heap
        self.ns = ns
        self.pending = 0  # ack id of the device->host backup covering this node (0: none)
        self.loading = 0  # id of the load-back that will make this node device-resident (0: none)
        self.hashes: Optional[tuple] = None  # lazy page digests (a hashes.Span), made when events or L3 need them
        self.hpin = 0  # host locks (receipts, load-backs) anchored at or below this node
        self.hstate = 0  # where its host tokens count: 0 nowhere, 1 host-evictable, 2 host-protected

    @property
    def num_tokens(self) -> int:
        """Token positions on this edge (values are int32, 4 bytes each)."""
        return len(self.value) // 4 if self.value is not None else len(self.host_value or b"") // 4

    @property
    def tier(self) -> str:
        """'device', 'both', 'host' or 'dead' (never at rest)."""
        if self.value is not None:
            return "both" if self.host_value is not None else "device"
        return "host" if self.host_value is not None else "dead"

    def __repr__(self) -> str:
        return (f"Node(id={self.id:#x}, tokens={self.num_tokens}, tier={self.tier}, lock_ref={self.lock_ref}, "
                f"host_lock_ref={self.host_lock_ref}, children={len(self.children)})")
