"""Differential test of `radixd.sglang.RadixdRadixCache` against SGLang 0.5.23's own `RadixCache` (run in
SGLang's venv by tests/test_sglang_backend.py, against a live radixd server).

    python tests/sglang_differential.py TARGET PAGE SEED STEPS

One seeded sequence of scheduler operations runs on two engines, each with its own KV pool, allocator and
req_to_token table: one with SGLang's plain RadixCache, one with the radixd backend. Requests are SGLang's
real `Req` (token ids in `array('q')`), matched through the scheduler's own `init_next_round_input` (the
key it builds: the whole fill ids, limited to all but the last token), checkpointed through
`checkpoint_kv_cache`, released through `release_kv_cache` and aborted through `finish(handle, ABORT)`.
Operations: queue and admit requests (a radixd hit is loaded with init_load_back), allocate with eviction,
chunked prefill with checkpoints, decode, finish or abort (queued or running), inc/dec_lock_ref pins,
evictions of varied sizes, flushes, in extra_key and cache_salt namespaces.

After every operation both engines must agree on matched lengths, evictable and protected sizes, free
slots, evict and insert results; every few operations the two trees are compared node by node (key ids
and their type, value lengths, lock refs), and whenever no request is in flight radixd holds no receipt,
no held slot (but its slot stock) and no lock; after every operation the backend is settled (its stores
published), so its tree matches the plain engine's at once. Where the backend is meant to differ the test models it explicitly: when it
reports a host hit (radixd holds pages SGLang's tree lost), the plain engine is given the same tokens the
way init_load_back gives them (fresh slots, the same insert), and the loaded KV must equal what the
"forward pass" wrote for those tokens.
"""
from __future__ import annotations

import os
import random
import sys
from array import array
from typing import Any, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests.sglang_cpu import stub_torchvision  # noqa: E402

stub_torchvision()
import torch  # noqa: E402
from sglang.srt.managers.schedule_batch import FINISH_LENGTH, Req  # noqa: E402
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import (CacheRequestOutcome, EvictParams,  # noqa: E402
                                                    InitLoadBackParams, InsertParams, MatchPrefixParams)
from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # noqa: E402
from sglang.srt.mem_cache.common import checkpoint_kv_cache, evict_from_tree_cache, release_kv_cache  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402

from sglang.srt.runtime_context import publish  # noqa: E402
from sglang.srt.server_args import ServerArgs  # noqa: E402

from radixd.client import CacheClient  # noqa: E402
from radixd.sglang.backend import RadixdRadixCache, attached  # noqa: E402

LAYERS, HEADS, DIM = 2, 2, 8
NAMESPACES = [(None, None), (None, None), ("lora-a", None), (None, "tenant-1")]


def kv_of(tokens: torch.Tensor, layer: int) -> torch.Tensor:
    """What "the forward pass" writes for these tokens (exact in float32, distinct per token and layer)."""
    return tokens.to(torch.float32) * 10 + layer


class Engine:
    """One engine's cache side: its own pools and tree (SGLang's, or SGLang's with radixd behind it)."""

    def __init__(self, backend: bool, page: int, slots: int, target: str):
        self.backend, self.page = backend, page
        self.r2t = ReqToTokenPool(size=16, max_context_len=1024, device="cpu", enable_memory_saver=False)
        self.kv = MHATokenToKVPool(size=slots, page_size=page, dtype=torch.float32, head_num=HEADS, head_dim=DIM,
                                   layer_num=LAYERS, device="cpu", enable_memory_saver=False)
        if page == 1:
            self.alloc = TokenToKVPoolAllocator(slots, torch.float32, "cpu", self.kv, False)
        else:
            self.alloc = PagedTokenToKVPoolAllocator(slots, page, torch.float32, "cpu", self.kv, False)
        params = CacheInitParams(disable=False, req_to_token_pool=self.r2t, token_to_kv_pool_allocator=self.alloc,
                                 page_size=page)
        self.cache = RadixdRadixCache(params, target=target) if backend else RadixCache(params)

    def state(self) -> tuple:
        c = self.cache
        return c.evictable_size(), c.protected_size(), self.alloc.available_size()

    # ---------------------------------------------------------- the scheduler's steps
    def match(self, req: Req) -> tuple[int, int]:
        req.init_next_round_input(self.cache)  # SGLang's own key: array('q') fill ids, limit = len - 1
        return req.prefix_len, req.host_hit_length

    def load(self, req: Req, hit: int, loaded: int) -> int:
        """init_load_back on the backend; on the plain engine, the same tokens given the same way."""
        if self.backend:
            n, node = self.cache.init_load_back(InitLoadBackParams(req.best_match_node, hit, req=req))
            req.last_node = node
            return n
        if not attached(self.cache, req.best_match_node):  # the backend refuses before anything
            return 0
        device = req.prefix_len
        slots = self.alloc.alloc(hit)  # the backend's steps: take slots; if short, pin the prefix, evict, take
        if slots is None:  # them again or give up
            self.cache.inc_lock_ref(req.best_match_node)
            self.cache.evict(EvictParams(num_tokens=hit))
            self.cache.dec_lock_ref(req.best_match_node)
            slots = self.alloc.alloc(hit)
        if slots is None or not loaded:
            assert not loaded, "the plain engine could not mirror a load-back the backend made"
            if slots is not None:
                self.alloc.free(slots)
            return 0
        key = RadixKey(req.full_untruncated_fill_ids[:device + loaded], req.extra_key, cache_salt=req.cache_salt)
        prefix = self.cache.path_device_indices(req.last_node)[:device].to(torch.int64)
        r = self.cache.insert(InsertParams(key=key, value=torch.cat([prefix, slots.to(torch.int64)]),
                                           inserted_len=device, priority=getattr(req.last_node, "priority", 0)))
        if r.prefix_len > device:
            self.alloc.free(slots[:r.prefix_len - device])
        for layer in range(LAYERS):  # "the forward pass" of the tokens the backend copied in
            toks = torch.tensor(key.token_ids[device:device + loaded])
            self.kv.k_buffer[layer][slots] = kv_of(toks, layer)[:, None, None]
            self.kv.v_buffer[layer][slots] = -kv_of(toks, layer)[:, None, None]
        req.last_node = r.last_device_node
        return loaded

    def admit(self, req: Req) -> int:
        """Lock the prefix and give the request its row (what the scheduler does once it admits it)."""
        prefix = self.cache.path_device_indices(req.last_node).to(torch.int64)
        req.lock = self.cache.lock(req.last_node)
        assert self.r2t.alloc([req]) is not None
        self.r2t.req_to_token[req.kv.req_pool_idx, :len(prefix)] = prefix.to(torch.int32)
        req.kv.cache_protected_len = req.kv.kv_committed_len = req.kv.kv_allocated_len = len(prefix)
        req.prefix_len = len(prefix)
        return len(prefix)

    def extend(self, req: Req, end: int) -> Optional[int]:
        """Allocate (evicting first if short) and run the forward for positions up to `end`; None: no room.
        As SGLang's paged allocation: positions continue in the request's last page, new ones take new pages."""
        page, row = self.page, self.r2t.req_to_token[req.kv.req_pool_idx]
        have = req.kv.kv_allocated_len
        evicted = None
        if end > have:
            covered = -(-have // page) * page  # positions the request's pages already hold
            need = (-(-end // page) - -(-have // page)) * page
            slots = torch.zeros(0, dtype=torch.int64)
            if need:
                if self.alloc.available_size() < need:
                    before = self.cache.evictable_size()
                    evict_from_tree_cache(self.cache, need)
                    evicted = before - self.cache.evictable_size()
                slots = self.alloc.alloc(need)
                if slots is None:
                    return None
            cont = min(end, covered) - have
            if cont > 0:
                row[have:have + cont] = row[have - 1] + 1 + torch.arange(cont, dtype=row.dtype)
            if end > covered:
                row[covered:end] = slots[:end - covered].to(row.dtype)
            req.kv.kv_allocated_len = end
        start = req.kv.kv_committed_len
        locs = row[start:end].to(torch.int64)
        toks = torch.tensor(req.full_untruncated_fill_ids[start:end])
        for layer in range(LAYERS):
            self.kv.k_buffer[layer][locs] = kv_of(toks, layer)[:, None, None]
            self.kv.v_buffer[layer][locs] = -kv_of(toks, layer)[:, None, None]
        req.kv.kv_committed_len = end
        req.extend_end = end
        return evicted or 0

    def checkpoint(self, req: Req) -> int:
        checkpoint_kv_cache(req, self.cache)
        return req.kv.cache_protected_len

    def release(self, req: Req, finished: bool) -> None:
        if not req.kv.kv_allocated_len:  # admitted with no prefix and no room for its first chunk: undo
            self.cache.unlock(req.lock)
            req.lock = None
            self.r2t.free(req)
            self.cache.finish(req.cache_request_handle, CacheRequestOutcome.ABORT)
            return
        if finished:
            req.finished_reason = FINISH_LENGTH(len(req.output_ids))
            release_kv_cache(req, self.cache, checkpoint=True)
        else:  # aborted while running: its KV goes, nothing is cached
            release_kv_cache(req, self.cache, checkpoint=False)
            self.cache.finish(req.cache_request_handle, CacheRequestOutcome.ABORT)

    def kv_ok(self, tokens: array, extra_key: Any, cache_salt: Any) -> bool:
        """The KV the tree holds for a prompt is what the forward pass wrote for its tokens."""
        m = self.cache.match_prefix(MatchPrefixParams(key=RadixKey(tokens, extra_key, cache_salt=cache_salt)))
        idx = self.cache.path_device_indices(m.last_device_node).to(torch.int64)
        toks = torch.tensor(tokens[:len(idx)])
        return all(torch.equal(self.kv.k_buffer[i][idx][:, 0, 0], kv_of(toks, i)) and
                   torch.equal(self.kv.v_buffer[i][idx][:, 0, 0], -kv_of(toks, i)) for i in range(LAYERS))


def structure(cache: RadixCache) -> None:
    """Every child is filed under its own child key and points back at its parent; every evictable leaf is
    in the tree."""
    for leaf in cache.evictable_leaves:
        assert attached(cache, leaf), f"evictable leaf {leaf.key} is no longer in the tree"
    stack = [cache.root_node]
    while stack:
        node = stack.pop()
        for key, child in node.children.items():
            assert child.parent is node and key == child.key.child_key(cache.page_size), (key, child.key)
            stack.append(child)


def dump(cache: RadixCache) -> list:
    """The tree node by node, children in key order: ids, their container type, value length, lock ref."""
    out = []
    stack = [(cache.root_node, 0)]
    while stack:
        node, depth = stack.pop()
        key = node.key
        out.append((depth, type(key.token_ids).__name__, tuple(key.token_ids), key.extra_key, key.cache_salt,
                    len(node.value) if node.value is not None else -1, node.lock_ref))
        for child in sorted(node.children.values(), key=lambda n: tuple(n.key.token_ids)):
            stack.append((child, depth + 1))
    return out


class Pair:
    """One request on both engines (each engine keeps its own Req: the tree writes per-engine state)."""

    def __init__(self, rid: str, tokens: list[int], ns: tuple, max_new: int):
        self.rid, self.ns, self.max_new = rid, ns, max_new
        self.reqs = [Req(rid, "", array("q", tokens), SamplingParams(max_new_tokens=max_new), extra_key=ns[0],
                         cache_salt=ns[1]) for _ in range(2)]
        self.prompt_len = len(tokens)
        self.matched = False
        self.running = False


def run(target: str, page: int, seed: int, steps: int) -> dict:
    publish(ServerArgs(model_path="dummy", device="cpu", page_size=page), role="scheduler")  # what Req reads
    rng = random.Random(seed)
    slots = 24 * page if page > 1 else 320  # small: allocations must evict
    mine, plain = Engine(True, page, slots, target), Engine(False, page, slots, target)
    engines = (mine, plain)
    client = CacheClient(target, name="differential", attach=False)
    unit = max(page, 8)  # prompt lengths scale with the page, and are not tiny at page 1
    stems = [[rng.randrange(1, 60) for _ in range(rng.randrange(1, 6) * unit + rng.randrange(page))]
             for _ in range(6)]
    queued: list[Pair] = []
    running: list[Pair] = []
    pins: list[tuple] = []
    counts = dict(admitted=0, loaded=0, loaded_tokens=0, chunks=0, decoded=0, finished=0, aborted=0, evicted=0,
                  flushes=0, pins=0, no_room=0, dumps=0, idle_checks=0, alloc_evictions=0)
    serial = 0

    def agree(what: str, a: Any, b: Any) -> None:
        assert a == b, f"step {step} {what}: radixd backend {a!r} != SGLang {b!r}"

    def idle() -> None:
        """The engine goes idle: running requests end, queued ones are aborted, pins released."""
        for p in running:
            for e, r in zip(engines, p.reqs):
                e.release(r, finished=r.kv.kv_committed_len >= p.prompt_len)
        for p in queued:
            for e, r in zip(engines, p.reqs):
                e.cache.finish(r.cache_request_handle, CacheRequestOutcome.ABORT)
        for nodes in pins:
            for e, (node, receipt) in zip(engines, nodes):
                e.cache.dec_lock_ref(node, receipt.to_dec_params() if hasattr(receipt, "to_dec_params") else None)
        running.clear()
        queued.clear()
        pins.clear()

    step = 0
    for step in range(steps):
        if step % 200 == 199:
            idle()
        op = rng.random()
        chosen = None
        if op < 0.20 and len(queued) + len(running) < 8:  # a request arrives; the scheduler matches it
            serial += 1
            stem = rng.choice(stems)
            tail = [rng.randrange(1, 60) for _ in range(rng.randrange(1, 3 * unit + 3))]
            p = Pair(f"r{serial}", stem + tail, rng.choice(NAMESPACES), rng.randrange(0, 2 * page + 2))
            mine.cache.queued(p.reqs[0])  # as the scheduler's _add_request_to_queue: the lookup starts now
            res = [e.match(r) for e, r in zip(engines, p.reqs)]
            agree("device match", res[0][0], res[1][0])
            agree("plain engine host hit", res[1][1], 0)
            p.matched = True
            queued.append(p)
        elif op < 0.38 and queued:  # admit: load a radixd hit, lock, first chunk
            p = queued.pop(rng.randrange(len(queued)))
            res = [e.match(r) for e, r in zip(engines, p.reqs)]  # each scheduling round matches again
            agree("device rematch", res[0][0], res[1][0])
            hit = p.reqs[0].host_hit_length
            loaded = mine.load(p.reqs[0], hit, 0) if hit else 0
            if hit:
                assert loaded in (0, hit), "a load-back is all or nothing"
                agree("mirrored load", plain.load(p.reqs[1], hit, loaded), loaded)
                counts["loaded"] += bool(loaded)
                counts["loaded_tokens"] += loaded
            agree("admitted prefix", *[e.admit(r) for e, r in zip(engines, p.reqs)])
            agree("state after admit", mine.state(), plain.state())
            if loaded:
                assert mine.kv_ok(p.reqs[0].full_untruncated_fill_ids[:p.reqs[0].prefix_len], *p.ns), \
                    f"step {step}: the loaded KV is not what the forward pass wrote for those tokens"
            p.running = True
            running.append(p)
            counts["admitted"] += 1
            op, chosen = 0.40, p  # and run its first chunk now
        if 0.38 <= op < 0.58 and running:  # a prefill chunk (checkpointed while unfinished) or a decode step
            p = chosen or rng.choice(running)
            r0 = p.reqs[0]
            if r0.kv.kv_committed_len < p.prompt_len:
                end = min(p.prompt_len, r0.kv.kv_committed_len + rng.randrange(1, 3 * unit + 2))
            else:
                if len(r0.output_ids) >= p.max_new:
                    continue
                tok = rng.randrange(1, 60)
                for r in p.reqs:
                    r.output_ids.append(tok)
                    r.refresh_fill_ids()
                end = r0.kv.kv_committed_len + 1
                counts["decoded"] += 1
            got = [e.extend(r, end) for e, r in zip(engines, p.reqs)]
            agree("extend (evicted tokens, or no room)", got[0], got[1])
            counts["alloc_evictions"] += bool(got[0])
            if got[0] is None:  # no room even after eviction: the scheduler aborts it
                counts["no_room"] += 1
                for e, r in zip(engines, p.reqs):
                    e.release(r, finished=False)
                running.remove(p)
            elif end < p.prompt_len:
                agree("checkpoint", *[e.checkpoint(r) for e, r in zip(engines, p.reqs)])
                counts["chunks"] += 1
        elif 0.58 <= op < 0.70 and running:  # finish (prompt done) or abort
            p = rng.choice(running)
            done = p.reqs[0].kv.kv_committed_len >= p.prompt_len and rng.random() < 0.85
            for e, r in zip(engines, p.reqs):
                e.release(r, finished=done)
            running.remove(p)
            counts["finished" if done else "aborted"] += 1
        elif 0.70 <= op < 0.74 and queued:  # aborted while queued: its radixd lock must go
            p = queued.pop(rng.randrange(len(queued)))
            for e, r in zip(engines, p.reqs):
                e.cache.finish(r.cache_request_handle, CacheRequestOutcome.ABORT)
            counts["aborted"] += 1
        elif 0.74 <= op < 0.80:  # a pin (inc_lock_ref) on a matched node, or its release
            if pins and (rng.random() < 0.5 or len(pins) > 3):
                nodes = pins.pop(rng.randrange(len(pins)))
                for e, (node, receipt) in zip(engines, nodes):
                    e.cache.dec_lock_ref(node, receipt.to_dec_params() if hasattr(receipt, "to_dec_params")
                                         else None)
            else:
                stem, ns = rng.choice(stems), rng.choice(NAMESPACES)
                key = RadixKey(array("q", stem), ns[0], cache_salt=ns[1])
                nodes = []
                lens = []
                for e in engines:
                    m = e.cache.match_prefix(MatchPrefixParams(key=key))
                    nodes.append((m.last_device_node, e.cache.inc_lock_ref(m.last_device_node)))
                    lens.append(m.device_prefix_len)
                agree("pin match", *lens)
                pins.append(tuple(nodes))
                counts["pins"] += 1
        elif 0.80 <= op < 0.92:  # an eviction of varied size
            n = rng.choice([1, page, 3 * page, rng.randrange(1, 200), 10_000])
            res = [e.cache.evict(EvictParams(num_tokens=n)).num_tokens_evicted for e in engines]
            agree("evict", res[0], res[1])
            counts["evicted"] += res[0]
        elif op >= 0.97 and not running and not pins:  # flush (only while idle, as SGLang's flush_cache)
            for p in queued:
                for e, r in zip(engines, p.reqs):
                    e.cache.finish(r.cache_request_handle, CacheRequestOutcome.ABORT)
            queued.clear()
            for e in engines:
                e.cache.reset()
            counts["flushes"] += 1
        mine.cache.settle()  # its stores published: what the plain engine's tree holds at once
        agree("evictable, protected, free slots", mine.state(), plain.state())
        for e in engines:
            structure(e.cache)
        if step % 25 == 0:
            agree("tree", dump(mine.cache), dump(plain.cache))
            counts["dumps"] += 1
        if not running and not queued and not pins:
            s = client.stats()
            held = mine.cache.stocked_tokens()  # the slot stock the backend keeps for stores
            assert (s["receipts"], s["held_tokens"], s["protected_tokens"]) == (0, held, 0), (step, s)
            counts["idle_checks"] += 1
    idle()
    agree("tree at the end", dump(mine.cache), dump(plain.cache))
    mine.cache.settle()
    mine.cache.shutdown()
    s = client.stats()
    assert (s["receipts"], s["held_tokens"], s["protected_tokens"]) == (0, 0, 0), s
    assert client.check() == []
    client.close()
    return counts


if __name__ == "__main__":
    target, page, seed, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    counts = run(target, page, seed, steps)
    print("counts", counts, flush=True)
    for what in ("loaded", "chunks", "decoded", "finished", "aborted", "evicted", "pins", "dumps", "idle_checks",
                 "alloc_evictions", "flushes"):
        assert counts[what] > 0, f"the sequence never exercised {what}: {counts}"
    print("ok differential", page, flush=True)
