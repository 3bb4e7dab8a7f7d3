"""The L3 tier on real stores (a directory, Valkey, Mooncake): backup, prefetch, sharing across servers,
namespaces, a store that dies and comes back; every server step ends with the server's own checker."""
from __future__ import annotations

import time
import urllib.request
import uuid

import numpy as np
import pytest

from radixd.client import CacheClient
from radixd.server.storage import StoreError, format_tag, open_store, page_keys
from radixd.server.pools.spec import PoolSpec

from .conftest import ServerProc
from .stores import BACKENDS, FileDir, Valkey
from .test_pools import _run as _in_process
from .test_service_tiers import _read, _write, conserved

PAGE = 16


@pytest.fixture(params=sorted(BACKENDS))
def store(request):
    s = BACKENDS[request.param]()
    yield s
    s.stop()


# ------------------------------------------------------------------ the store interface, per backend
def test_store_round_trip_stops_at_the_first_missing_page(store):
    st = open_store(store.url, 4096)
    try:
        rng = np.random.default_rng(1)
        pages = [rng.integers(0, 256, 4096, dtype=np.uint8) for _ in range(5)]
        keys = [f"t-{uuid.uuid4().hex}" for _ in range(5)]
        assert st.exists(keys) == [False] * 5
        assert st.put(keys[:2] + keys[3:4], pages[:2] + pages[3:4]) == 3
        assert st.exists(keys) == [True, True, False, True, False]
        outs = [np.zeros(4096, np.uint8) for _ in range(5)]
        assert st.get(keys, outs) == 2  # key 2 is missing: the run ends there, key 3 is not read
        assert np.array_equal(outs[0], pages[0]) and np.array_equal(outs[1], pages[1])
        assert not outs[3].any()
        assert st.get(keys[3:4], outs[3:4]) == 1 and np.array_equal(outs[3], pages[3])
    finally:
        st.close()


def test_a_page_of_another_size_is_a_miss():
    d = FileDir()
    try:
        small, big = open_store(d.url, 1024), open_store(d.url, 2048)
        small.put(["k"], [np.ones(1024, np.uint8)])
        assert big.exists(["k"]) == [True]
        assert big.get(["k"], [np.zeros(2048, np.uint8)]) == 0
    finally:
        d.stop()


def test_keys_name_the_format_the_extra_key_and_the_page():
    spec = PoolSpec(num_layers=2, kv_heads=2, head_dim=8, dtype="float16", page_size=16, num_slots=64)
    a, b = format_tag(spec, "llama"), format_tag(spec, "qwen")
    assert a != b and len(a) == 16 and format_tag(spec.with_slots(128, "layer_first"), "llama") == a
    d = bytes(range(32)) * 2
    base, lora = page_keys(a, "", d), page_keys(a, "adapter", d)
    assert len(base) == 2 and base[0].endswith(bytes(range(32)).hex()) and base[0] != lora[0]
    assert base[0].startswith(f"radixd1-{a}-0-")


# ------------------------------------------------------------------ through the real server
def _server(url: str, *extra: str, layout: str = "page_first", policy: str = "write_through") -> ServerProc:
    return ServerProc("--num-slots", "256", "--page-size", str(PAGE), "--host-slots", "1024", "--host-layout", layout,
                      "--write-policy", policy, "--load-back-threshold", "1", "--layers", "2", "--kv-heads", "2",
                      "--head-dim", "8", "--storage", url, "--prefetch-threshold", str(PAGE), *extra)


def _cache(c: CacheClient, target: str, tokens: np.ndarray, **ns) -> None:
    """A worker writes the prompt's KV, the scheduler publishes it, and the backups reach L3."""
    slots = c.alloc(len(tokens))
    assert _in_process(_write, target, slots, tokens) == "written"
    ins = c.cache_finished([dict(tokens=tokens, indices=slots, **ns)])[0]
    assert c.wait_storage(ins.backup_transfer_ids) is True
    conserved(c)


def _fetch_and_read(c: CacheClient, target: str, tokens: np.ndarray, **ns) -> None:
    """Prefetch from L3, load back to device, and have a worker check the bytes."""
    pf = c.prefetch([tokens], wait=True, **ns)[0]
    assert pf.host_len == len(tokens), pf
    m = c.match_prefix(tokens, lock=True, **ns)
    assert (m.matched_len, m.host_hit_len) == (0, len(tokens))
    lb = c.load_back(m.receipt_id)
    assert lb.loaded_len == len(tokens)
    done, failed = c.wait_transfers([lb.transfer_id])
    assert done == [lb.transfer_id] and not failed
    assert _in_process(_read, target, lb.indices, tokens) is True
    c.unlock([lb.receipt_id])
    conserved(c)


def test_two_servers_share_one_store_byte_for_byte(store):
    """A caches a prompt its worker wrote; B, cold, prefetches it from L3 and its worker reads A's bytes."""
    a = _server(store.url, "--model-id", "tiny")
    b = _server(store.url, "--model-id", "tiny", layout="layer_first")
    try:
        tokens = np.arange(5000, 5000 + 8 * PAGE, dtype=np.int32)
        with CacheClient(a.target, name="engine-a") as ca:
            _cache(ca, a.target, tokens)
            s = ca.stats()
            assert s["storage_put_pages_total"] == 8 and s["storage_errors_total"] == 0
            assert ca.info()["storage_format"] == CacheClient(b.target, attach=False).info()["storage_format"]
        with CacheClient(b.target, name="engine-b") as cb:
            m = cb.match_prefix(np.concatenate([tokens, [1]]))
            assert (m.matched_len, m.host_hit_len) == (0, 0) and m.prefetch_len in (0, len(tokens))
            _fetch_and_read(cb, b.target, tokens)
            s = cb.stats()
            assert s["storage_hit_tokens_total"] == len(tokens) and s["storage_get_pages_total"] == 8
            # the fetched pages went host -> device; a write-through re-backup finds them in L3 already
            assert s["storage_put_pages_total"] == 0
        with urllib.request.urlopen(f"http://{b.metrics_url.split('//')[1]}", timeout=10) as r:
            text = r.read().decode()
        nbytes = 8 * PAGE * 2 * 2 * 2 * 8 * 2  # pages x tokens x layers x (k, v) x heads x dim x 2 bytes
        assert f'radixd_storage_bytes_total{{direction="get"}} {float(nbytes)}' in text
        assert 'radixd_prefetch_outcomes_total{outcome="completed"} 1.0' in text
        assert 'radixd_storage_seconds_count{call="get"}' in text
    finally:
        a.stop()
        b.stop()


def test_queued_requests_sharing_a_prefix_each_get_their_whole_tail():
    """Two queued requests share 16 pages of 36: a cold server fetching both must bring every page of each
    (a fetch that brings only the shared pages may not stand in for the second request)."""
    d = FileDir()
    shared = np.arange(9000, 9000 + 16 * PAGE, dtype=np.int32)
    s5 = np.concatenate([shared, np.arange(20000, 20000 + 20 * PAGE, dtype=np.int32)])
    s6 = np.concatenate([shared, np.arange(30000, 30000 + 20 * PAGE, dtype=np.int32)])
    a = _server(d.url, "--prefetch-threshold", "256", "--num-slots", "1024")
    try:
        with CacheClient(a.target) as c:
            _cache(c, a.target, s5)
            _cache(c, a.target, s6)
    finally:
        a.stop()
    b = _server(d.url, "--prefetch-threshold", "256", "--num-slots", "1024")
    try:
        with CacheClient(b.target) as c:
            got = c.prefetch([s5, s6], wait=True)
            assert [(p.prefetch_len, p.host_len) for p in got] == [(len(s5), len(s5)), (len(s6), len(s6))], got
            for s in (s5, s6):
                m = c.match_prefix(s)
                assert (m.matched_len, m.host_hit_len) == (0, len(s))
            _fetch_and_read(c, b.target, s6)  # and the bytes are A's
            conserved(c)
    finally:
        b.stop()
        d.stop()


def test_file_store_outlives_the_server():
    d = FileDir()
    try:
        tokens = np.arange(100, 100 + 6 * PAGE, dtype=np.int32)
        a = _server(d.url)
        try:
            with CacheClient(a.target) as c:
                _cache(c, a.target, tokens)
        finally:
            assert a.stop() == 0
        a = _server(d.url)
        try:
            with CacheClient(a.target) as c:
                _fetch_and_read(c, a.target, tokens)
        finally:
            a.stop()
    finally:
        d.stop()


def test_pages_of_another_namespace_are_never_read():
    d = FileDir()
    a = _server(d.url, "--model-id", "model-a")
    b = _server(d.url, "--model-id", "model-b")
    try:
        tokens = np.arange(900, 900 + 4 * PAGE, dtype=np.int32)
        with CacheClient(a.target) as c:
            _cache(c, a.target, tokens, extra_key="lora-1")
            assert c.prefetch([tokens], wait=True, extra_key="lora-2")[0].host_len == 0  # another adapter
            assert c.prefetch([tokens], wait=True)[0].host_len == 0  # the base model
            c.evict(4 * PAGE, host_tokens=4 * PAGE)
            assert c.prefetch([tokens], wait=True, extra_key="lora-1")[0].host_len == len(tokens)
        with CacheClient(b.target) as c:  # another model: same tokens, same adapter, never a hit
            assert c.prefetch([tokens], wait=True, extra_key="lora-1")[0].host_len == 0
            assert c.stats()["storage_get_pages_total"] == 0
            conserved(c)
    finally:
        a.stop()
        b.stop()
        d.stop()


def test_write_back_to_storage_on_host_eviction():
    d = FileDir()
    srv = _server(d.url, "--storage-write-policy", "write_back")
    try:
        tokens = np.arange(300, 300 + 5 * PAGE, dtype=np.int32)
        with CacheClient(srv.target) as c:
            _cache(c, srv.target, tokens)
            assert c.stats()["storage_put_pages_total"] == 0  # on host only, so far
            assert c.evict(len(tokens), host_tokens=len(tokens)) == len(tokens)
            assert c.wait_storage() is True
            s = conserved(c)
            assert s["storage_put_pages_total"] == 5 and s["host_cached_tokens"] == 0
            _fetch_and_read(c, srv.target, tokens)
    finally:
        srv.stop()
        d.stop()


def test_match_policies_wait_or_not():
    """best_effort answers at once and reports the fetch; wait_complete answers with the pages on host."""
    d = FileDir()
    tokens = np.arange(7000, 7000 + 4 * PAGE, dtype=np.int32)
    a = _server(d.url)
    try:
        with CacheClient(a.target) as c:
            _cache(c, a.target, tokens)
    finally:
        a.stop()
    b = _server(d.url, "--prefetch-policy", "wait_complete")
    try:
        with CacheClient(b.target) as c:
            m = c.match_prefix(tokens, lock=True)
            assert (m.matched_len, m.host_hit_len, m.prefetch_len) == (0, len(tokens), 0)
            c.unlock([m.receipt_id])
            assert c.prefetch([tokens[:PAGE - 1]])[0].prefetch_len == 0  # below a page: nothing to fetch
            conserved(c)
    finally:
        b.stop()
        d.stop()


def test_a_dead_store_costs_misses_not_errors_and_is_used_again_when_back():
    v = Valkey()
    srv = _server(v.url)
    try:
        with CacheClient(srv.target) as c:
            first = np.arange(10_000, 10_000 + 4 * PAGE, dtype=np.int32)
            _cache(c, srv.target, first)
            v.kill()
            second = np.arange(20_000, 20_000 + 4 * PAGE, dtype=np.int32)
            _cache(c, srv.target, second)  # the host backup works; its L3 write fails, quietly
            cold = np.arange(30_000, 30_000 + 4 * PAGE, dtype=np.int32)
            m = c.match_prefix(cold)
            assert (m.matched_len, m.host_hit_len) == (0, 0)
            assert c.prefetch([cold], wait=True)[0].host_len == 0
            assert c.match_prefix(second).matched_len == len(second)  # device and host keep serving
            s = conserved(c)
            assert s["storage_errors_total"] >= 1 and s["storage_put_pages_total"] == 4
            v.start()
            deadline = time.monotonic() + 30
            n = 0
            while c.stats()["storage_put_pages_total"] == 4:  # the back-off ends within 8 s; then writes go through
                assert time.monotonic() < deadline, "radixd never used the store again"
                n += 1
                _cache(c, srv.target, np.arange(40_000 + n * 1000, 40_000 + n * 1000 + PAGE, dtype=np.int32))
                time.sleep(0.2)
            conserved(c)
    finally:
        srv.stop()
        v.stop()


def test_store_errors_are_store_errors():
    d = FileDir()
    st = open_store(d.url, 64)
    d.stop()  # the directory is gone: every write fails as an I/O error
    import os
    open(d.dir, "w").close()  # a file where the directory was
    try:
        with pytest.raises(StoreError) as e:
            st.put(["k"], [np.zeros(64, np.uint8)])
        assert e.value.kind == "io"
    finally:
        os.unlink(d.dir)
