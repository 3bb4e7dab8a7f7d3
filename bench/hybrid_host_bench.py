"""A hybrid model's host tier on the CPU: demote (device -> host, when the device evicts) and load-back (host ->
device, inside MatchPrefix) throughput against memcpy of the same bytes, measured in the same run.

    python bench/hybrid_host_bench.py [--prefixes 16] [--tokens 1024] [--runs 5] [--tp 8]

Per config (Gemma 3 with its sliding window, Nemotron-H with its Mamba2 states): the engine core is built in
process as the server builds it (device pools, a host tier of the same proportions), `--prefixes` prefixes of
`--tokens` tokens are cached, the device evicts them all (each is copied to the host: FULL KV, the last window
of SWA KV, the state) and a match of each brings it back. Bytes are what the tiers must move (FULL KV of every
token, SWA KV of one window, one state per prefix); the reference is np.copyto of as many contiguous bytes
between two shared-memory pools of the same size. Ratios are bytes/s of the tier over memcpy's (medians of
--runs), with the tree work, the allocators and the checks of each copy included.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from radixd.server.app import build_core  # noqa: E402
from radixd.server.config import load  # noqa: E402
from radixd.server.core import Item  # noqa: E402

CONFIGS = Path(__file__).resolve().parent.parent / "tests" / "configs"
PAGE = 16


def one_run(config: str, prefixes: int, tokens: int, tp: int, seed: int) -> dict:
    hf = json.loads((CONFIGS / config).read_text())
    path = Path(tempfile.mkdtemp()) / "config.json"
    path.write_text(json.dumps(hf))
    slots = prefixes * tokens + 4 * PAGE
    cfg = load(dict(model_config=str(path), hybrid_cache=True, num_slots=slots, page_size=PAGE, swa_ratio=1.0,
                    mamba_states=prefixes + 4, device="cpu", metrics_addr="", tp_size=tp, host_slots=2 * slots,
                    load_back_threshold=0))
    core = build_core(cfg, uuid.uuid4().hex)
    try:
        s = core.attach("bench")
        rng = np.random.default_rng(seed)
        reqs = [rng.integers(0, 50000, tokens, dtype=np.int32) for _ in range(prefixes)]
        states = core.states is not None
        for toks in reqs:
            full, _, held, _ = asyncio.run(core.alloc_slots(s, [tokens], 1 if states else 0))
            core.cache_finished(s, [Item(toks, full[0], ("", ""), 0, 0, 0, None, 0,
                                         int(held[0]) if states else None)])
        for p in core.all_pools():  # touch every page once, as a running server's pools are
            for v in getattr(p, "views", {}).values():
                v.fill(1)
        t = time.perf_counter()
        evicted = asyncio.run(core.evict(1 << 30))[0]
        demote = time.perf_counter() - t
        st = core.stats()
        assert evicted == prefixes * tokens and st["host_cached_tokens"] == evicted, (evicted, st)
        t = time.perf_counter()
        for toks in reqs:
            (m, _, _), = core.match_hybrid(s, [(toks, ("", ""), False, False, False)])
            assert m.matched_len == tokens
        load_back = time.perf_counter() - t
        assert core.check() == []
        full_b = core.device_pools[0].spec.slot_bytes * tokens
        swa_b = core.swa_pool.spec.slot_bytes * min(tokens, core.tree.swa.tail_len) if core.swa_pool else 0
        state_b = core.state_pool.slot_bytes if core.state_pool else 0
        total = prefixes * (full_b + swa_b + state_b)
        src = np.frombuffer(core.host_tier.kv_pool._region.mm, np.uint8)  # the whole pools' shared memory
        dst = np.frombuffer(core.device_pools[0]._region.mm, np.uint8)
        n = min(total, src.size, dst.size)
        reps = max(1, total // n)
        t = time.perf_counter()
        for _ in range(reps):
            np.copyto(dst[:n], src[:n])
        memcpy = (time.perf_counter() - t) * total / (reps * n)
        return dict(bytes=total, demote=demote, load_back=load_back, memcpy=memcpy)
    finally:
        for p in core.all_pools():
            p.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prefixes", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--tp", type=int, default=8)
    a = ap.parse_args()
    for config in ("gemma3-text.json", "nemotron-h-4b.json"):
        rows = [one_run(config, a.prefixes, a.tokens, a.tp, seed) for seed in range(a.runs)]
        med = {k: statistics.median(r[k] for r in rows) for k in ("demote", "load_back", "memcpy")}
        mb = rows[0]["bytes"] / 2**20
        print(f"{config}: {a.prefixes} x {a.tokens} tokens, {mb:.1f} MiB per direction (tp {a.tp})")
        print(f"  memcpy     {mb / med['memcpy']:8.0f} MiB/s")
        print(f"  demote     {mb / med['demote']:8.0f} MiB/s   {med['memcpy'] / med['demote']:.2f}x memcpy")
        print(f"  load-back  {mb / med['load_back']:8.0f} MiB/s   {med['memcpy'] / med['load_back']:.2f}x memcpy")


if __name__ == "__main__":
    main()
