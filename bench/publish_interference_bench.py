"""What a connector's background publish costs a Python-heavy forward running beside it in the same process.

An engine's forward runs on its thread while the connector's store thread publishes the previous request's pages
(one CacheFinished of 1024 tokens through `Stores`, as the vLLM connector does) and, with --index, the events'
index thread follows radixd's KV events of it. The forward here is a stand-in of the tiny CPU model's: a few hundred
small torch ops on one OpenMP thread (~12 ms), each of which lets go of the GIL. Forwards alternate between with a
publish posted just before them and without one, and the result is the median of the per-pair ratios (the
machine's drift cancels). radixd runs pinned to the last CPU.

  --pin          the forward's thread on the first CPU and every other thread of the process (ours, gRPC's) on the
                 last, as the vLLM connector's `radixd_cpus` "auto" places them when vLLM binds the forward
  --call none    the store thread does its round but makes no call (no server work, no events): its own cost
  --stepped, --linger-ms   when the store thread's round starts (at once on a step's end; after a linger)
  --relay        the calls and the events go through a relay process (radixd.client.relay, as the vLLM connector
                 makes them by default): the index is then the relay's table of first pages in shared memory

Read on this project's 2-core machine: unpinned 1.09-1.11 with the index, pinned 1.04-1.05, the round with no
call 1.004-1.008 (so the rest is the call, radixd's work on the other CPU and the events). --linger-ms 0 read
1.020-1.026 against 1.039-1.042, but the vLLM connector with no linger did not move bench/vllm_bench.py (1.056-1.069
in 4 runs): a stand-in forward is a guide to where a cost is, not a measure of the engine's.

With --relay (pinned, 3 runs each): 1.013-1.017 against 1.026-1.027 without the index; with the index (then still
a BlockIndex fed by the relayed stream, before the first-pages table) 1.017-1.021 against 1.027-1.034. The real
engine moved more than this stand-in (bench/vllm_bench.py: 1.051 to 1.04 with the relay, to 1.026 with the store
thread's poll every 20 ms instead of 5, which this stand-in, with no step around its forward, hardly sees).

    python bench/publish_interference_bench.py [--pin] [--index] [--relay] [--call grpc|none] [--pairs 200]
                                               [--runs 3]

Last line: RESULT publish_x=<median over runs of the per-run median ratio>.
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from radixd.client import CacheClient  # noqa: E402
from radixd.client.background import Stores  # noqa: E402
from radixd.client.events import LocalIndex  # noqa: E402
from radixd.client.relay import RelayedClient  # noqa: E402
from tests.conftest import ServerProc  # noqa: E402

PAGE, TOKENS = 32, 1024
ALL = os.sched_getaffinity(0)
NS = dict(extra_key="", cache_salt="")


def _forward(x0: torch.Tensor, weights: list[torch.Tensor]) -> torch.Tensor:
    x = x0
    for _ in range(12):
        for m in weights:
            x = torch.nn.functional.silu(x @ m) + x
            x = x * 0.5
    return x


def run(args: argparse.Namespace) -> float:
    """One server and one 'engine': the median with/without ratio of the forward's time over --pairs pairs."""
    torch.set_num_threads(1)
    cpus = sorted(ALL)
    os.sched_setaffinity(0, ALL)  # (a run before pinned this thread: the server must not inherit that)
    srv = ServerProc("--num-slots", "1048576", "--page-size", str(PAGE), "--kv-events")
    try:
        for tid in os.listdir(f"/proc/{srv.proc.pid}/task"):
            os.sched_setaffinity(int(tid), {cpus[-1]})
        if args.relay:  # (started from the last CPU: the relay process runs there)
            os.sched_setaffinity(0, {cpus[-1]} if args.pin else ALL)
            client = RelayedClient(srv.target)
            os.sched_setaffinity(0, ALL)
        else:
            client = CacheClient(srv.target)
        stores = Stores(client, PAGE, 65536, capacity=1048576)
        stores.stepped, stores.linger = args.stepped, args.linger_ms / 1000
        index = LocalIndex(client, srv.target, PAGE) if args.index else None
        if args.call == "none":
            client.cache_finished = lambda items: []  # (the round runs; nothing reaches radixd)
        weights = [torch.randn(64, 64) * 0.05 for _ in range(8)]
        x0 = torch.randn(TOKENS, 64)
        for _ in range(20):
            _forward(x0, weights)
        rng = random.Random(1)
        times: dict[int, list[float]] = {0: [], 1: []}
        me = threading.get_native_id()
        for i in range(2 * args.pairs):
            publish = i % 2
            if publish:
                toks = np.asarray([rng.randrange(3, 30000) for _ in range(TOKENS)], np.int32)
                pages = None
                while pages is None:
                    pages = stores.take_pages(TOKENS // PAGE, wait=1.0)
                stores.publish(i, toks, 0, pages, NS, finished=True)
                if args.stepped:
                    stores.flush()
            if args.pin:  # (every pass: gRPC may start threads of its own at any time)
                for tid in os.listdir("/proc/self/task"):
                    try:
                        os.sched_setaffinity(int(tid), {cpus[0]} if int(tid) == me else {cpus[-1]})
                    except OSError:
                        pass
            t0 = time.perf_counter()
            _forward(x0, weights)
            times[publish].append(time.perf_counter() - t0)
            stores.wait_idle(1.0)
            time.sleep(0.02)  # (the publish's server work and events are over before the next pair)
        if index is not None:
            index.close()
        stores.close()
        client.close()
        return statistics.median(b / a for a, b in zip(times[0], times[1]))
    finally:
        srv.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pin", action="store_true", help="the forward on the first CPU, the rest on the last")
    ap.add_argument("--index", action="store_true", help="follow radixd's KV events into a local index as well")
    ap.add_argument("--call", default="grpc", choices=["grpc", "none"], help="none: the round makes no call")
    ap.add_argument("--stepped", action="store_true", help="the engine ends a step after posting (Stores.flush): "
                    "the round goes at once, with no linger")
    ap.add_argument("--linger-ms", type=float, default=2.0, help="the store thread's linger before a round (Stores)")
    ap.add_argument("--relay", action="store_true", help="the calls (and the events) go through a relay process "
                    "(radixd.client.relay), as the vLLM connector's `radixd_relay` makes them")
    ap.add_argument("--pairs", type=int, default=200)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    if len(os.sched_getaffinity(0)) < 2:
        sys.exit("needs 2 CPUs at least (the forward's and radixd's)")
    ratios = [run(args) for _ in range(args.runs)]
    print(f"forward with a publish beside it / without (pin={args.pin}, index={args.index}, call={args.call}, relay={args.relay}): "
          + ", ".join(f"{r:.3f}" for r in ratios))
    print(f"RESULT publish_x={statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
