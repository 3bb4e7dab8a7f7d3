"""Drives `radixd.sglang.RadixdRadixCache` on real SGLang 0.5.23 classes (CPU pools), run in SGLang's venv by
tests/test_sglang_backend.py against a live radixd server. Each scenario prints `ok NAME` or raises.

    python tests/sglang_backend_check.py TARGET [SCENARIO ...]

The scheduler's call order is driven by hand: match_prefix (with the request), init_load_back when it
reports a host hit, alloc + forward (here: known values written into the KV pool), checkpoint while chunked
and at finish, release. `Req` is a stand-in with exactly the fields SGLang's cache reads.
"""
from __future__ import annotations

import inspect
import os
import random
import sys
import time
from array import array

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests.sglang_cpu import Kv, Req, stub_torchvision  # noqa: E402

stub_torchvision()
import torch  # noqa: E402
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import (EvictParams, InitLoadBackParams,  # noqa: E402
                                                    InsertParams, MatchPrefixParams)
from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey  # noqa: E402

from radixd.client import CacheClient  # noqa: E402
from radixd.sglang.backend import SUPPORTED_SGLANG, RadixdRadixCache  # noqa: E402

PAGE, LAYERS, HEADS, DIM = 4, 2, 2, 8
TARGET = sys.argv[1]


class Engine:
    """One SGLang engine's cache side: its own KV pool, allocator, req_to_token table and tree."""

    def __init__(self, backend: bool = True, slots: int = 512, tp: tuple = (1, 0, None)):
        tp_size, self.rank, group = tp
        self.r2t = ReqToTokenPool(size=8, max_context_len=256, device="cpu", enable_memory_saver=False)
        self.kv = MHATokenToKVPool(size=slots, page_size=PAGE, dtype=torch.float32, head_num=HEADS // tp_size,
                                   head_dim=DIM, layer_num=LAYERS, device="cpu", enable_memory_saver=False)
        self.alloc = PagedTokenToKVPoolAllocator(slots, PAGE, torch.float32, "cpu", self.kv, False)
        params = CacheInitParams(disable=False, req_to_token_pool=self.r2t, token_to_kv_pool_allocator=self.alloc,
                                 page_size=PAGE)
        self.cache = RadixdRadixCache(params, tp_size, self.rank, group, target=TARGET) if backend \
            else RadixCache(params)
        self._rows = iter(range(1, 8))

    def request(self, rid: str, tokens: list[int], **kw) -> Req:
        return Req(rid, array("q", tokens), Kv(next(self._rows)), **kw)

    def prefill(self, req: Req, upto: int, finish: bool) -> tuple[int, int]:
        """match (+ init_load_back), compute the rest, checkpoint; returns (device hit, loaded)."""
        ids = req.full_untruncated_fill_ids  # the scheduler's key: every id, matched up to all but the last
        key = RadixKey(ids, req.extra_key, limit=min(upto, len(ids) - 1), cache_salt=req.cache_salt)
        m = self.cache.match_prefix(MatchPrefixParams(key=key, req=req))
        node, loaded = m.last_device_node, 0
        if m.host_hit_length:
            loaded, node = self.cache.init_load_back(InitLoadBackParams(m.best_match_node, m.host_hit_length,
                                                                        req=req))
            assert loaded in (0, m.host_hit_length), "a load-back is all or nothing"
        prefix = self.cache.path_device_indices(node).to(torch.int64)
        have = len(prefix)
        self.r2t.req_to_token[req.kv.req_pool_idx, :have] = prefix.to(torch.int32)
        req.kv.cache_protected_len = have
        req.last_node = node
        if req.lock is not None:  # a later chunk: the previous checkpoint's lock is replaced
            self.cache.unlock(req.lock)
        req.lock = self.cache.lock(node)
        new = self.alloc.alloc(-(-(upto - have) // PAGE) * PAGE)[:upto - have]
        self.r2t.req_to_token[req.kv.req_pool_idx, have:upto] = new.to(torch.int32)
        toks = torch.tensor(req.full_untruncated_fill_ids[have:upto], dtype=torch.float32) + 1000 * self.rank
        for layer in range(LAYERS):  # "the forward pass": KV values that depend on token and layer
            self.kv.k_buffer[layer][new] = (toks * 10 + layer)[:, None, None]
            self.kv.v_buffer[layer][new] = -(toks * 10 + layer)[:, None, None]
        req.kv.kv_committed_len = upto
        req.done = finish
        self.cache.checkpoint(req, up_to=upto)
        return m.device_prefix_len, loaded

    def release(self, req: Req) -> None:
        self.cache.unlock(req.lock)
        req.lock = None
        self.cache.on_release(req, checkpointed=True)
        row = self.r2t.req_to_token[req.kv.req_pool_idx]
        tail = row[req.kv.cache_protected_len:len(req.full_untruncated_fill_ids)].to(torch.int64)
        if tail.numel():
            self.alloc.free(tail)

    def kv_of(self, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        node = self.cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", tokens)))).last_device_node
        idx = self.cache.path_device_indices(node).to(torch.int64)
        return (torch.stack([self.kv.k_buffer[i][idx] for i in range(LAYERS)]),
                torch.stack([self.kv.v_buffer[i][idx] for i in range(LAYERS)]))


class BareScheduler:
    """The two methods the backend wraps on SGLang 0.5.23's Scheduler, doing nothing else (a scenario steps it)."""

    def _add_request_to_queue(self, req, is_retracted: bool = False) -> None:
        pass

    def process_batch_result(self, batch, result) -> None:
        pass


def _key(req: Req) -> RadixKey:
    """The key SGLang's scheduler matches a queued request with (all ids, limited to all but the last)."""
    ids = req.full_untruncated_fill_ids
    return RadixKey(ids, req.extra_key, limit=len(ids) - 1, cache_salt=req.cache_salt)


def same_kv(a: Engine, b: Engine, tokens: list[int]) -> None:
    """Both engines hold exactly the same K and V bytes for these tokens."""
    ka, va = a.kv_of(tokens)
    kb, vb = b.kv_of(tokens)
    assert torch.equal(ka, kb) and torch.equal(va, vb), "engine B did not get engine A's bytes"


def quiet(c: CacheClient, *engines: Engine) -> dict:
    """radixd's stats once the engines' background work (publishes, releases) is done."""
    for e in engines:
        e.cache.settle()
    return c.stats()


def publish(c: CacheClient, e: Engine, rid: str, prompt: list[int], **kw) -> None:
    """Engine e prefills the whole prompt, finishes and releases it; its pages are in radixd on return."""
    r = e.request(rid, prompt, **kw)
    e.prefill(r, len(prompt), finish=True)
    e.release(r)
    quiet(c, e)


def settled(c: CacheClient, *engines: Engine) -> dict:
    """Nothing locked in radixd, nothing held but the engines' slot stocks, the checker clean."""
    s = quiet(c, *engines)
    assert s["receipts"] == 0 and s["held_tokens"] == sum(e.cache.stocked_tokens() for e in engines), s
    assert c.check() == [], c.check()
    return s


def radixd_holds_the_forwards_kv(c: CacheClient, tokens: list[int]) -> None:
    """radixd's own pool holds, at the slots it matches for `tokens`, each token's K and V as Engine.prefill's
    "forward" wrote them (every head and dim): the ground truth, not a round trip back through an engine."""
    pools = c.map_pools()
    try:
        m = c.match_prefix(tokens)
        assert m.matched_len == len(tokens), (m.matched_len, len(tokens))
        idx = torch.from_numpy(m.indices.astype("int64"))
        toks = torch.tensor(tokens, dtype=torch.float32)[:, None, None]
        for layer in range(LAYERS):
            k, v = pools.device[0].k_buffer[layer][idx], pools.device[0].v_buffer[layer][idx]
            assert torch.equal(k, (toks * 10 + layer).expand_as(k)), f"radixd's K of layer {layer} is not the forward's"
            assert torch.equal(v, -(toks * 10 + layer).expand_as(v)), f"radixd's V of layer {layer} is not the forward's"
    finally:
        pools.close()


def scenario_two_engines_share_pages_byte_for_byte(c: CacheClient) -> None:
    a, b = Engine(), Engine()
    prompt = [random.randrange(1, 999) for _ in range(42)]
    ra = a.request("a1", prompt)
    a.prefill(ra, 20, finish=False)  # a chunk: SGLang checkpoints, radixd gets nothing yet
    assert c.stats()["cached_tokens"] == 0
    a.prefill(ra, 42, finish=True)
    a.release(ra)
    assert settled(c, a, b)["cached_tokens"] == 40  # the whole pages of the finished request
    assert a.cache.rpcs <= 1  # on the scheduler thread: an Alloc while the slot stock is empty, nothing else
    radixd_holds_the_forwards_kv(c, prompt[:40])  # what radixd holds, against what "the forward" wrote
    rb = b.request("b1", prompt + [5, 6, 7])
    hit, loaded = b.prefill(rb, 45, finish=True)
    assert (hit, loaded) == (0, 40), (hit, loaded)
    same_kv(a, b, prompt[:40])
    b.release(rb)
    assert b.cache.loaded_tokens == 40 and a.cache.stored_tokens == 40
    from radixd.sglang import backend
    if backend._copy_pages_native is not None:  # (built: the store's and the load-back's copies took it)
        assert a.cache.native_copies >= 1 and b.cache.native_copies >= 1, (a.cache.native_copies,
                                                                             b.cache.native_copies)
    hit, loaded = b.prefill(b.request("b2", prompt), 42, finish=True)  # now SGLang's own tree has it
    assert (hit, loaded) == (40, 0)
    settled(c, a, b)
    a.cache.shutdown()
    b.cache.shutdown()


def scenario_a_scheduler_step_publishes_its_stores_in_one_call(c: CacheClient) -> None:
    """Built inside SGLang's scheduler, the backend wraps two of its methods: a queued request starts its lookup,
    and at the end of a step's results its finished requests go to radixd together, in one CacheFinished (their
    CPU copies on the store thread); radixd's pool then holds each one's K and V as the forward wrote them."""
    from radixd.sglang.backend import hook_scheduler
    e = Engine()
    e.cache.stores.max_wait = 60  # no round but the step's end (the idle-engine fallback out of the way)
    published: list[int] = []
    send = e.cache.client.cache_finished
    e.cache.client.cache_finished = lambda items, *a, **k: (published.append(len(items)), send(items, *a, **k))[1]
    rng = random.Random(time.time_ns())  # (prompts of its own: no other scenario's pages on the shared server)

    class Scheduler:  # the two methods the backend wraps, as SGLang 0.5.23's Scheduler has them
        def _add_request_to_queue(self, req, is_retracted: bool = False) -> None:
            pass

        def process_batch_result(self, batch, result) -> None:
            for r in batch:
                e.prefill(r, 40, finish=True)
                e.release(r)
            if result == "measured":
                st = e.cache.stores  # a store thread that publishes before the step's end goes idle in this wait
                with st._cv:
                    st._cv.wait_for(lambda: not (st._inbox.items or st._busy), 0.5)
                assert c.stats()["cached_tokens"] == before, "a store was published before its step ended"
    sched = Scheduler()
    hook_scheduler(sched, e.cache)
    for step in ("warm-up", "measured"):  # the first step fills the slot stock (as an engine's first steps do)
        prompts = [[rng.randrange(1000, 1999) for _ in range(40)] for _ in range(4)]
        e._rows = iter(range(1, 5))  # (the last step's requests were released: their req_to_token rows are free)
        reqs = [e.request(f"{step}{i}", p) for i, p in enumerate(prompts)]
        before = settled(c, e)["cached_tokens"]
        if step == "measured":
            assert e.cache.stocked_tokens() >= 160, "the slot stock did not grow to a step's stores"
            published.clear()
        for r in reqs:
            sched._add_request_to_queue(r)
            assert r.cache_request_handle in e.cache._asked, "queueing a request did not start its radixd lookup"
        sched.process_batch_result(reqs, step)
        assert settled(c, e)["cached_tokens"] == before + 160
    assert published == [4], f"a step's 4 stores took CacheFinished calls of {published} requests"
    for p in prompts:
        radixd_holds_the_forwards_kv(c, p)
    e.cache.shutdown()


def scenario_cpu_copies_go_by_whole_pages_only(c: CacheClient) -> None:
    """The CPU copy indexes one row per page only where the slots are whole pages in order; any other slots go
    slot by slot, and both write the same bytes."""
    import numpy as np
    from radixd.sglang.backend import _pages
    pages = np.array([8, 9, 10, 11, 20, 21, 22, 23])
    assert _pages(pages, PAGE).tolist() == [2, 5]
    for odd in ([9, 10, 11, 12], [8, 9, 11, 10], [8, 9, 10], [8, 9, 10, 11, 20, 21, 22, 24]):
        assert _pages(np.array(odd), PAGE) is None, odd
    assert _pages(np.array([3, 7, 1]), 1).tolist() == [3, 7, 1]
    e = Engine()
    held = np.asarray(c.alloc(2 * PAGE), dtype=np.int64)  # radixd slots of our own (whole pages, in order)
    native = e.cache._native
    for plans in ((native, None) if native is not None else (None,)):  # the native call, then numpy's
        e.cache._native, before = plans, e.cache.native_copies
        for dst in (held.tolist(), held[::-1].tolist()):  # whole pages, then the same slots backwards
            for t in e.cache.rk + e.cache.rv:
                t[dst] = 0
            src = pages + 4
            for layer in range(LAYERS):
                e.kv.k_buffer[layer][src] = torch.arange(len(src), dtype=torch.float32)[:, None, None] + 7 * layer
                e.kv.v_buffer[layer][src] = -torch.arange(len(src), dtype=torch.float32)[:, None, None] - 7 * layer
            from radixd.sglang.backend import _CopyJob
            job = _CopyJob(e.cache, torch.from_numpy(np.concatenate([np.arange(PAGE), src])))  # a page radixd had
            assert job(PAGE, np.array(dst)) and job.query()
            assert not job(PAGE, np.array(dst))  # once only
            for layer in range(LAYERS):
                assert torch.equal(e.cache.rk[layer][dst], e.kv.k_buffer[layer][src]), (dst, layer)
                assert torch.equal(e.cache.rv[layer][dst], e.kv.v_buffer[layer][src]), (dst, layer)
        # whole pages in order went by the native call when it is there (the backwards slots are not: per slot)
        assert e.cache.native_copies - before == (1 if plans is not None else 0)
    e.cache._native = native
    c.free(held)
    e.cache.shutdown()


def scenario_a_miss_makes_no_round_trip_with_kv_events(c: CacheClient) -> None:
    """radixd with --kv-events: an engine follows the events into a local index. A prompt radixd holds nothing of
    is a miss with no lookup at match or at store, and its pages are still published; a second engine started
    after that finds them in its snapshot, so its match is looked up, locked and loaded, byte for byte."""
    a = Engine()
    assert a.cache.index is not None and a.cache.index.current(), "the index never took the server's snapshot"
    prompt = [random.randrange(1, 999) for _ in range(42)]
    ra = a.request("a1", prompt)
    a.cache.queued(ra)
    assert a.prefill(ra, 42, finish=True) == (0, 0)
    a.release(ra)
    assert settled(c, a)["cached_tokens"] == 40  # stored with no lookup before it
    assert a.cache.lookups.rpcs == 0 and a.cache.index.misses == 1  # at queue time (match and store trust it)
    b = Engine()
    rb = b.request("b1", prompt + [5, 6, 7])
    b.cache.queued(rb)
    assert b.prefill(rb, 45, finish=True) == (0, 40)
    assert b.cache.index.misses == 0 and b.cache.lookups.rpcs >= 1
    same_kv(a, b, prompt[:40])
    b.release(rb)
    settled(c, a, b)
    a.cache.shutdown()
    b.cache.shutdown()


def scenario_pages_on_radixd_host_tier_are_loaded_back(c: CacheClient) -> None:
    a, b = Engine(), Engine()
    prompt = [random.randrange(1000, 2000) for _ in range(36)]
    publish(c, a, "h1", prompt)
    deadline = time.monotonic() + 10
    while c.stats()["cached_tokens"]:  # radixd demotes what its (asynchronous) backups put on host
        assert time.monotonic() < deadline, "radixd's backups never landed"
        c.evict(c.stats()["cached_tokens"])
    s = settled(c, a, b)
    assert s["cached_tokens"] == 0 and s["host_cached_tokens"] >= 36, s
    hit, loaded = b.prefill(b.request("h2", prompt + [7]), 37, finish=True)  # matched up to all but the last
    assert (hit, loaded) == (0, 36)
    same_kv(a, b, prompt[:36])
    settled(c, a, b)
    a.cache.shutdown()
    b.cache.shutdown()


def scenario_partial_hit_and_namespaces(c: CacheClient) -> None:
    a, b = Engine(), Engine()
    prompt = [random.randrange(1, 999) for _ in range(32)]
    publish(c, a, "p1", prompt, extra_key="lora-x")
    other = prompt[:16] + [1] * 16
    hit, loaded = b.prefill(b.request("p2", other, extra_key="lora-x"), 32, finish=True)
    assert (hit, loaded) == (0, 16)  # four shared pages
    hit, loaded = b.prefill(b.request("p3", prompt, extra_key="lora-y"), 32, finish=True)
    assert loaded == 0  # another adapter never sees them
    settled(c, a, b)
    a.cache.shutdown()
    b.cache.shutdown()


def scenario_abort_and_unused_markers_release_radixd_locks(c: CacheClient) -> None:
    a, b = Engine(), Engine()
    prompt = [random.randrange(1, 999) for _ in range(24)]
    publish(c, a, "x1", prompt)
    rb = b.request("x2", prompt + [3])
    m = b.cache.match_prefix(MatchPrefixParams(key=_key(rb), req=rb))
    assert m.host_hit_length == 24 and quiet(c, b)["receipts"] == 1  # locked in radixd while queued
    b.cache.release_aborted_request(rb.cache_request_handle)  # aborted before it was scheduled
    assert quiet(c, b)["receipts"] == 0
    m = b.cache.match_prefix(MatchPrefixParams(key=_key(rb), req=rb))
    b.cache.match_prefix(MatchPrefixParams(key=_key(rb), req=rb))  # re-asked
    assert quiet(c, b)["receipts"] == 1
    b.cache.on_release(rb, checkpointed=False)
    rq = b.request("x3", prompt + [4])
    b.cache.queued(rq)  # the scheduler queued it: its lookup locks radixd's pages at once
    assert quiet(c, b)["receipts"] == 1
    b.cache.release_aborted_request(rq.cache_request_handle)  # aborted in the queue: the lock goes
    settled(c, a, b)
    a.cache.shutdown()
    b.cache.shutdown()


def scenario_a_lock_outlives_a_queued_load_back_copy(c: CacheClient) -> None:
    """GPU: a load-back copy is queued on the scheduler's stream, not waited for; a request aborted before it ran
    keeps radixd's pages locked until its event completes. CPU copies are done on return (no event is kept), so
    the event here is a stand-in with CUDA's query/synchronize: what is checked is the backend's bookkeeping."""
    class Pending:
        done = False

        def query(self) -> bool:
            return self.done

        def synchronize(self) -> None:
            self.done = True
    a, b = Engine(), Engine()
    prompt = [random.randrange(5000, 6000) for _ in range(24)]
    publish(c, a, "q1", prompt)
    rb = b.request("q2", prompt + [3])
    b.cache.queued(rb)
    m = b.cache.match_prefix(MatchPrefixParams(key=_key(rb), req=rb))
    loaded, _ = b.cache.init_load_back(InitLoadBackParams(m.best_match_node, m.host_hit_length, req=rb))
    assert loaded == 24 and not b.cache._loading  # (CPU: copied on return)
    copy = b.cache._loading[rb.cache_request_handle] = Pending()
    b.cache.release_aborted_request(rb.cache_request_handle)  # aborted before its forward (and the copy) ran
    b.cache._drain()
    b.cache.stores.wait_idle(5)
    assert c.stats()["receipts"] == 1  # still locked: the copy has not read radixd's pages yet
    copy.done = True
    b.cache._drain()
    b.cache.stores.wait_idle(5)
    assert c.stats()["receipts"] == 0
    settled(c, a, b)
    a.cache.shutdown()
    b.cache.shutdown()


def engine_holds_the_forwards_kv(e: Engine, tokens: list[int]) -> None:
    """Engine e's pool holds, at the slots its tree matches for `tokens`, each token's K and V as Engine.prefill's
    "forward" wrote them (on whichever engine computed them): the ground truth of a load-back."""
    k, v = e.kv_of(tokens)
    assert k.shape[1] == len(tokens), (k.shape, len(tokens))
    toks = torch.tensor(tokens, dtype=torch.float32)[:, None, None]
    for layer in range(LAYERS):
        want = (toks * 10 + layer).expand_as(k[layer])
        assert torch.equal(k[layer], want), f"K of layer {layer} is not the forward's"
        assert torch.equal(v[layer], -want), f"V of layer {layer} is not the forward's"


def scenario_a_request_whose_lookup_is_out_waits_in_the_queue(c: CacheClient) -> None:
    """Built inside SGLang's scheduler, the backend holds a queued request whose radixd lookup is still out back from
    the admission pass while the engine has other work (as SGLang skips a request whose prefetch is not done), and
    admits it once the lookup landed; with nothing else to run, the pass waits for the lookups instead. A pass's
    load-backs are copied together at its end, and SGLang's pool then holds the forward's K and V for each."""
    import threading
    from radixd.sglang.backend import hook_scheduler
    a, b = Engine(), Engine()
    b.cache.deadline = 60.0  # (held back whatever this machine's pace; the deadline has a scenario of its own)
    rng = random.Random(time.time_ns())
    prompts = [[rng.randrange(7000, 7999) for _ in range(24)] for _ in range(3)]
    for i, p in enumerate(prompts):
        publish(c, a, f"w{i}", p)
    gate = threading.Event()  # radixd's answers wait for it: a lookup "still out" for as long as the test says
    match, take = b.cache.client.match_batch, b.cache.lookups.take
    b.cache.client.match_batch = lambda *args, **kw: (gate.wait(60), match(*args, **kw))[1]

    def take_opening(rid, wait=0.0):  # the backend waiting on a lookup opens the gate (only the idle pass may)
        if wait > 0:
            gate.set()
        return take(rid, wait)
    b.cache.lookups.take = take_opening
    copies_left: list[int] = []

    def admit(r) -> int:  # as SGLang's admission: match (+ load-back), the prefix locked, slots for the rest
        ids = r.full_untruncated_fill_ids
        m = b.cache.match_prefix(MatchPrefixParams(key=_key(r), req=r))
        node, loaded = m.last_device_node, 0
        if m.host_hit_length:
            loaded, node = b.cache.init_load_back(InitLoadBackParams(m.best_match_node, m.host_hit_length, req=r))
        prefix = b.cache.path_device_indices(node).to(torch.int64)
        b.r2t.req_to_token[r.kv.req_pool_idx, :len(prefix)] = prefix.to(torch.int32)
        r.kv.cache_protected_len, r.last_node, r.lock = len(prefix), node, b.cache.lock(node)
        new = b.alloc.alloc(PAGE)[:len(ids) - len(prefix)]
        b.r2t.req_to_token[r.kv.req_pool_idx, len(prefix):len(ids)] = new.to(torch.int32)
        return loaded

    class Running:
        def __init__(self, reqs: list):
            self.reqs = reqs

        def is_empty(self) -> bool:
            return not self.reqs

    class Scheduler:  # SGLang 0.5.23's waiting queue and the three methods the backend wraps
        def __init__(self):
            self.waiting_queue: list = []
            self.chunked_req = None

        def _add_request_to_queue(self, req, is_retracted: bool = False) -> None:
            self.waiting_queue.append(req)

        def get_new_batch_prefill(self, running_batch) -> list:
            batch = [(r, admit(r)) for r in self.waiting_queue]
            copies_left.append(len(b.cache._pending))
            self.waiting_queue = []
            return batch

        def process_batch_result(self, batch, result) -> None:
            pass
    sched = Scheduler()
    hook_scheduler(sched, b.cache)
    r1 = b.request("h1", prompts[0] + [3])
    sched._add_request_to_queue(r1)
    assert sched.get_new_batch_prefill(Running([object()])) == [], "admitted while its lookup was out"
    assert sched.waiting_queue == [r1] and r1.cache_request_handle in b.cache._asked and not gate.is_set()
    gate.set()
    b.cache.lookups.wait_idle(30)
    assert sched.get_new_batch_prefill(Running([object()])) == [(r1, 24)]  # landed: admitted, a hit
    assert sched.waiting_queue == [] and b.cache.idle_waited == 0
    engine_holds_the_forwards_kv(b, prompts[0])
    gate.clear()
    r2, r3 = b.request("h2", prompts[1] + [3]), b.request("h3", prompts[2] + [3])
    sched._add_request_to_queue(r2)
    sched._add_request_to_queue(r3)
    assert sched.get_new_batch_prefill(Running([])) == [(r2, 24), (r3, 24)], "the idle pass did not wait"
    assert gate.is_set() and b.cache.idle_waited > 0
    assert copies_left == [0, 1, 2] and not b.cache._pending, copies_left  # copied at the pass's end, together
    for p in prompts[1:]:
        engine_holds_the_forwards_kv(b, p)
    for r in (r1, r2, r3):
        b.release(r)
    settled(c, a, b)
    a.cache.shutdown()
    b.cache.shutdown()


def scenario_a_finished_hit_publishes_only_its_new_pages(c: CacheClient) -> None:
    """A queued request's lookup (SGLang's array('q') ids, handed to the lookup thread as they are) locks radixd's
    prefix; the request loads it back, computes more pages and finishes: its store attaches to that prefix (the
    looked-up ids agree with the stored ones across the two types), publishing only the new pages."""
    from radixd.sglang.backend import hook_scheduler
    a, b = Engine(), Engine()
    rng = random.Random(time.time_ns())
    prompt = [rng.randrange(9000, 9999) for _ in range(24)]
    publish(c, a, "p", prompt)
    more = prompt + [rng.randrange(9000, 9999) for _ in range(9)]  # two more whole pages, and one token
    sched = BareScheduler()
    hook_scheduler(sched, b.cache)
    published: list[dict] = []
    send = b.cache.client.cache_finished
    b.cache.client.cache_finished = lambda items, *x, **k: (published.extend(items), send(items, *x, **k))[1]
    r = b.request("f", more)
    sched._add_request_to_queue(r)
    asked = b.cache._asked[r.cache_request_handle].tokens
    assert isinstance(asked, array) and asked.typecode == "q", "the queued lookup converted SGLang's ids itself"
    b.cache.lookups.wait_idle(30)
    assert b.prefill(r, len(more), finish=True) == (0, 24)  # radixd's 24 loaded back, the rest computed
    sched.process_batch_result([r], None)
    b.release(r)
    settled(c, a, b)
    assert [(i["prev_prefix_len"], len(i["tokens"])) for i in published] == [(24, 32)], \
        [(i["prev_prefix_len"], len(i["tokens"])) for i in published]
    radixd_holds_the_forwards_kv(c, more[:32])
    a.cache.shutdown()
    b.cache.shutdown()


def scenario_a_queued_hit_is_copied_ahead_into_spare_slots(c: CacheClient) -> None:
    """Built inside SGLang's scheduler (CPU), the backend keeps a stock of spare SGLang slots, taken at a step's end; the
    lookup thread copies a queued request's hit into them as soon as radixd answers; the admission pass puts them in
    SGLang's tree as they are (its match then finds a device hit), or a load-back takes them (where SGLang holds the
    path's start itself, only the rest): no copy and no allocation on the scheduler thread either way, and SGLang's
    pool then holds the forward's K and V. The spare slots count as evictable (SGLang's leak
    check: free + evictable + protected stays its capacity); one a request aborted before admission goes back to the
    stock; an evict that empties the tree hands the stock back to SGLang's allocator."""
    from radixd.sglang.backend import hook_scheduler
    a, b = Engine(), Engine()
    total = b.alloc.available_size()

    def conserved() -> None:
        have = b.alloc.available_size() + b.cache.evictable_size() + b.cache.protected_size()
        assert have == total, (b.alloc.available_size(), b.cache.evictable_size(), b.cache.protected_size(), total)
    rng = random.Random(time.time_ns())
    prompts = [[rng.randrange(5000, 5999) for _ in range(24)] for _ in range(3)]
    for i, p in enumerate(prompts):
        publish(c, a, f"c{i}", p)
    sched = BareScheduler()
    hook_scheduler(sched, b.cache)
    assert b.cache.prefetch_tokens == 128 and b.cache._spare_tokens == 0  # (a quarter of this engine's 512)
    sched.process_batch_result([], None)  # a step's end: the stock taken from SGLang's allocator
    assert b.cache._spare_tokens == 128 and b.alloc.available_size() == total - 128
    conserved()
    copies = b.cache.native_copies
    r1 = b.request("c1", prompts[0] + [3])
    sched._add_request_to_queue(r1)
    b.cache.lookups.wait_idle(30)
    assert r1.cache_request_handle in b.cache.lookups.fetched, "radixd's answer came with no copy ahead"
    assert b.cache.copies_ahead == 1 and len(b.cache._spare) == (128 - 24) // PAGE
    conserved()
    b.cache.admission([r1], True)  # the admission pass begins: the copy ahead goes into SGLang's tree as it is
    b.cache.admitted()
    assert b.cache.prefetched_tokens == 24 and b.cache._spare_tokens == 128 - 24
    conserved()
    assert b.prefill(r1, len(prompts[0]) + 1, finish=True) == (24, 0)  # SGLang's own match finds it on the device
    assert not b.cache._pending and b.cache.native_copies == copies, "copied on the scheduler thread"
    engine_holds_the_forwards_kv(b, prompts[0])
    head = b.request("c2h", prompts[1][:9])  # SGLang holds the first two pages of the next prompt itself
    b.prefill(head, 9, finish=True)
    b.release(head)
    b.cache.settle()
    spare = b.cache._spare_tokens
    r2 = b.request("c2", prompts[1] + [3])
    sched._add_request_to_queue(r2)
    b.cache.lookups.wait_idle(30)
    assert r2.cache_request_handle in b.cache.lookups.fetched
    assert b.prefill(r2, len(prompts[1]) + 1, finish=True) == (8, 16)  # no admission hook: its load-back takes the
    # rest from the copy ahead
    assert b.cache.prefetched_tokens == 40 and b.cache._spare_tokens == spare - 16
    assert len(b.cache._spare) * PAGE == b.cache._spare_tokens, "the unused head did not go back to the stock"
    engine_holds_the_forwards_kv(b, prompts[1])
    r3 = b.request("c3", prompts[2] + [3])
    sched._add_request_to_queue(r3)
    b.cache.lookups.wait_idle(30)
    assert r3.cache_request_handle in b.cache.lookups.fetched
    b.cache.release_aborted_request(r3.cache_request_handle)  # aborted in the queue: its copy ahead back to the stock
    assert len(b.cache._spare) * PAGE == b.cache._spare_tokens and not b.cache._fetches
    for r in (r1, r2):
        b.release(r)
    sched.process_batch_result([], None)
    b.cache.settle()
    conserved()
    b.cache.evict(EvictParams(num_tokens=b.cache.evictable_size()))  # the tree emptied, and the stock with it
    assert b.cache._spare_tokens == 0 and b.alloc.available_size() == total
    settled(c, a, b)
    a.cache.shutdown()
    b.cache.shutdown()


def scenario_a_stopped_radixd_costs_a_miss_at_the_deadline(c: CacheClient) -> None:
    """radixd stopped (SIGSTOP) while a request is queued: its match waits no longer than the deadline, reports
    no radixd hit, and the lookup's lock is released once radixd answers again."""
    import signal
    a, b = Engine(), Engine()
    prompt = [random.randrange(3000, 4000) for _ in range(24)]
    publish(c, a, "s1", prompt)
    pid = int(os.environ["RADIXD_SERVER_PID"])
    b.cache.deadline = 0.3
    rb = b.request("s2", prompt + [5])
    os.kill(pid, signal.SIGSTOP)
    try:
        b.cache.queued(rb)
        t0 = time.monotonic()
        m = b.cache.match_prefix(MatchPrefixParams(key=_key(rb), req=rb))
        took = time.monotonic() - t0
    finally:
        os.kill(pid, signal.SIGCONT)
    assert m.host_hit_length == 0 and m.device_prefix_len == 0, m
    assert 0.25 <= took < 1.0, f"the match waited {took:.3f} s for a 0.3 s deadline"
    b.cache.release_aborted_request(rb.cache_request_handle)
    settled(c, a, b)  # the late lookup's lock went when it landed
    rc = b.request("s3", prompt + [6])  # radixd back: the next request finds the pages
    hit, loaded = b.prefill(rc, 25, finish=True)
    assert (hit, loaded) == (0, 24), (hit, loaded)
    b.release(rc)
    settled(c, a, b)
    a.cache.shutdown()
    b.cache.shutdown()


def scenario_same_matches_as_sglang_alone(c: CacheClient) -> None:
    """Random insert / match / evict through the backend and through SGLang's own RadixCache."""
    mine, plain = Engine(), Engine(backend=False)
    rng = random.Random(3)
    prompts = [[rng.randrange(1, 50) for _ in range(rng.randrange(4, 40))] for _ in range(12)]
    for step in range(400):
        p = rng.choice(prompts)[:rng.randrange(1, 40)]
        op = rng.random()
        if op < 0.4:
            for e in (mine, plain):
                key = RadixKey(array("q", p)).page_aligned(PAGE)
                vals = e.alloc.alloc(len(key)) if len(key) else torch.zeros(0, dtype=torch.int64)
                if vals is None:
                    e.cache.evict(EvictParams(num_tokens=len(key)))
                    vals = e.alloc.alloc(len(key))
                r = e.cache.insert(InsertParams(key=key, value=vals))
                e.alloc.free(vals[:r.prefix_len])
        elif op < 0.9:
            req = Req(f"d{step}", array("q", p), Kv(1))  # with a request, so the backend asks radixd too
            lens = [e.cache.match_prefix(MatchPrefixParams(key=_key(req), req=req)).device_prefix_len
                    for e in (mine, plain)]
            mine.cache.on_release(req, checkpointed=False)
            assert lens[0] == lens[1], (step, lens)
        else:
            n = rng.randrange(1, 60)
            for e in (mine, plain):
                e.cache.evict(EvictParams(num_tokens=n))
        assert mine.cache.evictable_size() == plain.cache.evictable_size()
    settled(c, mine)
    mine.cache.shutdown()


def scenario_overridden_signatures_match_sglang(c: CacheClient) -> None:
    import sglang
    assert sglang.__version__ == SUPPORTED_SGLANG, (sglang.__version__, SUPPORTED_SGLANG)
    bad = []
    for name, fn in vars(RadixdRadixCache).items():
        if callable(fn) and not name.startswith("_") and hasattr(RadixCache, name):
            a, b = inspect.signature(fn), inspect.signature(getattr(RadixCache, name))
            if [p for p in a.parameters] != [p for p in b.parameters]:
                bad.append(f"{name}{a} != {b}")
    assert not bad, bad
    # the scheduler methods `hook_scheduler` wraps, as SGLang's own Scheduler has them: the calls the wrappers pass
    # on, and an admission pass that reads the waiting queue when it runs (so a request left out of it waits there)
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.managers.scheduler import Scheduler
    params = {n: list(inspect.signature(getattr(Scheduler, n)).parameters)
              for n in ("_add_request_to_queue", "process_batch_result", "get_new_batch_prefill")}
    assert params == {"_add_request_to_queue": ["self", "req", "is_retracted"],
                      "process_batch_result": ["self", "batch", "result"],
                      "get_new_batch_prefill": ["self", "running_batch"]}, params
    assert callable(ScheduleBatch.is_empty)
    src = inspect.getsource(Scheduler._get_new_batch_prefill_raw)
    for line in ("for req in self.waiting_queue:", "req.init_next_round_input(self.tree_cache)",
                 "self.waiting_queue = [x for x in self.waiting_queue if x not in can_run_set]"):
        assert line in src, f"SGLang's admission pass no longer has {line!r}"


class GlooGroup:
    """The two calls the backend makes on SGLang's TP group, over torch.distributed (gloo, CPU)."""

    def broadcast_object(self, obj=None, src=0):
        box = [obj]
        torch.distributed.broadcast_object_list(box, src=src)
        return box[0]

    def barrier(self):
        torch.distributed.barrier()


def _tp_rank(rank: int, init: str, prompt: list[int], q) -> None:
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2, init_method=init)
    g = GlooGroup()
    a, b = Engine(tp=(2, rank, g)), Engine(tp=(2, rank, g))
    ra = a.request("tp-a", prompt)
    a.prefill(ra, len(prompt), finish=True)
    a.release(ra)
    rb = b.request("tp-b", prompt + [9])
    hit, loaded = b.prefill(rb, len(prompt) + 1, finish=True)
    ka, va = a.kv_of(prompt)
    kb, vb = b.kv_of(prompt)
    q.put((rank, hit, loaded, bool(torch.equal(ka, kb) and torch.equal(va, vb))))
    b.release(rb)
    g.barrier()
    a.cache.shutdown()
    b.cache.shutdown()
    torch.distributed.destroy_process_group()


def scenario_tensor_parallel_ranks_share_their_heads(c: CacheClient) -> None:
    """Two TP ranks (gloo): rank 0 talks to radixd, each rank stores and loads its own heads."""
    import multiprocessing as mp
    import tempfile
    ctx = mp.get_context("spawn")
    prompt = [random.randrange(2000, 3000) for _ in range(28)]
    init = f"file://{tempfile.mkdtemp()}/rendezvous"
    q = ctx.Queue()
    procs = [ctx.Process(target=_tp_rank, args=(r, init, prompt, q)) for r in range(2)]
    for p in procs:
        p.start()
    got = sorted(q.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert got == [(0, 0, 28, True), (1, 0, 28, True)], got
    pools = c.map_pools()  # radixd holds rank 0's head next to rank 1's
    idx = torch.from_numpy(c.match_prefix(prompt).indices.copy())
    toks = torch.tensor(prompt, dtype=torch.float32)
    for layer in range(LAYERS):
        k = pools.device[0].k_buffer[layer][idx]
        assert torch.equal(k[:, 0, 0], toks * 10 + layer) and torch.equal(k[:, 1, 0], toks * 10 + layer + 10000)
    pools.close()
    settled(c)


def scenario_a_hybrid_model_is_refused_at_engine_start_in_one_line(c: CacheClient) -> None:
    """SGLang's own TreeCacheBuildContext for a sliding-window and for a Mamba-hybrid model, through the factory
    SGLang's registry holds for radixd: refused before any radixd call (no session opens)."""
    from sglang.srt.mem_cache.registry import TreeCacheBuildContext, get_radix_cache_factory
    import radixd.sglang
    radixd.sglang.register()
    build = get_radix_cache_factory("radixd")
    e = Engine(backend=False)
    before = c.stats()["sessions"]
    for swa, ssm, words in ((True, False, "sliding-window"), (False, True, "Mamba"), (True, True, "and")):
        params = CacheInitParams(disable=False, req_to_token_pool=e.r2t, token_to_kv_pool_allocator=e.alloc,
                                 page_size=PAGE)
        ctx = TreeCacheBuildContext(server_args=None, params=params,
            is_hybrid_swa=swa, is_hybrid_ssm=ssm, enable_hierarchical_cache=False, disable_radix_cache=False,
            tp_worker=None, model_config=None, tp_size=1, tp_rank=0, tp_group=None)
        try:
            build(ctx)
        except ValueError as err:
            msg = str(err)
            assert "\n" not in msg and words in msg and "--radix-cache-backend radixd" in msg, msg
        else:
            raise AssertionError("a hybrid model was accepted")
    assert c.stats()["sessions"] == before  # refused before connecting


SCENARIOS = {k[len("scenario_"):]: v for k, v in dict(globals()).items() if k.startswith("scenario_")}

if __name__ == "__main__":
    random.seed(7)
    names = sys.argv[2:] or list(SCENARIOS)
    with CacheClient(TARGET, name="check") as client:
        for n in names:
            SCENARIOS[n](client)
            print("ok", n, flush=True)
