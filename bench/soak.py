"""A day of production in minutes: real processes against one radixd for a set time, faults injected at seeded
random times, everything checked as it runs.

    python bench/soak.py [--minutes 30] [--workers 3] [--seed 1] [--engine auto|on|off] [--json OUT]

Traffic: worker processes replay ../shared/traces through the client API the connectors use (MatchPrefix with a
lock, LoadBack, Alloc, KV bytes written into the mapped pool, CacheFinished), every page's bytes derived from its
tokens and the pages before it, so every hit any worker reads back is verified; a real vLLM CPU engine with the
connector (when .venv-vllm exists) generating a fixed prompt set whose greedy tokens must never change; a host
tier and a Valkey L3 store; a BlockIndex following radixd's events, compared with MatchPrefix at the end.

Faults, each kind at least once, in a seeded order: SIGKILL of a worker in mid-request; SIGSTOP of a worker past
the lock lease, then SIGCONT; SIGKILL of the engine in mid-generate and a restart; the device pool full (a client
holding every free slot); a slow store (Valkey stopped for seconds); SIGKILL and restart of the store; a burst of
malformed requests; SIGKILL of radixd and a restart on the same socket.

Checked: no byte of a hit differs from what was written; the engine's tokens never change; the invariant checker
and slot conservation after every fault; once every client is gone nothing is locked, held, attached, mapped or
open in radixd beyond what it had before they came; the hit rate back to its level after each fault (the time
it took); MatchPrefix p50/p99 per minute; radixd's RSS and descriptors over time (their slopes); the errors
clients saw, by kind. Exit status 1 on any lost byte, changed token, leak, failed check or unrecovered hit rate.
Last line: RESULT ok=<0|1> ... .
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))  # tests/stores.py: the Valkey server the tests use
from tests.conftest import ServerProc  # noqa: E402  (the tests' radixd child process)
from trace_replay import requests  # noqa: E402

PAGE = 32  # the engine's block (tests/vllm_engine.py): every client shares its KV geometry
MAX_PROMPT = 4096  # a trace prompt is cut here, so that a prompt fits beside what the others hold
LEASE = 2.0  # --lock-lease-seconds: a stopped client's locks go after this


# ------------------------------------------------------------------------------------------------ page bytes
def page_words(tokens: np.ndarray, start: int, end: int, layer: int, width: int) -> np.ndarray:
    """The int32 words of K at positions [start, end) of `tokens` for one layer, `width` per token: each page's
    chain digest (its tokens and every page before), the position, the token and the layer, so that a page holds
    bytes only these tokens at this place could have written (V is their complement)."""
    pages = -(-end // PAGE)
    d, digests = b"", np.zeros((pages, 2), np.uint32)
    raw = np.ascontiguousarray(tokens[:pages * PAGE], dtype="<i4").tobytes()
    for p in range(pages):
        d = hashlib.blake2b(d + raw[p * PAGE * 4:(p + 1) * PAGE * 4], digest_size=8).digest()
        digests[p] = np.frombuffer(d, "<u4")
    pos = np.arange(start, end)
    base = np.stack([digests[pos // PAGE, 0].view(np.int32), digests[pos // PAGE, 1].view(np.int32),
                     pos.astype(np.int32), tokens[start:end].astype(np.int32),
                     np.full(end - start, layer, np.int32)], axis=1)
    cols = np.arange(width)
    return base[:, cols % 5] ^ (cols * 0x9E3779B1 & 0x7FFFFFFF).astype(np.int32)


class Pages:
    """A worker's int32 views of radixd's device pool: write a request's new pages, verify a hit's."""

    def __init__(self, client):
        self.pools = client.map_pools(host=False)
        dev = self.pools.device[0]
        self.k = [t.view(-1, t.shape[1] * t.shape[2]).numpy().view(np.int32) for t in dev.k_buffer]
        self.v = [t.view(-1, t.shape[1] * t.shape[2]).numpy().view(np.int32) for t in dev.v_buffer]
        self.width = self.k[0].shape[1]

    def write(self, slots: np.ndarray, tokens: np.ndarray, start: int) -> None:
        for layer in range(len(self.k)):
            w = page_words(tokens, start, start + len(slots), layer, self.width)
            self.k[layer][slots] = w
            self.v[layer][slots] = ~w

    def bad(self, slots: np.ndarray, tokens: np.ndarray) -> int:
        """Tokens of a hit (slots for tokens[:len(slots)]) whose bytes are not what their tokens wrote."""
        wrong = np.zeros(len(slots), bool)
        for layer in range(len(self.k)):
            w = page_words(tokens, 0, len(slots), layer, self.width)
            wrong |= (self.k[layer][slots] != w).any(axis=1) | (self.v[layer][slots] != ~w).any(axis=1)
        return int(wrong.sum())


# ---------------------------------------------------------------------------------------------------- worker
def worker(args) -> None:
    """One client process: trace requests in a loop until killed; a JSON line per request on stdout."""
    from radixd.client import CacheClient
    from radixd.client.errors import NotFound, RadixdError, ServerRestarted, Unavailable

    reqs = [r[:MAX_PROMPT] for r in requests(args.trace, args.requests)]
    rng = random.Random(args.seed)
    out = sys.stdout
    c = pages = None
    i = rng.randrange(len(reqs))

    def emit(**rec) -> None:
        out.write(json.dumps(dict(t=time.time(), w=args.worker, **rec)) + "\n")
        out.flush()

    while True:
        if c is None:
            try:
                c = CacheClient(args.target, name=f"soak-{args.worker}", timeout=10)
                pages = Pages(c)
            except (RadixdError, OSError) as e:
                emit(err=type(e).__name__)
                c = pages = None
                time.sleep(0.2)  # radixd is restarting: try again shortly
                continue
        i = (i + 1 + (rng.random() < 0.2) * rng.randrange(50)) % len(reqs)  # mostly in trace order
        toks = reqs[i]
        receipt, held = 0, None
        try:
            t0 = time.perf_counter()
            m = c.match_prefix(toks, lock=True)
            ms = (time.perf_counter() - t0) * 1000
            prefix, receipt = m.indices, m.receipt_id
            if m.host_hit_len:
                lb = c.load_back(receipt)
                if lb.loaded_len:
                    done, failed = c.wait_transfers([lb.transfer_id])
                    if failed:
                        emit(err="LoadBackFailed")
                prefix, receipt = lb.indices, lb.receipt_id
            wrong = pages.bad(prefix, toks) if len(prefix) else 0
            need = len(toks) - len(prefix)
            held = c.alloc(need)
            pages.write(held[:need], toks, len(prefix))
            c.cache_finished([dict(tokens=toks, indices=np.concatenate([prefix, held[:need]]),
                                   prev_prefix_len=len(prefix), receipt_id=receipt)])
            if len(held) > need:
                c.free(held[need:])
            receipt, held = 0, None
            emit(n=len(toks), hit=len(prefix), dev=m.matched_len, ms=ms, bad=wrong)
        except (ServerRestarted, Unavailable) as e:
            emit(err=type(e).__name__)
            c.close()
            c = pages = None
        except NotFound as e:
            emit(err="NotFound:" + ("session" if "session" in str(e) else "receipt"))
            if "session" in str(e):
                c.close()
                c = pages = None
        except RadixdError as e:
            emit(err=type(e).__name__, msg=str(e)[:160])
            try:  # what this request held goes back (the session keeps nothing it does not use)
                if receipt:
                    c.unlock([receipt])
                if held is not None:
                    c.free(held)
            except RadixdError:
                pass


# --------------------------------------------------------------------------------------------- the processes
class Radixd(ServerProc):
    """radixd on a fixed unix socket (the tests' server), killed and restarted there; its RSS, descriptors and
    threads read from /proc."""

    def __init__(self, d: str, args: list[str]):
        self.restarts = 0
        super().__init__(*args, sock=os.path.join(d, "radixd.sock"))

    def kill_and_restart(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.restarts += 1
        self.start()

    def sample(self) -> dict:
        pid = self.proc.pid
        try:
            rss = int(next(ln for ln in open(f"/proc/{pid}/status") if ln.startswith("VmRSS:")).split()[1]) * 1024
            return dict(pid=pid, rss=rss, fds=len(os.listdir(f"/proc/{pid}/fd")),
                        threads=len(os.listdir(f"/proc/{pid}/task")))
        except (OSError, StopIteration):
            return {}


class Workers:
    """The worker processes, their JSON lines read by one thread each into a shared record list."""

    def __init__(self, n: int, target: str, seed: int, trace: str, nreq: int, logs: str):
        self.target, self.seed, self.trace, self.nreq, self.logs = target, seed, trace, nreq, logs
        self.records: list[dict] = []
        self.mu = threading.Lock()
        self.procs: dict[int, subprocess.Popen] = {}
        self.next = 0
        for _ in range(n):
            self.spawn()

    def spawn(self) -> int:
        idx = self.next
        self.next += 1
        p = subprocess.Popen([sys.executable, __file__, "--worker", str(idx), "--target", self.target, "--seed",
                              str(self.seed * 1000 + idx), "--trace", self.trace, "--requests", str(self.nreq)],
                             stdout=subprocess.PIPE, stderr=open(os.path.join(self.logs, f"worker{idx}.log"), "w"),
                             text=True)
        self.procs[idx] = p
        threading.Thread(target=self._read, args=(p,), daemon=True).start()
        return idx

    def _read(self, p: subprocess.Popen) -> None:
        for line in p.stdout:
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            with self.mu:
                self.records.append(rec)

    def since(self, t: float) -> list[dict]:
        with self.mu:
            return [r for r in self.records if r["t"] >= t]

    def victim(self, rng: random.Random) -> int:
        return rng.choice(sorted(self.procs))

    def kill(self, idx: int) -> None:
        p = self.procs.pop(idx)
        p.kill()
        p.wait()

    def stop_all(self) -> None:
        for idx in list(self.procs):
            self.kill(idx)


class Engine:
    """A real vLLM CPU engine with the connector (tests/vllm_engine.py --serve), generating a fixed prompt set; the
    first answers are the reference every later answer must equal."""

    def __init__(self, python: str, d: str, target: str):
        self.python, self.dir, self.target = python, d, target
        self.model = os.path.join(d, "model")  # built by the caller (radixd takes its geometry from it)
        rng = random.Random(7)
        shared = [rng.randrange(3, 512) for _ in range(256)]
        self.prompts = [shared + [rng.randrange(3, 512) for _ in range(64 + 32 * i)] for i in range(6)]
        json.dump(self.prompts, open(os.path.join(d, "prompts.json"), "w"))
        self.reference: dict[int, list[int]] = {}
        self.changed = 0  # answers that differed from the reference
        self.answers = 0
        self.cached_after_restart: list[int] = []  # the tokens a fresh engine found cached (radixd's, not its own)
        self.proc = None
        self.fresh = True
        self.restarts = -1
        self.start()

    def start(self) -> None:
        r, w = os.pipe()
        env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONPATH": ""}
        self.log = open(os.path.join(self.dir, "engine.log"), "a")
        self.proc = subprocess.Popen([self.python, str(ROOT / "tests" / "vllm_engine.py"), self.model,
                                      os.path.join(self.dir, "prompts.json"), "--serve", str(w), "--radixd",
                                      self.target], env=env, stdin=subprocess.PIPE, stdout=self.log,
                                     stderr=subprocess.STDOUT, text=True, pass_fds=(w,), start_new_session=True)
        os.close(w)
        self.reply = os.fdopen(r)
        self.ready = False
        self.fresh = True
        self.restarts += 1

    def wait_ready(self, timeout: float = 300) -> bool:
        """The engine's `ready` line (built and attached), or False when it died or took too long."""
        import select
        if not select.select([self.reply], [], [], timeout)[0]:
            return False
        self.ready = self.reply.readline().strip() == "ready"
        return self.ready

    def round(self) -> bool:
        """Every prompt once (one at a time); False when the engine died mid-round (it is killed by faults)."""
        cached = 0
        for i in range(len(self.prompts)):
            try:
                self.proc.stdin.write(f"{i}\n")
                self.proc.stdin.flush()
                line = self.reply.readline()
            except (BrokenPipeError, OSError, ValueError):
                return False
            if not line:
                return False
            res = json.loads(line)[0]
            toks = res["tokens"]
            self.answers += 1
            if i not in self.reference:
                self.reference[i] = toks
            elif toks != self.reference[i]:
                self.changed += 1
            cached += int(res["cached"])
        if self.fresh and self.restarts:  # a fresh engine holds nothing of its own: what it found was radixd's
            self.cached_after_restart.append(cached)
        self.fresh = False
        return True

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        try:
            self.reply.close()
        except OSError:
            pass

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.kill()


class EngineLoop:
    """The engine's traffic on a thread of its own: rounds of prompts; a killed engine is restarted."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.stop = threading.Event()
        self.mu = threading.Lock()
        self.restarting = threading.Event()
        self.deaths = 0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        e = self.engine
        while not self.stop.is_set():
            with self.mu:
                if not e.ready and not e.wait_ready():
                    self.deaths += 1
                    e.kill()
                    e.start()
                    continue
            if not e.round() and not self.stop.is_set():
                with self.mu:
                    e.kill()
                    e.start()

    def restart(self) -> None:
        """SIGKILL in mid-generate (the loop sees it and starts a fresh engine)."""
        self.engine.kill()

    def close(self) -> None:
        self.stop.set()
        self.engine.stop()
        self.thread.join(10)


# ------------------------------------------------------------------------------------------------------ checks
def probe(target: str):
    from radixd.client import CacheClient
    return CacheClient(target, name="soak-probe", timeout=10)


def checked(target: str) -> list[str]:
    """The invariant checker (slot conservation included) and conservation from the counters themselves."""
    with probe(target) as c:
        bad = c.check()
        s = c.stats()
    total = s["free_tokens"] + s["cached_tokens"] + s["held_tokens"] + s["in_flight_tokens"]
    if total != s["capacity_tokens"]:
        bad.append(f"free + tree + held + in_flight = {total} != capacity {s['capacity_tokens']}")
    return bad


def settled(srv: Radixd, failures: list[str], when: str) -> dict:
    """Once the clients are gone: nothing attached but the probe, locked, held or in flight; the checker clean.
    Returns radixd's /proc figures then."""
    deadline = time.time() + 10
    while True:
        with probe(srv.target) as c:
            s = c.stats()
        if s["sessions"] <= 1 or time.time() > deadline:
            break
        time.sleep(0.1)
    leftovers = {k: s[k] for k in ("sessions", "receipts", "held_tokens", "in_flight_tokens")}
    if leftovers != dict(sessions=1, receipts=0, held_tokens=0, in_flight_tokens=0):
        failures.append(f"left behind once {when}: {leftovers}")
    bad = checked(srv.target)
    if bad:
        failures.append(f"check once {when}: {bad[:3]}")
    return srv.sample()


def malformed_burst(target: str, n: int = 40) -> list[str]:
    """Requests no client should send; each must get its precise status, and nothing may change."""
    import grpc

    from radixd.proto import cache_pb2 as pb
    from radixd.proto import cache_pb2_grpc as pb_grpc
    wrong = []
    with probe(target) as c:
        stub = pb_grpc.RadixCacheStub(grpc.insecure_channel(target))
        sid = c.session_id
        cases = [
            ("Alloc", pb.AllocRequest(session_id="no-such-session", num_tokens=[16]), "NOT_FOUND"),
            ("MatchPrefix", pb.MatchRequest(session_id=sid, items=[pb.MatchItem(tokens=b"\x01\x02\x03")]),
             "INVALID_ARGUMENT"),
            ("MatchPrefix", pb.MatchRequest(session_id=sid, items=[pb.MatchItem(tokens=b"\xff" * 8)]),
             "INVALID_ARGUMENT"),
            ("Free", pb.FreeRequest(session_id=sid, indices=np.array([1 << 40], "<i8").tobytes()),
             "INVALID_ARGUMENT"),
            ("Free", pb.FreeRequest(session_id=sid, indices=np.array([0], "<i8").tobytes()), "PERMISSION_DENIED"),
            ("Unlock", pb.UnlockRequest(session_id=sid, receipt_id=[987654321]), "NOT_FOUND"),
            ("Alloc", pb.AllocRequest(session_id=sid, num_tokens=[1 << 31]), None),  # too large: refused somehow
        ]
        before = c.stats()
        for k in range(n):
            method, req, want = cases[k % len(cases)]
            try:
                getattr(stub, method)(req, timeout=10)
                wrong.append(f"{method} #{k % len(cases)} was served")
            except grpc.RpcError as e:
                if want is not None and e.code().name != want:
                    wrong.append(f"{method} #{k % len(cases)}: {e.code().name}, not {want}")
        after = c.stats()
        if after["held_tokens"] < before["held_tokens"] - 0 and after["sessions"] != before["sessions"]:
            wrong.append("a malformed request changed the sessions")
    return wrong


def hit_series(records: list[dict], t0: float, step: float = 1.0) -> dict[int, tuple[int, int]]:
    """(hit tokens, prompt tokens) per `step` seconds since t0."""
    out: dict[int, list[int]] = defaultdict(lambda: [0, 0])
    for r in records:
        if "n" in r:
            b = out[int((r["t"] - t0) // step)]
            b[0] += r["hit"]
            b[1] += r["n"]
    return {k: (v[0], v[1]) for k, v in out.items()}


def rate(series: dict, lo: float, hi: float) -> float:
    h = n = 0
    for k, (a, b) in series.items():
        if lo <= k < hi:
            h, n = h + a, n + b
    return h / n if n else float("nan")


def recovery(series: dict, before: tuple[float, float], after: float, until: float, window: float = 5.0,
             level: float = 0.8) -> float:
    """Seconds after `after` until the hit rate over `window` seconds is back to `level` x its rate over `before` (30 s
    before the fault: the trace's own swings fade over that long) (-1: not within `until`)."""
    base = rate(series, *before)
    if not base == base or base == 0:
        return 0.0
    t = after
    while t + window <= until:
        r = rate(series, t, t + window)
        if r == r and r >= level * base:
            return t + window - after
        t += 1.0
    return -1.0


def slope(ts: list[float], ys: list[float]) -> float:
    """Least-squares slope per minute (0 with fewer than 3 points)."""
    if len(ts) < 3:
        return 0.0
    return float(np.polyfit(np.asarray(ts) / 60.0, np.asarray(ys, float), 1)[0])


# -------------------------------------------------------------------------------------------------------- main
FAULTS = ["kill_client", "stop_client", "engine_kill", "pool_full", "slow_store", "store_restart", "malformed",
          "radixd_restart"]
HEAVY = {"store_restart", "radixd_restart"}


def run(args) -> int:
    from radixd.client.events import BlockIndex
    from tests.stores import Valkey

    requests(args.trace, 1)  # (a missing trace stops the run here, not each worker)
    d = tempfile.mkdtemp(prefix="radixd-soak-")
    rng = random.Random(args.seed)
    vllm_py = ROOT / ".venv-vllm" / "bin" / "python"
    use_engine = args.engine == "on" or (args.engine == "auto" and vllm_py.exists())
    if args.engine == "on" and not vllm_py.exists():
        raise SystemExit("--engine on: no .venv-vllm (.ci/run builds it)")
    store = Valkey(maxmemory="1gb")
    engine_model = os.path.join(d, "engine", "model")
    os.makedirs(os.path.dirname(engine_model), exist_ok=True)
    if use_engine:  # radixd's geometry is the engine model's own
        subprocess.run([str(vllm_py), str(ROOT / "tests" / "vllm_engine.py"), engine_model], check=True,
                       timeout=600, env={**os.environ, "PYTHONPATH": ""})
        geometry = ["--model-config", os.path.join(engine_model, "config.json")]
    else:
        geometry = ["--layers", "2", "--kv-heads", "2", "--head-dim", "32", "--dtype", "float32"]
    srv = Radixd(d, ["--num-slots", str(args.device_tokens), "--page-size", str(PAGE), *geometry,
                     "--host-slots", str(args.device_tokens * 4), "--write-policy", "write_through",
                     "--storage", store.url, "--storage-write-policy", "write_through", "--prefetch-policy",
                     "wait_complete", "--kv-events", "--lock-lease-seconds", str(LEASE)])
    idle = srv.sample()
    shm_before = {n for n in os.listdir("/dev/shm") if n.startswith("radixd-")}
    index = BlockIndex(PAGE)
    index.follow_grpc("radixd", srv.target, snapshot=True)
    workers = Workers(args.workers, srv.target, args.seed, args.trace, args.requests, d)
    engine = loop = None
    if use_engine:
        engine = Engine(str(vllm_py), os.path.join(d, "engine"), srv.target)
        loop = EngineLoop(engine)
    t0 = time.time()
    end = t0 + args.minutes * 60
    warm = max(45.0, 0.15 * (end - t0))  # (the caches fill first: a fault's baseline is taken after)
    kinds = list(FAULTS) if use_engine else [f for f in FAULTS if f != "engine_kill"]
    rng.shuffle(kinds)
    each = [f for f in FAULTS if use_engine or f != "engine_kill"]
    room = sum(3 if f in HEAVY else 1 for f in each) * 20  # a round, at 20 s a light fault
    while (len(kinds) // len(each) + 1) * room < end - t0 - warm - 25:  # more rounds on a longer run
        more = list(each)
        rng.shuffle(more)
        kinds += more
    # a fault that loses cached pages (the store's, radixd's) gets three times the others' time to win them back
    weight = [3.0 if k in HEAVY else 1.0 for k in kinds]
    span = (end - t0 - warm - 25) / sum(weight)
    starts = np.concatenate([[0.0], np.cumsum(weight)[:-1]]) * span
    plan = [(t0 + warm + at + rng.uniform(0, span * 0.3), k) for at, k in zip(starts, kinds)]
    faults, samples, failures = [], [], []
    print(f"soak: {args.minutes:g} min, {args.workers} workers, engine {'on' if use_engine else 'off'}, "
          f"{len(plan)} faults, seed {args.seed}; dir {d}", flush=True)

    def sample() -> None:
        s = srv.sample()
        if s:
            samples.append(dict(t=time.time() - t0, **s))

    try:
        for at, kind in plan:
            while time.time() < at:
                sample()
                time.sleep(min(2.0, max(at - time.time(), 0.01)))
            f = dict(kind=kind, t=time.time() - t0)
            if kind == "kill_client":
                workers.kill(workers.victim(rng))
                workers.spawn()
            elif kind == "stop_client":
                idx = workers.victim(rng)
                os.kill(workers.procs[idx].pid, signal.SIGSTOP)
                time.sleep(LEASE * 2)
                os.kill(workers.procs[idx].pid, signal.SIGCONT)
            elif kind == "engine_kill":
                loop.restart()
            elif kind == "pool_full":
                from radixd.client.errors import RadixdError
                with probe(srv.target) as hog:
                    try:
                        free = hog.stats()["free_tokens"] // PAGE * PAGE
                        got = hog.alloc(free) if free else np.zeros(0, np.int64)
                        time.sleep(3)
                        hog.free(got)
                    except RadixdError as e:
                        f["note"] = type(e).__name__
            elif kind == "slow_store":
                store.proc.send_signal(signal.SIGSTOP)
                time.sleep(3)
                store.proc.send_signal(signal.SIGCONT)
            elif kind == "store_restart":
                store.kill()
                time.sleep(1)
                store.start()
            elif kind == "malformed":
                bad = malformed_burst(srv.target)
                if bad:
                    failures.append(f"malformed burst: {bad[:3]}")
            elif kind == "radixd_restart":
                srv.kill_and_restart()
            f["done"] = time.time() - t0
            time.sleep(0.5)
            bad = checked(srv.target)
            if bad:
                failures.append(f"after {kind}: {bad[:3]}")
            f["check"] = "ok" if not bad else bad[:3]
            faults.append(f)
            print(f"  {f['t']:7.1f} s  {kind:15} check {f['check']}", flush=True)
        while time.time() < end:
            sample()
            time.sleep(min(2.0, max(end - time.time(), 0.01)))
        stop_t = time.time() - t0
    finally:
        workers.stop_all()
        if loop is not None:
            loop.close()
    # ------------------------------------------------------------ once every client is gone
    gone = settled(srv, failures, "the clients were gone")
    # the same again after a short second round of clients: what they leave must be nothing
    again = Workers(6, srv.target, args.seed + 1, args.trace, args.requests, d)
    time.sleep(8)
    again.stop_all()
    gone2 = settled(srv, failures, "a second round of clients was gone")
    for what, slack in (("fds", 3), ("threads", 2)):  # (the store's connections and threads come and go by load;
        # what six more sessions left behind would be six at least)
        if gone and gone2 and gone2[what] > gone[what] + slack:
            failures.append(f"radixd's {what}: {gone[what]} once the clients were gone, {gone2[what]} after another "
                            "round of six clients")
    records = workers.records + again.records
    prompts = [r for r in requests(args.trace, args.requests)]
    with probe(srv.target) as c:  # the index that followed the events agrees with MatchPrefix
        mismatched = 0
        sampled = [p[:MAX_PROMPT] for p in random.Random(3).sample(prompts, min(60, len(prompts)))]
        for attempt in range(3):
            deadline = time.time() + 10
            while not index.current("radixd") and time.time() < deadline:
                time.sleep(0.05)
            mismatched = sum(index.match(p).get("radixd", {}).get("GPU", 0) * PAGE != c.match_prefix(p).matched_len
                             for p in sampled)
            if not mismatched:
                break
            time.sleep(0.5)
        if mismatched:
            failures.append(f"the BlockIndex disagreed with MatchPrefix on {mismatched} of {len(sampled)} prompts")
    shm_after = {n for n in os.listdir("/dev/shm") if n.startswith("radixd-")}
    own = {n for n in shm_after if n.startswith(f"radixd-{srv.proc.pid}-")}
    stray = {n for n in shm_after - own - shm_before if not _alive(n)}  # (another live radixd's are its own business)
    if stray:
        failures.append(f"shared-memory segments of no live radixd: {sorted(stray)[:3]}")
    # ------------------------------------------------------------ figures
    bytes_bad = sum(r.get("bad", 0) for r in records)
    if bytes_bad:
        failures.append(f"{bytes_bad} hit tokens read back bytes their tokens did not write")
    done = [r for r in records if "n" in r]
    if not done:
        failures.append("no request completed")
    errors = Counter(r["err"] for r in records if "err" in r)
    series = hit_series(records, t0)
    recov = []
    for i, f in enumerate(faults):
        nxt = faults[i + 1]["t"] if i + 1 < len(faults) else stop_t
        r = recovery(series, (f["t"] - 30, f["t"]), f["done"], nxt)
        f["recovered_s"] = r
        recov.append(r)
        if r < 0:
            failures.append(f"hit rate not back after {f['kind']} at {f['t']:.0f} s (before the next fault)")
    per_min = defaultdict(list)
    for r in done:
        per_min[int((r["t"] - t0) // 60)].append(r["ms"])
    lat = {m: (float(np.percentile(v, 50)), float(np.percentile(v, 99)), len(v)) for m, v in sorted(per_min.items())}
    lives: dict[int, list[dict]] = defaultdict(list)  # radixd's incarnations (it is restarted by faults)
    for smp in samples:
        lives[smp["pid"]].append(smp)
    longest = max(lives.values(), key=len, default=[])
    inc = longest[len(longest) // 2:]  # its steady half (radixd keeps freed heap for reuse: RSS rises to a plateau)
    rss_slope = slope([s["t"] for s in inc], [s["rss"] / 2**20 for s in inc])
    fd_slope = slope([s["t"] for s in inc], [s["fds"] for s in inc])
    plateau = max((s["rss"] for s in longest), default=0) / 2**20
    eng = {}
    if engine is not None:
        eng = dict(answers=engine.answers, changed=engine.changed, cached_after_restart=engine.cached_after_restart)
        if engine.changed:
            failures.append(f"the engine's tokens changed in {engine.changed} of {engine.answers} answers")
        if not engine.answers:
            failures.append("the engine answered nothing")
        # (what a restarted engine finds is reported, not required: under the workers' traffic its pages may be
        # evicted from every tier before it is up; tests/test_vllm_connector.py checks the hits themselves)
    total = sum(r["n"] for r in done) or 1
    print(f"\nrequests {len(done)}  prompt tokens {total}  hit rate {sum(r['hit'] for r in done) / total:.3f}  "
          f"hit tokens verified {sum(r['hit'] for r in done)}  wrong {bytes_bad}")
    print("faults:")
    for f in faults:
        print(f"  {f['t']:7.1f} s  {f['kind']:15} hit rate back in {f['recovered_s']:5.1f} s  check {f['check']}")
    print("hit rate per 10 s: " + " ".join(f"{rate(series, k, k + 10):.2f}" for k in range(0, int(stop_t), 10)))
    print("MatchPrefix per minute (p50 ms, p99 ms, requests):")
    for m, (p50, p99, n) in lat.items():
        print(f"  min {m:3d}  {p50:7.2f}  {p99:8.2f}  {n}")
    print(f"radixd (its longest incarnation, {len(longest)} samples; the steady half): RSS slope {rss_slope:+.2f} "
          f"MiB/min (at most {plateau:.0f} MiB), descriptors slope {fd_slope:+.2f}/min, "
          f"idle before any client {idle}, once the clients were gone {gone}, after another round {gone2}; "
          f"restarts {srv.restarts}")
    print(f"errors seen by clients: {dict(errors)}")
    for msg, n in Counter(r["msg"] for r in records if "msg" in r).most_common(5):
        print(f"  {n} x {msg}")
    if eng:
        print(f"engine: {eng}")
    for msg in failures:
        print("FAIL", msg)
    result = dict(ok=int(not failures), requests=len(done), hit_tokens=sum(r["hit"] for r in done), wrong=bytes_bad,
                  faults=len(faults), worst_recovery_s=max(recov) if recov else 0, rss_slope_mib_min=rss_slope,
                  fd_slope_min=fd_slope, errors=sum(errors.values()), engine_changed=eng.get("changed", 0))
    if args.json:
        json.dump(dict(result=result, faults=faults, latency=lat, errors=errors, samples=samples, engine=eng,
                       failures=failures, hits_per_second={k: series[k] for k in sorted(series)}),
                  open(args.json, "w"), indent=1, default=str)
    print("RESULT " + " ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in result.items()))
    index.close()
    srv.stop()
    store.stop()
    return 0 if not failures else 1


def _alive(segment: str) -> bool:
    """Whether the radixd that named a segment (radixd-<pid>-...) still runs (one beside this run: parallel tests)."""
    try:
        os.kill(int(segment.split("-")[1]), 0)
    except (ValueError, IndexError, ProcessLookupError):
        return False
    except PermissionError:
        return True
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=30)
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--engine", choices=["auto", "on", "off"], default="auto")
    ap.add_argument("--trace", default="conversation_trace.jsonl")
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--device-tokens", type=int, default=32768)
    ap.add_argument("--json", default="")
    ap.add_argument("--worker", type=int, default=-1, help=argparse.SUPPRESS)
    ap.add_argument("--target", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker >= 0:
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
        worker(args)
    else:
        sys.exit(run(args))


if __name__ == "__main__":
    main()
