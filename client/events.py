"""Following radixd's KV events: a gRPC watcher, a ZMQ payload decoder and a router-side block index."""
from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from typing import Any, Iterator, Optional

import grpc

from radixd.proto import cache_pb2 as pb
from radixd.proto import cache_pb2_grpc as pb_grpc
from radixd.server.tree.hashes import first_block_hash, token_block_hashes

from .firsts import READY, STARTING, FirstPages

MEDIA = ("GPU", "CPU_PINNED")
log = logging.getLogger("radixd.events")


def watch(target: str, from_seq: Optional[int] = None, follow: bool = True, token: Optional[str] = None,
          channel: Optional[grpc.Channel] = None) -> Iterator[pb.EventBatch]:
    """EventBatch messages from a server: the replay from `from_seq` (if given), then live ones (follow)."""
    ch = channel or grpc.insecure_channel(target if "://" in target else f"unix://{target}")
    stub = pb_grpc.RadixCacheStub(ch)
    req = pb.WatchEventsRequest(follow=follow)
    if from_seq is not None:
        req.from_seq = from_seq
    meta = (("authorization", f"Bearer {token}"),) if token else ()
    yield from stub.WatchEvents(req, metadata=meta)


def event_dicts(batch: pb.EventBatch) -> list[dict]:
    """One batch's events as plain dicts (the ZMQ field names)."""
    out = []
    for ev in batch.events:
        kind = ev.WhichOneof("kind")
        if kind == "stored":
            s = ev.stored
            out.append(dict(type="BlockStored", block_hashes=list(s.block_hashes),
                            parent_block_hash=s.parent_block_hash if s.HasField("parent_block_hash") else None,
                            token_ids=list(zip(s.token_ids[::2], s.token_ids[1::2])) if s.bigram
                            else list(s.token_ids), block_size=s.block_size, medium=s.medium,
                            lora_name=s.lora_name or None, cache_salt=s.cache_salt or None))
            if s.HasField("group_idx"):  # hybrid models: the component, as vLLM names KV cache groups
                out[-1].update(group_idx=s.group_idx, kv_cache_spec_kind=s.kv_cache_spec_kind,
                               kv_cache_spec_sliding_window=s.kv_cache_spec_sliding_window
                               if s.HasField("kv_cache_spec_sliding_window") else None)
        elif kind == "removed":
            r = ev.removed
            out.append(dict(type="BlockRemoved", block_hashes=list(r.block_hashes), medium=r.medium))
            if r.HasField("group_idx"):
                out[-1]["group_idx"] = r.group_idx
        else:
            out.append(dict(type="AllBlocksCleared"))
    return out


def decode_zmq_payload(payload: bytes) -> tuple[float, list[dict]]:
    """A ZMQ batch payload (msgpack [ts, [tagged maps]]) as (ts, event dicts)."""
    import msgspec
    batch = msgspec.msgpack.decode(payload)
    return float(batch[0]), [dict(ev) for ev in batch[1]]


def replay_zmq(endpoint: str, start: int, stop: Optional[int] = None, timeout_ms: int = 10000) -> list:
    """(seq, payload) of the batches a ZMQ replay ROUTER still holds from `start` (up to `stop`)."""
    import zmq
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.RCVTIMEO, timeout_ms)
    s.connect(endpoint)
    try:
        s.send_multipart([b"", start.to_bytes(8, "big")])
        out = []
        while True:
            _, _, seq, payload = s.recv_multipart()
            n = int.from_bytes(seq, "big", signed=True)
            if n == -1:
                return out
            if stop is None or n < stop:
                out.append((n, payload))
    finally:
        s.close(linger=0)


def _key(ev: dict) -> str:
    group = ev.get("group_idx")
    return ev["medium"] if not group else f"{ev['medium']}/{group}"


def _lead(hashes: list, have: list) -> int:
    """How many of `hashes`, from the first, some counter in `have` holds."""
    return next((i for i, h in enumerate(hashes) if not any(h in c for c in have)), len(hashes))


class BlockIndex:
    """What a cache-aware router keeps: per node and medium, the block hashes it holds (a multiset). Followed
    with a snapshot (`follow_grpc(..., snapshot=True)`) it is complete and knows how far it has read, so an
    engine can answer "radixd holds nothing of this prompt" without a round trip."""

    def __init__(self, page_size: int):
        self.page_size = page_size
        self._nodes: dict[str, dict[str, Counter]] = {}
        self._lock = threading.Lock()
        self.resyncs = 0  # gaps or losses reported by a stream
        self.seen: dict[str, int] = {}  # node -> the first batch seq not applied yet (snapshot followers)
        self._ready: set[str] = set()  # nodes whose snapshot is applied and whose stream is live
        self._calls: list = []  # gRPC streams of the followers, cancelled by close()
        self.threads: list[threading.Thread] = []  # snapshot followers (one ends for good on a server without events)
        self._closed = threading.Event()

    @staticmethod
    def _apply(media: dict[str, Counter], events: list[dict]) -> None:
        for ev in events:
            kind = ev["type"]
            if kind == "BlockStored":
                media.setdefault(_key(ev), Counter()).update(ev["block_hashes"])
            elif kind == "BlockRemoved":  # one pass (Counter.subtract is a Python loop of its own)
                c = media.setdefault(_key(ev), Counter())
                get, pop = c.get, c.pop  # dict's own: Counter.__delitem__ is Python too
                for h in ev["block_hashes"]:
                    n = get(h, 0)
                    if n > 1:
                        c[h] = n - 1
                    elif n:
                        pop(h)
            else:
                for c in media.values():
                    c.clear()

    @classmethod
    def _apply_batch(cls, media: dict[str, Counter], batch: pb.EventBatch) -> None:
        """A gRPC batch straight from its messages: only the hashes (no token lists, little GIL time)."""
        for ev in batch.events:
            kind = ev.WhichOneof("kind")
            if kind == "stored":
                s = ev.stored
                key = s.medium if not s.group_idx else f"{s.medium}/{s.group_idx}"
                media.setdefault(key, Counter()).update(s.block_hashes)
            elif kind == "removed":
                r = ev.removed
                key = r.medium if not r.group_idx else f"{r.medium}/{r.group_idx}"
                cls._apply(media, [dict(type="BlockRemoved", block_hashes=r.block_hashes, medium=key)])
            else:
                for c in media.values():
                    c.clear()

    def apply(self, node: str, events: list[dict]) -> None:
        """Apply event dicts (from gRPC or ZMQ) of one node in stream order. A hybrid model's events carry a
        KV cache group: group 0 (FULL) counts as the medium itself, group g > 0 under "MEDIUM/g"."""
        with self._lock:
            self._apply(self._nodes.setdefault(node, {m: Counter() for m in MEDIA}), events)

    def blocks(self, node: str, medium: str, group: int = 0) -> Counter:
        with self._lock:
            return Counter(self._nodes.get(node, {}).get(medium if not group else f"{medium}/{group}", Counter()))

    def match(self, tokens: Any, cache_salt: str = "", extra_key: str = "") -> dict[str, dict[str, int]]:
        """Per node: leading blocks of `tokens` held on the device ("GPU"), and on either tier ("any")."""
        hashes = token_block_hashes(tokens, self.page_size, cache_salt, extra_key)
        out = {}
        with self._lock:
            for node, media in self._nodes.items():
                gpu, cpu = media.get("GPU", Counter()), media.get("CPU_PINNED", Counter())
                out[node] = {"GPU": _lead(hashes, [gpu]), "any": _lead(hashes, [gpu, cpu])}
        return out

    def leading(self, node: str, tokens: Any, cache_salt: str = "", media: tuple[str, ...] = MEDIA,
                pages: Optional[int] = None, extra_key: str = "") -> int:
        """Leading whole pages of `tokens` (hashing at most `pages` of them) held by `node` on any of `media`."""
        n = len(tokens) // self.page_size if pages is None else min(pages, len(tokens) // self.page_size)
        hashes = token_block_hashes(tokens[:n * self.page_size], self.page_size, cache_salt, extra_key)
        with self._lock:
            return _lead(hashes, [c for m, c in self._nodes.get(node, {}).items() if m in media])

    def holds_first(self, node: str, tokens: Any, cache_salt: str = "", media: tuple[str, ...] = MEDIA,
                    extra_key: str = "") -> bool:
        """Whether `node` holds the first whole page of `tokens` on any of `media`: one page hashed, the check an
        engine makes on each request's arrival (`leading` does the same for any number of pages)."""
        if len(tokens) < self.page_size:
            return False
        h = first_block_hash(tokens, self.page_size, cache_salt, extra_key)
        with self._lock:
            held = self._nodes.get(node, {})
            for m in media:
                c = held.get(m)
                if c is not None and h in c:
                    return True
            return False

    def current(self, node: str, seq: int = 0) -> bool:
        """Whether this index holds `node`'s whole state (its snapshot applied, its stream live) as of every
        batch before `seq` at least (a CacheUnfinished answer's event_seq: the client's own stores)."""
        with self._lock:
            return node in self._ready and self.seen.get(node, 0) >= seq

    def follow_zmq(self, node: str, endpoint: str, replay_endpoint: str = "", topic: bytes = b"") -> threading.Thread:
        """Follow a node's ZMQ PUB socket in a daemon thread; on a sequence gap, replay the missing batches."""
        import zmq

        def run() -> None:
            ctx = zmq.Context.instance()
            sub = ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.SUBSCRIBE, topic)
            sub.connect(endpoint)
            expect = None
            while True:
                _, seq_b, payload = sub.recv_multipart()
                seq = int.from_bytes(seq_b, "big")
                if expect is not None and seq > expect and replay_endpoint:
                    for _, p in replay_zmq(replay_endpoint, expect, seq):
                        self.apply(node, decode_zmq_payload(p)[1])
                elif expect is not None and seq > expect:
                    self.resyncs += 1
                self.apply(node, decode_zmq_payload(payload)[1])
                expect = seq + 1
        t = threading.Thread(target=run, daemon=True, name=f"blockindex-zmq-{node}")
        t.start()
        return t

    def follow_grpc(self, node: str, target: str, token: Optional[str] = None,
                    from_seq: Optional[int] = 0, snapshot: bool = False,
                    channel: Optional[grpc.Channel] = None, retry_s: float = 1.0) -> threading.Thread:
        """Follow a node over gRPC in a daemon thread: replaying from `from_seq`, or (snapshot) from the node's
        whole state, taken again whenever the stream breaks or reports a gap or a loss (`current` is false
        until it is applied)."""
        if not snapshot:
            def run() -> None:
                for batch in watch(target, from_seq, True, token, channel):
                    if batch.gap or batch.lost:
                        self.resyncs += 1
                        continue
                    self.apply(node, event_dicts(batch))
            t = threading.Thread(target=run, daemon=True, name=f"blockindex-{node}")
            t.start()
            return t
        ch = channel or grpc.insecure_channel(target if "://" in target else f"unix://{target}")
        stub = pb_grpc.RadixCacheStub(ch)
        meta = (("authorization", f"Bearer {token}"),) if token else ()

        def run() -> None:
            while not self._closed.is_set():
                call = stub.WatchEvents(pb.WatchEventsRequest(follow=True, snapshot=True), metadata=meta)
                with self._lock:
                    self._calls.append(call)
                try:
                    self._stream(node, call)
                except grpc.RpcError as e:
                    if self._closed.is_set() or e.code() == grpc.StatusCode.FAILED_PRECONDITION:
                        return  # closed, or the server records no events: never current
                    log.info("radixd events stream to %s broke (%s): resynchronising", target, e.code())
                finally:
                    with self._lock:
                        self._ready.discard(node)
                        self._calls.remove(call)
                self.resyncs += 1
                self._closed.wait(retry_s)
        t = threading.Thread(target=run, daemon=True, name=f"blockindex-{node}")
        t.start()
        self.threads.append(t)
        return t

    def _stream(self, node: str, call) -> None:
        """One snapshot stream: the snapshot built aside and swapped in whole, then live batches in order."""
        fresh: dict[str, Counter] = {m: Counter() for m in MEDIA}
        for batch in call:
            if batch.gap or batch.lost:
                return
            if batch.snapshot:
                self._apply_batch(fresh, batch)
                if not batch.snapshot_more:
                    with self._lock:
                        self._nodes[node], self.seen[node] = fresh, batch.seq
                        self._ready.add(node)
                continue
            with self._lock:
                if batch.seq != self.seen.get(node):  # never expected: a stream is gapless; start again
                    return
                self._apply_batch(self._nodes[node], batch)
                self.seen[node] = batch.seq + 1

    def close(self) -> None:
        """Stop the snapshot followers (their streams are cancelled)."""
        self._closed.set()
        with self._lock:
            calls = list(self._calls)
        for c in calls:
            c.cancel()


class LocalIndex:
    """An engine's view of one radixd server's pages, followed from its KV events (a snapshot, then live batches):
    it answers "radixd holds not even the first page of this prompt" with no round trip, and only while that
    answer can be trusted (its snapshot applied, its stream live, every batch up to the engine's own last store
    applied). A page another engine stored a moment ago may be missing from it: a lost hit, never a wrong load,
    as a hit is still looked up (and locked) by radixd itself."""

    NODE = "radixd"

    def __init__(self, client: Any, target: str, page_size: int, token: Optional[str] = None,
                 media: tuple[str, ...] = MEDIA, wait_s: float = 2.0):
        self.client, self.media, self.page_size = client, media, page_size  # client: whose CacheUnfinished answers
        # carry event_seq
        self.misses = 0  # prompts answered here
        self.index: Optional[BlockIndex] = None
        self.firsts: Optional[FirstPages] = None
        deadline = time.monotonic() + wait_s  # the snapshot, before the engine's first request (not on its path)
        if hasattr(client, "first_pages"):  # a relayed client: its relay keeps the first pages in shared memory, and
            # no thread of this process follows the events (each batch would take the GIL from the forward)
            st = client.stats()  # (at most a first page per page the server can hold)
            self.firsts = client.first_pages(media, (st["capacity_tokens"] + st["host_capacity_tokens"]) //
                                             page_size + 1)
            while self.firsts.state == STARTING and time.monotonic() < deadline:
                time.sleep(0.005)
            return
        self.index = BlockIndex(page_size)
        self.index.follow_grpc(self.NODE, target, token, snapshot=True)
        while not self.current() and time.monotonic() < deadline and any(t.is_alive() for t in self.index.threads):
            time.sleep(0.005)

    def current(self) -> bool:
        if self.firsts is not None:
            return self.firsts.state == READY and self.firsts.seen >= self.client.event_seq
        return self.index.current(self.NODE, self.client.event_seq)

    def known_miss(self, tokens: Any, cache_salt: str = "", extra_key: str = "") -> bool:
        """True when radixd certainly holds nothing of `tokens` in the namespace (any int sequence; counted in
        `misses`)."""
        if len(tokens) < self.page_size:
            return False
        h = first_block_hash(tokens, self.page_size, cache_salt, extra_key)
        firsts = self.firsts
        if firsts is not None:
            if h in firsts or firsts.state != READY or firsts.seen < self.client.event_seq:
                return False
            self.misses += 1
            return True
        index = self.index
        # an engine asks this for every request, on a cache-cold thread: point reads of the index's dicts, each
        # atomic under the GIL, instead of two calls that each take its lock
        held = index._nodes.get(self.NODE)
        if held is None:
            return False
        for m in self.media:
            c = held.get(m)
            if c is not None and h in c:
                return False  # (a hit, the common case, asks the index once)
        if self.NODE not in index._ready or index.seen.get(self.NODE, 0) < self.client.event_seq:
            return False  # (not current: the snapshot is not applied, or our own last stores not seen yet)
        self.misses += 1
        return True

    def close(self) -> None:
        if self.index is not None:
            self.index.close()
