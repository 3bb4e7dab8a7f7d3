"""The first pages radixd holds, as a hash set in shared memory: the relay process writes it from the KV events, an
engine reads it with no thread, no lock and no system call of its own (`LocalIndex.known_miss`). Entries never move
while a reader may probe them (removal leaves a tombstone; a rebuild goes to the other half, then the header counts
it, and a reader whose probe a rebuild overtook probes again), so a read racing a write can miss a page being added
(a lost hit) or see one being removed (a lookup radixd then answers), never miss a page that stays."""
from __future__ import annotations

import mmap
import os
from typing import Iterable

EMPTY, TOMB = 0, 1
_GEN, _STATE, _SEEN, _SLOTS = 0, 1, 2, 3  # header words: rebuilds so far (the active half is its parity), state,
# the next event batch seq, slots per half
STARTING, READY, RESYNC, NO_EVENTS = 0, 1, 2, 3  # the follower's state
_HEADER = 8


def _key(h: int) -> int:
    """A hash as stored: the two marker values move aside (a collision there is a false 'held': one lookup)."""
    return h if h > TOMB or h < EMPTY else h + 2


class FirstPages:
    """The table over a shared buffer: int64 header words, then two halves of `slots` int64 entries each."""

    def __init__(self, fd: int, slots: int = 0):
        """Map the table in memfd `fd`; with `slots` (a power of two), size and initialise it first (the writer)."""
        if slots:
            if slots & (slots - 1):
                raise ValueError(f"slots must be a power of two, not {slots}")
            os.ftruncate(fd, 8 * (_HEADER + 2 * slots))
        self.fd = fd
        self._map = mmap.mmap(fd, 0)
        self._w = memoryview(self._map).cast("q")
        if slots:
            self._w[_SLOTS] = slots
        self.slots = self._w[_SLOTS]
        self._mask = self.slots - 1
        self._used = 0  # writer: live entries plus tombstones in the active half
        self._live: dict[int, int] = {}  # writer: what the active half holds (key -> hashes added under it)

    @classmethod
    def create(cls, max_pages: int) -> "FirstPages":
        """A new table for up to `max_pages` first pages (kept at most a quarter full: short probes)."""
        slots = 1024
        while slots < 4 * max_pages:
            slots *= 2
        return cls(os.memfd_create("radixd-first-pages", os.MFD_CLOEXEC), slots)

    # ------------------------------------------------------------------ reader
    @property
    def state(self) -> int:
        return self._w[_STATE]

    @property
    def seen(self) -> int:
        """Every event batch before this seq is reflected (while the state is READY)."""
        return self._w[_SEEN]

    def __contains__(self, h: int) -> bool:
        w, mask = self._w, self._mask
        k = _key(h)
        while True:
            gen = w[_GEN]
            base = _HEADER + (gen & 1) * self.slots
            i = k & mask
            while True:
                v = w[base + i]
                if v == k or v == EMPTY:
                    break
                i = (i + 1) & mask
            if w[_GEN] == gen:  # (else a rebuild went on under this probe, maybe into its half: again)
                return v == k

    # ------------------------------------------------------------------ writer
    def set_state(self, state: int, seen: int = -1) -> None:
        if seen >= 0:
            self._w[_SEEN] = seen
        self._w[_STATE] = state

    def add(self, h: int) -> None:
        """One more page under h's key (add and remove pair up: a page held twice is added twice)."""
        k = _key(h)
        n = self._live.get(k, 0)
        self._live[k] = n + 1
        if n:
            return
        if 2 * (self._used + 1) > self.slots:  # (tombstones pile up: rebuild into the other half)
            self._rebuild()
            return
        w, mask = self._w, self._mask
        base = _HEADER + (w[_GEN] & 1) * self.slots
        i = k & mask
        v = w[base + i]
        while v != EMPTY and v != TOMB:  # (hashes are signed: a negative one is no marker)
            i = (i + 1) & mask
            v = w[base + i]
        if v == EMPTY:
            self._used += 1
        w[base + i] = k

    def remove(self, h: int) -> None:
        k = _key(h)
        n = self._live.get(k, 0)
        if n > 1:
            self._live[k] = n - 1
            return
        if not n:
            return
        del self._live[k]
        w, mask = self._w, self._mask
        base = _HEADER + (w[_GEN] & 1) * self.slots
        i = k & mask
        while w[base + i] != k:
            i = (i + 1) & mask
        w[base + i] = TOMB

    def reset(self, hashes: Iterable[int]) -> None:
        """Hold exactly `hashes` (each once)."""
        live: dict[int, int] = {}
        for h in hashes:
            k = _key(h)
            live[k] = live.get(k, 0) + 1
        self._live = live
        self._rebuild()

    def _rebuild(self) -> None:
        """Write what `_live` holds into the other half, then make it the active one."""
        keys = self._live
        if 2 * len(keys) > self.slots:
            raise OverflowError(f"{len(keys)} first pages do not fit a table of {self.slots}")
        w, mask, n = self._w, self._mask, self.slots
        gen = w[_GEN] + 1
        base = _HEADER + (gen & 1) * n
        w[base:base + n] = memoryview(bytes(8 * n)).cast("q")
        for k in keys:
            i = k & mask
            while w[base + i] != EMPTY:
                i = (i + 1) & mask
            w[base + i] = k
        w[_GEN] = gen
        self._used = len(keys)

    def close(self) -> None:
        self._w.release()
        self._map.close()
        os.close(self.fd)
