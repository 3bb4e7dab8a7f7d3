"""Page-granular slot allocator with per-slot ownership, vectorised over numpy."""
from __future__ import annotations

import numpy as np

FREE, TREE, HELD, IN_FLIGHT = 0, 1, 2, 3
STATE_NAMES = ("free", "tree", "held", "in_flight")
NO_OWNER = 0


class SlotError(Exception):
    """A slot operation that would break ownership (double free, foreign slot, out of range)."""


class OutOfSlots(SlotError):
    """Not enough free pages for an allocation."""


class SlotAllocator:
    """Slots move free -> held(owner) -> tree -> free; every move is validated and counted."""

    def __init__(self, num_slots: int, page_size: int = 1):
        if num_slots < 1 or page_size < 1 or num_slots % page_size:
            raise ValueError("num_slots must be a positive multiple of page_size")
        self.capacity = num_slots
        self.page_size = page_size
        self.state = np.zeros(num_slots, dtype=np.uint8)
        self.owner = np.zeros(num_slots, dtype=np.int32)
        n_pages = num_slots // page_size
        self._stack = np.arange(n_pages - 1, -1, -1, dtype=np.int64)  # pop from the end: page 0 first
        self._top = n_pages
        self._offsets = np.arange(page_size, dtype=np.int64)
        self.counts = [num_slots, 0, 0, 0]
        self._scratch = np.zeros(num_slots, dtype=np.int64)

    @property
    def free_slots(self) -> int:
        return self.counts[FREE]

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def free_pages(self) -> int:
        return self._top

    def alloc(self, num_tokens: int, owner: int) -> np.ndarray:
        """Whole pages for num_tokens, held by owner; all or nothing."""
        return self.alloc_many([num_tokens], owner)[0]

    def alloc_many(self, sizes: list[int], owner: int) -> list[np.ndarray]:
        """One all-or-nothing allocation per size (each rounded up to whole pages)."""
        pages = [self.pages_for(n) for n in sizes]
        need = sum(pages)
        if need > self._top:
            raise OutOfSlots(f"need {need} pages, {self._top} free")
        taken = self._stack[self._top - need:self._top][::-1].copy()
        self._top -= need
        slots = (taken[:, None] * self.page_size + self._offsets).reshape(-1)
        self.state[slots] = HELD
        self.owner[slots] = owner
        self.counts[FREE] -= slots.size
        self.counts[HELD] += slots.size
        out, at = [], 0
        for p in pages:
            out.append(slots[at:at + p * self.page_size])
            at += p * self.page_size
        return out

    def validate(self, slots: np.ndarray, state: int, owner: int | None = None) -> None:
        """Raise SlotError unless every slot is distinct, in range, in `state` (and owned by `owner`)."""
        if slots.size == 0:
            return
        lo, hi = int(slots.min()), int(slots.max())
        if lo < 0 or hi >= self.capacity:
            raise SlotError(f"slot index out of range [0, {self.capacity}): {lo if lo < 0 else hi}")
        order = np.arange(slots.size)
        self._scratch[slots] = order  # last write wins: a repeated slot leaves an earlier position mismatched
        if (self._scratch[slots] != order).any():
            raise SlotError("slot indices repeat")
        wrong = self.state[slots] != state
        if owner is not None:
            wrong |= self.owner[slots] != owner
        if wrong.any():
            i = int(np.flatnonzero(wrong)[0])
            s = int(slots[i])
            raise SlotError(f"slot {s} is {STATE_NAMES[self.state[s]]} (owner {self.owner[s]}), "
                            f"expected {STATE_NAMES[state]}" + (f" held by {owner}" if owner is not None else ""))

    def move(self, slots: np.ndarray, src: int, dst: int, owner: int | None = None, new_owner: int = NO_OWNER,
             check: bool = True) -> None:
        """Move slots between states after validating them; freed pages return to the pool."""
        slots = np.asarray(slots, dtype=np.int64)
        if check:
            self.validate(slots, src, owner)
        if slots.size == 0:
            return
        self.state[slots] = dst
        self.owner[slots] = new_owner
        self.counts[src] -= slots.size
        self.counts[dst] += slots.size
        if dst == FREE:
            self._release_pages(slots)

    def _release_pages(self, slots: np.ndarray) -> None:
        p = self.page_size
        if p == 1:
            pages = slots
        else:
            pages = np.unique(slots // p)
            pages = pages[(self.state.reshape(-1, p)[pages] == FREE).all(axis=1)]
        self._stack[self._top:self._top + pages.size] = pages
        self._top += pages.size

    def free(self, slots: np.ndarray, owner: int) -> None:
        """Return slots the owner holds."""
        self.move(slots, HELD, FREE, owner)

    def held_by(self, owner: int) -> np.ndarray:
        """Every slot an owner holds (O(capacity); used when a session ends)."""
        return np.flatnonzero((self.owner == owner) & (self.state == HELD))

    def check(self) -> list[str]:
        """Conservation and free-list consistency, recomputed from scratch."""
        bad = []
        real = np.bincount(self.state, minlength=4)[:4].tolist()
        if real != self.counts:
            bad.append(f"slot counts {dict(zip(STATE_NAMES, self.counts))} != recomputed {dict(zip(STATE_NAMES, real))}")
        if sum(self.counts) != self.capacity:
            bad.append(f"free + tree + held + in_flight = {sum(self.counts)} != capacity {self.capacity}")
        stack = self._stack[:self._top]
        fully_free = np.flatnonzero((self.state.reshape(-1, self.page_size) == FREE).all(axis=1))
        if np.unique(stack).size != stack.size or not np.array_equal(np.sort(stack), fully_free):
            bad.append(f"free-page list ({stack.size} pages) != fully free pages ({fully_free.size})")
        if (self.owner[self.state != HELD] != NO_OWNER).any():
            bad.append("a slot not held has an owner")
        return bad
