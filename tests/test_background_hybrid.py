"""The engines' background threads (`radixd.client.background`) against a real hybrid server: lookups hand back
the state slot at a hit's end, publishes donate a state each and put the donated slot back into the stock,
releases of a
model with states unlock, and nothing stays held or locked. The vLLM connector's Mamba path rests on these."""
from __future__ import annotations

import contextlib
import time

import numpy as np
import pytest

from radixd.client import CacheClient
from radixd.client.background import Lookups, Stores

from .conftest import ServerProc
from .test_service_hybrid import TRI_CONFIG, _config

PAGE = 4


@pytest.fixture
def server(tmp_path):
    s = ServerProc("--num-slots", "256", "--page-size", str(PAGE), "--model-config", _config(tmp_path, TRI_CONFIG),
                   "--hybrid-cache", "--swa-ratio", "0.5", "--mamba-states", "8")
    yield s
    s.stop()


def _settle(stores: Stores, lookups: Lookups) -> None:
    lookups.wait_idle(10)
    deadline = time.monotonic() + 10
    while not stores.idle() and time.monotonic() < deadline:
        stores.wait_idle(0.1)


@contextlib.contextmanager
def _engine(server, states: int):
    """An engine's client with its store and lookup threads, and a probe; afterwards nothing may stay held or
    locked, and the server's checker must pass."""
    c = CacheClient(server.target, name="engine")
    probe = CacheClient(server.target, name="probe")
    stores = Stores(c, PAGE, 64, hybrid=True, states=states)
    lookups = Lookups(c, False, stores, hybrid=True)
    stores.first = lookups
    pool = c.map_pools()
    try:
        yield c, probe, stores, lookups, pool.state.conv_buffer[0]
    finally:
        pool.close()
        lookups.close()
        stores.close()
        s = probe.stats()
        assert s["held_tokens"] == 0 and s["mamba_held"] == 0 and s["receipts"] == 0, s
        assert probe.check() == []
        probe.close()
        c.close()


def test_publishes_donate_states_and_give_the_donated_slots_back(server):
    with _engine(server, 2) as (c, probe, stores, lookups, conv):
        toks = np.arange(100, 124, dtype=np.int32)
        start = 0
        for end, mark in ((8, 1.0), (16, 2.0)):  # two steps of one request, each ending on a page
            got = stores.take_pages((end - start) // PAGE, wait=5, states=1)
            assert got is not None
            pages, twins, states = got
            assert len(states) == 1 and (twins[:, 0] >= 0).all()
            conv[int(states[0])] = mark  # the state as of `end`, as a worker would copy it
            stores.publish("r", toks[:end], start, pages.reshape(-1), {}, state=int(states[0]))
            start = end
        stores.release("r", toks[:16], {})
        _settle(stores, lookups)
        s = probe.stats()
        assert s["receipts"] == 0 and s["mamba_evictable"] == 2, s
        assert s["mamba_held"] == len(stores._states), s  # only the stock: donated slots went back into it
        for n, mark in ((8, 1.0), (16, 2.0)):  # the tree kept a copy of each donated state at its end
            m = probe.match_hybrid([toks[:n]])[0]
            assert m.matched_len == n and m.mamba_src >= 0 and float(conv[m.mamba_src].min()) == mark
        lookups.submit("q", toks[:20], {})
        deadline = time.monotonic() + 5
        while (res := lookups.take("q", 0.1)) is None and time.monotonic() < deadline:
            pass
        indices, receipt, _, state = res
        assert len(indices) == 16 and receipt and float(conv[state].min()) == 2.0
        stores.hold("q", indices, receipt)
        got = stores.take_pages(1, wait=5, states=1)
        stores.publish("q", toks[:24], 8, got[0].reshape(-1), {}, state=int(got[2][0]))  # cannot attach at 8
        stores.release("q", toks[:16], {})
        _settle(stores, lookups)
        assert "q" not in stores.refused and probe.stats()["receipts"] == 0
        salted = {"cache_salt": "tenant"}  # a namespaced request: its own prefix, invisible to the others
        got = stores.take_pages(2, wait=5, states=1)
        stores.publish("s", toks[:8], 0, got[0].reshape(-1), salted, state=int(got[2][0]))
        stores.release("s", toks[:8], salted)
        _settle(stores, lookups)
        for rid, ns, want in (("d", {}, 16), ("t", salted, 8), ("o", {"cache_salt": "other"}, 0)):
            lookups.submit(rid, toks[:20], ns)
            deadline = time.monotonic() + 5
            while (res := lookups.take(rid, 0.1)) is None and time.monotonic() < deadline:
                pass
            assert len(res[0]) == want, (ns, len(res[0]))
            stores.unlock(res[1])
        _settle(stores, lookups)


def test_a_burst_of_lookups_is_one_matchprefix_and_a_waiter_starts_it_at_once(server):
    """Requests an engine adds one by one while nobody waits go out together; the first take with a wait starts the
    round (the linger here is far longer than the test, so only the waiter can have started it)."""
    c = CacheClient(server.target, name="engine")
    stores = Stores(c, PAGE, 64, hybrid=True, states=1)
    lookups = Lookups(c, False, stores, hybrid=True, linger=60.0)
    stores.first = lookups
    try:
        for i in range(8):
            lookups.submit(i, np.arange(i * 100, i * 100 + 16, dtype=np.int32), {})
        t = time.monotonic()
        first = lookups.take(0, wait=30)
        assert first is not None and time.monotonic() - t < 10
        assert lookups.rpcs == 1  # the eight lookups in one MatchPrefix
        assert all(lookups.take(i) is not None for i in range(1, 8))
        assert lookups.idle()
    finally:
        lookups.close()
        stores.close()
        c.close()


def test_a_requests_chunks_queued_in_one_round_go_in_one_cacheunfinished_each_with_its_state(server):
    """Three chunks of one request published before the store thread's round (a prefill faster than its ticks):
    one CacheUnfinished takes all three, each item extending the one before (and taking over its lock) and donating
    the state as of its own end; radixd holds each chunk's end with that chunk's state, and one lock."""
    with _engine(server, 4) as (c, probe, stores, lookups, conv):
        toks = np.arange(300, 324, dtype=np.int32)
        taken = []
        for end in (8, 16, 24):  # the slots first (Alloc calls of their own), then the round under test
            got = stores.take_pages(8 // PAGE, wait=5, states=1)
            assert got is not None
            taken.append((end, got[0].reshape(-1), int(got[2][0])))
        _settle(stores, lookups)
        stores.stepped = True  # (the round runs at the step's end: every publish below is in it)
        for end, slots, state in taken:
            conv[state] = float(end)  # the state as of `end`, as a worker would copy it
            stores.publish("r", toks[:end], end - 8, slots, {}, state=state)
        calls: list[tuple[str, int]] = []
        for name in ("cache_unfinished", "unlock"):
            def counted(arg, _name=name, _real=getattr(c, name)):
                calls.append((_name, len(arg)))
                return _real(arg)
            setattr(c, name, counted)
        stores.flush()
        _settle(stores, lookups)
        assert calls == [("cache_unfinished", 3)], calls  # each item took over the lock of the one before
        assert probe.stats()["receipts"] == 1  # the last chunk's lock only
        for end, _, _ in taken:
            m = probe.match_hybrid([toks[:end]])[0]
            assert m.matched_len == end and m.mamba_src >= 0 and float(conv[m.mamba_src].min()) == float(end)
        stores.release("r", toks[:24], {})
        stores.flush()
        _settle(stores, lookups)
        assert probe.stats()["receipts"] == 0 and probe.check() == []
