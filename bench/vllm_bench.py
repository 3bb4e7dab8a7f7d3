"""vLLM connector benchmark: time to first token of a fresh engine on long prompts with and without a
radixd hit, and the connector's own cost on a miss, on a real vLLM engine (CPU, the tests' tiny model).

Engines run in vLLM's venv (`.venv-vllm`, built by .ci/run; or RADIXD_VLLM_PYTHON), one process each:
  C  no connector              the reference: full prefill
  A  connector, radixd cold    a miss: prefill + page stores + CacheUnfinished (+ MatchPrefix with --events off:
                               the connector then has no local index of radixd's pages to answer it)
  B  connector, radixd warm    a hit: MatchPrefix + page loads, prefill of the last partial page only
  L  no connector, the timed prompt served just before (not timed): vLLM's own prefix hit of it, the reference
     for an external hit (B/L: what a radixd hit costs over the engine's local one)
  N  (--floor) a connector that does nothing (tests/vllm_null_connector.py): vLLM's own cost of a connector, the
     floor no connector can go below; A/N is what radixd costs beyond it
The engines are up at once and take the prompts in turns (C and A, and N, changing which goes first, B one
prompt behind them, once radixd holds what A stored): this machine's speed drifts by up to 1.6x over seconds,
and a ratio of two times taken a few milliseconds apart cancels most of it. The ratios are the medians of the
per-prompt ratios.
Each engine first serves a short warm-up prompt, and each length one more (not timed); then --repeat
distinct prompts per length are timed.
Lead-ins (--lead-in, the default): in each turn an engine first serves a lead-in prompt of the same length (not
timed: a miss everywhere but B, which radixd holds for), then its timed prompt. Work an engine leaves running
after a request (the connector's stores and publishes, radixd's server, the events other engines follow) competes
with whatever the machine runs next: without a lead-in that is the next engine's timed prompt (N follows A in
two turns of three, C never did: N/C read 1.03-1.04 with radixd's traffic around it, and 0.99-1.02, median about
1.007, with none: --calibrate --floor). With one, each timed prompt follows its own engine's lead-in, as an
engine's requests follow each other, and the leftover work of the engine before lands on an untimed prompt.

The scheduler's side: for each batch size in --batches, engines A (cold radixd, every request a miss that
stores) and B (warm, every request a hit) serve --batch-prompts prompts of --batch-len tokens, that many
submitted together, and report what the connector cost vLLM's scheduler thread: per request the time in its
hooks (p50, p99; a step-wide hook's time is shared by the step's requests), the same less the time it waited
for a lookup while the engine had nothing else to run ("busy": what it kept the scheduler from other work),
and radixd calls per step made on the scheduler thread (an Alloc when the slot stock runs short) and on the
connector's lookup thread (MatchPrefix, LoadBack).

    python bench/vllm_bench.py [--lengths 512,1024,2048,4096] [--repeat 60] [--batches 1,16,128]
                               [--arch nemotron-h] [--floor]

CPU layout (--cpus): "split" (the default) runs every engine, C included, with one OpenMP thread fewer than the
machine has CPUs, bound to the CPUs but the last as vLLM's CPU executor binds a worker's (OMP_PLACES,
OMP_PROC_BIND: the engine's own thread is the forward's first), and pins radixd to the last CPU: the deployment
vLLM's CPU backend recommends (cores kept for everything beside the forward, VLLM_CPU_NUM_OF_RESERVED_CPU). The
connector then runs its threads (and gRPC's) on the CPUs the forward is not bound to (`radixd_cpus`, "auto").
"loose" is split with nothing but radixd bound (the kernel places the forward and the connector's threads).
"shared" leaves vLLM's defaults: on 2 CPUs
its second OpenMP thread was measured spinning on 93% of a CPU while the engine served hits, so radixd's server
and the connector's threads run against the forward or the spin. The layout is printed with the results.

--arch nemotron-h times the tiny Mamba2 hybrid instead (RadixdHybridConnector, radixd with --hybrid-cache, block
64): a hit loads the attention pages and the Mamba state at the hit's end; --mamba-chunk sets how often a miss
publishes a state (radixd's checkpoint interval).

Decode throughput (--decode-batches, default 1,16): engines C and A (connector, radixd cold: every request a miss
whose pages it stores) each take, in turns, a batch of --decode-len-token prompts generating --decode-tokens + 1
tokens and a batch of new prompts of the same length generating 1 (the same prefill); the difference is the batch's
decode time. decode_x_<batch> is A's decode tokens/s over C's (median of the rounds' ratios).

Last line: RESULT ttft_x_<len>=<C/B> ... miss_overhead_<len>=<A/C> ... local_x_<len>=<B/L> ... decode_x_<batch>=<A/C>
sched_p50_us_<miss|hit>_<batch>=...
max_rpcs_per_step_<miss|hit>_<batch>=...

--calibrate runs A without the connector too (and no B): its A/C (RESULT aa_<len>) is what two identical engines
read in one run, so the spread of aa over runs is the bench's resolution for miss_overhead on the machine. With
--floor too, N runs beside them (floor_<len> N/C, floor_over_aa_<len> N/A): the floor against two engines alike.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Optional
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tests.conftest import ServerProc  # noqa: E402
from radixd.client import CacheClient  # noqa: E402

ENGINE = ROOT / "tests" / "vllm_engine.py"
BLOCK = 32


_ENGINE_ENV: dict[str, str] = {}  # the engines' OpenMP threads (--cpus)


def _layout(how: str) -> str:
    """Set the engines' OpenMP threads for --cpus; what the run uses, in words."""
    cpus = sorted(os.sched_getaffinity(0))
    if how in ("split", "loose") and len(cpus) > 1:
        _ENGINE_ENV["OMP_NUM_THREADS"] = str(len(cpus) - 1)
        if how == "loose":
            return f"loose: engines with {len(cpus) - 1} OpenMP threads, unbound; radixd pinned to CPU {cpus[-1]}"
        forward = ",".join(map(str, cpus[:-1]))  # (one place of them all, as vLLM's configure_omp_envs writes it)
        _ENGINE_ENV.update(OMP_PLACES="{" + forward + "}", OMP_PROC_BIND="true")
        return f"split: engines with {len(cpus) - 1} OpenMP threads bound to CPUs {forward}, radixd pinned to CPU " \
               f"{cpus[-1]}"
    return f"shared: vLLM's default threads on {len(cpus)} CPUs, radixd unpinned"


def _server(how: str, *args: str) -> ServerProc:
    """A radixd server, pinned (every thread) to the last CPU under --cpus split or loose."""
    srv = ServerProc(*args)
    cpus = sorted(os.sched_getaffinity(0))
    if how in ("split", "loose") and len(cpus) > 1:
        for tid in os.listdir(f"/proc/{srv.proc.pid}/task"):
            os.sched_setaffinity(int(tid), {cpus[-1]})
    return srv


def _python() -> str:
    for cand in (os.environ.get("RADIXD_VLLM_PYTHON"), ROOT / ".venv-vllm" / "bin" / "python"):
        if cand and Path(cand).exists():
            return str(cand)
    raise SystemExit("no vLLM venv: run .ci/run once (it builds .venv-vllm) or set RADIXD_VLLM_PYTHON")


def _engine(py: str, model: str, prompts: list[list[int]], target: str, max_len: int, batch: int = 1,
            stats: str = "", hybrid: bool = False) -> list[dict]:
    d = tempfile.mkdtemp(prefix="radixd-vllm-bench-")
    pj, oj = os.path.join(d, "p.json"), os.path.join(d, "o.json")
    json.dump(prompts, open(pj, "w"))
    cmd = [py, str(ENGINE), model, pj, oj, "--max-tokens", "1", "--max-model-len", str(max_len),
           "--batch", str(batch)]
    if target:
        cmd += ["--radixd", target] + (["--hybrid"] if hybrid else [])
    if stats:
        cmd += ["--stats", stats]
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PYTHONPATH": "", **_ENGINE_ENV}
    with open(os.path.join(d, "log"), "w") as log:
        p = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        rc = p.wait(1800)
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if rc != 0:
        raise SystemExit(f"engine failed ({rc}); see {d}/log")
    return json.load(open(oj))


class _Served:
    """An engine kept up (tests/vllm_engine.py --serve) that generates the prompts it is handed by index."""

    def __init__(self, py: str, model: str, prompts: list[list[int]], target: str, max_len: int, hybrid: bool,
                 *more: str):
        self.dir = tempfile.mkdtemp(prefix="radixd-vllm-bench-")
        json.dump(prompts, open(os.path.join(self.dir, "p.json"), "w"))
        r, w = os.pipe()
        cmd = [py, str(ENGINE), model, os.path.join(self.dir, "p.json"), "--max-tokens", "1", "--max-model-len",
               str(max_len), "--serve", str(w), *more]
        if target:
            cmd += ["--radixd", target] + (["--hybrid"] if hybrid else [])
        env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PYTHONPATH": "", **_ENGINE_ENV}
        with open(os.path.join(self.dir, "log"), "w") as log:
            self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT,
                                         pass_fds=(w,), text=True, start_new_session=True)
        os.close(w)
        self.reply = os.fdopen(r)

    def _line(self) -> str:
        line = self.reply.readline()
        if not line:
            raise SystemExit(f"engine failed ({self.proc.wait()}); see {self.dir}/log")
        return line

    def ready(self) -> None:
        self._line()

    def run(self, i: int) -> dict:
        self.proc.stdin.write(f"{i}\n")
        self.proc.stdin.flush()
        return json.loads(self._line())[0]

    def run_batch(self, ids: list[int], max_tokens: int) -> list[dict]:
        """The prompts together, each generating max_tokens tokens."""
        self.proc.stdin.write(" ".join(map(str, ids)) + f" max={max_tokens}\n")
        self.proc.stdin.flush()
        return json.loads(self._line())

    def close(self) -> None:
        try:
            self.proc.stdin.close()
            self.proc.wait(120)
        except (OSError, subprocess.TimeoutExpired):
            pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _await_stored(client: CacheClient, prompt: list[int], block: int, hybrid: bool, timeout: float = 10.0) -> None:
    """Until radixd holds what the miss engine stored of the prompt (its publish runs after its generate returns)."""
    want = (len(prompt) - (1 if hybrid else 0)) // block * block
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = client.match_hybrid([prompt])[0].matched_len if hybrid else client.match_prefix(prompt).matched_len
        if got >= want:
            return
        time.sleep(0.001)
    print(f"warning: radixd holds a shorter prefix than the miss engine stored ({got} < {want} tokens)")


def _decode(py: str, model: str, args, hybrid: bool, block: int, extra: tuple) -> dict[str, float]:
    """Decode throughput with the connector (A: radixd cold, each request a miss that stores) against without (C),
    per batch size: each round, on both engines in turn, a batch generating --decode-tokens + 1 tokens and another
    of new prompts generating 1 (the same prefill): the difference is the batch's decode time."""
    rng = random.Random(11)
    batches = [int(x) for x in args.decode_batches.split(",")]
    n, rounds = args.decode_len, args.decode_rounds
    groups = {b: [[[rng.randrange(3, 512) for _ in range(n)] for _ in range(b)] for _ in range(2 * (rounds + 1))]
              for b in batches}
    everything = [p for b in batches for g in groups[b] for p in g]
    srv = _server(args.cpus, "--num-slots", str(max(65536, 2 * sum(map(len, everything)))), "--page-size", str(block),
                  "--model-config", os.path.join(model, "config.json"), *extra)
    max_len = n + args.decode_tokens + 2 * block
    engines = {w: _Served(py, model, everything, srv.target if w == "A" else "", max_len, hybrid,
                          *(["--extra", args.extra] if w == "A" else [])) for w in "CA"}
    results: dict[str, float] = {}
    print(f"\n{'batch':>5} {'C decode tok/s':>15} {'A decode tok/s':>15} {'A/C':>6}   (prompts of {n} tokens, "
          f"{args.decode_tokens} decoded each; medians of {rounds} rounds)")
    try:
        for e in engines.values():
            e.ready()
        at = 0
        for b in batches:
            ids = [list(range(at + g * b, at + (g + 1) * b)) for g in range(len(groups[b]))]
            at += len(groups[b]) * b
            rates: dict[str, list[float]] = {"C": [], "A": []}
            for r in range(rounds + 1):  # (round 0 warms the batch's shapes up, not counted)
                for w in ("CA" if r % 2 else "AC"):
                    long = engines[w].run_batch(ids[2 * r], args.decode_tokens + 1)[0]["seconds"]
                    short = engines[w].run_batch(ids[2 * r + 1], 1)[0]["seconds"]
                    if r:
                        rates[w].append(b * args.decode_tokens / max(long - short, 1e-6))
            ratio = statistics.median(a / c for a, c in zip(rates["A"], rates["C"]))
            results[f"decode_x_{b}"] = ratio
            print(f"{b:5d} {statistics.median(rates['C']):15.0f} {statistics.median(rates['A']):15.0f} {ratio:6.3f}")
    finally:
        for e in engines.values():
            e.close()
        srv.stop()
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="512,1024,2048,4096", help="prompt lengths for time to first token ('' skips)")
    ap.add_argument("--repeat", type=int, default=60)
    ap.add_argument("--batches", default="1,16,128", help="batch sizes for the scheduler-side costs ('' skips)")
    ap.add_argument("--batch-len", type=int, default=256)
    ap.add_argument("--decode-batches", default="1,16", help="batch sizes for decode throughput ('' skips)")
    ap.add_argument("--decode-tokens", type=int, default=64, help="tokens each request decodes")
    ap.add_argument("--decode-len", type=int, default=256, help="prompt tokens of the decode batches")
    ap.add_argument("--decode-rounds", type=int, default=5, help="rounds of the decode comparison (medians)")
    ap.add_argument("--batch-prompts", type=int, default=256)
    ap.add_argument("--arch", default="llama", choices=["llama", "llama-8l", "nemotron-h"],
                    help="llama: the tests' 2-layer model (1 KiB of K+V per token); llama-8l: 8 layers, 32 KiB per "
                         "token (copies no longer negligible against the forward)")
    ap.add_argument("--mamba-chunk", type=int, default=0, help="radixd's --mamba-chunk (nemotron-h): tokens between "
                                                               "published states (0: the config's chunk_size)")
    ap.add_argument("--cpus", default="split", choices=["split", "loose", "shared"],
                    help="split: engines get one OpenMP thread fewer than the CPUs, bound; radixd the last CPU (see above)")
    ap.add_argument("--extra", default="{}", help="more kv_connector_extra_config for engines A and B (JSON), e.g. "
                                                  "'{\"local_index\": false}' or '{\"async_save\": true}'")
    ap.add_argument("--events", default="on", choices=["on", "off"],
                    help="radixd's --kv-events: on, the connector answers misses from its local index (no RPC)")
    ap.add_argument("--floor", action="store_true",
                    help="engine N too, with a connector that does nothing (tests/vllm_null_connector.py): N/C is "
                         "vLLM's own cost of having a connector, A/N radixd's beyond it (RESULT floor_<len>, "
                         "over_floor_<len>)")
    ap.add_argument("--lead-in", default="on", choices=["on", "off"],
                    help="before each timed prompt, an untimed one on the same engine (see the docstring)")
    ap.add_argument("--local", default="on", choices=["on", "off"],
                    help="engine L too: no connector, each timed prompt served once untimed first, so that its timed "
                         "run is vLLM's own prefix hit; B/L is a radixd hit against the engine's local one "
                         "(RESULT local_x_<len>)")
    ap.add_argument("--calibrate", action="store_true",
                    help="engine A without the connector too (no B): A/C is then what two identical engines read, "
                         "the resolution of miss_overhead on this machine (RESULT aa_<len>)")
    args = ap.parse_args()
    py = _python()
    print("CPU layout:", _layout(args.cpus))
    model = tempfile.mkdtemp(prefix="radixd-vllm-bench-model-")
    subprocess.run([py, str(ENGINE), model, "--arch", args.arch], check=True, env={**os.environ, "PYTHONPATH": ""})
    hybrid = args.arch == "nemotron-h"
    block = 64 if hybrid else BLOCK  # the Nemotron-H engine's block (tests/vllm_engine.py)
    extra = ("--hybrid-cache", "--mamba-states", "2048", "--mamba-chunk", str(args.mamba_chunk)) if hybrid else ()
    extra += ("--kv-events",) if args.events == "on" else ()
    results = _ttft(py, model, args, hybrid, block, extra) if args.lengths else {}
    if args.decode_batches:
        results.update(_decode(py, model, args, hybrid, block, extra))
    if args.batches:
        results.update(_scheduler_side(py, model, args))
    print("RESULT " + " ".join(f"{k}={v:.3f}" for k, v in results.items()))


def _ttft(py: str, model: str, args, hybrid: bool, block: int, extra: tuple) -> dict[str, float]:
    """Time to first token of engines C, A and B on --repeat prompts of each of --lengths, taken in turns."""
    lengths = [int(x) for x in args.lengths.split(",")]
    rng = random.Random(7)
    warm = [rng.randrange(3, 512) for _ in range(40)]
    per = args.repeat + 1  # the first prompt of each length warms that shape up and is not counted
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in lengths for _ in range(per)]
    max_len = max(lengths) + 2 * block
    srv = _server(args.cpus, "--num-slots", str(max(65536, (4 if args.lead_in == "on" else 2) * sum(map(len, prompts)))), "--page-size", str(block),
                     "--model-config", os.path.join(model, "config.json"), *extra)
    everything = [warm] + prompts
    leads = args.lead_in == "on"
    if leads:  # (a lead-in per prompt, same length, distinct: lead(i) is the index of prompt i's)
        everything += [[rng.randrange(3, 512) for _ in range(len(p))] for p in prompts]

    def lead(i: int) -> Optional[int]:
        return len(prompts) + i if leads and 0 < i <= len(prompts) else None
    plain = "CA" if args.calibrate else "C"  # (--calibrate: A has no connector either, and there is no B)
    local = args.local == "on" and not args.calibrate
    plain += "L" if local else ""
    floor = args.floor and not hybrid
    turns = ("CAN", "ANC", "NCA") if floor else ("AC", "CA")  # (each engine first, middle and last in turn)
    engines = {w: _Served(py, model, everything, "" if w in plain + "N" else srv.target, max_len, hybrid,
                          *(["--await-index"] if w == "B" and args.events == "on" else []),
                          *(["--null-connector"] if w == "N" else []),
                          *(["--extra", args.extra] if w not in plain + "N" else []))
               for w in ("CA" if args.calibrate else "CAB") + ("N" if floor else "") + ("L" if local else "")}
    times: dict[str, list[float]] = {w: [] for w in "CABNL"}
    cached: list[int] = []
    try:
        for e in engines.values():
            e.ready()
        with CacheClient(srv.target, attach=False) as probe:
            timed = 1 + len(prompts)  # (the warm-up and the timed prompts; the lead-ins follow them)
            for i in range(timed + 1):
                if i < timed:
                    for w in turns[i % len(turns)]:
                        if lead(i) is not None:
                            engines[w].run(lead(i))
                        got = engines[w].run(i)
                        times[w].append(got["seconds"])
                        if w == "C":
                            want = got["tokens"]
                else:  # one more call: with async_save a store is reported (then published) at the next step
                    engines["A"].run(0)
                if i and not args.calibrate:  # B trails by a prompt, so that A's stores of it have landed
                    _await_stored(probe, everything[i - 1], block, hybrid)
                    if lead(i) is not None and i < timed:
                        engines["B"].run(lead(i))
                    got = engines["B"].run(i - 1)
                    assert got["tokens"] == prev, "a hit changed the output"
                    times["B"].append(got["seconds"])
                    cached.append(got["cached"])
                    if local:  # the same prompt twice: a miss that fills L's own prefix cache, then L's local hit
                        engines["L"].run(i - 1)
                        got = engines["L"].run(i - 1)
                        assert got["tokens"] == prev, "a local hit changed the output"
                        times["L"].append(got["seconds"])
                prev = want
    finally:
        for e in engines.values():
            e.close()
        srv.stop()
    results: dict[str, float] = {}
    if args.calibrate:
        print(f"{'prompt':>7} {'C no conn ms':>13} {'A no conn ms':>13} {'A/C':>6}   (medians of {args.repeat} "
              "prompts, of times and of per-prompt ratios)")
        for i, n in enumerate(lengths):
            sl = slice(1 + i * per + 1, 1 + (i + 1) * per)
            tc, ta = times["C"][sl], times["A"][sl]
            results[f"aa_{n}"] = statistics.median(a / c for a, c in zip(ta, tc))
            print(f"{n:7d} {statistics.median(tc) * 1e3:13.1f} {statistics.median(ta) * 1e3:13.1f} "
                  f"{results[f'aa_{n}']:6.3f}")
            if floor:  # (the connector floor beside the bench's resolution, in the same rotation)
                tn = times["N"][sl]
                results[f"floor_{n}"] = statistics.median(x / c for x, c in zip(tn, tc))
                results[f"floor_over_aa_{n}"] = statistics.median(x / a for x, a in zip(tn, ta))
                print(f"{'':7} N, a connector that does nothing: N/C {results[f'floor_{n}']:.3f}, N/A "
                      f"{results[f'floor_over_aa_{n}']:.3f}")
        return results
    print(f"{'prompt':>7} {'C no conn ms':>13} {'A miss ms':>10} {'B hit ms':>9} {'B cached':>9} "
          f"{'TTFT C/B':>9} {'miss A/C':>9}   (medians of {args.repeat} prompts, of times and of per-prompt ratios)")
    for i, n in enumerate(lengths):
        sl = slice(1 + i * per + 1, 1 + (i + 1) * per)
        tc, ta, tb = (times[w][sl] for w in "CAB")
        results[f"ttft_x_{n}"] = statistics.median(c / b for c, b in zip(tc, tb))
        results[f"miss_overhead_{n}"] = statistics.median(a / c for a, c in zip(ta, tc))
        print(f"{n:7d} {statistics.median(tc) * 1e3:13.1f} {statistics.median(ta) * 1e3:10.1f} "
              f"{statistics.median(tb) * 1e3:9.1f} {min(cached[sl]):9d} {results[f'ttft_x_{n}']:9.2f} "
              f"{results[f'miss_overhead_{n}']:9.3f}")
        if local:  # (L's list, like B's, starts at the warm-up prompt)
            tl = times["L"][sl]
            results[f"local_x_{n}"] = statistics.median(b / x for b, x in zip(tb, tl))
            print(f"{'':7} L, the same prompt hit in vLLM's own prefix cache: {statistics.median(tl) * 1e3:.1f} ms; "
                  f"a radixd hit B/L {results[f'local_x_{n}']:.3f}")
        if floor:
            tn = times["N"][sl]
            results[f"floor_{n}"] = statistics.median(x / c for x, c in zip(tn, tc))
            results[f"over_floor_{n}"] = statistics.median(a / x for a, x in zip(ta, tn))
            print(f"{'':7} N, a connector that does nothing: {statistics.median(tn) * 1e3:.1f} ms, N/C "
                  f"{results[f'floor_{n}']:.3f} (vLLM's own cost of a connector); A/N {results[f'over_floor_{n}']:.3f} "
                  "(radixd's beyond it)")
    return results


def _scheduler_side(py: str, model: str, args) -> dict[str, float]:
    """The connector's cost on vLLM's scheduler thread at each batch size, on misses (A) and hits (B)."""
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 512) for _ in range(args.batch_len)] for _ in range(args.batch_prompts)]
    out: dict[str, float] = {}
    print(f"\n{'batch':>5} {'mode':>4} {'requests':>8} {'steps':>6} {'p50 us':>8} {'p99 us':>8} {'busy p50':>8} "
          f"{'busy p99':>8} {'rpcs/step max':>13} {'mean':>5} {'lookup rpcs/step max':>20} {'mean':>5} "
          f"{'local misses':>12}")
    hooks: list[str] = []  # per hook: calls x mean microseconds
    for batch in [int(x) for x in args.batches.split(",")]:
        hybrid = args.arch == "nemotron-h"
        block = 64 if hybrid else BLOCK
        srv = _server(args.cpus, "--num-slots", str(max(65536, 2 * args.batch_len * args.batch_prompts)),
                         "--page-size", str(block), "--model-config", os.path.join(model, "config.json"),
                         *(("--hybrid-cache", "--mamba-states", "2048", "--mamba-chunk", str(args.mamba_chunk))
                           if hybrid else ()), *(("--kv-events",) if args.events == "on" else ()))
        try:
            for mode in ("miss", "hit"):  # the first engine stores every prompt, the second finds them all
                path = tempfile.mktemp(prefix="radixd-vllm-stats-")
                _engine(py, model, prompts, srv.target, args.batch_len + 2 * block, batch, path,
                        hybrid=hybrid)
                st = json.load(open(path))
                print(f"{batch:5d} {mode:>4} {st['requests']:8d} {st['steps']:6d} {st['p50_us']:8.0f} "
                      f"{st['p99_us']:8.0f} {st['busy_p50_us']:8.0f} {st['busy_p99_us']:8.0f} {st['max_rpcs_per_step']:13d} {st['mean_rpcs_per_step']:5.2f} "
                      f"{st['max_lookup_rpcs_per_step']:20d} {st['mean_lookup_rpcs_per_step']:5.2f} "
                      f"{st['local_misses']:12d}")
                hooks.append(f"{batch:5d} {mode:>4}  " + "  ".join(
                    f"{name} {n}x{us:.0f}" for name, (n, us) in sorted(st["hooks_us"].items())))
                out[f"sched_p50_us_{mode}_{batch}"] = st["p50_us"]
                out[f"sched_p99_us_{mode}_{batch}"] = st["p99_us"]
                out[f"sched_busy_p50_us_{mode}_{batch}"] = st["busy_p50_us"]
                out[f"max_rpcs_per_step_{mode}_{batch}"] = st["max_rpcs_per_step"]
        finally:
            srv.stop()
    print("\nper hook, calls x mean us (a step-wide hook is called once a step):")
    print("\n".join(hooks))
    return out


if __name__ == "__main__":
    main()
