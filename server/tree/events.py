"""KV events as the tree records them (SPEC-tiers section 6): per medium, coalesced, from a bounded queue.

The tree appends raw records (lazy page spans, no hashing) on the request path; the engine takes them with
`take_records()` (a list swap), wraps them with `raw_events()` and materializes them (hashes, coalesces) off
it, then publishes. Medium names follow SGLang:
"GPU" for the device tier, "CPU_PINNED" for the host tier.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

import numpy as np

from .hashes import block_hash, block_hashes, namespaced, span_digests, span_last, span_seed

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
    lora_name: Optional[str] = None  # the adapter: the namespace's extra_key (namespaces the block hashes)
    group_idx: Optional[int] = None  # hybrid models: which component (vLLM's KV cache group), see hybrid.py
    kv_cache_spec_kind: Optional[str] = None
    kv_cache_spec_sliding_window: Optional[int] = None


@dataclass(slots=True)
class BlockRemoved:
    """Pages that left a medium."""

    block_hashes: list[int]
    medium: str
    group_idx: Optional[int] = None


@dataclass(slots=True)
class AllBlocksCleared:
    """Everything is gone (reset)."""


Event = Union[BlockStored, BlockRemoved, AllBlocksCleared]


STORED, REMOVED, CLEARED = 0, 1, 2  # raw record kinds: (STORED, span, parent span, key, medium, salt, lora),
# (REMOVED, [span, ...], medium), (CLEARED,)


class Coalescer:
    """Merges neighbours (R6.4): a store continuing the tail's chain, or a remove of the tail's medium."""

    def __init__(self) -> None:
        self.events: list[Event] = []

    def push(self, ev: Event) -> None:
        tail = self.events[-1] if self.events else None
        if isinstance(ev, BlockStored) and isinstance(tail, BlockStored) and tail.block_hashes and \
                (tail.medium, tail.block_size, tail.cache_salt, tail.lora_name, tail.group_idx) == \
                (ev.medium, ev.block_size, ev.cache_salt, ev.lora_name, ev.group_idx) and \
                ev.parent_block_hash == tail.block_hashes[-1]:
            tail.block_hashes.extend(ev.block_hashes)
            tail.token_ids.extend(ev.token_ids)
            return
        if isinstance(ev, BlockRemoved) and isinstance(tail, BlockRemoved) and \
                (tail.medium, tail.group_idx) == (ev.medium, ev.group_idx):
            tail.block_hashes.extend(ev.block_hashes)
            return
        self.events.append(ev)


@dataclass
class EventQueue:
    """The tree's bounded queue of raw records: appending one costs no hashing and no list building."""

    limit: int = 1 << 20
    records: list = field(default_factory=list)
    dropped: int = 0  # records lost to the bound since the last take (consumers must resynchronise)

    def push_raw(self, rec: tuple) -> None:
        if len(self.records) < self.limit:
            self.records.append(rec)
        else:
            self.dropped += 1

    def take(self) -> tuple[list, int]:
        """The queued records in order, and how many were dropped; leaves the queue empty."""
        out, lost = self.records, self.dropped
        self.records, self.dropped = [], 0
        return out, lost


class ReadyEvents:
    """Events a tree hashed already (the hybrid tree's), published by the hub like raw records."""

    __slots__ = ("events",)

    def __init__(self, events: list):
        self.events = events

    def __len__(self) -> int:
        return len(self.events)

    def materialize(self) -> list:
        return self.events


class RawEvents:
    """Records taken from the tree, turned into events (hashing the pages) by `materialize()`, anywhere.

    Safe on another thread while the tree goes on: records hold immutable keys and spans only.
    """

    __slots__ = ("records", "page_size", "key_dtype", "bigram")

    def __init__(self, records: list, page_size: int, key_dtype: str, bigram: bool):
        self.records, self.page_size, self.key_dtype, self.bigram = records, page_size, key_dtype, bigram

    def __len__(self) -> int:
        return len(self.records)

    def materialize(self) -> list[Event]:
        """The coalesced events, with block hashes (native hashing releases the GIL)."""
        out = Coalescer()
        for rec in self.records:
            kind = rec[0]
            if kind == STORED:
                _, span, parent, key, medium, salt, lora = rec
                seed = span_seed(span)  # a namespace's published hashes are its own (hashes.py)
                hashes = namespaced(block_hashes(span_digests(span)), seed)
                prev = namespaced([block_hash(span_last(parent))], seed)[0] if parent is not None else None
                toks = np.frombuffer(key, self.key_dtype)
                if self.bigram:  # an atom is a pair, published as SGLang does: [first, second]
                    ids = list(zip((toks >> 32).tolist(), (toks & 0xFFFFFFFF).astype(np.int32).tolist()))
                else:
                    ids = toks.tolist()
                out.push(BlockStored(hashes, prev, ids, self.page_size, medium, salt, lora))
            elif kind == REMOVED:
                hashes = []
                for sp in rec[1]:
                    hashes += namespaced(block_hashes(span_digests(sp)), span_seed(sp))
                out.push(BlockRemoved(hashes, rec[2]))
            else:
                out.push(AllBlocksCleared())
        return out.events
