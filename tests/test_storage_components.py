"""The L3 tier of hybrid models on real stores (a directory, Valkey, a Valkey cluster, Mooncake): a prefix server A
cached and evicted to its host tier is a hit on a cold server B that restores every component byte-exact (FULL KV
of every position, the SWA window before the end, the state at the end), for every component set; the prefetch
policies; another model's objects are never read. Each value written names its token prefix (computed here, without
radixd); the checker and per-pool conservation run after every call."""
from __future__ import annotations

import json

import numpy as np
import pytest

from .conftest import ServerProc
from .stores import BACKENDS
from .test_service_hybrid import COMPONENT_SETS, PAGE, Engine

rng = np.random.default_rng(3)
PROMPTS = [rng.integers(0, 1000, int(rng.integers(20, 90)), dtype=np.int32) for _ in range(6)]
ALIGNED = sum(len(t) - len(t) % PAGE for t in PROMPTS)


@pytest.fixture(params=sorted(BACKENDS))
def store(request):
    s = BACKENDS[request.param]()
    yield s
    s.stop()


def _server(tmp_path, components: str, url: str, *extra: str) -> ServerProc:
    path = tmp_path / f"{components}.json"
    path.write_text(json.dumps(COMPONENT_SETS[components]))
    return ServerProc("--num-slots", "384", "--page-size", str(PAGE), "--model-config", str(path), "--hybrid-cache",
                      "--swa-ratio", "0.5", "--mamba-states", "10", "--host-slots", "1536", "--load-back-threshold",
                      "0", "--storage", url, "--prefetch-threshold", "1", *extra)


def _store_from_a(tmp_path, components: str, url: str, *extra: str,
                  host_evicts: bool = False) -> tuple[ServerProc, dict]:
    """Server A caches PROMPTS (values of their prefixes), evicts them to its host tier (and so to L3; with
    host_evicts, from the host too: a write-back store takes them then); it stays up (a Mooncake object lives in
    the segments its clients mount)."""
    a = _server(tmp_path, components, url, *extra)
    try:
        e = Engine(a.target)
        for t in PROMPTS:
            e.finish(e.start(t, rng))
        e.c.evict_hybrid(1 << 20)
        assert e.c.wait_storage()
        e.ok()
        if host_evicts:
            st = e.c.stats()
            assert st["host_cached_tokens"] >= ALIGNED and st["storage_put_pages_total"] == 0, st
            assert e.c.evict_host(1 << 20) >= ALIGNED
            assert e.c.wait_storage()
            assert e.c.stats()["host_cached_tokens"] == 0
            e.ok()
        st = e.c.stats()
        assert st["storage_errors_total"] == 0 and st["storage_put_pages_total"] > 0, st
        e.close()
        return a, st
    except BaseException:
        a.stop()
        raise


def _hits_on_b(b: ServerProc, components: str) -> Engine:
    """Every prompt on cold server B: a hit of all its whole pages, restored from L3, checked value by value."""
    e = Engine(b.target)
    e.host = True
    for t in PROMPTS:
        m = e.c.match_hybrid([t], lock=True, mamba_cow=e.conv is not None)[0]
        assert m.matched_len == len(t) - len(t) % PAGE
        e.verify(t, m, cow=e.conv is not None)
        e.ok()
        e.c.unlock([m.receipt_id])
        if m.mamba_slot >= 0:
            e.c.free_hybrid(states=[m.mamba_slot])
        e.ok()
    return e


@pytest.mark.parametrize("components", ["FSM", "M"])
def test_a_hybrid_prefix_stored_by_one_server_is_restored_byte_exact_by_another(tmp_path, store, components):
    a, _ = _store_from_a(tmp_path, components, store.url, "--model-id", "tiny", "--prefetch-policy",
                         "wait_complete")
    b = _server(tmp_path, components, store.url, "--model-id", "tiny", "--prefetch-policy", "wait_complete")
    try:
        e = _hits_on_b(b, components)
        st = e.c.stats()
        assert st["storage_hit_tokens_total"] == ALIGNED and st["load_back_tokens_total"] == ALIGNED, st
        assert e.checked["state"] == (len(PROMPTS) if "M" in components else 0)
        assert e.checked["full"] == (ALIGNED if "F" in components else 0)
        e.close()
    finally:
        b.stop()
        a.stop()


@pytest.mark.parametrize("components", ["S", "SM"])
def test_models_without_full_attention_restore_their_windows_and_states_from_l3(tmp_path, components):
    """No FULL KV at all: the store holds the SWA windows (and states); the tree's keys come with the request."""
    url = f"file://{tmp_path / 'l3'}"
    a, put = _store_from_a(tmp_path, components, url, "--prefetch-policy", "wait_complete")
    b = _server(tmp_path, components, url, "--prefetch-policy", "wait_complete")
    try:
        e = _hits_on_b(b, components)
        st = e.c.stats()
        assert st["storage_hit_tokens_total"] == ALIGNED and e.checked["swa"] > 0, st
        assert st["storage_get_pages_total"] <= put["storage_put_pages_total"]  # windows, not whole prefixes
        e.close()
    finally:
        b.stop()
        a.stop()


def test_best_effort_answers_at_once_and_a_later_match_hits(tmp_path):
    """best_effort: the first match does not wait for the store (a miss now); once the fetch has landed, the next
    match hits all of it; wait_complete hits at the first match (above)."""
    url = f"file://{tmp_path / 'l3'}"
    a, _ = _store_from_a(tmp_path, "FSM", url)
    b = _server(tmp_path, "FSM", url)  # (best_effort is the default)
    try:
        e = Engine(b.target)
        t = PROMPTS[0]
        assert e.c.match_hybrid([t])[0].matched_len == 0
        assert e.c.wait_storage()
        m = e.c.match_hybrid([t])[0]
        assert m.matched_len == len(t) - len(t) % PAGE
        e.verify(t, m, cow=False)
        e.ok()
        e.close()
    finally:
        b.stop()
        a.stop()


def test_another_models_objects_are_never_read(tmp_path):
    """The format tags name the model (--model-id) and each component's geometry: a server of another model id
    finds nothing in the same store."""
    url = f"file://{tmp_path / 'l3'}"
    a, _ = _store_from_a(tmp_path, "FSM", url, "--model-id", "one", "--prefetch-policy", "wait_complete")
    b = _server(tmp_path, "FSM", url, "--model-id", "two", "--prefetch-policy", "wait_complete")
    try:
        e = Engine(b.target)
        assert e.c.match_hybrid([PROMPTS[0]])[0].matched_len == 0
        st = e.c.stats()
        assert st["storage_hit_tokens_total"] == 0 and st["storage_get_pages_total"] == 0, st
        e.ok()
        e.close()
    finally:
        b.stop()
        a.stop()


@pytest.mark.parametrize("components", ["FSM", "S", "M"])
def test_a_write_back_store_takes_a_hybrid_prefix_when_the_host_evicts_it(tmp_path, components):
    """--storage-write-policy write_back: the host tier taking a prefix writes nothing; its eviction from the host
    writes every component (each leaf's own pages, the window ending there, its state), and cold server B then hits
    every prompt restored byte-exact."""
    url = f"file://{tmp_path / 'l3'}"
    wb = ("--storage-write-policy", "write_back", "--prefetch-policy", "wait_complete")
    a, _ = _store_from_a(tmp_path, components, url, *wb, host_evicts=True)
    b = _server(tmp_path, components, url, *wb)
    try:
        e = _hits_on_b(b, components)
        st = e.c.stats()
        assert st["storage_hit_tokens_total"] == ALIGNED and st["load_back_tokens_total"] == ALIGNED, st
        assert e.checked["state"] == (len(PROMPTS) if "M" in components else 0)
        e.close()
    finally:
        b.stop()
        a.stop()
