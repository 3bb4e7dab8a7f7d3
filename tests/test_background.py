"""The engines' store thread (`radixd.client.background.Stores`) against a real plain server: a request released in
the round of its last publish is published and released by one CacheFinished; one released later takes the
CacheUnfinished, then CacheFinished, path. Both leave the same cache, no lock and nothing held. The inbox those
threads take work from wakes a sleeping thread on a post, and a polling one takes it with no wake at all."""
from __future__ import annotations

import contextlib
import threading
import time
import urllib.request
from typing import Any, Iterator

import numpy as np

from radixd.client import CacheClient
from radixd.client.background import Inbox, Lookups, Stores
from radixd.client.errors import RadixdError

from .conftest import ServerProc

PAGE = 4


def _calls(srv: ServerProc) -> dict[str, float]:
    """Successful RPCs per method, from the server's Prometheus endpoint."""
    with urllib.request.urlopen(f"http://{srv.metrics_url.split('//')[1]}", timeout=10) as r:
        lines = r.read().decode().splitlines()
    out = {}
    for ln in lines:
        if ln.startswith("radixd_rpc_requests_total{") and 'code="OK"' in ln:
            method = ln.split('method="')[1].split('"')[0]
            out[method] = float(ln.rsplit(" ", 1)[1])
    return out


def _settle(stores: Stores) -> None:
    deadline = time.monotonic() + 10
    while not stores.idle() and time.monotonic() < deadline:
        stores.wait_idle(0.1)
    assert stores.idle()


@contextlib.contextmanager
def _engine(stock: int, **lookups_kw: Any) -> Iterator[tuple[ServerProc, CacheClient, CacheClient, Stores, Lookups]]:
    """A server, an engine's client with its store and lookup threads, and a probe client; all closed after."""
    srv = ServerProc("--num-slots", "256", "--page-size", str(PAGE))
    c, probe = CacheClient(srv.target, name="engine"), CacheClient(srv.target, name="probe")
    stores = Stores(c, PAGE, stock)
    lookups = Lookups(c, False, stores, **lookups_kw)
    stores.first = lookups
    try:
        yield srv, c, probe, stores, lookups
    finally:
        lookups.close()
        stores.close()
        c.close()
        probe.close()
        srv.stop()


def test_a_release_in_the_round_of_its_publish_is_one_cachefinished():
    with _engine(64) as (srv, c, probe, stores, lookups):
        base = np.arange(100, 108, dtype=np.int32)  # radixd holds its first page, locked by a lookup
        c.cache_finished([dict(tokens=base[:PAGE], indices=c.alloc(PAGE))])
        m = c.match_prefix(base, lock=True)
        assert m.matched_len == PAGE and m.receipt_id
        pages = stores.take_pages(2, wait=5)
        pages_later = stores.take_pages(2, wait=5)
        assert pages is not None and pages_later is not None
        _settle(stores)
        before = _calls(srv)
        toks = np.concatenate([base, np.arange(200, 204, dtype=np.int32)])  # 3 pages: 1 held, 2 new
        # all three in one round, as a request that ends at its prefill queues them (one extend: atomic)
        stores._inbox.items.extend([("hold", "r", m.indices, m.receipt_id),
                                    ("publish", "r", toks, PAGE, pages.reshape(-1), {}, False, 0, -1, None),
                                    ("release", "r", toks, {})])
        stores._inbox.ring()
        _settle(stores)
        after = _calls(srv)
        assert after.get("CacheFinished", 0) - before.get("CacheFinished", 0) == 1
        assert after.get("CacheUnfinished", 0) == before.get("CacheUnfinished", 0)
        assert after.get("Unlock", 0) == before.get("Unlock", 0)
        got = probe.match_prefix(toks)
        assert got.matched_len == 12 and got.indices[PAGE:].tolist() == pages.reshape(-1).tolist()

        other = np.arange(300, 308, dtype=np.int32)  # released in a later round: publish, then release
        stores.publish("q", other, 0, pages_later.reshape(-1), {})
        _settle(stores)
        stores.release("q", other, {})
        _settle(stores)
        final = _calls(srv)
        assert final.get("CacheUnfinished", 0) - after.get("CacheUnfinished", 0) == 1
        assert final.get("CacheFinished", 0) - after.get("CacheFinished", 0) == 1
        assert probe.match_prefix(other).matched_len == 8
        s = probe.stats()
        assert s["receipts"] == 0 and s["held_tokens"] == stores.stocked(), s
        assert probe.check() == []


def test_a_step_of_stores_is_planned_on_the_store_thread_in_one_round():
    """`Stores.store` (an engine hands a finished request over with radixd's prefix, if any, and the thread does the
    rest): one step's four stores (a miss, a full hit, a partial hit, one whose lookup was for other tokens) go in one
    round of one Alloc (the stock was empty), one CacheFinished and one Unlock (the stale lookup's lock). Each copy is
    called once, for exactly the pages beyond radixd's prefix (None for the full hit), and radixd ends up holding
    every prompt, the partial hit's new pages in the slots its copy was given, with no lock and nothing held."""
    with _engine(64) as (srv, c, probe, stores, lookups):
        stores.stepped = True
        prompts = {k: np.arange(100 * i, 100 * i + n * PAGE, dtype=np.int32)
                   for i, (k, n) in enumerate([("miss", 2), ("hit", 2), ("part", 3), ("stale", 2), ("other", 1)], 1)}
        for k, n in (("hit", 8), ("part", 4), ("other", 4)):
            c.cache_finished([dict(tokens=prompts[k][:n], indices=c.alloc(n))])
        locked = {k: c.match_prefix(prompts[k], lock=True) for k in ("hit", "part", "other")}
        _settle(stores)
        before = _calls(srv)
        copies: dict[str, list] = {}

        def copier(k: str):
            def copy(start: int, slots):
                if k not in copies:
                    copies[k] = [start, None if slots is None else np.array(slots)]
                return slots is not None
            return copy
        stores.store("miss", prompts["miss"], np.zeros(0, np.int64), 0, {}, copier("miss"))
        m = locked["hit"]
        stores.store("hit", prompts["hit"], m.indices, m.receipt_id, {}, copier("hit"), lookup=prompts["hit"])
        m = locked["part"]
        stores.store("part", prompts["part"], m.indices, m.receipt_id, {}, copier("part"), lookup=prompts["part"])
        m = locked["other"]  # looked up for other tokens than the request finished with
        stores.store("stale", prompts["stale"], m.indices, m.receipt_id, {}, copier("stale"), lookup=prompts["other"])
        stores.flush()  # the step's end
        _settle(stores)
        after = _calls(srv)
        assert {k: after.get(k, 0) - before.get(k, 0) for k in ("Alloc", "CacheFinished", "Unlock")} == \
            dict(Alloc=1, CacheFinished=1, Unlock=1), (before, after)
        assert copies["hit"] == [8, None]
        for k, start in (("miss", 0), ("part", PAGE), ("stale", 0)):
            assert copies[k][0] == start and len(copies[k][1]) == len(prompts[k]) - start, k
            got = probe.match_prefix(prompts[k])
            assert got.matched_len == len(prompts[k]), k
            assert got.indices[start:].tolist() == copies[k][1].tolist(), k
        assert probe.match_prefix(prompts["hit"]).matched_len == 8
        assert probe.match_prefix(prompts["other"]).matched_len == PAGE
        s = probe.stats()
        assert s["receipts"] == 0 and s["held_tokens"] == stores.stocked(), s
        assert probe.check() == []


def test_the_slot_stock_grows_so_one_alloc_serves_many_stores_and_never_past_an_eighth_of_the_server():
    """A steady stream of stores: the stock doubles at each refill up to slot_stock_tokens, so Allocs become rare;
    on a server whose eighth is smaller, the stock stops there (slots held ready must not crowd out the cache)."""
    for capacity, stock_max, want_max in ((8192, 1024, 1024), (1024, 1024, 128)):
        srv = ServerProc("--num-slots", str(capacity), "--page-size", str(PAGE))
        c, probe = CacheClient(srv.target, name="engine"), CacheClient(srv.target, name="probe")
        stores = Stores(c, PAGE, stock_max, capacity=probe.info()["capacity_tokens"])
        try:
            before = _calls(srv).get("Alloc", 0)
            short, most = 0, 0
            for _ in range(100):  # a request of 2 pages per round, as a scheduler step of one short prompt
                got = stores.take_pages(2, wait=5)
                short += got is None
                if got is not None:
                    stores.free(got.reshape(-1))
                _settle(stores)
                most = max(most, stores.stocked())
            allocs = _calls(srv).get("Alloc", 0) - before
            assert short == 0
            assert most <= want_max, (capacity, most)
            assert stores._want * PAGE == want_max  # it did grow to its bound
            if want_max >= 1024:
                assert allocs <= 10, allocs  # without the growth: one refill per 2 requests (50)
            s = probe.stats()
            assert s["held_tokens"] == stores.stocked() and probe.check() == [], s
        finally:
            stores.close()
            c.close()
            probe.close()
            srv.stop()


def test_large_stores_never_leave_the_stock_past_its_bound_and_an_idle_stock_goes_back():
    """A vLLM engine's stores of 1024 tokens on a radixd of 2688 used to leave 1024 slots held while it idled (the
    target grew to the request's size): each large store takes its shortfall once, the stock stays within an eighth
    of the server, and once the engine stops storing the whole stock goes back to radixd within its idle time."""
    srv = ServerProc("--num-slots", "2688", "--page-size", str(PAGE))
    c, probe = CacheClient(srv.target, name="engine"), CacheClient(srv.target, name="probe")
    bound = 2688 // 8
    stores = Stores(c, PAGE, 8192, capacity=probe.info()["capacity_tokens"], idle_return=0.5)
    try:
        for _ in range(6):  # a 1024-token prompt's pages, as the scheduler asks for them
            got = stores.take_pages(1024 // PAGE, wait=5)
            assert got is not None and got.size == 1024
            stores.free(got.reshape(-1))
            _settle(stores)
            assert stores.stocked() <= bound, stores.stocked()
            assert probe.stats()["held_tokens"] == stores.stocked()
        small = stores.take_pages(2, wait=5)  # small stores grow it up to the bound at most
        assert small is not None
        stores.free(small.reshape(-1))
        _settle(stores)
        assert 0 < stores.stocked() <= bound
        end = time.monotonic() + 10  # idle: the stock goes back (bounded wait for the store thread's deadline)
        while probe.stats()["held_tokens"] and time.monotonic() < end:
            time.sleep(0.02)
        assert stores.stocked() == 0 and probe.stats()["held_tokens"] == 0 and probe.check() == []
        again = stores.take_pages(2, wait=5)  # and the next store grows it anew
        assert again is not None and again.size == 2 * PAGE
        stores.free(again.reshape(-1))
    finally:
        stores.close()
        c.close()
        probe.close()
        srv.stop()


def _consume(inbox: Inbox, got: list, done: threading.Event) -> threading.Thread:
    def run() -> None:
        inbox.wait(lambda: bool(inbox.items))
        got.extend(inbox.drain())
        done.set()
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_an_inbox_wakes_a_sleeping_thread_and_a_polling_one_needs_no_wake():
    asleep = Inbox(tick=0.005, rest=0.0)  # no rest: the thread sleeps at once, until a post rings
    got: list = []
    done = threading.Event()
    t = _consume(asleep, got, done)
    deadline = time.monotonic() + 10
    while not asleep._asleep and time.monotonic() < deadline:
        time.sleep(0.001)
    assert asleep._asleep and not done.is_set()
    asleep.post("a")
    assert done.wait(5) and got == ["a"]
    t.join(5)

    polling = Inbox(tick=0.005, rest=60.0)  # work came lately: the thread polls, a post rings nothing
    rings: list = []
    polling.ring = lambda: rings.append(1)  # type: ignore[method-assign]
    got2: list = []
    done2 = threading.Event()
    t2 = _consume(polling, got2, done2)
    polling.post("b")
    assert done2.wait(5) and got2 == ["b"]
    assert rings == [] and not polling._asleep
    t2.join(5)


def test_a_handed_over_lookup_is_held_by_the_store_thread_and_cut_and_listed_on_the_lookup_thread():
    """Lookups with `hand_over` and `firsts` (the vLLM connector's): the lookup thread cuts the tokens at `upto`,
    lists each page's first slot, and gives the lock to the store thread, so a release there (or a drop of a
    result never taken) lets it go; tokens beyond `upto` or a publish's end are never sent to radixd."""
    with _engine(16, hand_over=True, firsts=PAGE) as (_, c, probe, stores, lookups):
        prompt = list(range(500, 519))  # a list, as vLLM holds a prompt; radixd holds its first 3 pages
        slots = c.alloc(12)
        c.cache_finished([dict(tokens=np.asarray(prompt[:12], np.int32), indices=slots)])
        lookups.submit("r", prompt, dict(extra_key="", cache_salt=""), upto=8)
        res = lookups.take("r", wait=5)
        assert res is not None and res[0].tolist() == slots[:8].tolist()  # cut at 8: two pages, not three
        assert res[-1] == slots[:8:PAGE].tolist()
        _settle(stores)
        assert probe.stats()["receipts"] == 1  # locked, and held by the store thread (never handed by hand)
        # a publish of the next page, with the whole prompt handed over: cut to its end on the store thread
        more = stores.take_pages(1, wait=5)
        assert more is not None
        stores.publish("r", prompt, 8, more, {})
        stores.release("r", prompt, {})
        _settle(stores)
        got = probe.match_prefix(np.asarray(prompt + [0], np.int32))
        assert got.matched_len == 12, got  # published (a longer token list with 4 slots would have been refused)
        assert probe.stats()["receipts"] == 0
        got = stores.take_pages(3, wait=5, firsts=True)  # a page radixd does not have, [12, 16), and two more
        assert got is not None and got[1] == got[0][:, 0].tolist()  # the pages' first slots, listed beforehand
        more, spare = got[0][:1], got[0][1:]
        again = stores.take_pages(2, wait=5, firsts=True)  # the list goes on where the last take ended
        assert again is not None and again[1] == again[0][:, 0].tolist()
        assert not set(again[0].reshape(-1).tolist()) & set(got[0].reshape(-1).tolist())
        stores.free(spare)
        stores.free(again[0])
        lookups.submit("s", prompt, dict(extra_key="", cache_salt=""), upto=16)
        res = lookups.take("s", wait=5)
        assert res is not None and len(res[0]) == 12 and res[-1] == res[0][::PAGE].tolist()
        stores.publish("s", prompt, 12, more, {})
        stores.release("s", prompt, {})
        _settle(stores)
        got = probe.match_prefix(np.asarray(prompt + [0], np.int32))
        assert got.matched_len == 16 and got.indices[12:].tolist() == more.reshape(-1).tolist(), got

        lookups.submit("dropped", prompt, dict(extra_key="", cache_salt=""), upto=16)
        lookups.wait_idle(5)
        _settle(stores)
        assert probe.stats()["receipts"] == 1
        lookups.drop("dropped")  # landed but never taken: the store thread lets its lock go
        _settle(stores)
        s = probe.stats()
        assert s["receipts"] == 0 and s["held_tokens"] == stores.stocked() and probe.check() == [], s


def test_a_short_alloc_gets_an_idle_stock_back_before_it_is_refused():
    """An engine's stock of held slots must never make another client's Alloc fail: radixd, short of free slots
    while other sessions hold some, asks for stocks back (its pressure counter) and waits for them; a client that
    holds its slots and returns nothing still gets its Alloc refused, after the wait, saying what others held."""
    capacity = 1024
    srv = ServerProc("--num-slots", str(capacity), "--page-size", str(PAGE))
    c, probe, other = (CacheClient(srv.target, name=n) for n in ("engine", "probe", "other"))
    info = probe.info()
    assert info["pressure_segment"]
    stores = Stores(c, PAGE, 8192, capacity=info["capacity_tokens"], idle_return=600,
                    pressure=info["pressure_segment"])
    try:
        for _ in range(4):  # a few stores grow the stock (an idle return would take an hour here)
            got = stores.take_pages(2, wait=5)
            assert got is not None
            stores.free(got.reshape(-1))
            _settle(stores)
        stocked = stores.stocked()
        assert 0 < stocked <= capacity // 8 and probe.stats()["held_tokens"] == stocked
        mine = other.alloc(capacity - stocked)  # every free slot
        assert probe.stats()["free_tokens"] == 0
        more = other.alloc(2 * PAGE)  # only the engine's stock can serve it
        assert more.size == 2 * PAGE
        assert stores.stocked() == 0 and stores.returned == 1
        s = probe.stats()
        assert s["held_tokens"] == capacity - stocked + 2 * PAGE and probe.check() == [], s
        other.free(more)
        third = CacheClient(srv.target, name="third")
        try:
            took = third.alloc(stocked)  # the rest; "other" holds slots it never gives back
            before = probe.stats()
            try:
                third.alloc(PAGE)
                raise AssertionError("an Alloc with nothing free and nothing returned was served")
            except RadixdError as e:
                assert "RESOURCE_EXHAUSTED" in repr(e) or "other sessions hold" in str(e), e
                assert f"other sessions hold {capacity - stocked}" in str(e), e
            assert probe.stats() == before and probe.check() == []  # the refusal changed nothing
            third.free(took)
        finally:
            third.close()
        other.free(mine)
    finally:
        stores.close()
        for x in (c, probe, other):
            x.close()
        srv.stop()


def test_a_client_that_dies_while_its_alloc_waits_for_stocks_is_given_nothing():
    """An Alloc waiting for other sessions' slots must not hand slots to a session that ended meanwhile (they would
    stay held by nobody): its client is SIGKILLed while it waits, and afterwards only the holder's slots are held."""
    import subprocess
    import sys
    srv = ServerProc("--num-slots", "256", "--page-size", str(PAGE))
    holder, probe = CacheClient(srv.target, name="holder"), CacheClient(srv.target, name="probe")
    try:
        mine = holder.alloc(256)  # every slot, never given back
        code = ("import sys; from radixd.client import CacheClient; c = CacheClient(sys.argv[1]); print('up', "
                "flush=True); c.alloc(4)")
        p = subprocess.Popen([sys.executable, "-c", code, srv.target], stdout=subprocess.PIPE, text=True)
        assert p.stdout.readline().strip() == "up"
        deadline = time.monotonic() + 10
        while _asks(srv) < 1:  # the Alloc has asked for stocks and waits (0.5 s)
            assert time.monotonic() < deadline and p.poll() is None
            time.sleep(0.005)
        p.kill()
        p.wait()
        deadline = time.monotonic() + 10
        while probe.stats()["sessions"] > 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        holder.free(mine[:8])  # (what a waiting Alloc would now take, were it still waiting)
        s = probe.stats()
        assert s["sessions"] == 2 and s["held_tokens"] == 248 and probe.check() == [], s
    finally:
        holder.close()
        probe.close()
        srv.stop()


def _asks(srv: ServerProc) -> float:
    with urllib.request.urlopen(f"http://{srv.metrics_url.split('//')[1]}", timeout=10) as r:
        for ln in r.read().decode().splitlines():
            if ln.startswith("radixd_stock_asks_total "):
                return float(ln.split()[1])
    return 0.0
