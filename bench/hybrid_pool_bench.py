"""CPU copy throughput of a hybrid model's extra pools against memcpy of the same bytes, in the same run.

    python bench/hybrid_pool_bench.py [--config tests/configs/nemotron-h-4b.json] [--tp 8] [--runs 5]

* state: copy-on-write of 8 random state slots (every layer's conv and temporal state) with StatePool.copy,
  against one np.copyto of as many contiguous bytes;
* swa: a request's window of SWA KV (every sliding-window layer, K and V) gathered page by page through
  radixd's FULL->SWA page map into a staging buffer, against np.copyto of as many bytes.
The memcpy reference copies as many contiguous bytes between the same memories (the pool's shared memory and
the same destination), so both pay the same page size and TLB costs; ratios are bytes/s of the pool copy
over memcpy's (medians of --runs); the goal is >= 0.8.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from radixd.server.layouts import model_layout  # noqa: E402
from radixd.server.pools.hybrid import StatePool, SwaTranslation, take_pages  # noqa: E402
from radixd.server.pools.pool import KVPool  # noqa: E402
from radixd.server.pools.spec import PoolSpec  # noqa: E402


def timed(fn, reps: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def state_run(lay, rnd) -> tuple[float, int]:
    pool = StatePool(32, len(lay.state_layers), lay.state, "b" * 16)
    try:
        for v in pool.views.values():
            v.fill(1)
        src, dst = rnd.choice(32, 8, replace=False), rnd.choice(32, 8, replace=False)
        flat = [v.reshape(len(v), -1) for v in pool.views.values()]

        def memcpy():  # as many bytes, contiguous: slots 0-7 onto 8-15 of every buffer
            for f in flat:
                np.copyto(f[8:16], f[0:8])
        return timed(lambda: pool.copy(src, dst)), timed(memcpy), 8 * pool.slot_bytes
    finally:
        pool.close()


def swa_run(lay, hf, rnd, window_tokens: int, page: int = 16, fragmented: bool = False) -> tuple:
    text = hf.get("text_config") or hf
    heads, dim = text.get("num_key_value_heads") or text["num_attention_heads"], text.get("head_dim")
    full_slots, swa_slots = 8 * window_tokens, 2 * window_tokens
    spec = PoolSpec(num_layers=len(lay.swa_layers), kv_heads=heads, head_dim=dim, dtype="bfloat16",
                    page_size=page, num_slots=swa_slots)
    pool = KVPool(spec, "swa", "c" * 16)
    tr = SwaTranslation(full_slots, swa_slots, page)
    try:
        pages = rnd.choice(full_slots // page, window_tokens // page, replace=False)
        full = (pages[:, None] * page + np.arange(page)).reshape(-1)
        if fragmented:  # the window's SWA pages scattered over the pool, as after long churn
            tr.assign(full[rnd.permutation(len(full) // page)[:, None] * page + np.arange(page)].reshape(-1))
        else:  # a fresh request: its pages assigned in token order, one run of the SWA pool
            tr.assign(full)
        idx = tr.translate(full)
        staging = {name: np.empty((window_tokens // page, page, heads, dim), dtype=v.dtype)
                   for name, v in pool.views.items()}
        paged = {name: v.reshape(-1, page, heads, dim) for name, v in pool.views.items()}

        def gather():  # whole pages through the page map: one gather of page-sized blocks per buffer
            swa_pages = tr.translate_pages(pages)
            for name, v in paged.items():
                take_pages(v, swa_pages, staging[name])
        n_pages = window_tokens // page

        def memcpy():  # as many bytes, contiguous, from the same pool memory into the same staging
            for name, v in paged.items():
                np.copyto(staging[name], v[:n_pages])
        assert (idx == tr.translate(full)).all()
        return timed(gather), timed(memcpy), sum(s.nbytes for s in staging.values())
    finally:
        pool.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(Path(__file__).resolve().parent.parent / "tests/configs/nemotron-h-4b.json"))
    ap.add_argument("--swa-config", default=str(Path(__file__).resolve().parent.parent / "tests/configs/gpt-oss.json"))
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    rnd = np.random.default_rng(0)
    hf, shf = json.loads(Path(args.config).read_text()), json.loads(Path(args.swa_config).read_text())
    lay, slay = model_layout(hf, args.tp), model_layout(shf, 1)
    rows = {"state": [], "swa": [], "swa-frag": []}
    for _ in range(args.runs):
        t, ref, n = state_run(lay, rnd)
        rows["state"].append((n / t, n / ref, n))
        t, ref, n = swa_run(slay, shf, rnd, window_tokens=4096)
        rows["swa"].append((n / t, n / ref, n))
        t, ref, n = swa_run(slay, shf, rnd, window_tokens=4096, fragmented=True)
        rows["swa-frag"].append((n / t, n / ref, n))
    print(f"state: {Path(args.config).name} tp={args.tp}; swa: {Path(args.swa_config).name}, a 4096-token window; "
          f"medians of {args.runs}")
    print(f"{'pool':<8}{'MiB':>10}{'pool GB/s':>12}{'memcpy GB/s':>14}{'ratio':>8}")
    for name, r in rows.items():
        ratio = statistics.median(a / b for a, b, _ in r)
        print(f"{name:<8}{r[0][2] / 2**20:>10.1f}{statistics.median(a for a, _, _ in r) / 1e9:>12.2f}"
              f"{statistics.median(b for _, b, _ in r) / 1e9:>14.2f}{ratio:>8.2f}")


if __name__ == "__main__":
    main()
