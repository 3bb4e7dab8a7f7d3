"""L3 benchmark: backup and prefetch throughput per store against the store's raw client moving the same
bytes in the same run, then a Mooncake trace replayed across two servers sharing one store.

Throughput: radixd's L3 tier in process (a real host pool, tree and StorageTier): a backup of --pages pages
(exists, then put the missing ones, host slots pinned) and a prefetch of as many (hash chain, exists, host
allocation, get into the host pool, insert into the tree). The reference is the store's own client putting
and getting the same pages from the same memory (redis-py pipeline / MGET, file write / readinto,
Mooncake batch_put_from / batch_get_into), timed interleaved; medians of --repeat rounds, fresh keys each.

Sharing: requests of the trace go round-robin to two real servers (MatchPrefix waits for its prefetch,
LoadBack, Alloc, CacheFinished); each server's token hit rate with and without a shared file store.

    python bench/storage_bench.py [--repeat 5] [--pages 256] [--requests 1200]

Last line: RESULT <store>_put_x=.. <store>_get_x=.. ... shared_hit_off=.. shared_hit_l3=..
"""
from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from radixd.client import CacheClient  # noqa: E402
from radixd.server.app import build_core  # noqa: E402
from radixd.server.config import Config  # noqa: E402
from radixd.server.storage.mooncake import _addr  # noqa: E402
from radixd.server.tree.hashes import chain  # noqa: E402
from tests.stores import FileDir, MooncakeMaster, Valkey  # noqa: E402

from trace_replay import requests  # noqa: E402

PAGE = 16


def _raw_put(store, keys, pages) -> None:
    s = store
    if s.scheme == "valkey":
        pipe = s.client.pipeline(transaction=False)
        for k, p in zip(keys, pages):
            pipe.set(k, memoryview(p))
        pipe.execute()
    elif s.scheme == "file":
        for k, p in zip(keys, pages):
            os.makedirs(os.path.join(s.root, k[-2:]), exist_ok=True)
            with open(os.path.join(s.root, k[-2:], k), "wb") as fh:
                fh.write(memoryview(p))
    else:
        s.store.batch_put_from(keys, [_addr(p) for p in pages], [p.nbytes for p in pages])


def _raw_get(store, keys, outs) -> None:
    s = store
    if s.scheme == "valkey":
        for v, o in zip(s.client.mget(keys), outs):
            o[:] = np.frombuffer(v, np.uint8)
    elif s.scheme == "file":
        for k, o in zip(keys, outs):
            with open(os.path.join(s.root, k[-2:], k), "rb", buffering=0) as fh:
                fh.readinto(memoryview(o))
    else:
        s.store.batch_get_into(keys, [_addr(o) for o in outs], [o.nbytes for o in outs])


async def _throughput(url: str, npages: int, repeat: int) -> tuple[float, float, float, float]:
    cfg = Config(device="cpu", num_slots=npages * PAGE, page_size=PAGE, layers=4, kv_heads=4, head_dim=64,
                 host_slots=4 * npages * PAGE, host_layout="page_first", storage=url, prefetch_threshold=PAGE)
    core = build_core(cfg, uuid.uuid4().hex)
    tier, host, tree = core.storage, core.host, core.tree
    rng = np.random.default_rng(0)
    raw = host.host_pool.views["pages"].view(np.uint8)
    raw[...] = rng.integers(0, 256, raw.shape, dtype=np.uint8)
    src = host._take(host.host_alloc, npages * PAGE)  # the pages a backup reads
    scratch = host._take(host.host_alloc, npages * PAGE)  # where the raw client reads into
    nbytes = npages * tier.page_bytes
    put_x, get_x, put_rate, get_rate = [], [], [], []
    try:
        for r in range(repeat):
            tokens = rng.integers(0, 32000, npages * PAGE, dtype=np.int32)
            root = tree.root_id(("", ""))
            digests = chain(tokens.tobytes(), PAGE * 4, tree.chain_prior(root)[1])
            raw_keys = [f"raw-{uuid.uuid4().hex}" for _ in range(npages)]
            views = tier._view(src)
            order = [0, 1] if r % 2 == 0 else [1, 0]
            t_tier = t_raw = 0.0
            for which in order:
                t0 = time.perf_counter()
                if which == 0:
                    tier.backup(("", ""), src, digests)
                    assert await tier.idle(120)
                    t_tier = time.perf_counter() - t0
                else:
                    await asyncio.get_running_loop().run_in_executor(None, _raw_put, tier.store, raw_keys, views)
                    t_raw = time.perf_counter() - t0
            assert tier.pages["put"] == (r + 1) * npages, (r, tier.pages, dict(tier.errors), tier.store.scheme)
            put_x.append(t_raw / t_tier)
            put_rate.append(nbytes / t_tier / 1e9)
            outs = tier._view(scratch)
            for which in order:
                t0 = time.perf_counter()
                if which == 0:
                    op = tier.maybe_prefetch(("", ""), tokens, 0, 0, root)
                    await op.done.wait()
                    assert op.outcome == "completed" and op.loaded == tokens.size, op.outcome
                    t_tier = time.perf_counter() - t0
                else:
                    await asyncio.get_running_loop().run_in_executor(None, _raw_get, tier.store, raw_keys, outs)
                    t_raw = time.perf_counter() - t0
            get_x.append(t_raw / t_tier)
            get_rate.append(nbytes / t_tier / 1e9)
            host.evict_host(tree.host_cached_tokens)  # the next round fetches again
            assert tree.check() == [] and tier.check() == []  # (the bench holds src and scratch slots itself)
    finally:
        await tier.drain()
        tier.close()
        host.engine.close()
        for p in core.device_pools + [core.host_pool]:
            p.close()
    return (statistics.median(put_x), statistics.median(get_x), statistics.median(put_rate),
            statistics.median(get_rate))


def _serve(sock: str, device: int, host: int, storage: str):
    extra = ["--storage", storage, "--prefetch-policy", "wait_complete", "--prefetch-threshold", str(PAGE)] \
        if storage else []
    p = subprocess.Popen([sys.executable, "-m", "radixd.server.cli", "serve", "--listen", f"unix:{sock}",
                          "--device", "cpu", "--num-slots", str(device), "--page-size", str(PAGE), "--layers", "2",
                          "--kv-heads", "1", "--head-dim", "16", "--host-slots", str(host), *extra],
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert "ready" in p.stdout.readline()
    return p


def _request(c: CacheClient, toks: np.ndarray, acc: dict) -> None:
    m = c.match_prefix(toks, lock=True)
    prefix, receipt = m.indices, m.receipt_id
    acc["device"] += m.matched_len
    if m.host_hit_len:
        lb = c.load_back(receipt)
        if lb.loaded_len:
            c.wait_transfers([lb.transfer_id])
            acc["loaded"] += lb.loaded_len
        prefix, receipt = lb.indices, lb.receipt_id
    need = len(toks) - len(prefix)
    new = c.alloc(need)
    if len(new) > need:
        c.free(new[need:])
        new = new[:need]
    c.cache_finished([dict(tokens=toks, indices=np.concatenate([prefix, new]), prev_prefix_len=len(prefix),
                           receipt_id=receipt)])
    acc["total"] += len(toks)


def _shared(reqs: list[np.ndarray], device: int, host: int, l3: bool) -> list[float]:
    d = tempfile.mkdtemp(prefix="radixd-shared-")
    store = f"file://{d}/l3" if l3 else ""
    procs = [_serve(os.path.join(d, f"{i}.sock"), device, host, store) for i in range(2)]
    try:
        clients = [CacheClient(f"unix://{d}/{i}.sock", name=f"engine-{i}") for i in range(2)]
        accs = [dict(device=0, loaded=0, total=0) for _ in range(2)]
        for i, toks in enumerate(reqs):
            if len(toks) <= device // 2:
                _request(clients[i % 2], toks, accs[i % 2])
        for c in clients:
            bad = c.check()
            assert bad == [], bad[:5]
            c.close()
        return [(a["device"] + a["loaded"]) / a["total"] for a in accs]
    finally:
        for p in procs:
            p.terminate()
            p.wait(30)
        shutil.rmtree(d, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--pages", type=int, default=256)
    ap.add_argument("--requests", type=int, default=1200)
    ap.add_argument("--device-tokens", type=int, default=262144)
    ap.add_argument("--host-x", type=float, default=2.0)
    ap.add_argument("--stores", default="file,valkey,mooncake")
    args = ap.parse_args()
    results = {}
    print(f"{'store':9} {'put GB/s':>9} {'put x raw':>10} {'get GB/s':>9} {'get x raw':>10}   "
          f"({args.pages} pages of 64 KiB, medians of {args.repeat})")
    for name in [n for n in args.stores.split(",") if n]:
        s = {"file": FileDir, "valkey": Valkey, "mooncake": MooncakeMaster}[name]()
        try:
            url = s.url.replace("segment=64MiB", "segment=2GiB")  # room for every round: no eviction mid-bench
            px, gx, pr, gr = asyncio.run(_throughput(url, args.pages, args.repeat))
        finally:
            s.stop()
        results[f"{name}_put_x"], results[f"{name}_get_x"] = px, gx
        print(f"{name:9} {pr:9.2f} {px:10.2f} {gr:9.2f} {gx:10.2f}")
    if args.requests:
        reqs = requests("conversation_trace.jsonl", args.requests)
        host = int(args.device_tokens * args.host_x)
        off = _shared(reqs, args.device_tokens, host, False)
        on = _shared(reqs, args.device_tokens, host, True)
        print(f"two servers, round-robin, {len(reqs)} requests: hit rate per server without L3 "
              f"{off[0]:.3f} / {off[1]:.3f}, with a shared L3 {on[0]:.3f} / {on[1]:.3f}")
        results["shared_hit_off"], results["shared_hit_l3"] = statistics.mean(off), statistics.mean(on)
    print("RESULT " + " ".join(f"{k}={v:.3f}" for k, v in results.items()))


if __name__ == "__main__":
    main()
