"""vLLM connector benchmark: time to first token of a fresh engine on long prompts with and without a
radixd hit, and the connector's own cost on a miss, on a real vLLM engine (CPU, the tests' tiny model).

Engines run in vLLM's venv (`.venv-vllm`, built by .ci/run; or RADIXD_VLLM_PYTHON), one process each:
  C  no connector              the reference: full prefill
  A  connector, radixd cold    a miss: prefill + page stores + CacheUnfinished (+ MatchPrefix with --events off:
                               the connector then has no local index of radixd's pages to answer it)
  B  connector, radixd warm    a hit: MatchPrefix + page loads, prefill of the last partial page only
Each engine first serves a short warm-up prompt, and each length one more (not timed); then --repeat
distinct prompts per length are timed.

The scheduler's side: for each batch size in --batches, engines A (cold radixd, every request a miss that
stores) and B (warm, every request a hit) serve --batch-prompts prompts of --batch-len tokens, that many
submitted together, and report what the connector cost vLLM's scheduler thread: per request the time in its
hooks (p50, p99; a step-wide hook's time is shared by the step's requests), the same less the time it waited
for a lookup while the engine had nothing else to run ("busy": what it kept the scheduler from other work),
and radixd calls per step made on the scheduler thread (an Alloc when the slot stock runs short) and on the
connector's lookup thread (MatchPrefix, LoadBack).

    python bench/vllm_bench.py [--lengths 512,1024,2048,4096] [--repeat 3] [--batches 1,16,128]
                               [--arch nemotron-h]

CPU layout (--cpus): "split" (the default) runs every engine, C included, with one OpenMP thread fewer than the
machine has CPUs, and pins radixd to the last CPU: the deployment vLLM's CPU backend recommends (cores kept
for everything beside the forward, VLLM_CPU_NUM_OF_RESERVED_CPU). "shared" leaves vLLM's defaults: on 2 CPUs
its second OpenMP thread was measured spinning on 93% of a CPU while the engine served hits, so radixd's server
and the connector's threads run against the forward or the spin. The layout is printed with the results.

--arch nemotron-h times the tiny Mamba2 hybrid instead (RadixdHybridConnector, radixd with --hybrid-cache, block
64): a hit loads the attention pages and the Mamba state at the hit's end; --mamba-chunk sets how often a miss
publishes a state (radixd's checkpoint interval).

Last line: RESULT ttft_x_<len>=<C/B> ... miss_overhead_<len>=<A/C> ... sched_p50_us_<miss|hit>_<batch>=...
max_rpcs_per_step_<miss|hit>_<batch>=...
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
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tests.conftest import ServerProc  # noqa: E402

ENGINE = ROOT / "tests" / "vllm_engine.py"
BLOCK = 32


_ENGINE_ENV: dict[str, str] = {}  # the engines' OpenMP threads (--cpus)


def _layout(how: str) -> str:
    """Set the engines' OpenMP threads for --cpus; what the run uses, in words."""
    cpus = sorted(os.sched_getaffinity(0))
    if how == "split" and len(cpus) > 1:
        _ENGINE_ENV["OMP_NUM_THREADS"] = str(len(cpus) - 1)
        return f"split: engines with {len(cpus) - 1} OpenMP threads, radixd pinned to CPU {cpus[-1]}"
    return f"shared: vLLM's default threads on {len(cpus)} CPUs, radixd unpinned"


def _server(how: str, *args: str) -> ServerProc:
    """A radixd server, pinned (every thread) to the last CPU under --cpus split."""
    srv = ServerProc(*args)
    cpus = sorted(os.sched_getaffinity(0))
    if how == "split" and len(cpus) > 1:
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="512,1024,2048,4096")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--batches", default="1,16,128", help="batch sizes for the scheduler-side costs ('' skips)")
    ap.add_argument("--batch-len", type=int, default=256)
    ap.add_argument("--batch-prompts", type=int, default=256)
    ap.add_argument("--arch", default="llama", choices=["llama", "nemotron-h"])
    ap.add_argument("--mamba-chunk", type=int, default=0, help="radixd's --mamba-chunk (nemotron-h): tokens between "
                                                               "published states (0: the config's chunk_size)")
    ap.add_argument("--cpus", default="split", choices=["split", "shared"],
                    help="split: engines get one OpenMP thread fewer than the CPUs, radixd the last CPU (see above)")
    ap.add_argument("--events", default="on", choices=["on", "off"],
                    help="radixd's --kv-events: on, the connector answers misses from its local index (no RPC)")
    args = ap.parse_args()
    py = _python()
    print("CPU layout:", _layout(args.cpus))
    model = tempfile.mkdtemp(prefix="radixd-vllm-bench-model-")
    subprocess.run([py, str(ENGINE), model, "--arch", args.arch], check=True, env={**os.environ, "PYTHONPATH": ""})
    hybrid = args.arch != "llama"
    block = 64 if hybrid else BLOCK  # the Nemotron-H engine's block (tests/vllm_engine.py)
    extra = ("--hybrid-cache", "--mamba-states", "2048", "--mamba-chunk", str(args.mamba_chunk)) if hybrid else ()
    extra += ("--kv-events",) if args.events == "on" else ()
    lengths = [int(x) for x in args.lengths.split(",")]
    rng = random.Random(7)
    warm = [rng.randrange(3, 512) for _ in range(40)]
    per = args.repeat + 1  # the first prompt of each length warms that shape up and is not counted
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in lengths for _ in range(per)]
    max_len = max(lengths) + 2 * block
    srv = _server(args.cpus, "--num-slots", str(max(65536, 2 * sum(map(len, prompts)))), "--page-size", str(block),
                     "--model-config", os.path.join(model, "config.json"), *extra)
    try:
        c = _engine(py, model, [warm] + prompts, "", max_len)[1:]
        a = _engine(py, model, [warm] + prompts, srv.target, max_len, hybrid=hybrid)[1:]
        b = _engine(py, model, [warm] + prompts, srv.target, max_len, hybrid=hybrid)[1:]  # warm-up hits: loads warmed
    finally:
        srv.stop()
    results = {}
    print(f"{'prompt':>7} {'C no conn ms':>13} {'A miss ms':>10} {'B hit ms':>9} {'B cached':>9} "
          f"{'TTFT C/B':>9} {'miss A/C':>9}   (medians of {args.repeat} prompts)")
    for i, n in enumerate(lengths):
        sl = slice(i * per + 1, (i + 1) * per)
        tc = statistics.median(r["seconds"] for r in c[sl])
        ta = statistics.median(r["seconds"] for r in a[sl])
        tb = statistics.median(r["seconds"] for r in b[sl])
        cached = min(r["cached"] for r in b[sl])
        assert all(x["tokens"] == y["tokens"] for x, y in zip(b[sl], c[sl])), "a hit changed the output"
        results[f"ttft_x_{n}"], results[f"miss_overhead_{n}"] = tc / tb, ta / tc
        print(f"{n:7d} {tc * 1e3:13.1f} {ta * 1e3:10.1f} {tb * 1e3:9.1f} {cached:9d} {tc / tb:9.2f} {ta / tc:9.2f}")
    if args.batches:
        results.update(_scheduler_side(py, model, args))
    print("RESULT " + " ".join(f"{k}={v:.3f}" for k, v in results.items()))


def _scheduler_side(py: str, model: str, args) -> dict[str, float]:
    """The connector's cost on vLLM's scheduler thread at each batch size, on misses (A) and hits (B)."""
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 512) for _ in range(args.batch_len)] for _ in range(args.batch_prompts)]
    out: dict[str, float] = {}
    print(f"\n{'batch':>5} {'mode':>4} {'requests':>8} {'steps':>6} {'p50 us':>8} {'p99 us':>8} {'busy p50':>8} "
          f"{'busy p99':>8} {'rpcs/step max':>13} {'mean':>5} {'lookup rpcs/step max':>20} {'mean':>5} "
          f"{'local misses':>12}")
    for batch in [int(x) for x in args.batches.split(",")]:
        block = 64 if args.arch != "llama" else BLOCK
        srv = _server(args.cpus, "--num-slots", str(max(65536, 2 * args.batch_len * args.batch_prompts)),
                         "--page-size", str(block), "--model-config", os.path.join(model, "config.json"),
                         *(("--hybrid-cache", "--mamba-states", "2048", "--mamba-chunk", str(args.mamba_chunk))
                           if args.arch != "llama" else ()), *(("--kv-events",) if args.events == "on" else ()))
        try:
            for mode in ("miss", "hit"):  # the first engine stores every prompt, the second finds them all
                path = tempfile.mktemp(prefix="radixd-vllm-stats-")
                _engine(py, model, prompts, srv.target, args.batch_len + 2 * block, batch, path,
                        hybrid=args.arch != "llama")
                st = json.load(open(path))
                print(f"{batch:5d} {mode:>4} {st['requests']:8d} {st['steps']:6d} {st['p50_us']:8.0f} "
                      f"{st['p99_us']:8.0f} {st['busy_p50_us']:8.0f} {st['busy_p99_us']:8.0f} {st['max_rpcs_per_step']:13d} {st['mean_rpcs_per_step']:5.2f} "
                      f"{st['max_lookup_rpcs_per_step']:20d} {st['mean_lookup_rpcs_per_step']:5.2f} "
                      f"{st['local_misses']:12d}")
                out[f"sched_p50_us_{mode}_{batch}"] = st["p50_us"]
                out[f"sched_p99_us_{mode}_{batch}"] = st["p99_us"]
                out[f"sched_busy_p50_us_{mode}_{batch}"] = st["busy_p50_us"]
                out[f"max_rpcs_per_step_{mode}_{batch}"] = st["max_rpcs_per_step"]
        finally:
            srv.stop()
    return out


if __name__ == "__main__":
    main()
