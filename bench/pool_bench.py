"""Pool benchmark: allocator ops/s and CPU gather/scatter bandwidth vs plain memcpy (same run).

    python bench/pool_bench.py [--repeat 5]
"""
from __future__ import annotations

import argparse
import time
import uuid

import numpy as np

from radixd.server.pools import HELD, TREE, KVPool, PoolSpec, SlotAllocator
from radixd.server.transfer import copy_slots


def bench_allocator(repeat: int) -> None:
    print(f"{'allocator':28} {'alloc+free pairs/s':>20} {'us/pair':>9}")
    for page in (1, 16):
        for n in (16, 256, 4096):
            a = SlotAllocator(1 << 20, page_size=page)
            rates = []
            for _ in range(repeat):
                k = 2000
                t0 = time.perf_counter()
                for _ in range(k):
                    a.free(a.alloc(n, 1), 1)
                rates.append(k / (time.perf_counter() - t0))
            r = float(np.median(rates))
            print(f"page={page:<3} n={n:<6} {'':14} {r:20.0f} {1e6 / r:9.1f}")
        a = SlotAllocator(1 << 20, page_size=page)
        s = a.alloc(4096, 1)
        t0 = time.perf_counter()
        for _ in range(500):
            a.move(s, HELD, TREE, 1)
            a.move(s, TREE, HELD, None, 1)
        print(f"page={page:<3} ownership move of 4096 slots: {(time.perf_counter() - t0) / 1000 * 1e6:.1f} us")


def bench_copy(repeat: int) -> None:
    spec = PoolSpec(num_layers=8, kv_heads=8, head_dim=128, dtype="bfloat16", page_size=16, num_slots=16384)
    dev = KVPool(spec, "device", uuid.uuid4().hex)
    print(f"\n{'copy (device->host)':28} {'GB/s':>8} {'x memcpy':>9}")
    n = 4096
    rng = np.random.default_rng(0)
    pages = rng.permutation(spec.num_pages)[:n // 16]
    src = (pages[:, None] * 16 + np.arange(16)).reshape(-1)
    nbytes = n * spec.slot_bytes
    a = np.ones(nbytes, dtype=np.uint8)
    b = np.empty_like(a)
    for layout in ("layer_first", "page_first"):
        host = KVPool(spec.with_slots(8192, layout), "host", dev.instance_id)
        dst = np.arange(n)
        ratios, rates = [], []
        for _ in range(repeat):
            t0 = time.perf_counter()
            np.copyto(b, a)
            t_mem = time.perf_counter() - t0
            t0 = time.perf_counter()
            copy_slots(dev, src, host, dst)
            t_copy = time.perf_counter() - t0
            ratios.append(t_mem / t_copy)
            rates.append(nbytes / t_copy / 1e9)
        print(f"{layout:28} {np.median(rates):8.2f} {np.median(ratios):9.2f}   ({nbytes >> 20} MiB, {n} slots, whole pages)")
        host.close()
    dev.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    bench_allocator(args.repeat)
    bench_copy(args.repeat)


if __name__ == "__main__":
    main()
