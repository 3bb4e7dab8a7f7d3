"""The asynchronous copy engine: page copies run off the event loop, completions come back to it.

One worker thread copies in submission order (a write-through parent is on host before its child), so
the tree and the gRPC handlers never block on a copy. A completion runs its callback on the event loop,
where the engine owns all state; waiters are woken there too.
"""
from __future__ import annotations

import asyncio
import itertools
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np

from radixd.server.pools.pool import KVPool

from .pages import PageCopier

DIRECTIONS = ("d2h", "h2d")  # backup (device -> host) and load-back (host -> device)


@dataclass
class Transfer:
    """One submitted batch of page copies and, once done, how it went."""

    id: int
    direction: str
    tokens: int
    nbytes: int
    owner: str = ""  # session id of the client it serves ("" for the server's own backups)
    done: bool = False
    ok: bool = False
    error: str = ""
    seconds: float = 0.0
    ipc_event_handle: bytes = b""  # GPU load-back: the interprocess event a worker's stream can wait on
    future: Optional[asyncio.Future] = field(default=None, repr=False)
    enqueued: Optional[asyncio.Future] = field(default=None, repr=False)  # GPU + ipc: set once the event is recorded
    event: Any = field(default=None, repr=False)  # kept while the transfer is remembered: importers may open it late


def copier_for(src: KVPool, dst: KVPool) -> Any:
    """The page copier between two pools: CUDA streams when one is on a GPU, numpy/torch gathers otherwise."""
    if "cuda" in (src.backend, dst.backend):
        from .cuda import CudaPageCopier
        return CudaPageCopier(src, dst)
    return PageCopier(src, dst)


class TransferEngine:
    """Submit copies, get a Transfer; `on_done(transfer)` runs on the event loop when the copy is over."""

    def __init__(self, max_kept: int = 4096):
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="radixd-copy")
        self._copiers: dict[tuple[int, int], PageCopier] = {}
        self._ids = itertools.count(1)
        self.active: dict[int, Transfer] = {}
        self.finished: dict[int, Transfer] = {}  # the most recent, for WaitTransfers after the fact
        self._max_kept = max_kept
        self.fail_next = 0  # test hook: make the next N copies fail as a broken copy would
        self.listeners: list[Callable[[Transfer], None]] = []

    def _copier(self, src: KVPool, dst: KVPool) -> Any:
        key = (id(src), id(dst))
        c = self._copiers.get(key)
        if c is None:
            c = self._copiers[key] = copier_for(src, dst)
        return c

    def prepare(self, a: KVPool, b: KVPool) -> None:
        """Build the copiers both ways at start: the first copy must not import or set up on the event loop."""
        self._copier(a, b)
        self._copier(b, a)

    def submit(self, direction: str, src: KVPool, src_slots: np.ndarray, dst: KVPool, dst_slots: np.ndarray,
               on_done: Callable[[Transfer], None], owner: str = "", ipc: bool = False) -> Transfer:
        """Queue a copy of whole pages; never blocks. on_done always runs, once, on the event loop.

        With `ipc` and a CUDA pool, `t.enqueued` resolves once the copy's interprocess event is recorded
        (`t.ipc_event_handle`); a worker may then wait on it instead of on the whole transfer."""
        copier = self._copier(src, dst)
        src_slots = np.array(src_slots, dtype=np.int64)
        dst_slots = np.array(dst_slots, dtype=np.int64)
        t = Transfer(next(self._ids), direction, int(src_slots.size), int(src_slots.size) * src.spec.slot_bytes,
                     owner)
        fail = self.fail_next > 0
        self.fail_next -= fail
        loop = asyncio.get_running_loop()
        notify = None
        if ipc and hasattr(copier, "enqueue"):
            t.enqueued = loop.create_future()

            def notify(handle: bytes, event: Any, t: Transfer = t) -> None:
                t.ipc_event_handle, t.event = handle, event  # an exported event must outlive its importers' use
                loop.call_soon_threadsafe(lambda: t.enqueued.done() or t.enqueued.set_result(handle))
        t.future = loop.run_in_executor(self._pool, self._run, copier, src_slots, dst_slots, fail, notify)
        self.active[t.id] = t

        def finished(fut: asyncio.Future) -> None:
            t.done = True
            if t.enqueued is not None and not t.enqueued.done():
                t.enqueued.set_result(b"")  # failed before its event was recorded: waiters go by `ok`
            exc = fut.exception()
            if exc is None:
                t.ok, t.seconds = True, fut.result()
            else:
                t.error = f"{type(exc).__name__}: {exc}"
            del self.active[t.id]
            self.finished[t.id] = t
            if len(self.finished) > self._max_kept:
                del self.finished[next(iter(self.finished))]
            on_done(t)
            for listener in self.listeners:
                listener(t)
        t.future.add_done_callback(finished)
        return t

    @staticmethod
    def _run(copier: Any, src_slots: np.ndarray, dst_slots: np.ndarray, fail: bool,
             notify: Optional[Callable[[bytes, Any], None]] = None) -> float:
        t0 = time.perf_counter()
        if fail:
            raise OSError("injected copy failure")
        if notify is None:
            copier.copy(src_slots, dst_slots)
        else:  # GPU: record the interprocess event, hand its handle out, then wait for the stream
            event, handle = copier.enqueue(src_slots, dst_slots, ipc=True)
            notify(handle, event)
            copier.finish(event)
        return time.perf_counter() - t0

    def get(self, tid: int) -> Optional[Transfer]:
        """A transfer still running or recently finished."""
        return self.active.get(tid) or self.finished.get(tid)

    async def wait(self, ids: list[int], timeout: Optional[float]) -> list[Transfer]:
        """Wait until all `ids` are done or the timeout passes; returns the ones that are done."""
        pending = [self.active[i].future for i in ids if i in self.active]
        if pending:
            await asyncio.wait(pending, timeout=timeout)  # each future's own done callback ran first
        return [t for t in (self.get(i) for i in ids) if t is not None and t.done]

    async def drain(self) -> None:
        """Wait for every queued copy to complete (callbacks included)."""
        while self.active:
            await asyncio.wait([t.future for t in self.active.values()])

    def close(self) -> None:
        self._pool.shutdown(wait=True)
