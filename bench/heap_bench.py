"""Heap benchmark: what `--heap-retain-mb` saves a real server on requests whose buffers change size.

Two servers, started alternately (retained heap: the default; then `--heap-retain-mb 0`: glibc's defaults), each
given one cached prompt of --tokens and then asked for matches of random lengths up to it (the same lengths for
both). Per run: the client-side p50 and mean of a MatchPrefix, and the server's minor page faults over the matches
(/proc/PID/stat). Printed per run and as medians over --runs, with the ratios retained / default.

    python bench/heap_bench.py [--runs 5] [--tokens 200000] [--matches 300]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from tests.conftest import ServerProc  # noqa: E402

from radixd.client import CacheClient  # noqa: E402


def minflt(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[7])  # field 10: minor faults


def one(args, flags: list[str], seed: int) -> tuple[float, float, int]:
    """(p50 ms, mean ms, server minor faults) of the matches on a fresh server."""
    s = ServerProc("--num-slots", str(1 << (args.tokens - 1).bit_length()), *flags)
    try:
        c = CacheClient(s.target, name="heap-bench")
        toks = np.random.default_rng(1).integers(0, 32000, args.tokens, dtype=np.int32)
        c.insert(toks, c.alloc(len(toks)))
        c.match_prefix(toks[:1024])
        lengths = np.random.default_rng(seed).integers(1000, args.tokens, args.matches)
        f0, ts = minflt(s.proc.pid), []
        for n in lengths:
            t0 = time.perf_counter()
            c.match_prefix(toks[:n])
            ts.append(time.perf_counter() - t0)
        faults = minflt(s.proc.pid) - f0
        c.close()
        return float(np.median(ts)) * 1e3, float(np.mean(ts)) * 1e3, faults
    finally:
        s.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=200_000)
    ap.add_argument("--matches", type=int, default=300)
    args = ap.parse_args()
    rows = {"retained": [], "default": []}
    print(f"{'run':>3} {'heap':9} {'p50 ms':>8} {'mean ms':>8} {'faults':>8}")
    for run in range(args.runs):
        order = [("retained", []), ("default", ["--heap-retain-mb", "0"])]
        for name, flags in order if run % 2 == 0 else order[::-1]:
            r = one(args, flags, seed=run)
            rows[name].append(r)
            print(f"{run:3d} {name:9} {r[0]:8.3f} {r[1]:8.3f} {r[2]:8d}", flush=True)
    med = {k: np.median(np.array(v), axis=0) for k, v in rows.items()}
    ratio = med["retained"] / med["default"]
    print(f"medians: retained p50 {med['retained'][0]:.3f} ms, mean {med['retained'][1]:.3f} ms, "
          f"{med['retained'][2]:.0f} faults; default {med['default'][0]:.3f} / {med['default'][1]:.3f} ms, "
          f"{med['default'][2]:.0f} faults")
    print(f"RESULT heap_p50_x={ratio[0]:.2f} heap_mean_x={ratio[1]:.2f} heap_faults_x={ratio[2]:.3f}")


if __name__ == "__main__":
    main()
