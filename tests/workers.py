"""Client programs that tests run as separate processes: random workloads, optionally killed mid-way."""
from __future__ import annotations

import sys
import time

import numpy as np

from radixd.client import CacheClient, FailedPrecondition, RadixdError, ResourceExhausted


def random_workload(target: str, seed: int, seconds: float, announce: bool = False) -> int:
    """Random alloc/insert/match+lock/unlock/free/finish/evict until `seconds` pass; returns ops done."""
    rng = np.random.default_rng(seed)
    prompts = [np.random.default_rng(i).integers(0, 1000, 64, dtype=np.int32) for i in range(4)]
    ops = 0
    with CacheClient(target, name=f"worker-{seed}") as c:
        if announce:
            print("attached", flush=True)
        held: list[np.ndarray] = []
        receipts: list[int] = []
        loading: dict[int, tuple[int, ...]] = {}
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            op = rng.integers(8)
            toks = np.concatenate([prompts[rng.integers(4)][:rng.integers(8, 64)],
                                   rng.integers(0, 1000, rng.integers(0, 32), dtype=np.int32)])
            try:
                if op == 0:
                    held.append(c.alloc(int(rng.integers(1, 64))))
                elif op == 1 and held:
                    c.free(held.pop())
                elif op == 2:
                    m = c.match_prefix(toks, lock=True)
                    receipts.append(m.receipt_id)
                elif op == 3 and receipts:
                    r = receipts.pop(int(rng.integers(len(receipts))))
                    try:
                        c.unlock([r])
                    except FailedPrecondition:  # a load-back still copying: wait for it, then release
                        c.wait_transfers(list(loading.pop(r, ())))
                        c.unlock([r])
                elif op == 4:
                    m = c.match_prefix(toks, lock=True)
                    new = c.alloc(len(toks) - m.matched_len)
                    c.cache_finished([dict(tokens=toks, indices=np.concatenate([m.indices, new]),
                                           prev_prefix_len=m.matched_len, receipt_id=m.receipt_id)])
                elif op == 5:
                    c.evict(int(rng.integers(1, 100)))
                elif op == 6:
                    new = c.alloc(len(toks))
                    c.insert(toks, new)
                elif op == 7:  # host tier: bring a demoted prefix back (kills land mid-copy too)
                    m = c.match_prefix(toks, lock=True)
                    if m.host_hit_len:
                        lb = c.load_back(m.receipt_id)
                        receipts.append(lb.receipt_id)
                        if lb.transfer_id:
                            loading[lb.receipt_id] = (lb.transfer_id,)
                    else:
                        receipts.append(m.receipt_id)
            except ResourceExhausted:
                if held:
                    c.free(held.pop())
            ops += 1
    return ops


def main() -> None:
    target, seed, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    try:
        print(f"ops {random_workload(target, seed, seconds, announce=True)}", flush=True)
    except RadixdError as e:
        print(f"error {type(e).__name__}: {e}", flush=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
