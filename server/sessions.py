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

    def add_receipt(self, s: Session, receipt: int) -> None:
        s.receipts.add(receipt)
        self._receipt_owner[receipt] = s

    def take_receipt(self, s: Session, receipt: int, check_only: bool = False) -> None:
        """Validate (and unless check_only, drop) a receipt the session must own."""
        if receipt not in s.receipts:
            other = self._receipt_owner.get(receipt)
            if other is not None:
                raise Conflict(f"receipt {receipt:#x} belongs to another session")
            raise NotFound(f"receipt {receipt:#x} is unknown or already released")
        if not check_only:
            s.receipts.discard(receipt)
            self._receipt_owner.pop(receipt, None)

    def __len__(self) -> int:
        return len(self._by_id)

    def __iter__(self):
        return iter(list(self._by_id.values()))

    @property
    def receipt_count(self) -> int:
        return len(self._receipt_owner)
