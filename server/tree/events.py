"""KV events as the tree records them (SPEC-tiers section 6): per medium, coalesced, in a bounded queue.

The tree appends; the engine drains with `take_events()` and publishes. Medium names follow SGLang:
"GPU" for the device tier, "CPU_PINNED" for the host tier.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

GPU, CPU = "GPU", "CPU_PINNED"


@dataclass(slots=True)
class BlockStored:
    """Pages that became cached on a medium; parent_block_hash chains them to the page before."""

    block_hashes: list[int]
    parent_block_hash: Optional[int]
    token_ids: list[int]
    block_size: int
    medium: str
    cache_salt: Optional[str] = None


@dataclass(slots=True)
class BlockRemoved:
    """Pages that left a medium."""

    block_hashes: list[int]
    medium: str


@dataclass(slots=True)
class AllBlocksCleared:
    """Everything is gone (reset)."""


Event = Union[BlockStored, BlockRemoved, AllBlocksCleared]


@dataclass
class EventQueue:
    """Coalescing queue (R6.4): a store continuing the tail's chain, or a remove of the tail's medium, merges."""

    limit: int = 1 << 20
    events: list = field(default_factory=list)
    dropped: int = 0  # events lost to the bound since the last take (consumers must resynchronise)

    def push(self, ev: Event) -> None:
        tail = self.events[-1] if self.events else None
        if isinstance(ev, BlockStored) and isinstance(tail, BlockStored) and tail.block_hashes and \
                (tail.medium, tail.block_size, tail.cache_salt) == (ev.medium, ev.block_size, ev.cache_salt) and \
                ev.parent_block_hash == tail.block_hashes[-1]:
            tail.block_hashes.extend(ev.block_hashes)
            tail.token_ids.extend(ev.token_ids)
            return
        if isinstance(ev, BlockRemoved) and isinstance(tail, BlockRemoved) and tail.medium == ev.medium:
            tail.block_hashes.extend(ev.block_hashes)
            return
        if len(self.events) >= self.limit:
            self.dropped += 1
            return
        self.events.append(ev)

    def take(self) -> tuple[list[Event], int]:
        """The queued events in order, and how many were dropped; leaves the queue empty."""
        out, lost = self.events, self.dropped
        self.events, self.dropped = [], 0
        return out, lost
