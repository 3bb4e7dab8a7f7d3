"""Sessions: one per attached client stream; they own held slots and lock receipts."""
from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from typing import Optional

from .errors import Conflict, NotFound


@dataclass
class Session:
    """A client's lease on slots and locks; `owner` is its id in the slot allocator."""

    session_id: str
    owner: int
    client_name: str
    receipts: set[int] = field(default_factory=set)
    started: float = field(default_factory=time.time)
    events: asyncio.Queue = field(default_factory=asyncio.Queue)  # transfer completions for its stream


class SessionTable:
    """Live sessions by id, plus which session holds each receipt."""

    def __init__(self):
        self._by_id: dict[str, Session] = {}
        self._receipt_owner: dict[int, Session] = {}
        self._since: dict[int, float] = {}  # receipt -> when taken (monotonic); insertion order is age order
        self._expired: dict[int, None] = {}  # receipts released by the lease, newest last (bounded)
        self._next_owner = 1

    def create(self, client_name: str) -> Session:
        s = Session(uuid.uuid4().hex, self._next_owner, client_name)
        self._next_owner += 1
        self._by_id[s.session_id] = s
        return s

    def get(self, session_id: str) -> Session:
        s = self._by_id.get(session_id)
        if s is None:
            raise NotFound(f"unknown or ended session {session_id!r} (attach first; a restarted server "
                           "forgets every session)")
        return s

    def find(self, session_id: str) -> Optional[Session]:
        return self._by_id.get(session_id)

    def alive(self, s: Session) -> bool:
        return self._by_id.get(s.session_id) is s

    def remove(self, s: Session) -> None:
        self._by_id.pop(s.session_id, None)
        for r in s.receipts:
            self._receipt_owner.pop(r, None)
            self._since.pop(r, None)

    def add_receipt(self, s: Session, receipt: int) -> None:
        s.receipts.add(receipt)
        self._receipt_owner[receipt] = s
        self._since[receipt] = time.monotonic()

    def oldest_receipt_age(self) -> float:
        """Seconds the oldest live receipt has been held (0 without any)."""
        for t in self._since.values():
            return time.monotonic() - t
        return 0.0

    def older_than(self, seconds: float) -> list[tuple[int, Session]]:
        """Receipts held longer than `seconds`, oldest first."""
        cutoff = time.monotonic() - seconds
        out = []
        for r, t in self._since.items():
            if t > cutoff:
                break
            out.append((r, self._receipt_owner[r]))
        return out

    def expire(self, s: Session, receipt: int) -> None:
        """The lease released this receipt: drop it, and remember it so a later use says why."""
        self.take_receipt(s, receipt)
        self._expired[receipt] = None
        if len(self._expired) > 100_000:
            del self._expired[next(iter(self._expired))]

    def take_receipt(self, s: Session, receipt: int, check_only: bool = False) -> None:
        """Validate (and unless check_only, drop) a receipt the session must own."""
        if receipt not in s.receipts:
            other = self._receipt_owner.get(receipt)
            if other is not None:
                raise Conflict(f"receipt {receipt:#x} belongs to another session")
            if receipt in self._expired:
                raise NotFound(f"receipt {receipt:#x} expired: it was held longer than --lock-lease-seconds and "
                               "released by the server")
            raise NotFound(f"receipt {receipt:#x} is unknown or already released")
        if not check_only:
            s.receipts.discard(receipt)
            self._receipt_owner.pop(receipt, None)
            self._since.pop(receipt, None)

    def __len__(self) -> int:
        return len(self._by_id)

    def __iter__(self):
        return iter(list(self._by_id.values()))

    @property
    def receipt_count(self) -> int:
        return len(self._receipt_owner)
