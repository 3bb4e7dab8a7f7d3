"""KV events as a deployment pays for them: the same engine request cycles (trace_replay's MatchPrefix(lock)
-> LoadBack -> Alloc -> CacheFinished, Mooncake trace) against a server with events off and one publishing
every change over ZMQ to a live router-side follower (`BlockIndex.follow_zmq` in its own process), and an
identical events-off copy whose ratio to the first is the method's own bias. Each cycle runs on all three in a
random order, so they see the same requests in the same state. Both servers share one CPU and the client has another (service_bench.py says why), so
the publisher thread competes with the request path for the same CPU: the worst case for it.

    python bench/events_service_bench.py [--requests 1500] [--device-tokens 131072] [--host-x 4] [--page 16]

Last line: RESULT events_vs_off_p50=<cycle time ratio to both events-off servers pooled> copy_vs_off_p50=<the
bias between the two events-off servers> batches=<the follower got> follower_matches=<1: it holds the server's pages>
"""
from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np

from radixd.client import CacheClient
from service_bench import pin_to
from trace_replay import replay_args, request_cycle, requests


def follower(endpoint: str, replay: str, page: int) -> None:
    """A router following the node: apply every batch to a BlockIndex (replaying any gap); given the server's
    page counts on stdin, wait until it holds as many (or 60 s) and print what it holds."""
    from radixd.client.events import BlockIndex

    class Counting(BlockIndex):
        batches = 0

        def apply(self, node: str, events: list[dict]) -> None:
            self.batches += 1
            super().apply(node, events)
    idx = Counting(page)
    idx.follow_zmq("node", endpoint, replay)
    print("ready", flush=True)
    want = [int(x) for x in sys.stdin.readline().split()]
    t0 = time.perf_counter()
    held = []
    while time.perf_counter() - t0 < 60:  # the follower may still be applying the last batches: poll
        held = [sum(idx.blocks("node", m).values()) for m in ("GPU", "CPU_PINNED")]
        if held == want:
            break
        time.sleep(0.05)
    print(f"{idx.batches} {held[0]} {held[1]} {time.perf_counter() - t0:.2f} {idx.resyncs}", flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = replay_args(__doc__, 131072)
    ap.add_argument("--follower", help=argparse.SUPPRESS)
    ap.add_argument("--replay", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.follower:
        return follower(args.follower, args.replay, args.page)
    reqs = [r for r in requests(args.trace, args.requests) if len(r) <= args.device_tokens // 2]
    d = tempfile.mkdtemp(prefix="radixd-evbench-")
    endpoint, replay = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
    base = ["--device", "cpu", "--num-slots", str(args.device_tokens), "--page-size", str(args.page), "--layers", "2",
            "--kv-heads", "1", "--head-dim", "16"]
    if args.host_x:
        base += ["--host-slots", str(int(args.device_tokens * args.host_x)), "--write-policy", "write_through"]
    names = {"off": [], "copy": [], "events": ["--kv-events-endpoint", endpoint, "--kv-events-replay-endpoint", replay]}
    servers = {k: subprocess.Popen([sys.executable, "-m", "radixd.server.cli", "serve", "--listen",
                                    f"unix:{d}/{k}.sock", *base, *extra], stdout=subprocess.PIPE,
                                   stderr=subprocess.DEVNULL, text=True) for k, extra in names.items()}
    sub = None
    all_cpus = os.sched_getaffinity(0)
    try:
        for p in servers.values():
            assert "ready" in p.stdout.readline()
        sub = subprocess.Popen([sys.executable, __file__, "--follower", endpoint, "--replay", replay,
                                "--page", str(args.page)],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert "ready" in sub.stdout.readline()
        if len(all_cpus) >= 2:
            client_cpu, server_cpu = sorted(all_cpus)[:2]
            os.sched_setaffinity(0, {client_cpu})
            for p in servers.values():
                pin_to(p.pid, {server_cpu})
        clients = {k: CacheClient(f"unix://{d}/{k}.sock", name="evbench") for k in names}
        times: dict[str, list[float]] = {k: [] for k in names}
        order = list(names)
        rng = np.random.default_rng(7)
        for toks in reqs:
            for k in rng.permutation(order):
                t0 = time.perf_counter()
                request_cycle(clients[k], toks)
                times[k].append(time.perf_counter() - t0)
        checks = [c.check() for c in clients.values()]
        st = clients["events"].stats()
        for c in clients.values():
            c.close()
        want = (st["cached_tokens"] // args.page, st["host_cached_tokens"] // args.page)
        out, _ = sub.communicate(f"{want[0]} {want[1]}\n", timeout=120)  # before the server goes: gaps replay
        batches, gpu, cpu, lag, resyncs = out.split()
    finally:
        os.sched_setaffinity(0, all_cpus)
        if sub is not None and sub.poll() is None:
            sub.kill()
        for p in servers.values():
            p.terminate()
            p.wait(10)
    assert checks == [[]] * len(names), checks
    med = {k: np.median(v) * 1e6 for k, v in times.items()}
    print(f"{args.trace}: {len(reqs)} request cycles, page {args.page}, device {args.device_tokens} tokens, host "
          f"{args.host_x:g}x; p50 us per cycle: " + ", ".join(f"{k} {v:.0f}" for k, v in med.items()))
    same = (int(gpu), int(cpu)) == want
    print(f"the follower got {batches} batches ({resyncs} gaps) and holds GPU={gpu} CPU_PINNED={cpu} blocks "
          f"{lag} s after the last reply; the server caches GPU={want[0]} CPU_PINNED={want[1]} pages: "
          f"{'the same' if same else 'DIFFERENT'}")
    pooled = np.median(times["off"] + times["copy"]) * 1e6  # both events-off servers: the reference
    print(f"RESULT events_vs_off_p50={med['events'] / pooled:.3f} copy_vs_off_p50={med['copy'] / med['off']:.3f} "
          f"batches={batches} follower_matches={int(same)}")

if __name__ == "__main__":
    main()
