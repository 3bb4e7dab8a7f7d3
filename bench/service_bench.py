"""Service benchmark: MatchPrefix in-process vs through the gRPC service (unbatched, batched 8/64,
concurrent clients) against two floors, all in one run:

* "bare floor": a bare grpc.aio server on uvloop over a unix socket, no protobuf and no interceptors, that
  answers each request with as many bytes as radixd's MatchPrefix response; the client sends the same
  request bytes. Timed interleaved with MatchPrefix, call by call, each pair in random order (so neither
  server is always the one woken second): the ratio an outsider would measure.
* "echo (floor)": radixd's own Echo RPC with the tokens as payload.

    python bench/service_bench.py [--requests 2000] [--clients 4] [--seconds 3]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

from radixd.client import CacheClient
from radixd.proto import cache_pb2 as pb
from radixd.server.tree import RadixTree


def workload(n_conv: int, seed: int = 3):
    """Conversations sharing system prompts: (cached sequences, follow-up prompts to match)."""
    rng = np.random.default_rng(seed)
    systems = [rng.integers(0, 32000, 600, dtype=np.int32) for _ in range(8)]
    seqs, prompts = [], []
    for _ in range(n_conv):
        s = np.concatenate([systems[rng.integers(8)], rng.integers(0, 32000, int(rng.integers(200, 1200)),
                                                                   dtype=np.int32)])
        seqs.append(s)
        prompts.append(np.concatenate([s, rng.integers(0, 32000, 100, dtype=np.int32)]))
    return seqs, prompts


def pct(a):
    a = np.asarray(a) * 1e6
    return np.percentile(a, 50), np.percentile(a, 99)


def timed(fn, items, batch=1):
    out = []
    for i in range(0, len(items) - batch + 1, batch):
        chunk = items[i:i + batch]
        t0 = time.perf_counter()
        fn(chunk)
        out.append((time.perf_counter() - t0) / batch)
    return out


def concurrent_worker(target: str, seconds: float) -> None:
    _, prompts = workload(200)
    with CacheClient(target) as c:
        n, end = 0, time.monotonic() + seconds
        while time.monotonic() < end:
            c.match_prefix(prompts[n % len(prompts)])
            n += 1
    print(n)


def floor_server(sock: str) -> None:
    """A bare grpc.aio server: raw bytes in, `n` zero bytes out (n = first 4 bytes, little-endian)."""
    import asyncio

    import grpc

    async def call(request: bytes, context) -> bytes:
        return bytes(int.from_bytes(request[:4], "little"))

    async def run() -> None:
        server = grpc.aio.server()
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
            "bench.Floor", {"Call": grpc.unary_unary_rpc_method_handler(call)})])
        server.add_insecure_port(f"unix:{sock}")
        await server.start()
        print("ready", flush=True)
        await server.wait_for_termination()
    try:
        import uvloop
        uvloop.run(run())
    except ImportError:
        asyncio.run(run())


def interleaved(c: CacheClient, floor_sock: str, reqs: list) -> tuple[list, list]:
    """Per request: the bare floor with radixd's exact request bytes and response size, then MatchPrefix."""
    import grpc

    from radixd.client import codec
    ch = grpc.insecure_channel(f"unix://{floor_sock}")
    call = ch.unary_unary("/bench.Floor/Call")
    wire = []
    for r in reqs:
        req = codec.match_request(c.session_id, [r], False, "", "")
        resp = c._stub.MatchPrefix(req)
        wire.append(len(resp.SerializeToString()).to_bytes(4, "little") + req.SerializeToString())
    for w in wire[:200]:
        call(w)
    floor, match = [], []
    coin = np.random.default_rng(11).random(len(reqs)) < 0.5
    for r, w, floor_first in zip(reqs, wire, coin):  # each pair in random order: neither side always goes first
        if floor_first:
            t0 = time.perf_counter()
            call(w)
            t1 = time.perf_counter()
            c.match_batch([r])
            t2 = time.perf_counter()
            floor.append(t1 - t0)
            match.append(t2 - t1)
        else:
            t0 = time.perf_counter()
            c.match_batch([r])
            t1 = time.perf_counter()
            call(w)
            t2 = time.perf_counter()
            match.append(t1 - t0)
            floor.append(t2 - t1)
    ch.close()
    return floor, match


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--floor-server", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        concurrent_worker(args.worker, args.seconds)
        return
    if args.floor_server:
        floor_server(args.floor_server)
        return
    seqs, prompts = workload(200)
    total = sum(map(len, seqs))
    d = tempfile.mkdtemp(prefix="radixd-bench-")
    sock = os.path.join(d, "s.sock")
    server = subprocess.Popen([sys.executable, "-m", "radixd.server.cli", "serve", "--listen", f"unix:{sock}",
                               "--device", "cpu", "--num-slots", str(total + 4096), "--layers", "1", "--kv-heads", "1",
                               "--head-dim", "8", "--metrics-addr", "127.0.0.1:0"],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    floor_sock = os.path.join(d, "floor.sock")
    floor = subprocess.Popen([sys.executable, __file__, "--floor-server", floor_sock], stdout=subprocess.PIPE,
                             text=True)
    try:
        assert "ready" in server.stdout.readline()
        assert "ready" in floor.stdout.readline()
        target = f"unix://{sock}"
        tree = RadixTree()
        with CacheClient(target) as c:
            slot = 0
            for s in seqs:
                idx = c.alloc(len(s))
                c.insert(s, idx)
                tree.insert(s, np.arange(slot, slot + len(s), dtype=np.int32))
                slot += len(s)
            reqs = [prompts[i % len(prompts)] for i in range(args.requests)]
            packed = [p.tobytes() for p in reqs]
            for _ in range(200):  # warm up
                c.echo(packed[0])
                c.match_prefix(reqs[0])
            rows = {}
            rows["bare floor"], rows["MatchPrefix vs bare"] = interleaved(c, floor_sock, reqs)
            rows["in-process tree"] = timed(lambda ch: tree.match_prefix(ch[0]), packed)
            rows["echo (floor)"] = timed(lambda ch: c._stub.Echo(pb.EchoRequest(payload=ch[0])), packed)
            rows["MatchPrefix x1"] = timed(lambda ch: c.match_batch(ch), reqs)
            rows["MatchPrefix x8"] = timed(lambda ch: c.match_batch(ch), reqs, 8)
            rows["MatchPrefix x64"] = timed(lambda ch: c.match_batch(ch), reqs, 64)
        procs = [subprocess.Popen([sys.executable, __file__, "--worker", target, "--seconds", str(args.seconds)],
                                  stdout=subprocess.PIPE, text=True) for _ in range(args.clients)]
        done = sum(int(p.communicate()[0].strip().splitlines()[-1]) for p in procs)
    finally:
        server.terminate()
        server.wait(10)
        floor.terminate()
        floor.wait(10)
    base = np.median(rows["in-process tree"])
    echo50 = pct(rows["echo (floor)"])[0]
    print(f"{'per request':22} {'p50 us':>9} {'p99 us':>9} {'x echo p50':>11} {'x in-process':>13}")
    for name, v in rows.items():
        p50, p99 = pct(v)
        print(f"{name:22} {p50:9.1f} {p99:9.1f} {p50 / echo50:11.2f} {np.median(v) / base:13.2f}")
    print(f"{args.clients} concurrent clients, unbatched MatchPrefix: {done / args.seconds:.0f} requests/s in total")
    m1 = pct(rows["MatchPrefix x1"])[0] / echo50
    b64 = np.median(rows["MatchPrefix x64"]) / base
    bare = pct(rows["MatchPrefix vs bare"])[0] / pct(rows["bare floor"])[0]
    print(f"RESULT match_vs_bare_p50={bare:.2f} (goal <= 1.25) match_vs_echo_p50={m1:.2f} "
          f"batched64_vs_inprocess={b64:.2f} (goal <= 2)")


if __name__ == "__main__":
    main()
