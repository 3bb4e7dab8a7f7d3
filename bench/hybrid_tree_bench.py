"""radixd's hybrid tree against SGLang 0.5.23's UnifiedRadixCache (its Rust tree core) on the same operations.

    .venv-sglang/bin/python bench/hybrid_tree_bench.py [--config tri|swa|mamba] [--page 16] [--window 4096]
        [--convs 200] [--turns 4] [--runs 3] [--events]

A multi-turn chat workload (shared system prompts, each turn extends its conversation): per phase, ops/s of
both on identical operations, and radixd/SGLang ratios (medians of --runs). Phases: insert (a turn's prefix,
with its donated MAMBA state), match (every turn again), lock+unlock (each matched node), evict (everything,
one call per 1/50 of the cache). Neither side records KV events (SGLang's default; --events turns radixd's
on). SGLang's frees are intercepted where its cache applies them (as in tests/hybrid_differential.py), so
neither side pays for an allocator. Memory: RSS growth per cached token while each tree holds the whole
workload.
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import os
import random
import statistics
import sys
import time
from array import array

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests.hybrid_differential import build  # noqa: E402  (sets SGLang up on CPU)

import numpy as np  # noqa: E402
import torch  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixKey  # noqa: E402
from sglang.srt.mem_cache.unified_cache.components import ComponentType as CT  # noqa: E402


def rss() -> int:
    gc.collect()
    _libc.malloc_trim(0)  # hand freed heap back, so growth is what the tree holds now
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


_libc = ctypes.CDLL("libc.so.6")


def workload(convs: int, turns: int, page: int, seed: int = 0) -> list[list[int]]:
    rnd = random.Random(seed)
    systems = [[rnd.randrange(1, 30000) for _ in range(rnd.randrange(8, 40) * page)] for _ in range(8)]
    out = []
    for _ in range(convs):
        seq = list(rnd.choice(systems))
        for _ in range(turns):
            seq = seq + [rnd.randrange(1, 30000) for _ in range(rnd.randrange(4, 30) * page)]
            out.append(list(seq))
    return out


def one_run(args) -> dict:
    reqs = workload(args.convs, args.turns, args.page)
    cache, rec, mine, comps = build(args.config, args.page, "rust", args.window, events=args.events)
    has_mamba = CT.MAMBA in comps
    out = {}
    # insert: each turn's whole prefix; slots are fresh for the new tail (the shared part is a duplicate)
    next_slot = [1]
    plans = []
    for toks in reqs:
        n = len(toks)
        vals = np.arange(next_slot[0], next_slot[0] + n, dtype=np.int64)
        next_slot[0] += n
        # each side gets its own native input: radixd packed int32 (what the service decodes from the wire),
        # SGLang a RadixKey over array('q') (what its scheduler builds)
        plans.append((np.array(toks, dtype=np.int32), vals, torch.from_numpy(vals), RadixKey(array("q", toks)),
                      next_slot[0]))
    r0 = rss()
    t = time.perf_counter()
    for i, (toks, vals, _, _, mv) in enumerate(plans):
        mine.insert(toks, vals, mamba_value=mv if has_mamba else -1)
    mine_t = time.perf_counter() - t
    mine_mem = rss() - r0
    r0 = rss()
    t = time.perf_counter()
    for toks, _, tv, key, mv in plans:
        cache.insert(InsertParams(key=key, value=tv, mamba_value=torch.tensor([mv]) if has_mamba else None))
    sgl_t = time.perf_counter() - t
    sgl_mem = rss() - r0
    rec.take()
    out["insert"] = (len(plans) / mine_t, len(plans) / sgl_t)
    tokens = mine.sizes()["full"][0]
    out["mem B/token"] = (max(mine_mem, 0) / tokens, max(sgl_mem, 0) / tokens)
    # match
    t = time.perf_counter()
    mine_nodes = [mine.match_prefix(toks).node_id for toks, *_ in plans]
    mine_t = time.perf_counter() - t
    t = time.perf_counter()
    sgl_nodes = [cache.match_prefix(MatchPrefixParams(key=key)).last_device_node for _, _, _, key, _ in plans]
    sgl_t = time.perf_counter() - t
    out["match"] = (len(plans) / mine_t, len(plans) / sgl_t)
    # lock + unlock
    t = time.perf_counter()
    for nid in mine_nodes:
        mine.unlock(mine.lock(nid))
    mine_t = time.perf_counter() - t
    t = time.perf_counter()
    for nid in sgl_nodes:
        cache.unlock(cache.lock(nid))
    sgl_t = time.perf_counter() - t
    out["lock+unlock"] = (len(plans) / mine_t, len(plans) / sgl_t)
    # evict everything in 50 calls
    step = max(1, tokens // 50)
    t = time.perf_counter()
    calls = 0
    while mine.sizes()["full"][0]:
        mine.evict(full=step)
        calls += 1
    mine_t = time.perf_counter() - t
    t = time.perf_counter()
    sgl_calls = 0
    while cache.full_evictable_size():
        cache.evict(EvictParams(num_tokens=step))
        sgl_calls += 1
    sgl_t = time.perf_counter() - t
    rec.take()
    out["evict"] = (calls / mine_t, sgl_calls / sgl_t)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="tri", choices=["swa", "mamba", "tri"])
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--window", type=int, default=4096)
    ap.add_argument("--convs", type=int, default=200)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--events", action="store_true",
                    help="radixd records KV events too (SGLang's cache here records none, its default)")
    args = ap.parse_args()
    runs = [one_run(args) for _ in range(args.runs)]
    print(f"config={args.config} page={args.page} window={args.window} requests={args.convs * args.turns} "
          f"runs={args.runs} events={'radixd only' if args.events else 'off'} "
          f"(medians; SGLang = UnifiedRadixCache, Rust core)")
    print(f"{'phase':<14}{'radixd':>14}{'SGLang':>14}{'ratio':>10}")
    for phase in runs[0]:
        a = statistics.median(r[phase][0] for r in runs)
        b = statistics.median(r[phase][1] for r in runs)
        ratio = statistics.median(r[phase][0] / r[phase][1] for r in runs if r[phase][1])
        if phase.startswith("mem"):
            print(f"{phase:<14}{a:>14.1f}{b:>14.1f}{ratio:>10.2f}  (lower is better)")
        else:
            print(f"{phase:<14}{a:>14.0f}{b:>14.0f}{ratio:>10.2f}  ops/s")


if __name__ == "__main__":
    main()
