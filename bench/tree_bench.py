"""Tree benchmark: radixd's RadixTree vs SGLang's RadixCache on the identical operation sequence.

Each implementation runs in its own worker process (so memory is measured cleanly), possibly under a
different interpreter (SGLang usually lives in its own venv: --sglang-python /path/to/python).
Workloads: synthetic multi-turn conversations (page 1 and 16) and replays of ../shared/traces/*.jsonl.

    python bench/tree_bench.py [--sglang-python PY] [--conversations 1000] [--trace-requests 500] [--rounds 3]
                               [--write-policy write_through|write_through_selective|write_back] [--events]
                               [--heap-retain-mb MiB] [--no-prefault]
    python bench/tree_bench.py --events-cost RUNS [--publisher thread|inline|after]
        # radixd alone: KV events off vs on (request-path cost)
    python bench/tree_bench.py --events-instructions
        # the same question without the machine's noise: instructions executed, counted by valgrind

Every worker keeps the server's freed heap and, unless --no-prefault, faults it in before the timed operations (as
`radixd serve --prefault`): the trees' growth then costs memcpy, not this machine's page faults.

With --write-policy the host tier is on: every backup the tree asks for is committed and finished inline
(no data is copied), so the numbers show the tree's own cost of the second tier.

Beside SGLang's RadixCache it runs SGLang's UnifiedRadixCache on the seeds' compiled Rust tree core
(`tree_core_backend="rust"`, FULL only) on the same operations: the "x rust" column.

Each round runs every implementation on a workload back to back (their order turned each round), so each ratio
compares runs taken seconds apart; a workload's ratio is the median of its rounds' ratios.
ops/s is the mean op time less the timer's own floor (an empty timed interval, measured by each worker).
Last line: RESULT insert_x=.. match_x=.. lock_x=.. evict_x=.. mem_x=.. and the same against Rust as *_x_rust, each
the worst workload's ratio (radixd ops/s over the reference's; mem: radixd's bytes over the reference's)
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from radixd.server.config import Config

HERE = Path(__file__).resolve().parent
TRACES = [HERE.parent.parent / "shared" / "traces", HERE.parent / "shared" / "traces"]
VOCAB = 32000
BLOCK = 512


# ------------------------------------------------------------------ workloads (deterministic)
def synthetic(n_conv: int, seed: int = 7):
    """Shared system prompts, growing conversations. Returns ops: list of (kind, tokens)."""
    rng = np.random.default_rng(seed)
    systems = [rng.integers(0, VOCAB, int(rng.integers(500, 1500)), dtype=np.int32) for _ in range(10)]
    convs = []
    for _ in range(n_conv):
        parts = [systems[int(rng.integers(len(systems)))]]
        ends_user, ends_reply = [], []
        for _ in range(int(rng.integers(2, 6))):
            parts.append(rng.integers(0, VOCAB, int(rng.integers(30, 300)), dtype=np.int32))
            ends_user.append(sum(map(len, parts)))
            parts.append(rng.integers(0, VOCAB, int(rng.integers(30, 300)), dtype=np.int32))
            ends_reply.append(sum(map(len, parts)))
        convs.append((np.concatenate(parts), ends_user, ends_reply))
    ops = []
    for t in range(5):  # round-robin over conversations, one turn at a time
        for toks, eu, er in convs:
            if t < len(er):
                ops.append(("match_cont", toks[:eu[t]]))
                ops.append(("insert", toks[:er[t]]))
    for _ in range(n_conv):
        s = systems[int(rng.integers(len(systems)))]
        ops.append(("match_new", np.concatenate([s[:int(rng.integers(50, len(s)))],
                                                 rng.integers(0, VOCAB, 200, dtype=np.int32)])))
    return ops


def _trace_file(name: str) -> Path:
    for root in TRACES:
        if (root / name).exists():
            return root / name
    raise FileNotFoundError(name)


def trace(name: str, n_req: int):
    """Mooncake trace: each 512-token block id expands to deterministic pseudo-random tokens."""
    blocks: dict[int, np.ndarray] = {}
    ops = []
    with open(_trace_file(name)) as f:
        for i, line in enumerate(f):
            if i >= n_req:
                break
            req = json.loads(line)
            parts = []
            for b in req["hash_ids"]:
                if b not in blocks:
                    blocks[b] = np.random.default_rng(b).integers(0, VOCAB, BLOCK, dtype=np.int32)
                parts.append(blocks[b])
            toks = np.concatenate(parts)[:req["input_length"]]
            ops.append(("match_cont", toks))
            ops.append(("insert", toks))
    return ops


def workloads(args):
    wl = [("synthetic-p1", 1, lambda: synthetic(args.conversations)),
          ("synthetic-p16", 16, lambda: synthetic(args.conversations))]
    for name in ("conversation_trace.jsonl", "synthetic_trace.jsonl"):
        try:
            _trace_file(name)
        except FileNotFoundError:
            continue
        wl.append((f"trace-{name.split('_')[0]}-p16", 16, lambda n=name: trace(n, args.trace_requests)))
    return wl


# ------------------------------------------------------------------ adapters
class RadixdImpl:
    def __init__(self, page: int, write_policy: str | None = None, events: bool = False, publisher: str = "thread"):
        from radixd.server.tree import RadixTree
        self.inline = publisher == "inline"
        self.deferred = publisher == "after"
        kw = {"write_policy": write_policy} if write_policy else {}
        if events:
            kw["events"] = True
        self.t = RadixTree(page_size=page, **kw)
        self.drain = self._take if events else (lambda: None)
        self.host_slot = 0
        self.published = [0, 0]  # pages, ns: what the publisher thread did, off the request path
        if events:
            import queue
            import threading
            self._q: "queue.SimpleQueue" = queue.SimpleQueue()
            if not self.inline and not self.deferred:
                self._pub = threading.Thread(target=self._publisher, daemon=True)
                self._pub.start()

    def _take(self):
        records, _ = self.t.take_records()  # what the server does after every RPC, on the request path
        if records:
            self._q.put(records)

    def after(self):
        """Untimed, between operations: the server publishes after it answered (inline mode)."""
        if self.inline and hasattr(self, "_q"):
            while not self._q.empty():
                self._publish_one(self._q.get())

    def _publish_one(self, records) -> None:
        """What the server's publisher thread does with one RPC's records (server/events.py)."""
        from radixd.server.events import native_payload
        t0 = time.perf_counter_ns()
        raw = self.t.raw_events(records)
        if native_payload(raw, 0.0) is None:  # without the native encoder: hash and build Python events
            raw.materialize()
        self.published[1] += time.perf_counter_ns() - t0
        if self.inline or self.deferred:  # counted where nothing is timed: beside the operations it would hold the GIL
            self.published[0] += sum(r[1][2] - r[1][1] if r[0] == 0 else
                                     sum(sp[2] - sp[1] for sp in r[1]) if r[0] == 1 else 0 for r in raw.records)

    def _publisher(self):
        """The server's publisher thread: hash the pages and build the events, beside the request path."""
        while True:
            raw = self._q.get()
            if raw is None:
                return
            self._publish_one(raw)

    def publish_done(self) -> tuple[int, int]:
        """Wait for the publisher to finish; (pages, ns) it handled."""
        if self.deferred and hasattr(self, "_q"):  # the publisher's work, done only now that the timing is over
            while not self._q.empty():
                self._publish_one(self._q.get())
        if hasattr(self, "_pub"):
            self._q.put(None)
            self._pub.join()
        return self.published[0], self.published[1]

    # Each side's key is built fresh before its timed call, as SGLang's adapter builds its RadixKey and as the server
    # decodes a request's tokens just received: neither side reads a key last touched when the workload was made.
    def prep(self, toks, start):
        return toks.copy(), np.arange(start, start + len(toks), dtype=np.int32)

    def prep_key(self, toks):
        return toks.copy()

    def insert(self, k, v):
        r = self.t.insert(k, v)
        for a in getattr(r, "backups", ()):  # host tier on: what the engine does, minus the copy itself
            self._backup(a)
        self.drain()

    def _backup(self, a) -> int:
        self.t.commit_backup(a.ack, np.arange(self.host_slot, self.host_slot + a.tokens, dtype=np.int32))
        self.host_slot += a.tokens
        return int(self.t.finish_backup(a.ack).device.size)  # write-back: demoted once the copy is done

    def match(self, k):
        return self.t.match_prefix(k).node_id

    def lock_unlock(self, node):
        self.t.unlock(self.t.lock(node))

    def evict(self, n):
        r = self.t.evict(n)
        n = r.evicted_tokens + sum(self._backup(a) for a in getattr(r, "write_backs", ()))
        self.drain()
        return n

    def cached(self):
        return self.t.cached_tokens


class _MockAllocator:
    device = "cpu"

    def free(self, *a, **k):
        pass

    def free_segment(self, *a, **k):
        pass


def _stub_torchvision():
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from tests.sglang_cpu import stub_torchvision
    stub_torchvision()


class SGLangImpl:
    """SGLang's RadixCache, or (core="rust") its UnifiedRadixCache on the seeds' compiled Rust tree core, FULL only,
    as SGLang ships it."""

    def __init__(self, page: int, events: bool = False, core: str | None = None):
        import warnings
        warnings.filterwarnings("ignore")
        _stub_torchvision()
        import torch
        from array import array
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
        from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey
        self.torch, self.array, self.Key = torch, array, RadixKey
        self.IP, self.MP, self.EP = InsertParams, MatchPrefixParams, EvictParams
        if core is None:
            self.c = RadixCache.create_simulated(mock_allocator=_MockAllocator(), page_size=page,
                                                 enable_kv_cache_events=events)
        else:
            from sglang.srt.mem_cache.cache_init_params import CacheInitParams
            from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
            from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
            from sglang.srt.runtime_context import publish
            from sglang.srt.server_args import ServerArgs
            publish(ServerArgs(model_path="dummy", device="cpu"), role="scheduler")
            alloc = _MockAllocator()
            alloc.page_size = page
            self.c = UnifiedRadixCache(CacheInitParams(
                disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=alloc, page_size=page,
                enable_kv_cache_events=events, tree_components=(ComponentType.FULL,), tree_core_backend=core))
            assert type(self.c.tree_core).__name__.startswith("Rust"), type(self.c.tree_core)
        self.drain = self.c.take_events if events else (lambda: None)

    def publish_done(self) -> tuple[int, int]:  # SGLang hashes inside its operations: nothing is left
        return 0, 0

    def prep(self, toks, start):
        return (self.Key(self.array("q", toks.astype(np.int64).tobytes())),
                self.torch.arange(start, start + len(toks), dtype=self.torch.int64))

    def prep_key(self, toks):
        return self.Key(self.array("q", toks.astype(np.int64).tobytes()))

    def insert(self, k, v):
        self.c.insert(self.IP(key=k, value=v))
        self.drain()

    def match(self, k):
        return self.c.match_prefix(self.MP(key=k)).last_device_node

    def lock_unlock(self, node):
        r = self.c.inc_lock_ref(node)
        self.c.dec_lock_ref(node, r.to_dec_params())

    def evict(self, n):
        n = self.c.evict(self.EP(num_tokens=n)).num_tokens_evicted
        self.drain()
        return n

    def cached(self):
        return self.c.evictable_size() + self.c.protected_size()


def used_bytes() -> int:
    """Resident memory less the C heap's free bytes: what objects hold, whether or not the heap was faulted in."""
    from radixd.server.memory import heap_free_bytes
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return rss - (heap_free_bytes() or 0)


def run_worker(impl_name: str, only: str, args) -> dict:
    """Run one workload under one implementation in a fresh process; return per-op timings and memory."""
    out = {}
    from radixd.server.memory import retain_freed_memory
    # every implementation under the heap setting radixd serves with (--heap-retain-mb, --prefault)
    retain_freed_memory(args.heap_retain_mb << 20, prefault=args.prefault)
    for wname, page, make in workloads(args):
        if wname != only:
            continue
        ops = make()
        impl = RadixdImpl(page, args.write_policy, args.events, args.publisher) if impl_name == "radixd" else \
            SGLangImpl(page, args.events, "rust" if impl_name == "sglang-rust" else None)
        times = {"insert": [], "match_cont": [], "match_new": [], "lock_unlock": [], "evict": []}
        nodes = []
        slot = 0
        gc.collect()
        gc.disable()
        used0 = used_bytes()
        pc, tc = time.perf_counter_ns, time.thread_time_ns
        cpu = {"insert": 0, "match": 0, "evict": 0}  # this thread's CPU time: what the operations themselves did
        for kind, toks in ops:
            if kind == "insert":
                k, v = impl.prep(toks, slot)
                slot += len(toks)
                c0, t0 = tc(), pc()
                impl.insert(k, v)
                times["insert"].append(pc() - t0)
                cpu["insert"] += tc() - c0
                if hasattr(impl, "after"):
                    impl.after()
            else:
                k = impl.prep_key(toks)
                c0, t0 = tc(), pc()
                node = impl.match(k)
                times[kind].append(pc() - t0)
                cpu["match"] += tc() - c0
                if kind == "match_cont":
                    nodes.append(node)
        del k
        gc.enable()
        gc.collect()
        mem = used_bytes() - used0
        cached = impl.cached()
        for node in nodes[-5000:]:
            t0 = pc()
            impl.lock_unlock(node)
            times["lock_unlock"].append(pc() - t0)
        del nodes
        while True:
            c0, t0 = tc(), pc()
            n = impl.evict(4096)
            if not n:
                break
            times["evict"].append(pc() - t0)
            cpu["evict"] += tc() - c0
            if hasattr(impl, "after"):
                impl.after()
        pub_pages, pub_ns = impl.publish_done()
        out[wname] = {"times": {k: v for k, v in times.items() if v}, "mem_bytes": mem, "cached": cached,
                      "timer_ns": timer_floor(),
                      "publish_ns": pub_ns, "publish_pages": pub_pages, "cpu": cpu}
    return out


def instructions_worker(only: str, mode: str, args) -> None:
    """One workload's operations, untimed, for callgrind to count: "base" only builds the workload (and the slot
    arrays), "off" and "on" run it with events off or on, the records taken after every operation as the server
    takes them after every RPC and then dropped (hashing them is the publisher's work, not the tree's). The
    garbage collector stays on, as in the server."""
    for wname, page, make in workloads(args):
        if wname != only:
            continue
        ops, slot = [], 0
        for kind, toks in make():
            ops.append((kind, toks, np.arange(slot, slot + len(toks), dtype=np.int32) if kind == "insert" else None))
            slot += len(toks) if kind == "insert" else 0
        if mode == "base":
            return
        impl = RadixdImpl(page, events=mode == "on", publisher="after")
        take = impl.t.take_records
        impl.drain = take
        for kind, toks, vals in ops:
            if kind == "insert":
                impl.insert(toks, vals)
            else:
                impl.match(toks)
                take()
        while impl.evict(4096):
            pass


def events_instructions(args, base: list[str]) -> None:
    """Instructions the operations execute with events on vs off, under valgrind's callgrind (deterministic)."""
    import re
    import shutil
    if shutil.which("valgrind") is None:
        sys.exit("--events-instructions needs valgrind (apt-get install valgrind)")
    env = {**os.environ, "PYTHONHASHSEED": "0", "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}

    def count(wname: str, mode: str) -> int:
        r = subprocess.run(["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", sys.executable, *base,
                            "--instructions-worker", wname, "--mode", mode], capture_output=True, text=True, env=env)
        m = re.search(r"Collected\s*:\s*(\d+)", r.stderr)
        if r.returncode or m is None:
            sys.exit(f"callgrind failed on {wname} {mode}:\n{r.stderr[-3000:]}")
        return int(m.group(1))

    print(f"{'workload':22} {'off Minstr':>11} {'on Minstr':>10} {'on/off':>7}   (the operations alone: each count "
          "less a run that only builds the workload)")
    worst = 0.0
    for wname, _, _ in workloads(args):
        b, off, on = (count(wname, m) for m in ("base", "off", "on"))
        x = (on - b) / (off - b)
        worst = max(worst, x)
        print(f"{wname:22} {(off - b) / 1e6:11.1f} {(on - b) / 1e6:10.1f} {x:7.3f}", flush=True)
    print(f"RESULT events_instructions_x={worst:.3f}")


def timer_floor(n: int = 20000) -> float:
    """Mean ns an empty timed interval reads (two perf_counter_ns calls and a list append, as every timed op pays):
    about 140-190 ns on this VM, 15% of a 1 us lock+unlock. It is no part of either implementation's work."""
    pc, t = time.perf_counter_ns, []
    for _ in range(n):
        t0 = pc()
        t.append(pc() - t0)
    return float(np.mean(t))


def summarize(ns: list[int], floor_ns: float = 0.0) -> dict:
    """ops/s from the mean op time less the timer's floor (the percentiles are as read)."""
    a = np.array(ns, dtype=np.float64) / 1e3
    return {"ops_s": 1e6 / max(a.mean() - floor_ns / 1e3, 1e-3), "p50": float(np.percentile(a, 50)),
            "p99": float(np.percentile(a, 99)), "n": len(a)}


def find_sglang_python(explicit: str | None) -> str | None:
    cands = [explicit, os.environ.get("RADIXD_SGLANG_PYTHON"), sys.executable]
    for py in filter(None, cands):
        r = subprocess.run([py, __file__, "--probe"], capture_output=True)
        if r.returncode == 0:
            return py
        if py == explicit:
            print(f"note: {py} cannot import sglang:\n{r.stderr.decode()[-500:]}", file=sys.stderr)
    return None


def events_cost(args, base: list[str]) -> None:
    """What KV events cost: the same radixd run with events off and on, interleaved. "tree": the tree's own
    recording on the request path (the publisher's work done after the timed run); then with the publisher
    beside the operations as the server runs it (--publisher thread, or between operations with inline)."""
    def run(wname: str, publisher: str | None) -> dict:
        cmd = [sys.executable, *base, "--worker", "radixd", "--workload", wname]
        cmd += ["--events", "--publisher", publisher] if publisher else []
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode:
            sys.exit(f"worker failed on {wname}:\n{r.stderr[-3000:]}")
        return json.loads(r.stdout.strip().splitlines()[-1])[wname]

    modes = ["after"] + ([args.publisher] if args.publisher != "after" else [])
    ops = ("insert", "match", "evict", "all")
    print(f"{'workload':22} {'op':8} {'off ms':>8} " + " ".join(f"{m + ' ms':>10} {m + '/off':>11} {'cpu':>6}"
                                                              for m in modes) + f" {'off/off':>8}")
    print(f"  (medians of {args.events_cost} interleaved runs off, {', '.join(modes)}, off; after = the tree's own "
          "recording, its publisher's work done after the timed run; off/off is the noise floor; cpu: the "
          "operating thread's own CPU time, on/off)")
    worst: dict[tuple, float] = {}
    pub = []
    for wname, _, _ in workloads(args):
        ratios = {(m, op): [] for m in modes for op in ops}
        cpu = {(m, op): [] for m in modes for op in ops}
        null = {op: [] for op in ops}
        ms: dict[tuple, list] = {}
        for _ in range(args.events_cost):
            sums, cpus = {}, {}
            for k in ["off0", *modes, "off1"]:
                w = run(wname, None if k.startswith("off") else k)
                t = w["times"]
                cpus[k] = dict(w["cpu"], all=sum(w["cpu"].values()))
                sums[k] = {"insert": sum(t["insert"]), "match": sum(t["match_cont"]) + sum(t.get("match_new", [])),
                           "evict": sum(t["evict"])}
                sums[k]["all"] = sum(sums[k].values())
                if not k.startswith("off") and w["publish_pages"]:
                    pub.append(w["publish_ns"] / w["publish_pages"])
            for op in ops:
                off = (sums["off0"][op] + sums["off1"][op]) / 2
                coff = (cpus["off0"][op] + cpus["off1"][op]) / 2
                null[op].append(sums["off1"][op] / sums["off0"][op])
                ms.setdefault(("off", op), []).append(off / 1e6)
                for m in modes:
                    ratios[(m, op)].append(sums[m][op] / off)
                    cpu[(m, op)].append(cpus[m][op] / coff)
                    ms.setdefault((m, op), []).append(sums[m][op] / 1e6)
        for op in ops:
            cells = []
            for m in modes:
                med = float(np.median(ratios[(m, op)]))
                worst[(m, op)] = max(worst.get((m, op), 0.0), med)
                cells.append(f"{np.median(ms[(m, op)]):10.1f} {med:11.3f} {float(np.median(cpu[(m, op)])):6.3f}")
            print(f"{wname:22} {op:8} {np.median(ms[('off', op)]):8.1f} " + " ".join(cells) +
                  f" {float(np.median(null[op])):8.3f}")
    from radixd.server.events import NATIVE
    print(f"publisher ({'native' if NATIVE else 'Python'} encoder): {np.median(pub):.0f} ns per page hashed and encoded")
    res = " ".join(f"events_{op}_x={worst[('after', op)]:.3f}" for op in ops if op != "all")
    res += f" events_total_x={worst[('after', 'all')]:.3f}"
    for m in modes[1:]:
        res += f" events_total_{m}_x={worst[(m, 'all')]:.3f}"
    print(f"RESULT {res} publish_ns_per_page={np.median(pub):.0f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sglang-python", help="interpreter that can import sglang (default: auto-detect)")
    ap.add_argument("--conversations", type=int, default=1000)
    ap.add_argument("--trace-requests", type=int, default=500)
    ap.add_argument("--rounds", type=int, default=3,
                    help="rounds of every implementation on every workload; the ratios are medians over them")
    ap.add_argument("--write-policy", choices=["write_through", "write_through_selective", "write_back"],
                    help="run radixd with the host tier on (backups committed and finished inline, no copies)")
    ap.add_argument("--events", action="store_true", help="KV events on in both caches (drained after each op)")
    ap.add_argument("--events-cost", type=int, metavar="RUNS",
                    help="instead: radixd alone, events off vs on, RUNS interleaved runs per workload (medians)")
    ap.add_argument("--publisher", choices=["thread", "inline", "after"], default="thread",
                    help="where radixd's events are hashed: a publisher thread beside the operations (the "
                         "server's way), between operations (untimed), or after the whole timed run (what the "
                         "tree's own recording costs, with no publisher work anywhere near the operations); "
                         "--events-cost always measures after, and this mode beside it")
    ap.add_argument("--events-instructions", action="store_true",
                    help="instead: instructions the operations execute with events on vs off (needs valgrind)")
    ap.add_argument("--heap-retain-mb", type=int, default=Config().heap_retain_mb,
                    help="freed heap every worker keeps for reuse, as `radixd serve --heap-retain-mb` (default: the "
                         "server's; 0: glibc's defaults)")
    ap.add_argument("--no-prefault", dest="prefault", action="store_false",
                    help="leave the kept heap cold: new edges' memory is faulted in during the timed operations "
                         "(default: faulted in at start, as `radixd serve --prefault`)")
    ap.add_argument("--worker", choices=["radixd", "sglang", "sglang-rust"], help=argparse.SUPPRESS)
    ap.add_argument("--instructions-worker", help=argparse.SUPPRESS)
    ap.add_argument("--mode", choices=["base", "off", "on"], help=argparse.SUPPRESS)
    ap.add_argument("--workload", help=argparse.SUPPRESS)
    ap.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.probe:
        _stub_torchvision()
        import sglang.srt.mem_cache.radix_cache  # noqa: F401
        return
    if args.worker:
        print(json.dumps(run_worker(args.worker, args.workload, args)))
        return
    if args.instructions_worker:
        return instructions_worker(args.instructions_worker, args.mode, args)
    base = [__file__, "--conversations", str(args.conversations), "--trace-requests", str(args.trace_requests)]
    if args.events_cost:
        return events_cost(args, base)
    if args.events_instructions:
        return events_instructions(args, base)
    base += ["--publisher", args.publisher, "--heap-retain-mb", str(args.heap_retain_mb)]
    base += [] if args.prefault else ["--no-prefault"]
    if args.write_policy:
        base += ["--write-policy", args.write_policy]
    if args.events:
        base += ["--events"]
    sgl = find_sglang_python(args.sglang_python)
    if sgl is None:
        print("SGLang is not importable: printing radixd's numbers only (see shared/peers/README.md)")
    impls = [(i, py) for i, py in (("radixd", sys.executable), ("sglang", sgl), ("sglang-rust", sgl)) if py]
    rounds: list[dict[str, dict]] = []
    for rnd in range(args.rounds):
        results: dict[str, dict] = {}
        for wname, _, _ in workloads(args):
            # each workload's implementations back to back, their order turned each round: this machine's speed
            # drifts over minutes, and a ratio of runs taken seconds apart cancels most of the drift
            k = rnd % len(impls)
            for impl, py in impls[k:] + impls[:k]:
                r = subprocess.run([py, *base, "--worker", impl, "--workload", wname], capture_output=True, text=True)
                if r.returncode:
                    sys.exit(f"{impl} worker failed on {wname}:\n{r.stderr[-3000:]}")
                results.setdefault(impl, {}).update(json.loads(r.stdout.strip().splitlines()[-1]))
        rounds.append(results)
    report(rounds, args)


def report(rounds: list[dict[str, dict]], args) -> None:
    """Print each workload's ops and memory (the median round) and the RESULT line: per phase, the worst workload's
    median over the rounds of radixd's ops/s over the reference's."""
    refs = [r for r in ("sglang", "sglang-rust") if r in rounds[0]]
    print(f"every worker keeps {args.heap_retain_mb} MiB of freed heap, " +
          ("faulted in at start (radixd serve --heap-retain-mb N --prefault)" if args.prefault else
           "cold (radixd serve --heap-retain-mb N, no --prefault)") +
          f"; {len(rounds)} rounds, each implementation once per workload per round (medians over the rounds)")
    floors = [w["timer_ns"] for res in rounds for impl in res.values() for w in impl.values()]
    print(f"ops/s: each worker's mean op time less its timer floor (an empty timed interval: "
          f"{min(floors):.0f}-{max(floors):.0f} ns); p50/p99 as read")
    ratios: dict[str, dict[str, list[float]]] = {r: {"insert": [], "match": [], "lock": [], "evict": [], "mem": []}
                                                 for r in refs}
    spread: dict[str, dict[str, list[tuple[float, float]]]] = {r: {k: [] for k in ratios[r]} for r in refs}
    print(f"{'workload':22} {'op':12} {'impl':11} {'ops/s':>11} {'p50 us':>9} {'p99 us':>9}   {'x sglang':>8} "
          f"{'x rust':>8}   (x: median over rounds [min-max])")
    for wname in rounds[0]["radixd"]:
        for op in ("insert", "match_cont", "match_new", "lock_unlock", "evict"):
            per_round = []
            for res in rounds:
                per_round.append({impl: summarize(res[impl][wname]["times"][op], res[impl][wname]["timer_ns"])
                                  for impl in res if res[impl][wname]["times"].get(op)})
            if "radixd" not in per_round[0]:
                continue
            key = {"insert": "insert", "match_cont": "match", "lock_unlock": "lock", "evict": "evict"}.get(op)
            cells = {}
            for ref in ("sglang", "sglang-rust"):
                xs = [row["radixd"]["ops_s"] / row[ref]["ops_s"] for row in per_round if ref in row]
                if xs:
                    cells[ref] = f"{float(np.median(xs)):5.2f} [{min(xs):.2f}-{max(xs):.2f}]"
                    if key:
                        ratios[ref][key].append(float(np.median(xs)))
                        spread[ref][key].append((min(xs), max(xs)))
            for impl in per_round[0]:
                med = lambda f: float(np.median([row[impl][f] for row in per_round if impl in row]))  # noqa: E731
                extra = f"   {cells.get('sglang', ''):>18} {cells.get('sglang-rust', ''):>18}" if impl == "radixd" \
                    else ""
                print(f"{wname:22} {op:12} {impl:11} {med('ops_s'):11.0f} {med('p50'):9.1f} {med('p99'):9.1f}{extra}")
        for impl in rounds[0]:
            w = rounds[0][impl][wname]  # memory does not depend on the machine's speed: the first round's
            per_m = w["mem_bytes"] / max(w["cached"], 1) * 1e6 / 2**20
            print(f"{wname:22} {'memory':12} {impl:11} {per_m:8.1f} MiB per 1M cached tokens ({w['cached']} tokens)")
        for ref in refs:
            m = [rounds[0][i][wname]["mem_bytes"] / max(rounds[0][i][wname]["cached"], 1) for i in ("radixd", ref)]
            ratios[ref]["mem"].append(m[0] / m[1])
    # the worst workload per phase: a goal holds when every workload meets it
    worst = {ref: {k: (max(v) if k == "mem" else min(v)) if v else float("nan") for k, v in r.items()}
             for ref, r in ratios.items()}
    if "sglang" in worst:
        print("RESULT " + " ".join(f"{k}_x={v:.2f}" for k, v in worst["sglang"].items()) +
              ("".join(f" {k}_x_rust={v:.2f}" for k, v in worst["sglang-rust"].items()) if "sglang-rust" in worst
               else ""))
    else:
        print("RESULT insert_x=nan match_x=nan evict_x=nan mem_x=nan")


if __name__ == "__main__":
    main()
