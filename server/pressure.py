"""Slot pressure: an Alloc that finds the pool short while other sessions hold slots asks them for their stocks
back and waits a moment before it is refused.

Engines keep stocks of held slots for their stores (client/background.py). radixd cannot take held slots back
(their holder may be writing into them), so it asks: a counter in a small shared-memory segment, named in
GetInfo, goes up; a stock holder on the node watches it and frees its stock; every Free, Unlock and session end
wakes the waiting Alloc, which tries again until `GRACE` seconds have passed.
"""
from __future__ import annotations

import asyncio
import struct
import time
from typing import Awaitable, Callable, TypeVar

from .errors import Exhausted
from .pools.shm import ShmRegion, segment_name

GRACE = 0.5  # seconds an Alloc waits for stocks to come back before it is refused
T = TypeVar("T")


class Pressure:
    """The counter stock holders watch, and the wake-up for Allocs waiting on their returns."""

    def __init__(self, instance_id: str, shared: bool = True, grace: float = GRACE):
        self.grace = grace
        self.count = 0
        self.waited = 0  # Allocs that waited (metrics, tests)
        self.rescued = 0  # of those, the ones a return let through
        self._region = ShmRegion(segment_name(instance_id, "pressure"), 64, create=True) if shared else None
        self._waiters: set[asyncio.Future] = set()

    @property
    def segment(self) -> str:
        return self._region.name if self._region is not None else ""

    def freed(self) -> None:
        """Something may have come back (a Free, an Unlock, a session's end): waiting Allocs try again."""
        for f in self._waiters:
            if not f.done():
                f.set_result(None)

    def _bump(self) -> None:
        self.count += 1
        if self._region is not None:
            struct.pack_into("<Q", self._region.mm, 0, self.count)

    async def alloc(self, attempt: Callable[[], Awaitable[T]], others_hold: Callable[[], int]) -> T:
        """attempt(), and when it is refused for room while other sessions hold slots, again after each return
        until the grace ends; the last refusal says what other sessions held."""
        try:
            return await attempt()
        except Exhausted:
            if not others_hold() or self.grace <= 0:
                raise
        self._bump()
        self.waited += 1
        deadline = time.monotonic() + self.grace
        while True:
            left = deadline - time.monotonic()
            if left > 0:
                wake = asyncio.get_running_loop().create_future()
                self._waiters.add(wake)
                try:
                    await asyncio.wait_for(wake, left)
                except asyncio.TimeoutError:
                    pass
                finally:
                    self._waiters.discard(wake)
            try:
                out = await attempt()
            except Exhausted as e:
                if time.monotonic() < deadline:
                    continue
                held = others_hold()
                raise Exhausted(f"{e}; other sessions hold {held} slots, not returned within "
                                f"{self.grace * 1000:.0f} ms of asking") from None
            self.rescued += 1
            return out

    def close(self) -> None:
        if self._region is not None:
            self._region.close()
