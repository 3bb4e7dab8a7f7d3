"""The host tier through the real server: backups, demotion, load-back byte for byte, write-back, bad input."""
from __future__ import annotations

import os

import numpy as np
import pytest

from radixd.client import CacheClient, FailedPrecondition, InvalidArgument, NotFound

from .conftest import ServerProc
from .test_pools import _run as _in_process  # a spawned process that answers through a queue
from .test_service import conserved as device_conserved



def conserved(c: CacheClient) -> dict:
    """Conservation per pool and tier, plus the server's checker over both tiers and every transfer."""
    s = device_conserved(c)
    assert s["host_cached_tokens"] == s["host_evictable_tokens"] + s["host_protected_tokens"]
    assert s["host_free_tokens"] + s["host_cached_tokens"] <= s["host_capacity_tokens"]  # exact: check()
    return s


def pattern(tokens: np.ndarray, layer: int) -> np.ndarray:
    """KV a worker writes for these tokens: distinct per token and layer, exact in float16."""
    return ((tokens.astype(np.int64) * 7 + layer * 3) % 1999).astype(np.float32) - 999.0


def _write(target, slots, tokens, q):
    with CacheClient(target, name="writer") as c:
        pools = c.map_pools()
        dev = pools.device[0]
        import torch
        for layer in range(len(dev.k_buffer)):
            val = torch.from_numpy(pattern(tokens, layer)).to(dev.k_buffer[layer].dtype)
            dev.k_buffer[layer][torch.from_numpy(slots)] = val[:, None, None]
            dev.v_buffer[layer][torch.from_numpy(slots)] = -val[:, None, None]
        pools.close()
    q.put("written")


def _read(target, slots, tokens, q):
    with CacheClient(target, name="reader") as c:
        pools = c.map_pools()
        dev = pools.device[0]
        ok = True
        for layer in range(len(dev.k_buffer)):
            want = pattern(tokens, layer)
            k = dev.k_buffer[layer][slots].float().numpy()
            v = dev.v_buffer[layer][slots].float().numpy()
            ok &= bool(np.array_equal(k, np.broadcast_to(want[:, None, None], k.shape)))
            ok &= bool(np.array_equal(v, np.broadcast_to(-want[:, None, None], v.shape)))
        pools.close()
    q.put(ok)


def _cache_backed_up(c: CacheClient, *prompts: np.ndarray) -> None:
    """Cache each prompt in fresh slots and wait for its host backups (if the policy starts any)."""
    for toks in prompts:
        ins = c.cache_finished([dict(tokens=toks, indices=c.alloc(len(toks)))])[0]
        c.wait_transfers(ins.backup_transfer_ids)


def _server(page: int, layout: str, policy: str, slots: int = 256, host: int = 1024, *extra: str) -> ServerProc:
    return ServerProc("--num-slots", str(slots), "--page-size", str(page), "--host-slots", str(host),
                      "--host-layout", layout, "--write-policy", policy, "--load-back-threshold", "1",
                      "--layers", "2", "--kv-heads", "2", "--head-dim", "8", *extra)


@pytest.mark.parametrize("policy", ["write_through", "write_through_selective", "write_back"])
@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
@pytest.mark.parametrize("page", [1, 16])
def test_demote_then_load_back_is_byte_exact(page, layout, policy):
    srv = _server(page, layout, policy)
    try:
        with CacheClient(srv.target, name="scheduler") as c:
            tokens = np.arange(1000, 1000 + 96, dtype=np.int32)
            slots = c.alloc(96)
            assert _in_process(_write, srv.target, slots, tokens) == "written"
            ins = c.cache_finished([dict(tokens=tokens, indices=slots)])[0]
            if policy == "write_through_selective":  # a second insert of the same prefix crosses threshold 2
                again = c.alloc(96)
                ins = c.cache_finished([dict(tokens=tokens, indices=again)])[0]
            assert bool(ins.backup_transfer_ids) == (policy != "write_back")
            done, failed = c.wait_transfers(ins.backup_transfer_ids)
            assert sorted(done) == sorted(ins.backup_transfer_ids) and not failed
            s = conserved(c)
            assert s["host_cached_tokens"] == (0 if policy == "write_back" else 96)
            assert c.evict(96) == 96  # demoted (write-back: written back first, then demoted)
            s = conserved(c)
            assert (s["cached_tokens"], s["host_cached_tokens"]) == (0, 96)
            m = c.match_prefix(np.concatenate([tokens, [5, 6, 7]]), lock=True)
            assert (m.matched_len, m.host_hit_len) == (0, 96)
            lb = c.load_back(m.receipt_id)
            assert lb.loaded_len == 96 and lb.transfer_id and lb.receipt_id != m.receipt_id
            assert len(lb.indices) == 96 and conserved(c)["in_flight_tokens"] in (0, 96)
            done, failed = c.wait_transfers([lb.transfer_id])
            assert done == [lb.transfer_id] and not failed
            assert _in_process(_read, srv.target, lb.indices, tokens) is True
            m2 = c.match_prefix(tokens)
            assert m2.matched_len == 96 and np.array_equal(m2.indices, lb.indices)
            with pytest.raises(NotFound):
                c.unlock([m.receipt_id])  # replaced by the load-back's receipt
            c.unlock([lb.receipt_id])
            conserved(c)
    finally:
        srv.stop()


def test_refused_load_backs_change_nothing():
    srv = _server(1, "page_first", "write_through", 64, 256, "--load-back-threshold", "8")
    try:
        with CacheClient(srv.target) as c:
            short, long_ = np.arange(1, 5, dtype=np.int32), np.arange(100, 140, dtype=np.int32)
            _cache_backed_up(c, short, long_)
            c.evict(64)
            before = conserved(c)
            m = c.match_prefix(short, lock=True)
            lb = c.load_back(m.receipt_id)
            assert (lb.loaded_len, lb.reason, lb.receipt_id) == (0, "threshold", m.receipt_id)
            m2 = c.match_prefix(long_, lock=True)
            lb = c.load_back(m2.receipt_id, mem_quota=10)
            assert (lb.loaded_len, lb.reason) == (0, "quota")
            locked = c.alloc(64 - 0)  # the device is full of held slots: nothing evictable
            lb = c.load_back(m2.receipt_id)
            assert (lb.loaded_len, lb.reason) == (0, "no_room")
            c.free(locked)
            c.unlock([m.receipt_id, m2.receipt_id])
            after = conserved(c)
            for k in ("cached_tokens", "host_cached_tokens", "free_tokens", "host_free_tokens", "load_back_tokens_total"):
                assert after[k] == before[k], k
    finally:
        srv.stop()


def test_write_back_under_alloc_pressure_and_host_eviction_under_host_pressure():
    srv = _server(16, "page_first", "write_back", 128, 128)
    try:
        with CacheClient(srv.target) as c:
            prompts = [np.arange(i * 1000, i * 1000 + 64, dtype=np.int32) for i in range(6)]
            for toks in prompts[:2]:
                c.cache_finished([dict(tokens=toks, indices=c.alloc(64))])
            s = conserved(c)
            assert (s["cached_tokens"], s["host_cached_tokens"]) == (128, 0)
            held = c.alloc(64)  # the device is full: radixd writes back, waits, demotes, then hands out
            s = conserved(c)
            assert s["host_cached_tokens"] == 64 and s["backup_tokens_total"] == 64
            c.free(held)
            for toks in prompts[2:]:  # more than the host holds: host leaves go in LRU order
                c.cache_finished([dict(tokens=toks, indices=c.alloc(64))])
                conserved(c)
            s = conserved(c)
            assert s["host_evicted_tokens_total"] > 0 and s["host_cached_tokens"] <= 128
            assert c.match_prefix(prompts[0]).host_hit_len == 0  # the oldest left the host tier
    finally:
        srv.stop()


def test_failed_copy_rolls_back_and_is_counted():
    env = dict(os.environ)
    os.environ["RADIXD_TEST_FAIL_COPIES"] = "1"
    try:
        srv = _server(1, "page_first", "write_through", 64, 256)
    finally:
        os.environ.clear()
        os.environ.update(env)
    try:
        with CacheClient(srv.target) as c:
            toks = np.arange(10, 42, dtype=np.int32)
            ins = c.cache_finished([dict(tokens=toks, indices=c.alloc(32))])[0]
            done, failed = c.wait_transfers(ins.backup_transfer_ids)
            assert failed == list(ins.backup_transfer_ids)
            s = conserved(c)
            assert (s["transfer_failures_total"], s["host_cached_tokens"], s["host_free_tokens"]) == (1, 0, 256)
            c.evict(32)  # never backed up: deleted, not demoted
            assert c.match_prefix(toks).host_hit_len == 0
    finally:
        srv.stop()


def test_bad_input_for_new_rpcs_changes_nothing():
    srv = _server(1, "page_first", "write_through", 64, 256)
    try:
        with CacheClient(srv.target) as a, CacheClient(srv.target) as b:
            toks = np.arange(1, 33, dtype=np.int32)
            ins = a.cache_finished([dict(tokens=toks, indices=a.alloc(32))])[0]
            a.wait_transfers(ins.backup_transfer_ids)
            a.evict(32)
            m = a.match_prefix(toks, lock=True)
            before = conserved(a)
            with pytest.raises(NotFound):
                a.load_back(m.receipt_id + 12345)  # unknown receipt
            with pytest.raises(FailedPrecondition):
                b.load_back(m.receipt_id)  # another session's receipt
            with pytest.raises(InvalidArgument):
                a.load_back(m.receipt_id, mem_quota=-1)
            with pytest.raises(NotFound):
                a.wait_transfers([987654321])
            assert conserved(a) == before
            lb = a.load_back(m.receipt_id)
            assert a.wait_transfers([lb.transfer_id])[0] == [lb.transfer_id]
            a.unlock([lb.receipt_id])
            conserved(a)
    finally:
        srv.stop()


def _load_and_die(target, tokens, q):
    with CacheClient(target, name="dies") as c:
        m = c.match_prefix(tokens, lock=True)
        lb = c.load_back(m.receipt_id)
        q.put(lb.loaded_len)
        q.close()
        q.join_thread()  # the answer is out of the process before it dies
        os._exit(0)  # no unlock, no wait: the copy may still be running when the session ends


def test_transfer_completions_reach_the_attach_stream_and_dead_sessions_leak_nothing():
    import threading
    import time
    srv = _server(16, "layer_first", "write_through", 256, 1024)
    try:
        with CacheClient(srv.target) as c:
            toks = np.arange(1, 129, dtype=np.int32)
            ins = c.cache_finished([dict(tokens=toks, indices=c.alloc(128))])[0]
            c.wait_transfers(ins.backup_transfer_ids)
            c.evict(128)
            m = c.match_prefix(toks, lock=True)
            lb = c.load_back(m.receipt_id)
            got = []
            reader = threading.Thread(target=lambda: got.append(next(c.transfer_events())), daemon=True)
            reader.start()
            reader.join(30)
            assert got == [(lb.transfer_id, True)]
            c.unlock([lb.receipt_id])
            c.evict(128)
            assert _in_process(_load_and_die, srv.target, toks) == 128
            deadline = time.monotonic() + 5
            while True:  # the dead session's receipt goes once its copy has landed
                s = c.stats()
                if s["sessions"] == 1 and s["receipts"] == 0 and s["in_flight_tokens"] == 0:
                    break
                assert time.monotonic() < deadline, s
                time.sleep(0.01)
            s = conserved(c)
            assert s["cached_tokens"] == 128 and s["protected_tokens"] == 0 and s["held_tokens"] == 0
    finally:
        srv.stop()


def test_async_client_loads_back_too():
    import asyncio

    from radixd.client import AsyncCacheClient
    srv = _server(1, "page_first", "write_back", 64, 256)

    async def run():
        async with AsyncCacheClient(srv.target) as c:
            toks = np.arange(1, 33, dtype=np.int32)
            (slots,) = await c.alloc([32])
            await c.cache_finished([dict(tokens=toks, indices=slots)])
            assert await c.evict(32) == 32
            m = await c.match_prefix(toks, lock=True)
            lb = await c.load_back(m.receipt_id)
            assert lb.loaded_len == 32 and (await c.wait_transfers([lb.transfer_id]))[0] == [lb.transfer_id]
            await c.unlock([lb.receipt_id])
            assert await c.check() == []
    try:
        asyncio.run(run())
    finally:
        srv.stop()


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_evict_beyond_what_is_evictable_frees_what_it_can(policy):
    """Evict(n) larger than the evictable total frees everything evictable (write-backs waited for), under
    either policy; a locked prefix stays."""
    srv = _server(16, "page_first", policy, 256, 1024)
    try:
        with CacheClient(srv.target) as c:
            a, b = np.arange(1, 65, dtype=np.int32), np.arange(1000, 1064, dtype=np.int32)
            _cache_backed_up(c, a, b)
            m = c.match_prefix(a, lock=True)
            assert conserved(c)["cached_tokens"] == 128
            assert c.evict(10_000) == 64  # b only: a is locked
            s = conserved(c)
            assert (s["cached_tokens"], s["host_cached_tokens"]) == (64, 64 if policy == "write_back" else 128)
            c.unlock([m.receipt_id])
            assert c.evict(10_000) == 64
            assert conserved(c)["cached_tokens"] == 0
    finally:
        srv.stop()


def test_clients_that_come_and_go_leave_no_error_in_the_log():
    """Every Attach stream a client drops is torn down cleanly (no pending task destroyed): a clean run
    logs no ERROR, backups and load-backs included."""
    srv = _server(16, "page_first", "write_through")
    try:
        for i in range(30):  # enough dropped streams that the server's garbage collector runs meanwhile
            with CacheClient(srv.target, name=f"client-{i}") as c:
                if i < 5:
                    t = np.arange(100 * i, 100 * i + 32, dtype=np.int32)
                    ins = c.cache_finished([dict(tokens=t, indices=c.alloc(len(t)))])[0]
                    c.wait_transfers(ins.backup_transfer_ids)
                conserved(c)
        with CacheClient(srv.target, name="last") as c:  # the sessions above are gone
            assert c.stats()["sessions"] == 1
    finally:
        assert srv.stop() == 0
    log = srv.log()
    assert "ERROR" not in log and "Task was destroyed" not in log, log[-3000:]


def test_the_copy_engine_is_ready_before_the_first_backup():
    """Building the copiers (and importing torch) happens at start, never on the loop at the first backup."""
    import subprocess
    import sys
    code = ("import sys, uuid; from radixd.server.app import build_core; from radixd.server.config import Config; "
            "c = build_core(Config(device='cpu', num_slots=256, page_size=16, layers=2, kv_heads=2, head_dim=8, "
            "host_slots=512), uuid.uuid4().hex); "
            "print(len(c.host.engine._copiers), 'torch' in sys.modules); "
            "[p.close() for p in c.device_pools + [c.host_pool]]")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["2", "True"], out.stdout + out.stderr[-2000:]
