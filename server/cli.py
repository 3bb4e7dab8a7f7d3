"""`radixd` command line: serve, demo, stats, check, info."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from .config import DEFAULT_SOCKET

SERVE_FLAGS = [
    ("--listen", dict(action="append", help="unix:PATH or HOST:PORT (repeatable)")),
    ("--device", dict(choices=["auto", "cpu", "cuda"],
                      help="pool memory: cuda (GPU, CUDA IPC), cpu (shared memory); auto = cuda when a GPU is seen")),
    ("--gpus", dict(help="comma-separated GPU ordinals for device pools (cuda)")),
    ("--num-slots", dict(type=int, help="device pool size in tokens (or --device-mem)")),
    ("--page-size", dict(type=int, help="tokens per page; must equal the engine's page / block size")),
    ("--eviction-policy", dict(choices=["lru", "lfu", "fifo", "mru", "filo", "priority", "slru"],
                               help="which unlocked leaf is evicted first")),
    ("--layers", dict(type=int, help="model layers (or --model / --model-config)")),
    ("--kv-heads", dict(type=int, help="KV heads per layer on this engine rank")),
    ("--head-dim", dict(type=int, help="dimension of one K (or V) head")),
    ("--dtype", dict(choices=["float16", "bfloat16", "float32", "fp8_e4m3"], help="KV element type")),
    ("--mla", dict(action="store_const", const=True,
                   help="one latent buffer per layer (DeepSeek MLA) instead of K and V")),
    ("--host-slots", dict(type=int, help="host (second tier) pool size in tokens")),
    ("--host-mem", dict(help="host pool size in bytes, e.g. 200GiB (instead of --host-slots)")),
    ("--host-ratio", dict(type=float, help="host tokens = R x device tokens (instead of --host-slots)")),
    ("--write-policy", dict(choices=["write_through", "write_through_selective", "write_back"],
                            help="when device KV is copied to the host tier")),
    ("--write-through-threshold", dict(type=int, help="inserts before write_through_selective backs a node up")),
    ("--load-back-threshold", dict(type=int, help="smallest host segment (tokens) worth loading back")),
    ("--host-layout", dict(choices=["layer_first", "page_first"],
                           help="host pool layout; page_first keeps a page contiguous (L3 zero-copy)")),
    ("--bigram", dict(action="store_const", const=True, help="EAGLE bigram keys (token pairs)")),
    ("--storage", dict(help="L3 store shared by servers: file:///DIR, valkey://HOST:PORT, valkey+unix:///SOCK, "
                            "redis+cluster://HOST:PORT, mooncake://MASTER:PORT (off by default)")),
    ("--storage-write-policy", dict(choices=["write_through", "write_back"],
                                    help="copy host pages to L3 when backed up (write_through) or when evicted")),
    ("--prefetch-threshold", dict(type=int, help="tokens beyond the host prefix that make a match fetch from L3")),
    ("--prefetch-policy", dict(choices=["best_effort", "wait_complete", "timeout"],
                               help="whether a match waits for its L3 prefetch")),
    ("--prefetch-timeout-ms", dict(type=int, help="how long a match waits under --prefetch-policy timeout")),
    ("--model-id", dict(help="model name in storage keys, so servers of different models never share pages")),
    ("--kv-events", dict(action="store_const", const=True, help="record KV events (gRPC WatchEvents)")),
    ("--kv-events-endpoint", dict(help="ZMQ PUB endpoint for KV events in vLLM's wire format")),
    ("--kv-events-replay-endpoint", dict(help="ZMQ ROUTER endpoint that replays buffered KV event batches")),
    ("--kv-events-topic", dict(help="ZMQ topic of the KV event messages")),
    ("--kv-events-buffer", dict(type=int, help="KV event batches kept for replay")),
    ("--metrics-addr", dict(help="HOST:PORT of the Prometheus endpoint (port 0 picks one)")),
    ("--config", dict(help="TOML file ([radixd] table or top-level keys)")),
    ("--token", dict(help="require this bearer token")),
    ("--tls-cert", dict(help="PEM certificate for TCP listeners (with --tls-key)")),
    ("--tls-key", dict(help="PEM private key for --tls-cert")),
    ("--allow-remote", dict(action="store_const", const=True, help="listen beyond loopback without a token")),
    ("--grace-seconds", dict(type=float, help="how long a shutdown waits for calls in progress")),
    ("--lock-lease-seconds", dict(type=float, help="release a lock receipt held longer than this (hung clients; "
                                                   "off by default)")),
    ("--prefault", dict(action="store_const", const=True,
                        help="touch every pool page and the retained heap (--heap-retain-mb) at start")),
    ("--heap-retain-mb", dict(type=int, help="MiB of freed heap kept for reuse instead of returned to the kernel "
                                              "(0: the C library's default)")),
    ("--model-config", dict(help="Hugging Face config.json of the engine's model: sets --layers, --kv-heads, "
                                 "--head-dim, --dtype and --mla (explicit flags win)")),
    ("--model", dict(help="a bundled model preset for the KV geometry (e.g. llama-3.1-8b, qwen2.5-7b, deepseek-v3)")),
    ("--tp-size", dict(type=int, help="the engine's tensor-parallel size (divides the model's KV heads)")),
    ("--device-mem", dict(help="device pool size in bytes, e.g. 40GiB (instead of --num-slots)")),
    ("--hybrid-cache", dict(action="store_const", const=True,
                            help="hold a hybrid model's sliding-window KV and Mamba / linear-attention states in "
                                 "pools of their own (needs --model-config)")),
    ("--swa-ratio", dict(type=float, help="SWA pool slots = R x device slots (default 0.8)")),
    ("--mamba-states", dict(type=int, help="state slots for Mamba / linear-attention layers (default 256)")),
    ("--mamba-chunk", dict(type=int, help="tokens between state checkpoints (default: the config's chunk_size)")),
]


def _client(args):
    from radixd.client import CacheClient
    return CacheClient(args.target, token=args.token or os.environ.get("RADIXD_TOKEN"), attach=False)


class UsageError(Exception):
    """A user error: one line, exit status 2."""


def cmd_serve(args) -> None:
    import signal

    # Idle OpenMP threads (torch's host-pool gathers) must sleep, not spin: they would take the cores the request
    # path, the event publisher and the engines beside radixd need. Read when torch loads, which has not happened yet.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

    from .app import StartupError, Terminated, _step, run
    from .config import ConfigError, load

    def stopped(signum, frame):  # until the event loop takes the signals over: nothing is built yet
        raise Terminated()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stopped)
    flags = {name[2:].replace("-", "_"): getattr(args, name[2:].replace("-", "_")) for name, _ in SERVE_FLAGS}
    try:
        cfg = load(flags)
        _step("config")
        run(cfg)
    except (ConfigError, StartupError) as e:
        raise UsageError(str(e)) from None
    except Terminated:
        print("radixd: stopped by a signal during start-up; nothing was left behind", file=sys.stderr)
        sys.exit(143)


def cmd_health(args) -> None:
    """gRPC health check for probes: exit 0 when the server answers SERVING, 1 otherwise."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    target = args.target if "://" in args.target else f"unix://{args.target}"
    with grpc.insecure_channel(target) as ch:
        status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=args.timeout)
    name = health_pb2.HealthCheckResponse.ServingStatus.Name(status.status)
    print(name)
    sys.exit(0 if status.status == health_pb2.HealthCheckResponse.SERVING else 1)


def cmd_stats(args) -> None:
    print(json.dumps(_client(args).stats(), indent=2))


def cmd_info(args) -> None:
    info = _client(args).info()
    info["device_pools"] = [p.to_dict() for p in info["device_pools"]]
    for name in ("host_pool", "swa_pool", "state_pool"):
        info[name] = info[name].to_dict() if info[name] else None
    print(json.dumps(info, indent=2))


def cmd_check(args) -> None:
    bad = _client(args).check()
    print("ok" if not bad else "\n".join(bad))
    sys.exit(1 if bad else 0)


def cmd_demo(args) -> None:
    """Start a server on a private socket, run a small multi-turn workload through it, print what happened."""
    import numpy as np

    from radixd.client import CacheClient
    sock = os.path.join(tempfile.mkdtemp(prefix="radixd-demo-"), "radixd.sock")
    server = subprocess.Popen([sys.executable, "-m", "radixd.server.cli", "serve", "--listen", f"unix:{sock}",
                               "--num-slots", "32768", "--metrics-addr", "127.0.0.1:0"],
                              stdout=subprocess.PIPE, text=True)
    try:
        line = server.stdout.readline()
        if "ready" not in line:
            sys.exit(f"server did not start: {line}")
        print(line.strip())
        metrics_url = line.split("metrics=")[1].split()[0]
        with CacheClient(f"unix://{sock}", name="demo") as c:
            info = c.info()
            pools = c.map_pools()
            print(f"pools: {[p.backend + ':' + p.tier for p in info['device_pools']]} "
                  f"k_buffer[0] {tuple(pools.device[0].k_buffer[0].shape)} {pools.device[0].k_buffer[0].dtype}")
            rng = np.random.default_rng(0)
            system = rng.integers(0, 32000, 400, dtype=np.int32)
            lat = []
            for conv in range(args.conversations):
                history = system
                for turn in range(4):
                    prompt = np.concatenate([history, rng.integers(0, 32000, 60, dtype=np.int32)])
                    t0 = time.perf_counter()
                    m = c.match_prefix(prompt, lock=True)
                    lat.append(time.perf_counter() - t0)
                    new = c.alloc(len(prompt) - m.matched_len + 40)
                    full = np.concatenate([prompt, rng.integers(0, 32000, 40, dtype=np.int32)])
                    kv = np.concatenate([m.indices, new[:len(full) - m.matched_len]])
                    pools.device[0].k_buffer[0][kv[-1]] = float(turn)  # the "forward pass" writes KV
                    c.cache_finished([dict(tokens=full, indices=kv, prev_prefix_len=m.matched_len,
                                           receipt_id=m.receipt_id)])
                    c.free(new[len(full) - m.matched_len:])
                    history = full
            s = c.stats()
            bad = c.check()
            pools.close()
        lat_us = np.array(lat) * 1e6
        print(f"requests: {len(lat)}  hit rate: {s['hit_tokens_total'] / max(s['queried_tokens_total'], 1):.1%}  "
              f"MatchPrefix p50 {np.percentile(lat_us, 50):.0f} us p99 {np.percentile(lat_us, 99):.0f} us")
        print(f"cached tokens: {s['cached_tokens']}  nodes: {s['num_nodes']}  free slots: {s['free_tokens']}  "
              f"invariants: {'ok' if not bad else bad}")
        print(f"metrics: {metrics_url}")
    finally:
        server.terminate()
        server.wait(10)


def cmd_events(args) -> None:
    """One JSON line per event: {"seq", "ts", "type", ...}; notices of gaps and losses as {"notice"}."""
    from radixd.client.events import event_dicts, watch
    token = args.token or os.environ.get("RADIXD_TOKEN")
    try:
        for batch in watch(args.target, args.from_seq, args.follow, token):
            if batch.gap or batch.lost:
                print(json.dumps({"notice": batch.message, "first_seq": batch.first_seq}), flush=True)
                continue
            for ev in event_dicts(batch):
                print(json.dumps({"seq": batch.seq, "ts": batch.ts, **ev}), flush=True)
    except KeyboardInterrupt:
        pass


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (which flag, what is wrong) and exit status 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message} (see --help)\n")


def _ints(text: str) -> list[int]:
    from .config import parse_bytes
    return [int(parse_bytes(x)) if x[-1:].isalpha() else int(x) for x in text.split(",") if x]


def cmd_simulate(args) -> None:
    """Replay a trace (or a synthetic workload) through the real tree over a grid; table, CSV, plots."""
    from . import simulate as sim
    try:
        caps, pages = _ints(args.capacity), _ints(args.page)
        host_x = [float(x) for x in args.host_x.split(",") if x]
    except ValueError as e:
        raise UsageError(f"simulate: {e}") from None
    from .tree import POLICIES
    policies = [p for p in args.policy.split(",") if p]
    bad = [p for p in policies if p not in POLICIES]
    if bad or not policies:
        raise UsageError(f"simulate --policy: {bad or policies} not among {', '.join(POLICIES)}")
    if args.trace == "synthetic":
        total = args.requests or 2000
        make = lambda: sim.synthetic_requests(total)  # noqa: E731
    else:
        if not os.path.exists(args.trace):
            raise UsageError(f"simulate --trace: {args.trace} does not exist")
        with open(args.trace) as fh:
            total = sum(1 for _ in fh)
        total = min(total, args.requests) if args.requests else total
        make = lambda: sim.trace_requests(args.trace, total)  # noqa: E731
    hybrid, grid = None, {}
    if args.model_config:
        hybrid, grid = _hybrid_grid(args, host_x, policies)
    os.makedirs(args.out, exist_ok=True)
    results, timelines = sim.run_grid(make, caps, host_x, policies, pages, every=max(total // 50, 1),
                                      progress=not args.quiet, total=total, hybrid=hybrid, **grid)
    print(sim.table(results))
    csv_path = os.path.join(args.out, "simulate.csv")
    sim.write_csv(results, csv_path)
    outputs = [csv_path]
    if not args.no_plots:
        try:
            outputs += sim.plot(results, timelines, args.out)
        except ImportError:
            print("matplotlib is not installed (pip install 'radixd[plots]'): no plots", file=sys.stderr)
    print("wrote " + " ".join(outputs))


def _hybrid_grid(args, host_x: list[float], policies: list[str]) -> tuple:
    """simulate --model-config: the model's hybrid layout and the SWA / state axes of the grid."""
    from .layouts import LayoutError, model_layout, read_model_config
    from .simulate import HybridLayout
    try:
        hf, _ = read_model_config(args.model_config)
        lay = model_layout(hf)
    except (OSError, ValueError, LayoutError) as e:
        raise UsageError(f"simulate --model-config: {args.model_config}: {e}") from None
    if not lay.hybrid:
        raise UsageError(f"simulate --model-config: not a hybrid model ({lay.describe()}); leave it out")
    if any(host_x) or policies != ["lru"]:
        raise UsageError("simulate --model-config: a hybrid layout is simulated on the device, by LRU (no --host-x, "
                         "--policy)")
    try:
        ratios = [float(x) for x in args.swa_ratio.split(",") if x]
        states = _ints(args.mamba_states)
    except ValueError as e:
        raise UsageError(f"simulate: {e}") from None
    text = hf.get("text_config") or hf
    chunk = args.mamba_chunk or text.get("chunk_size") or 64
    return HybridLayout(lay.window if lay.swa_layers else None, chunk if lay.state_layers else None,
                        bool(lay.full_layers)), dict(swa_ratios=tuple(ratios), states=tuple(states))


def cmd_top(args) -> None:
    """A live view of a running server (q or Ctrl-C quits)."""
    try:
        import rich  # noqa: F401
    except ImportError:
        raise UsageError("top needs rich: pip install 'radixd[top]'") from None
    from .top import run
    c = _client(args)
    try:
        run(c, interval=args.interval, iterations=args.iterations)
    finally:
        c.close()


def main(argv: list[str] | None = None) -> None:
    ap = _Parser(prog="radixd", description="KV-cache manager for LLM serving")
    sub = ap.add_subparsers(dest="cmd", required=True)
    serve = sub.add_parser("serve", help="run the server")
    from .config import SCHEMA
    for name, kw in SERVE_FLAGS:  # values stay text here: config.load reads every source the same way
        st = SCHEMA[name[2:].replace("-", "_")]
        kw = {k: v for k, v in kw.items() if k not in ("type", "choices")}
        if st.choices:
            kw["help"] = f"{kw['help']} ({', '.join(st.choices)})"
        serve.add_argument(name, default=None, **kw)
    serve.set_defaults(fn=cmd_serve)
    demo = sub.add_parser("demo", help="start a server and run a short demo client against it")
    demo.add_argument("--conversations", type=int, default=20)
    demo.set_defaults(fn=cmd_demo)
    simp = sub.add_parser("simulate", help="what-if replay of a trace through the tree over a grid of settings")
    simp.add_argument("--trace", default="synthetic", help="Mooncake-format JSONL trace, or 'synthetic'")
    simp.add_argument("--requests", type=int, default=0, help="replay at most this many requests")
    simp.add_argument("--capacity", default="65536,262144,1048576", help="device capacities in tokens (comma list)")
    simp.add_argument("--host-x", default="0", help="host tier sizes as multiples of the device (comma list)")
    simp.add_argument("--policy", default="lru", help="eviction policies (comma list)")
    simp.add_argument("--page", default="16", help="page sizes (comma list)")
    simp.add_argument("--model-config", default="", help="a hybrid model's config.json: simulate its SWA pool and "
                      "state slots (the grid's --swa-ratio and --mamba-states)")
    simp.add_argument("--swa-ratio", default="0.125,0.5", help="hybrid: SWA pool sizes as multiples of the device "
                      "capacity (comma list)")
    simp.add_argument("--mamba-states", default="64,256", help="hybrid: state slots (comma list)")
    simp.add_argument("--mamba-chunk", type=int, default=0, help="hybrid: state checkpoint interval (default: the "
                      "config's chunk_size, else 64)")
    simp.add_argument("--out", default="radixd-simulate", help="folder for the CSV and the plots")
    simp.add_argument("--no-plots", action="store_true")
    simp.add_argument("--quiet", action="store_true", help="no progress bar")
    simp.set_defaults(fn=cmd_simulate)
    for name, fn, help_ in (("stats", cmd_stats, "print server statistics"), ("info", cmd_info, "print pools"),
                            ("check", cmd_check, "run the server's invariant checker"),
                            ("events", cmd_events, "print KV events as JSON lines"),
                            ("health", cmd_health, "gRPC health check for probes (exit 0 = serving)"),
                            ("top", cmd_top, "live view: hit rate, pools, RPC rates and latency (q quits)")):
        p = sub.add_parser(name, help=help_)
        if name == "top":
            p.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes")
            p.add_argument("--iterations", type=int, default=0, help="print this many frames and exit (headless)")
        if name == "health":
            p.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for an answer")
        if name == "events":
            p.add_argument("--from", dest="from_seq", type=int, default=0, help="replay from this sequence number")
            p.add_argument("--follow", action="store_true", help="keep printing live events")
        p.add_argument("--target", default=os.environ.get("RADIXD_TARGET", DEFAULT_SOCKET.replace("unix:", "unix://")))
        p.add_argument("--token", default=None)
        p.set_defaults(fn=fn)
    args = ap.parse_args(argv)
    try:
        args.fn(args)
    except UsageError as e:
        print(f"radixd: {e}", file=sys.stderr)
        sys.exit(2)
    except Exception as e:  # an unreachable server: one line, not a traceback
        import grpc
        from radixd.client import RadixdError
        if not isinstance(e, (RadixdError, grpc.RpcError)) or args.cmd == "serve":
            raise
        detail = e.details() if isinstance(e, grpc.RpcError) else str(e)
        print(f"radixd {args.cmd}: cannot get an answer from {args.target}: {detail}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
