"""The service end to end: real server process, real gRPC, real shared memory, separate worker processes."""
from __future__ import annotations

import multiprocessing as mp
import os
import stat
import urllib.request

import grpc
import numpy as np
import pytest

from radixd.client import (
    CacheClient, FailedPrecondition, InvalidArgument, NotFound, PermissionDenied, ResourceExhausted,
    ServerRestarted, Unauthenticated,
)
from radixd.proto import cache_pb2 as pb
from radixd.proto import cache_pb2_grpc as pb_grpc

from .conftest import ServerProc

CTX = mp.get_context("spawn")


def conserved(c: CacheClient) -> dict:
    """Slot conservation and the server's own checker; returns the stats."""
    s = c.stats()
    assert s["free_tokens"] + s["cached_tokens"] + s["held_tokens"] + s["in_flight_tokens"] == s["capacity_tokens"]
    assert s["cached_tokens"] == s["evictable_tokens"] + s["protected_tokens"]
    assert c.check() == []
    return s


def _worker_write(target, slots, value, q):
    with CacheClient(target, name="worker") as c:
        pools = c.map_pools()
        for layer in range(len(pools.device[0].k_buffer)):
            pools.device[0].k_buffer[layer][slots] = value
            pools.device[0].v_buffer[layer][slots] = -value
        pools.close()
    q.put("done")


def test_end_to_end_alloc_write_insert_match_read_unlock_evict(server, client):
    tokens = np.arange(100, 164, dtype=np.int32)
    slots = client.alloc(64)
    assert slots.dtype == np.int64 and len(slots) == 64
    assert conserved(client)["held_tokens"] == 64
    q = CTX.Queue()
    p = CTX.Process(target=_worker_write, args=(server.target, slots, 2.5, q))
    p.start()
    assert q.get(timeout=60) == "done"
    p.join(30)
    r = client.insert(tokens, slots)
    assert (r.prefix_len, r.adopted, r.freed_duplicates) == (0, 64, 0)
    s = conserved(client)
    assert (s["held_tokens"], s["cached_tokens"]) == (0, 64)
    with CacheClient(server.target, name="second") as other:
        m = other.match_prefix(np.concatenate([tokens, [1, 2, 3]]), lock=True)
        assert m.matched_len == 64 and np.array_equal(m.indices, slots) and m.receipt_id
        pools = other.map_pools()
        assert float(pools.device[0].k_buffer[1][int(m.indices[7])][0, 0]) == 2.5
        assert float(pools.device[0].v_buffer[0][int(m.indices[63])][3, 5]) == -2.5
        pools.close()
        assert conserved(other)["protected_tokens"] == 64
        assert client.evict(1000) == 0  # locked
        other.unlock([m.receipt_id])
        with pytest.raises(NotFound):
            other.unlock([m.receipt_id])
    assert client.evict(1000) == 64
    assert conserved(client)["free_tokens"] == 4096


def test_duplicates_prev_prefix_and_cache_finished(client):
    tokens = np.arange(1, 41, dtype=np.int32)
    a = client.alloc(40)
    client.insert(tokens, a)
    m = client.match_prefix(np.concatenate([tokens, np.arange(500, 520)]), lock=True)
    new = client.alloc(20)
    kv = np.concatenate([m.indices, new])
    full = np.concatenate([tokens, np.arange(500, 520)])
    r = client.cache_finished([dict(tokens=full, indices=kv, prev_prefix_len=40, receipt_id=m.receipt_id)])[0]
    assert (r.prefix_len, r.adopted, r.freed_duplicates) == (40, 20, 0)
    s = conserved(client)
    assert s["receipts"] == 0 and s["held_tokens"] == 0 and s["cached_tokens"] == 60
    dup = client.alloc(60)  # another request computed the same 60 tokens meanwhile
    r = client.insert(full, dup)
    assert r.freed_duplicates == 60 and r.adopted == 0
    assert conserved(client)["held_tokens"] == 0


def test_cache_unfinished_relocks_and_returns_new_indices(client):
    toks = np.arange(10, 30, dtype=np.int32)
    m = client.match_prefix(toks, lock=True)
    assert m.matched_len == 0
    slots = client.alloc(20)
    ins, m2 = client.cache_unfinished([dict(tokens=toks, indices=slots, receipt_id=m.receipt_id)])[0]
    assert ins.adopted == 20 and m2.matched_len == 20 and np.array_equal(m2.indices, slots)
    assert m2.receipt_id and m2.receipt_id != m.receipt_id
    s = conserved(client)
    assert s["protected_tokens"] == 20 and s["receipts"] == 1
    with pytest.raises(FailedPrecondition):
        client.reset()  # locked
    client.unlock([m2.receipt_id])
    assert client.reset() == 20
    assert conserved(client)["cached_tokens"] == 0


def test_one_cache_unfinished_takes_a_requests_next_chunks_each_extending_the_one_before(client):
    """A request's chunks published together (a client's store thread that fell a round behind): the second item
    has no receipt and its prefix is the first item's tokens and slots; both are inserted, and the second takes
    over the first's lock (its receipt comes back as 0). A prefix that is not an earlier item's is refused whole;
    CacheFinished takes no chains."""
    toks = np.arange(100, 124, dtype=np.int32)
    a, b = client.alloc([8, 16])
    first = dict(tokens=toks[:8], indices=a)
    second = dict(tokens=toks[:24], indices=np.concatenate([a, b]), prev_prefix_len=8)
    before = conserved(client)
    wrong = dict(second, indices=np.concatenate([b[:8], b[:8], b[8:]]))  # not the first item's slots
    with pytest.raises(InvalidArgument, match="item 1: prev_prefix_len 8 exceeds the cached prefix"):
        client.cache_unfinished([first, wrong])
    with pytest.raises(InvalidArgument, match="item 1: prev_prefix_len 8 exceeds the cached prefix"):
        client.cache_finished([first, second])
    assert conserved(client) == before  # refused whole: nothing changed
    (i1, m1), (i2, m2) = client.cache_unfinished([first, second])
    assert i1.adopted == 8 and i2.adopted == 16 and m2.matched_len == 24 and np.array_equal(m2.indices[:8], a)
    assert m1.receipt_id == 0 and m2.receipt_id  # the second item took over the first's lock
    s = conserved(client)
    assert s["receipts"] == 1
    assert s["cached_tokens"] == 24 and s["protected_tokens"] == 24 and s["held_tokens"] == before["held_tokens"] - 24
    client.unlock([m2.receipt_id])
    assert conserved(client)["evictable_tokens"] == 24 and client.check() == []


def test_alloc_evicts_when_short_and_exhausts_cleanly(client):
    a = client.alloc(4000)
    client.insert(np.arange(4000, dtype=np.int32), a)
    b = client.alloc(3000)  # evicts unlocked leaves
    assert len(b) == 3000
    s = conserved(client)
    assert s["evicted_tokens_total"] >= 2904
    before = client.stats()
    with pytest.raises(ResourceExhausted):
        client.alloc(2000)  # 1096 free + ~1000 evictable is not enough
    after = client.stats()
    assert before == after  # nothing allocated, nothing evicted needlessly


def test_bad_input_gets_precise_status_and_changes_nothing(server, client):
    a = client.alloc(8)
    client.insert(np.arange(8, dtype=np.int32), a)
    held = client.alloc(4)
    before = client.stats()
    stub = pb_grpc.RadixCacheStub(grpc.insecure_channel(server.target))
    sid = client.session_id

    def status(method, req):
        with pytest.raises(grpc.RpcError) as e:
            getattr(stub, method)(req)
        return e.value.code()

    I, N, F, P = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
                  grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.PERMISSION_DENIED)
    tok = np.arange(20, 24, dtype=np.int32).tobytes()
    idx = held.tobytes()
    item = lambda **kw: pb.InsertItem(**{"tokens": tok, "indices": idx, **kw})  # noqa: E731
    cases = [
        ("Insert", pb.InsertRequest(session_id=sid, items=[item(tokens=b"\x01\x02\x03")]), I),
        ("Insert", pb.InsertRequest(session_id=sid, items=[item(indices=b"\x01" * 7)]), I),
        ("Insert", pb.InsertRequest(session_id=sid, items=[item(indices=idx[:8])]), I),  # length mismatch
        ("Insert", pb.InsertRequest(session_id=sid, items=[item(tokens=np.array([1, -5, 2, 3], "<i4").tobytes())]), I),
        ("Insert", pb.InsertRequest(session_id=sid, items=[item(indices=np.array([0, 1, 2, 99999], "<i8").tobytes())]), I),
        ("Insert", pb.InsertRequest(session_id=sid, items=[item(indices=a[:4].tobytes())]), P),  # tree's slots
        ("Insert", pb.InsertRequest(session_id=sid, items=[item(prev_prefix_len=4)]), I),  # not cached
        ("Insert", pb.InsertRequest(session_id=sid, items=[item(), item()]), P),  # same held slots twice
        ("Insert", pb.InsertRequest(session_id="nope", items=[item()]), N),
        ("Free", pb.FreeRequest(session_id=sid, indices=a[:2].tobytes()), P),
        ("Free", pb.FreeRequest(session_id=sid, indices=b"\x00" * 9), I),
        ("Lock", pb.LockRequest(session_id=sid, node_id=[12345]), F),  # another instance's tag
        ("Unlock", pb.UnlockRequest(session_id=sid, receipt_id=[777]), N),
        ("MatchPrefix", pb.MatchRequest(session_id=sid, items=[pb.MatchItem(tokens=b"\x00" * 5)]), I),
        ("MatchPrefix", pb.MatchRequest(items=[pb.MatchItem(tokens=tok, lock=True)]), N),
        ("Alloc", pb.AllocRequest(session_id=sid, num_tokens=[10 ** 9]), I),
        ("CacheFinished", pb.CacheFinishedRequest(session_id=sid, items=[
            pb.FinishedItem(tokens=tok, indices=idx, receipt_id=424242)]), N),
    ]
    for method, req, code in cases:
        assert status(method, req) == code, (method, req)
    assert client.stats() == before
    assert client.check() == []
    # a stale node handle: evicted node
    m = client.match_prefix(np.arange(8, dtype=np.int32))
    client.evict(100)
    with pytest.raises(NotFound, match="stale"):
        client.lock([m.node_id])
    # another session's receipt
    with CacheClient(server.target) as other:
        client.insert(np.arange(20, 24, dtype=np.int32), held)
        r = client.match_prefix(np.arange(20, 24, dtype=np.int32), lock=True).receipt_id
        with pytest.raises(FailedPrecondition, match="another session"):
            other.unlock([r])
    conserved(client)


def test_session_end_releases_locks_and_held_slots(server, client):
    other = CacheClient(server.target, name="short-lived")
    s = other.alloc(100)
    other.insert(np.arange(50, dtype=np.int32), s[:50])
    other.match_prefix(np.arange(50, dtype=np.int32), lock=True)
    st = client.stats()
    assert st["held_tokens"] == 50 and st["protected_tokens"] == 50 and st["sessions"] == 2
    other.close()
    import time
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline and client.stats()["sessions"] != 1:
        time.sleep(0.01)
    st = conserved(client)
    assert st["held_tokens"] == 0 and st["protected_tokens"] == 0 and st["evictable_tokens"] == 50


def test_metrics_move_with_operations(server, client):
    def scrape():
        with urllib.request.urlopen(f"http://{server.metrics_url.split('//')[1]}", timeout=10) as r:
            text = r.read().decode()
        vals = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                k, v = line.rsplit(" ", 1)
                vals[k] = float(v)
        return vals

    before = scrape()
    s = client.alloc(32)
    client.insert(np.arange(32, dtype=np.int32), s)
    client.match_prefix(np.arange(40, dtype=np.int32))
    after = scrape()
    assert after["radixd_hit_tokens_total"] - before.get("radixd_hit_tokens_total", 0) == 32
    assert after["radixd_queried_tokens_total"] - before.get("radixd_queried_tokens_total", 0) == 40
    assert after['radixd_pool_slots{state="tree",tier="device"}'] == 32
    assert after['radixd_rpc_requests_total{code="OK",method="MatchPrefix"}'] >= 1
    assert after['radixd_rpc_latency_seconds_count{method="Insert"}'] >= 1
    assert after["radixd_sessions"] == 1 and after["radixd_tree_nodes"] == 1
    with pytest.raises(PermissionDenied):
        client.free([4000])  # in range, not held by this session
    assert scrape()['radixd_rpc_errors_total{code="PERMISSION_DENIED",method="Free"}'] == 1


def test_health_reflection_and_socket_mode(server):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    ch = grpc.insecure_channel(server.target)
    r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service="radixd.v1.RadixCache"))
    assert r.status == health_pb2.HealthCheckResponse.SERVING
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
    stub = reflection_pb2_grpc.ServerReflectionStub(ch)
    resp = next(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
    names = {s.name for s in resp.list_services_response.service}
    assert "radixd.v1.RadixCache" in names and "grpc.health.v1.Health" in names
    assert stat.S_IMODE(os.stat(server.sock).st_mode) == 0o600


def test_token_auth():
    s = ServerProc("--num-slots", "64", "--token", "s3cret")
    try:
        with pytest.raises(Unauthenticated):
            CacheClient(s.target)
        with pytest.raises(Unauthenticated):
            CacheClient(s.target, token="wrong")
        with CacheClient(s.target, token="s3cret") as c:
            assert c.stats()["capacity_tokens"] == 64
        stub = pb_grpc.RadixCacheStub(grpc.insecure_channel(s.target))
        with pytest.raises(grpc.RpcError) as e:
            stub.GetStats(pb.GetStatsRequest())
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        s.stop()


def test_remote_tcp_without_token_is_refused():
    with pytest.raises(RuntimeError, match="did not start"):
        ServerProc("--num-slots", "64", "--listen", "0.0.0.0:0")


def test_server_restart_is_detected_and_reconnect_works():
    s = ServerProc("--num-slots", "64")
    c = CacheClient(s.target)
    try:
        old = c.instance_id
        pools = c.map_pools()
        desc = c.info()["device_pools"][0]
        pools.close()
        assert s.stop() == 0
        assert not os.path.exists(f"/dev/shm/{desc.handle.decode()}")  # unlinked on clean shutdown
        s.start()
        with pytest.raises(ServerRestarted):
            c.alloc(4)
        with pytest.raises(ServerRestarted):
            c.map_pools()
        from radixd.client.pools import PoolMappingError, map_pool
        with pytest.raises(PoolMappingError):
            map_pool(desc)
        c.reconnect()
        assert c.instance_id != old
        assert len(c.alloc(4)) == 4
        c.map_pools().close()
    finally:
        c.close()
        s.stop()


def test_async_client(server):
    import asyncio

    from radixd.client import AsyncCacheClient

    async def go():
        async with AsyncCacheClient(server.target) as c:
            (slots,) = await c.alloc([16])
            await c.insert_batch([dict(tokens=np.arange(16), indices=slots)])
            ms = await c.match_batch([np.arange(16), np.arange(8)], lock=True)
            assert [m.matched_len for m in ms] == [16, 8]
            await c.unlock([m.receipt_id for m in ms])
            assert await c.echo(b"x" * 10) == b"x" * 10
            assert await c.check() == []
            return await c.stats()

    assert asyncio.run(go())["cached_tokens"] == 16


def test_cli_stats_info_check(server, client):
    import json
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-m", "radixd.server.cli", "stats", "--target", server.target],
                         capture_output=True, text=True, check=True).stdout
    assert json.loads(out)["capacity_tokens"] == 4096
    info = json.loads(subprocess.run([sys.executable, "-m", "radixd.server.cli", "info", "--target", server.target],
                                     capture_output=True, text=True, check=True).stdout)
    assert info["instance_id"] == server.instance_id and info["device_pools"][0]["backend"] == "shm"
    r = subprocess.run([sys.executable, "-m", "radixd.server.cli", "check", "--target", server.target],
                       capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == "ok"


def test_config_file_env_and_flags(tmp_path, monkeypatch):
    from radixd.server.config import load
    f = tmp_path / "radixd.toml"
    f.write_text('[radixd]\nnum_slots = 2048\npage_size = 4\neviction_policy = "lfu"\n')
    monkeypatch.setenv("RADIXD_PAGE_SIZE", "8")
    cfg = load({"config": str(f), "eviction_policy": "slru"})
    assert (cfg.num_slots, cfg.page_size, cfg.eviction_policy) == (2048, 8, "slru")
    f.write_text("bogus = 1\n")
    with pytest.raises(ValueError, match="bogus"):
        load({"config": str(f)})
