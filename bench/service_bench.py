"""Service benchmark: MatchPrefix in-process vs through the gRPC service (unbatched, batched 8/64,
concurrent clients) against two floors, all in one run:

* "bare floor": a bare grpc.aio server on uvloop over a unix socket, no protobuf and no interceptors, that
  answers each request with as many bytes as radixd's MatchPrefix response; the client sends the same
  request bytes. Timed interleaved with MatchPrefix, call by call, each pair in random order (so neither
  server is always the one woken second): the ratio an outsider would measure.
* "echo (floor)": radixd's own Echo RPC with the tokens as payload.

Where the CPU scheduler puts each process moves the ratio by itself: two identical floor servers measured this
way on 2 vCPUs read 1.13-1.19 (the one started once the other served was the slower one). So the timed single-client part runs
pinned, the client on one CPU and both servers together on another, and the run first measures an identical
copy of the floor against the floor (`copy_vs_bare_p50`, the method's own bias; about 1.00 pinned). `--no-pin`
measures unpinned; the concurrent-clients part always runs unpinned.

    python bench/service_bench.py [--requests 2000] [--clients 4] [--seconds 3] [--no-pin]
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


def paired(a, b, n: int, seed: int) -> tuple[list, list]:
    """n calls of each, a(i) and b(i) back to back, each pair in random order (neither always goes first)."""
    out_a, out_b = [], []
    for i, a_first in enumerate(np.random.default_rng(seed).random(n) < 0.5):
        first, second = (a, b) if a_first else (b, a)
        t0 = time.perf_counter()
        first(i)
        t1 = time.perf_counter()
        second(i)
        t2 = time.perf_counter()
        out_a.append(t1 - t0 if a_first else t2 - t1)
        out_b.append(t2 - t1 if a_first else t1 - t0)
    return out_a, out_b


def floor_wire(c: CacheClient, reqs: list) -> list[bytes]:
    """Per request, what the floor is sent: radixd's response size, then radixd's exact request bytes."""
    from radixd.client import codec
    wire = []
    for r in reqs:
        req = codec.match_request(c.session_id, [r], False, "", "")
        resp = c._stub.MatchPrefix(req)
        wire.append(len(resp.SerializeToString()).to_bytes(4, "little") + req.SerializeToString())
    return wire


def floor_call(sock: str):
    import grpc
    return grpc.insecure_channel(f"unix://{sock}").unary_unary("/bench.Floor/Call")


def pin_to(pid: int, cpus: set[int]) -> None:
    """Every thread of a process onto these CPUs (a process's affinity call moves only its main thread)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except ProcessLookupError:  # a thread that just ended
            pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--no-pin", dest="pin", action="store_false",
                    help="leave the CPU placement to the scheduler (biased: see the module docstring)")
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
    floors = [subprocess.Popen([sys.executable, __file__, "--floor-server", os.path.join(d, f"floor{k}.sock")],
                               stdout=subprocess.PIPE, text=True) for k in range(2)]
    all_cpus = os.sched_getaffinity(0)
    pin = args.pin and len(all_cpus) >= 2
    try:
        assert "ready" in server.stdout.readline()
        for f in floors:
            assert "ready" in f.stdout.readline()
        if pin:
            client_cpu, server_cpu = sorted(all_cpus)[:2]
            os.sched_setaffinity(0, {client_cpu})
            for p in (server, *floors):
                pin_to(p.pid, {server_cpu})
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
            wire = floor_wire(c, reqs)
            bare, copy = (floor_call(os.path.join(d, f"floor{k}.sock")) for k in range(2))
            for i in range(200):  # warm up
                c.echo(packed[0])
                c.match_prefix(reqs[0])
                bare(wire[i])
                copy(wire[i])
            rows = {}
            control = paired(lambda i: bare(wire[i]), lambda i: copy(wire[i]), len(reqs), 7)
            spare = floors.pop()  # the copy is done: only two servers from here on
            spare.terminate()
            spare.wait(10)
            rows["bare floor"], rows["MatchPrefix vs bare"] = paired(lambda i: bare(wire[i]),
                                                                     lambda i: c.match_batch([reqs[i]]), len(reqs), 11)
            rows["in-process tree"] = timed(lambda ch: tree.match_prefix(ch[0]), packed)
            rows["echo (floor)"] = timed(lambda ch: c._stub.Echo(pb.EchoRequest(payload=ch[0])), packed)
            rows["MatchPrefix x1"] = timed(lambda ch: c.match_batch(ch), reqs)
            rows["MatchPrefix x8"] = timed(lambda ch: c.match_batch(ch), reqs, 8)
            rows["MatchPrefix x64"] = timed(lambda ch: c.match_batch(ch), reqs, 64)
        if pin:
            os.sched_setaffinity(0, all_cpus)
            pin_to(server.pid, all_cpus)
        procs = [subprocess.Popen([sys.executable, __file__, "--worker", target, "--seconds", str(args.seconds)],
                                  stdout=subprocess.PIPE, text=True) for _ in range(args.clients)]
        done = sum(int(p.communicate()[0].strip().splitlines()[-1]) for p in procs)
    finally:
        for p in (server, *floors):
            p.terminate()
            p.wait(10)
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
    bias = pct(control[1])[0] / pct(control[0])[0]
    print(f"pinned: {'client on one CPU, both servers on another' if pin else 'no'}; an identical copy of the floor "
          f"against the floor: {bias:.2f}")
    print(f"RESULT match_vs_bare_p50={bare:.2f} (goal <= 1.25) copy_vs_bare_p50={bias:.2f} match_vs_echo_p50={m1:.2f} "
          f"batched64_vs_inprocess={b64:.2f} (goal <= 2)")


if __name__ == "__main__":
    main()
