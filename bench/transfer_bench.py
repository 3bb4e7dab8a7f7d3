"""Transfer benchmark: backup (device -> host) and load-back (host -> device) throughput vs memcpy.

Both host layouts, whole pages, a fragmented side (random pages, as a tree's nodes are) and a freshly
allocated side (consecutive pages). The reference is `np.copyto` of the same number of bytes, timed
interleaved in the same run; medians of --repeat runs.

    python bench/transfer_bench.py [--repeat 7] [--layers 8] [--tokens 4096]

Last line: RESULT d2h_page_first_x=.. h2d_page_first_x=.. d2h_layer_first_x=.. h2d_layer_first_x=..
"""
from __future__ import annotations

import argparse
import time
import uuid

import numpy as np

from radixd.server.pools import KVPool, PoolSpec
from radixd.server.transfer.pages import PageCopier


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--page", type=int, default=16)
    args = ap.parse_args()
    spec = PoolSpec(num_layers=args.layers, kv_heads=8, head_dim=128, dtype="bfloat16", page_size=args.page,
                    num_slots=4 * args.tokens)
    dev = KVPool(spec, "device", uuid.uuid4().hex)
    n, p = args.tokens, args.page
    rng = np.random.default_rng(0)
    scattered = (rng.permutation(spec.num_pages)[:n // p][:, None] * p + np.arange(p)).reshape(-1)
    fresh = np.arange(n)
    nbytes = n * spec.slot_bytes
    a = np.ones(nbytes, dtype=np.uint8)
    b = np.empty_like(a)
    results = {}
    print(f"{'direction':6} {'host layout':12} {'GB/s':>7} {'memcpy GB/s':>12} {'x memcpy':>9}   "
          f"({nbytes >> 20} MiB, {n} tokens, page {p})")
    for layout in ("page_first", "layer_first"):
        host = KVPool(spec.with_slots(2 * n, layout), "host", dev.instance_id)
        host_scattered = (rng.permutation(host.spec.num_pages)[:n // p][:, None] * p + np.arange(p)).reshape(-1)
        cases = {"d2h": (PageCopier(dev, host), scattered, fresh),  # a node's pages -> fresh host pages
                 "h2d": (PageCopier(host, dev), host_scattered, fresh)}  # and back into fresh device pages
        for name, (copier, src, dst) in cases.items():
            ratios, rates, mem = [], [], []
            copier.copy(src, dst)  # warm: page faults and torch's first call are not the copy
            for _ in range(args.repeat):
                t0 = time.perf_counter()
                np.copyto(b, a)
                t_mem = time.perf_counter() - t0
                t0 = time.perf_counter()
                copier.copy(src, dst)
                t_copy = time.perf_counter() - t0
                ratios.append(t_mem / t_copy)
                rates.append(nbytes / t_copy / 1e9)
                mem.append(nbytes / t_mem / 1e9)
            results[f"{name}_{layout}_x"] = float(np.median(ratios))
            print(f"{name:6} {layout:12} {np.median(rates):7.2f} {np.median(mem):12.2f} {np.median(ratios):9.2f}")
        host.close()
    dev.close()
    print("RESULT " + " ".join(f"{k}={v:.2f}" for k, v in results.items()))


if __name__ == "__main__":
    main()
