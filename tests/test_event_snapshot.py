"""A watcher that starts late: WatchEvents' snapshot of the whole cache, and a BlockIndex that follows a server with
it, stays current (a client's own stores included, by CacheUnfinished's event_seq) and takes it again after a
restart."""
from __future__ import annotations

import asyncio
import time

import grpc
import numpy as np
import pytest

from radixd.client import CacheClient
from radixd.client.events import BlockIndex, event_dicts, watch
from radixd.proto import cache_pb2 as pb
from radixd.proto import cache_pb2_grpc as pb_grpc
from radixd.server.events import EventHub
from radixd.server.tree.events import AllBlocksCleared, BlockStored
from radixd.server.tree.tree import RadixTree

from .conftest import ServerProc
from .test_service_events import PAGE, _workload


def _snapshot(target: str) -> list[pb.EventBatch]:
    with grpc.insecure_channel(target) as ch:
        return list(pb_grpc.RadixCacheStub(ch).WatchEvents(pb.WatchEventsRequest(snapshot=True, follow=False)))


def _until(cond, what: str, timeout: float = 30.0) -> None:
    """Wait for a condition another thread makes true (polled; fails with `what` past the timeout)."""
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


def test_the_snapshot_equals_every_batch_so_far(tmp_path):
    """After a workload over both tiers and three namespaces, the snapshot rebuilds what replaying every batch
    rebuilds, per medium, and answers what the cache answers; it says which seq comes next."""
    srv = ServerProc("--num-slots", "256", "--page-size", str(PAGE), "--host-slots", "512", "--load-back-threshold",
                     "1", "--kv-events", "--kv-events-buffer", "100000")
    try:
        with CacheClient(srv.target) as c:
            prompts = _workload(c, np.random.default_rng(7))
            stream = list(watch(srv.target, 0, follow=False))
            snap = _snapshot(srv.target)
            assert snap and all(b.snapshot for b in snap)
            assert [b.snapshot_more for b in snap] == [True] * (len(snap) - 1) + [False]
            assert {b.seq for b in snap} == {len(stream)}  # the first live batch to come
            assert snap[0].events[0].WhichOneof("kind") == "cleared"
            assert all(ev.WhichOneof("kind") == "stored" for b in snap for ev in b.events[1:] if b is snap[0])
            full, fresh = BlockIndex(PAGE), BlockIndex(PAGE)
            for b in stream:
                full.apply("n", event_dicts(b))
            for b in snap:
                fresh.apply("n", event_dicts(b))
            for medium in ("GPU", "CPU_PINNED"):
                assert +fresh.blocks("n", medium) == +full.blocks("n", medium)
            assert sum(fresh.blocks("n", "CPU_PINNED").values()) and sum(fresh.blocks("n", "GPU").values())
            for toks, salt, lora in prompts:
                m = c.match_prefix(toks, cache_salt=salt, extra_key=lora)
                assert fresh.match(toks, cache_salt=salt, extra_key=lora)["n"] == {
                    "GPU": m.matched_len // PAGE, "any": (m.matched_len + m.host_hit_len) // PAGE}
            with grpc.insecure_channel(srv.target) as ch:  # a snapshot replaces a replay: asking for both is refused
                with pytest.raises(grpc.RpcError) as e:
                    list(pb_grpc.RadixCacheStub(ch).WatchEvents(pb.WatchEventsRequest(snapshot=True, from_seq=0)))
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "from_seq" in e.value.details()
    finally:
        srv.stop()


def test_the_snapshot_comes_in_batches_of_bounded_pages():
    """The hub cuts a large cache into batches of about `pages_per_batch` pages, in tree order, hashed off the
    loop; concatenated they are the whole state."""
    t = RadixTree(page_size=2, events=True)
    rng = np.random.default_rng(3)
    for _ in range(40):
        toks = rng.integers(0, 9, 2 * int(rng.integers(1, 12)), dtype=np.int32)
        t.insert(toks, np.arange(len(toks), dtype=np.int32))
    hub = EventHub(t.take_records, t.raw_events, snapshot=t.snapshot_records)

    async def go():
        hub.flush()
        await hub.settled()
        return await hub.snapshot(pages_per_batch=5)
    seq, chunks = asyncio.run(go())
    assert seq == 1 and isinstance(chunks[0][0], AllBlocksCleared)
    stored = [ev for ch in chunks for ev in ch if isinstance(ev, BlockStored)]
    assert sum(len(ch) for ch in chunks) == len(stored) + 1 and len(chunks) > 3
    for ch in chunks[:-1]:  # each cut right after the event that reached the bound
        pages = [len(ev.block_hashes) for ev in ch if isinstance(ev, BlockStored)]
        assert sum(pages) >= 5 and sum(pages[:-1]) < 5
    want = sorted(h for nd in t.iter_nodes() if nd.parent is not None
                  for h in np.frombuffer(t._digests(nd), ">i8").reshape(-1, 4)[:, 0].tolist())
    assert sorted(h for ev in stored for h in ev.block_hashes) == want


def test_a_follower_stays_current_and_resyncs_after_a_restart(tmp_path):
    """BlockIndex.follow_grpc(snapshot=True) on a server that already holds pages: current once the snapshot is
    in, current past a client's own stores (event_seq), equal to the cache after more traffic; after the server
    restarts on the same socket it takes the new server's snapshot and is current again."""
    sock = str(tmp_path / "r.sock")
    args = ("--num-slots", "256", "--page-size", str(PAGE), "--host-slots", "512", "--kv-events")
    srv = ServerProc(*args, sock=sock)
    idx = BlockIndex(PAGE)
    try:
        with CacheClient(srv.target) as c:
            before = np.arange(100, 100 + 3 * PAGE, dtype=np.int32)
            c.cache_finished([dict(tokens=before, indices=c.alloc(len(before)))])
            idx.follow_grpc("n", srv.target, snapshot=True, retry_s=0.05)
            _until(lambda: idx.current("n"), "the snapshot")
            assert idx.leading("n", before) == 3  # known from the snapshot alone: no batch was replayed
            toks = np.arange(200, 200 + 2 * PAGE, dtype=np.int32)
            assert idx.leading("n", toks) == 0 and not idx.holds_first("n", toks)
            r = c.cache_unfinished([dict(tokens=toks, indices=c.alloc(len(toks)))])
            assert c.event_seq > 0
            _until(lambda: idx.current("n", c.event_seq), "the client's own store")
            assert idx.leading("n", toks) == 2 and idx.leading("n", toks, pages=1) == 1
            assert idx.leading("n", toks, media=("CPU_PINNED",)) == 0
            assert idx.holds_first("n", toks) and idx.holds_first("n", toks.tolist())
            assert not idx.holds_first("n", toks, media=("CPU_PINNED",)) and not idx.holds_first("n", toks[:PAGE - 1])
            c.unlock([r[0][1].receipt_id])
            prompts = _workload(c, np.random.default_rng(11))
            c.cache_unfinished([dict(tokens=toks, indices=c.alloc(len(toks)))])
            _until(lambda: idx.current("n", c.event_seq), "the workload's batches")
            for t, salt, lora in prompts:
                m = c.match_prefix(t, cache_salt=salt, extra_key=lora)
                assert idx.leading("n", t, cache_salt=salt, extra_key=lora) == (m.matched_len + m.host_hit_len) // PAGE
                assert idx.holds_first("n", list(t), cache_salt=salt, extra_key=lora) == \
                    (m.matched_len + m.host_hit_len >= PAGE)
        resyncs = idx.resyncs
        srv.stop()
        _until(lambda: not idx.current("n"), "the follower to notice the server is gone")
        srv = ServerProc(*args, sock=sock)
        _until(lambda: idx.current("n") and idx.resyncs > resyncs, "the new server's snapshot")
        assert idx.leading("n", before) == 0  # a new server's cache is empty: nothing stale survives
        with CacheClient(srv.target) as c:
            c.cache_unfinished([dict(tokens=before, indices=c.alloc(len(before)))])
            _until(lambda: idx.current("n", c.event_seq), "a store on the new server")
            assert idx.leading("n", before) == 3
    finally:
        idx.close()
        srv.stop()


def test_a_follower_of_a_server_without_events_is_never_current(server):
    """Events off: the stream is refused once (FAILED_PRECONDITION) and the follower gives up for good."""
    idx = BlockIndex(PAGE)
    t = idx.follow_grpc("n", server.target, snapshot=True, retry_s=0.05)
    t.join(timeout=30)
    assert not t.is_alive() and not idx.current("n")


def test_a_local_index_calls_a_miss_only_while_current(tmp_path):
    """LocalIndex.known_miss, as the engines ask it for every request (numpy, list or SGLang's array('q') ids): a
    prompt radixd holds no page of is a miss; one it holds is not, in its own namespace only; a prompt shorter than
    a page, one asked right after the client's own store (seen or not yet) and any prompt while the index is not
    current (its server gone) are never called misses."""
    from array import array

    from radixd.client.events import LocalIndex
    srv = ServerProc("--num-slots", "256", "--page-size", str(PAGE), "--kv-events")
    try:
        with CacheClient(srv.target) as c:
            idx = LocalIndex(c, srv.target, PAGE)
            try:
                assert idx.current()
                toks = np.arange(300, 300 + 2 * PAGE, dtype=np.int32)
                for form in (toks, toks.tolist(), array("q", toks.tolist())):
                    assert idx.known_miss(form)
                assert idx.misses == 3
                assert not idx.known_miss(toks[:PAGE - 1])  # not a whole page: nothing to look up
                c.cache_unfinished([dict(tokens=toks, indices=c.alloc(len(toks)))])
                assert not idx.known_miss(toks)  # right after our own store: held, or not current yet
                _until(lambda: idx.current(), "the client's own store")
                for form in (toks, toks.tolist(), array("q", toks.tolist()), toks[:PAGE]):
                    assert not idx.known_miss(form)
                assert idx.known_miss(toks, cache_salt="other")  # the same ids in another namespace
                assert idx.known_miss(toks, extra_key="adapter")  # and under an adapter
                idx.misses -= 1
                assert idx.known_miss(toks[PAGE:])  # the second page alone starts no chain radixd holds
                assert idx.misses == 5
                srv.stop()
                _until(lambda: not idx.current(), "the index to notice the server is gone")
                assert not idx.known_miss(np.arange(900, 900 + PAGE, dtype=np.int32))
            finally:
                idx.close()
    finally:
        srv.stop()
