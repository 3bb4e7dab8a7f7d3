"""What the tree hands back: results of its operations and the plans the engine executes."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

_EMPTY = np.zeros(0, dtype=np.int32)


def _slots(parts: list[bytes]) -> np.ndarray:
    return np.frombuffer(b"".join(parts), dtype="<i4") if parts else _EMPTY


@dataclass(slots=True)
class MatchResult:
    """Longest cached page-aligned prefix: device slots, device length, host extension and both end nodes."""

    indices: np.ndarray
    matched_len: int
    host_hit_len: int  # tokens beyond matched_len that a successful load-back would add
    node_id: int  # last device-resident node (lock it to protect `indices`)
    best_node_id: int = 0  # deepest matched node, device or host (lock or load back from it)


@dataclass(slots=True)
class BackupAction:
    """Copy these device slots to host: allocate host slots, copy, then commit_backup(ack, host_slots)."""

    ack: int
    node_ids: tuple[int, ...]
    device_slots: np.ndarray
    write_back: bool  # eviction asked for it: the node is demoted when the copy finishes

    @property
    def tokens(self) -> int:
        """Host slots the engine must allocate (evict_host first when fewer are free)."""
        return int(self.device_slots.size)


@dataclass(slots=True)
class InsertResult:
    """What insert did: which incoming slots the tree adopted, which the caller frees, what it keeps.

    The tree adopts the contiguous range [prefix_len, prefix_len + adopted_len) of the given slots (fresh
    leaf and re-evicted host-only nodes); `duplicates` are to be freed; `tail` stays with the caller.
    """

    prefix_len: int  # tokens of the key that were device-resident before this insert
    node_id: int
    duplicates: np.ndarray
    adopted_len: int
    tail: np.ndarray = field(default_factory=lambda: _EMPTY)
    unevicted_len: int = 0  # part of adopted_len that re-populated host-only nodes
    backups: tuple[BackupAction, ...] = ()


@dataclass(slots=True)
class HostInsertResult:
    """insert_host: the first `prefix_len` tokens were cached already (their host slots are duplicates);
    `adopted` host slots now belong to the tree; `dropped` ones (write-through closure) go back too."""

    prefix_len: int
    node_id: int
    duplicates: np.ndarray
    adopted: np.ndarray
    dropped: np.ndarray


@dataclass(slots=True)
class EvictResult:
    """Slots released by eviction (device or host, per call); the caller returns them to the allocator."""

    freed: np.ndarray
    evicted_tokens: int
    write_backs: tuple[BackupAction, ...] = ()  # write-back: copies that must finish before more is freed
    demoted_tokens: int = 0  # of evicted_tokens, how many stay cached on host
    spilled: tuple = ()  # evict_host(spill=True): (namespace, host slots, digests) of each evicted host node

    @property
    def write_back_tokens(self) -> int:
        """Tokens that will be freed once the write-backs finish."""
        return sum(a.tokens for a in self.write_backs)


@dataclass(slots=True)
class FreedSlots:
    """Slots of both tiers that the caller must return to their allocators."""

    device: np.ndarray
    host: np.ndarray


@dataclass(slots=True)
class LoadBackPlan:
    """A planned host->device load; `op` is 0 and `reason` says why when nothing will be loaded."""

    op: int
    node_ids: tuple[int, ...]
    host_slots: np.ndarray
    evict_tokens: int  # device tokens the caller must evict before allocating len(host_slots)
    reason: str = ""  # "", "resident", "threshold", "quota", "pinned", "no_room"

    @property
    def tokens(self) -> int:
        """Device slots the engine must allocate for the load."""
        return int(self.host_slots.size)


@dataclass(slots=True)
class TreeCounters:
    """Monotonic counters for observability."""

    hit_tokens: int = 0
    queried_tokens: int = 0
    evicted_tokens_device: int = 0
    evicted_tokens_host: int = 0
    inserted_tokens: int = 0
    host_hit_tokens: int = 0
    demoted_tokens: int = 0
    backup_tokens: int = 0
    load_back_tokens: int = 0
    reclaimed_host_tokens: int = 0
    storage_inserted_tokens: int = 0
