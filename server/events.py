"""KV events out of the server: sequenced batches, a replay buffer, gRPC watchers and a ZMQ publisher.

ZMQ wire format (what vLLM 0.32 and SGLang 0.5.23 publish, so their routers follow radixd unchanged):
* PUB socket, one 3-frame message per batch: [topic, seq as 8-byte big-endian unsigned, payload]; seq
  counts from 0.
* payload = msgpack of the batch as a positional array [ts: float, events: list] (a data-parallel rank
  would be a third element; radixd has none, and like vLLM omits the default);
* each event a map tagged by "type": BlockStored {block_hashes, parent_block_hash, token_ids, block_size,
  lora_id, medium, lora_name (always: vLLM 0.32's decoder requires it; the adapter, i.e. the namespace's
  extra_key, or nil), cache_salt (only when set)}, BlockRemoved {block_hashes, medium}, AllBlocksCleared {}.
  With bigram (EAGLE) keys each token id is a [first, second] pair, as SGLang publishes them.
* Replay: a ROUTER socket; a DEALER sends [b"", start seq (8-byte big-endian)] and gets every buffered
  batch with seq >= start as [b"", topic, seq, payload], then [b"", b"", -1 (8-byte signed), b""].
The cache never waits for a consumer: PUB drops for slow subscribers, a slow gRPC watcher is told it lost
events and its stream ends.

Off the request path: after each RPC the loop only takes the tree's raw records (no hashing) and gives them
a sequence number; one publisher thread hashes the pages (natively, the GIL released) and encodes the
batch; the loop then buffers and sends it, in sequence order. A replay first waits for what was taken.
"""
from __future__ import annotations

import asyncio
import functools
import logging
import os
import stat
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional

import numpy as np

from radixd.proto import cache_pb2 as pb

from .tree.events import AllBlocksCleared, BlockRemoved, BlockStored, Event, RawEvents

try:  # resolve digests and encode the msgpack batch in C, the GIL released (setup.py builds it with OpenSSL)
    from ._kvevents import encode_batch as _native_encode
except ImportError:  # pragma: no cover - depends on the build machine
    _native_encode = None

NATIVE = _native_encode is not None
log = logging.getLogger("radixd.events")
END_MARKER = (-1).to_bytes(8, "big", signed=True)


def _msgspec_types():
    """The encoder's structs: the same shapes vLLM declares (tagged maps in a positional batch)."""
    import msgspec

    class _Stored(msgspec.Struct, tag="BlockStored", omit_defaults=True, gc=False):
        block_hashes: list[int]
        parent_block_hash: Optional[int]
        token_ids: list[int]
        block_size: int
        lora_id: Optional[int]
        medium: Optional[str]
        lora_name: Optional[str]  # no default: always written (vLLM's decoder requires the field)
        cache_salt: Optional[str] = None
        group_idx: Optional[int] = None  # hybrid models only (vLLM's KV cache group; omitted otherwise)
        kv_cache_spec_kind: Optional[str] = None
        kv_cache_spec_sliding_window: Optional[int] = None

    class _Removed(msgspec.Struct, tag="BlockRemoved", omit_defaults=True, gc=False):
        block_hashes: list[int]
        medium: Optional[str]
        group_idx: Optional[int] = None

    class _Cleared(msgspec.Struct, tag="AllBlocksCleared", omit_defaults=True, gc=False):
        pass

    class _Batch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
        ts: float
        events: list
        data_parallel_rank: Optional[int] = None

    return msgspec.msgpack.Encoder(), _Stored, _Removed, _Cleared, _Batch


def to_proto(seq: int, ts: float, events: list[Event]) -> pb.EventBatch:
    out = []
    for ev in events:
        if isinstance(ev, BlockStored):
            pairs = bool(ev.token_ids) and isinstance(ev.token_ids[0], tuple)
            ids = [t for pair in ev.token_ids for t in pair] if pairs else ev.token_ids
            msg = pb.BlockStoredEvent(block_hashes=ev.block_hashes, token_ids=ids, block_size=ev.block_size,
                                      medium=ev.medium, cache_salt=ev.cache_salt or "", lora_name=ev.lora_name or "",
                                      bigram=pairs)
            if ev.parent_block_hash is not None:
                msg.parent_block_hash = ev.parent_block_hash
            if ev.group_idx is not None:
                msg.group_idx, msg.kv_cache_spec_kind = ev.group_idx, ev.kv_cache_spec_kind or ""
                if ev.kv_cache_spec_sliding_window is not None:
                    msg.kv_cache_spec_sliding_window = ev.kv_cache_spec_sliding_window
            out.append(pb.KvEvent(stored=msg))
        elif isinstance(ev, BlockRemoved):
            msg = pb.BlockRemovedEvent(block_hashes=ev.block_hashes, medium=ev.medium)
            if ev.group_idx is not None:
                msg.group_idx = ev.group_idx
            out.append(pb.KvEvent(removed=msg))
        else:
            out.append(pb.KvEvent(cleared=pb.AllBlocksClearedEvent()))
    return pb.EventBatch(seq=seq, ts=ts, events=out)


@functools.lru_cache(maxsize=1)
def _types():
    return _msgspec_types()


def python_payload(ts: float, events: list[Event]) -> bytes:
    """The batch's msgpack bytes through msgspec (the native encoder writes the same bytes)."""
    enc, stored, removed, cleared, batch = _types()
    out = []
    for ev in events:
        if isinstance(ev, BlockStored):
            out.append(stored(ev.block_hashes, ev.parent_block_hash, ev.token_ids, ev.block_size, None, ev.medium,
                              ev.lora_name, ev.cache_salt, ev.group_idx, ev.kv_cache_spec_kind,
                              ev.kv_cache_spec_sliding_window))
        elif isinstance(ev, BlockRemoved):
            out.append(removed(ev.block_hashes, ev.medium, ev.group_idx))
        else:
            out.append(cleared())
    return enc.encode(batch(ts, out))


def native_payload(raw, ts: float) -> Optional[bytes]:
    """The batch's msgpack bytes, hashing what the records left unhashed (natively; None without it)."""
    if _native_encode is None or not isinstance(raw, RawEvents):
        return None
    return _native_encode(raw.records, ts, raw.page_size, np.dtype(raw.key_dtype).itemsize, raw.bigram)


class Batch:
    """One published batch: its payload, and its events built from the records only when asked (gRPC)."""

    __slots__ = ("seq", "ts", "raw", "_events", "payload")

    def __init__(self, seq: int, ts: float, raw: Optional[RawEvents], events: Optional[list[Event]],
                 payload: Optional[bytes]):
        self.seq, self.ts, self.raw, self._events, self.payload = seq, ts, raw, events, payload

    @property
    def events(self) -> list[Event]:
        if self._events is None:
            self._events, self.raw = self.raw.materialize(), None  # digests are hashed already: cheap
        return self._events


class Watcher:
    """One gRPC consumer: a bounded queue; when it overflows the consumer is cut off, never waited for."""

    def __init__(self, limit: int):
        self.queue: asyncio.Queue = asyncio.Queue(maxsize=limit)
        self.lost = False

    def offer(self, batch: pb.EventBatch) -> None:
        if self.lost:
            return
        try:
            self.queue.put_nowait(batch)
        except asyncio.QueueFull:
            self.lost = True
            self.queue = asyncio.Queue(maxsize=1)  # drop the backlog: the consumer must resynchronise
            self.queue.put_nowait(None)


class EventHub:
    """Sequences the tree's events into batches and fans them out; `flush()` after every change."""

    def __init__(self, take: Callable[[], tuple[list, int]], wrap: Callable[[list], RawEvents], buffer: int = 10000,
                 endpoint: str = "", replay_endpoint: str = "", topic: str = "", watcher_limit: int = 4096,
                 snapshot: Optional[Callable[[], list]] = None):
        self._take, self._wrap, self._snapshot = take, wrap, snapshot
        self.buffer: deque[Batch] = deque(maxlen=buffer)
        self.next_seq = 0  # the next sequence number flush() hands out
        self.published_seq = 0  # the next one to be published (the publisher thread may be behind)
        self.watchers: set[Watcher] = set()
        self.watcher_limit = watcher_limit
        self.topic = topic.encode()
        self.dropped = 0  # events the tree's bound dropped (never expected; counted for alerts)
        self.failed = 0  # batches the publisher could not build (a bug: logged, their seq is a gap)
        self._pub = self._router = self._ctx = None
        self._replay_task: Optional[asyncio.Task] = None
        self._ipc_paths: list[str] = []  # ipc:// socket files this hub bound (removed at close)
        self._encode = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="radixd-events")
        self._last: Optional[asyncio.Future] = None
        if endpoint or replay_endpoint:
            import zmq
            self._encode = python_payload
            self._ctx = zmq.Context.instance()
            if endpoint:
                self._pub = self._ctx.socket(zmq.PUB)
                self._pub.setsockopt(zmq.SNDHWM, 100_000)
                try:
                    self._pub.bind(endpoint)
                    self._bound(endpoint)
                except zmq.ZMQError as e:
                    self._pub.close(0)
                    raise ValueError(f"--kv-events-endpoint {endpoint}: cannot bind ({e})") from None
            self._replay_endpoint = replay_endpoint

    def flush(self) -> None:
        """Take what the tree recorded since the last flush (cheap) and have it published as one batch."""
        records, lost = self._take()
        if lost:
            self.dropped += lost
        if not records:
            return
        seq, ts = self.next_seq, time.time()
        self.next_seq += 1
        fut = asyncio.get_running_loop().run_in_executor(self._pool, self._build, seq, ts, records,
                                                         bool(self.watchers))
        fut.add_done_callback(functools.partial(self._publish, seq, ts))  # callbacks run in flush order
        self._last = fut

    def _build(self, seq: int, ts: float, records: list, proto: bool) -> tuple[Batch, Optional[pb.EventBatch]]:
        """On the publisher thread: hash, coalesce, encode (natively when built, with the GIL released)."""
        raw = self._wrap(records)
        payload = native_payload(raw, ts)
        if payload is not None:
            batch = Batch(seq, ts, raw, None, payload if self._encode else None)
        else:
            events = raw.materialize()
            batch = Batch(seq, ts, None, events, python_payload(ts, events) if self._encode else None)
        return batch, to_proto(seq, ts, batch.events) if proto else None

    def _publish(self, seq: int, ts: float, fut: asyncio.Future) -> None:
        self.published_seq = seq + 1
        if fut.cancelled() or fut.exception() is not None:
            self.failed += 1
            log.error("KV event batch %d could not be built: %r", seq, None if fut.cancelled() else fut.exception())
            return
        batch, proto = fut.result()
        self.buffer.append(batch)
        if self._pub is not None:
            import zmq
            try:
                self._pub.send_multipart([self.topic, seq.to_bytes(8, "big"), batch.payload], flags=zmq.NOBLOCK)
            except zmq.Again:  # pragma: no cover - PUB drops rather than blocks; counted as a gap by SUBs
                pass
        if self.watchers:
            proto = proto or to_proto(seq, ts, batch.events)
            for w in self.watchers:
                w.offer(proto)

    async def settled(self) -> None:
        """Wait until every batch flushed so far is published (replays must include them)."""
        target, fut = self.next_seq, self._last
        if fut is None:
            return
        await asyncio.wait([fut])
        while self.published_seq < target:  # its publish callback was queued before this task's wake-up
            await asyncio.sleep(0)

    # ------------------------------------------------------------------ snapshot
    async def snapshot(self, pages_per_batch: int = 4096) -> tuple[int, list[list[Event]]]:
        """The whole cache as events (AllBlocksCleared first), in batches of about `pages_per_batch` pages, and
        the seq of the first batch they do not reflect. The state is read at once, on the loop; it is hashed on
        the publisher thread, after the batches flushed before it."""
        if self._snapshot is None:
            raise ValueError("this event source has no snapshot")
        self.flush()  # every change so far is in a batch before `seq`
        seq, records = self.next_seq, self._snapshot()
        events = await asyncio.get_running_loop().run_in_executor(
            self._pool, lambda: self._wrap(records).materialize() if records else [])
        out, cur, pages = [], [AllBlocksCleared()], 0
        for ev in events:
            cur.append(ev)
            pages += len(ev.block_hashes)
            if pages >= pages_per_batch:
                out.append(cur)
                cur, pages = [], 0
        if cur or not out:
            out.append(cur)
        return seq, out

    # ------------------------------------------------------------------ replay
    def replay(self, start: int) -> tuple[Optional[int], list]:
        """Buffered batches with seq >= start, and the first seq still held when start is older (a gap)."""
        items = [b for b in self.buffer if b.seq >= start]
        oldest = self.buffer[0].seq if self.buffer else self.published_seq
        gap = oldest if start < oldest else None
        return gap, items

    async def start(self) -> None:
        """Bind the replay socket now (a bad endpoint fails the start) and serve it in a task."""
        if self._ctx is not None and self._replay_endpoint:
            import zmq
            import zmq.asyncio
            self._router = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
            try:
                self._router.bind(self._replay_endpoint)
                self._bound(self._replay_endpoint)
            except zmq.ZMQError as e:
                self._router.close(0)
                self._router = None
                raise ValueError(f"--kv-events-replay-endpoint {self._replay_endpoint}: cannot bind ({e})") from None
            self._replay_task = asyncio.get_running_loop().create_task(self._serve_replay())

    async def _serve_replay(self) -> None:
        try:
            while True:
                frames = await self._router.recv_multipart()
                if len(frames) < 3 or len(frames[-1]) != 8:
                    continue
                ident, start = frames[0], int.from_bytes(frames[-1], "big")
                await self.settled()
                _, items = self.replay(start)
                for b in items:
                    await self._router.send_multipart([ident, b"", self.topic, b.seq.to_bytes(8, "big"), b.payload])
                await self._router.send_multipart([ident, b"", b"", END_MARKER, b""])
        except asyncio.CancelledError:
            pass
        finally:
            self._router.close(linger=0)

    def _bound(self, endpoint: str) -> None:
        if endpoint.startswith("ipc://"):
            self._ipc_paths.append(endpoint[len("ipc://"):])

    async def close(self) -> None:
        await self.settled()
        self._pool.shutdown(wait=True)
        if self._replay_task is not None:
            self._replay_task.cancel()
            await asyncio.gather(self._replay_task, return_exceptions=True)
        if self._pub is not None:
            self._pub.close(linger=0)
        for path in self._ipc_paths:  # ZMQ leaves the socket files of ipc:// endpoints behind
            try:
                if stat.S_ISSOCK(os.lstat(path).st_mode):
                    os.unlink(path)
            except OSError:
                pass
