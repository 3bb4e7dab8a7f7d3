"""SGLang backend benchmark: what `radixd.sglang.RadixdRadixCache` costs SGLang's scheduler thread, per request
and in radixd calls per scheduler step, at batch sizes 1, 16 and 128, against SGLang's own RadixCache doing
the same operations in the same run.

SGLang's scheduler does not run on CPU here, so its calls are driven as it makes them, on SGLang 0.5.23's own
cache classes and CPU KV pools (in `.venv-sglang`, built by .ci/run; or RADIXD_SGLANG_PYTHON), in the order of
SGLang's scheduler loop, through the three scheduler methods the backend hooks: a step queues --batch requests
(`_add_request_to_queue`: the backend's `queued`), forms the batch (`get_new_batch_prefill`: the waiting requests
admitted, each matched, loaded back on a radixd hit and given slots; the backend holds back a request whose lookup
is still out while the engine runs others, and copies the pass's load-backs at its end), runs "the forward" (not
timed: it writes the admitted requests' KV) and processes its results (`process_batch_result`: the requests
finishing this step checkpointed and released, then the backend's `end_step`). A request runs --decode-steps steps
after its prefill step, so the engine has other work when the next step's requests arrive (0: it is idle then, and
a pass waits for their lookups: "idle" time, left out of the "busy" figures as in bench/vllm_bench.py).
Timed: every cache call of a request, its slots' allocation included (a pass-wide or step-wide call's time shared
by the requests it served). Two modes: "miss" (radixd cold: every request stores its pages) and "hit" (a fresh
engine on the same prompts: every request loads them from radixd). RPCs per step: on the scheduler thread, and on
the backend's lookup and store threads (after each step, untimed, the bench lets those threads finish the step's
round, as they would during the next forward).

    python bench/sglang_bench.py [--batches 1,16,128] [--prompts 256] [--length 256] [--page 16] [--events on|off]
                                 [--repeats 3] [--forward-mb 64] [--decode-steps 1] [--pool-tokens 65536]

Each batch size runs `--repeats` rounds, on new prompts each round, of two pairs: SGLang alone beside the miss run,
then beside the hit run, the runs of a pair stepped in turn so that the machine's drift hits them alike; a
figure is the median over rounds, and the extra time the median of each pair's difference. The hit's pair has a
third run: SGLang alone with each step's prompts' whole pages in its own tree before they arrive (inserted untimed,
then left cache-cold): SGLang's own hit, whose calls walk the same two-node paths a load-back leaves; the hit's
time over it is what radixd adds to a hit SGLang would have served itself. The untimed forward streams
`--forward-mb` through the CPU's caches, as a model's forward does (the scheduler's next calls run cache-cold, with or
without the backend).

`loaded`: tokens a run's hits took from radixd; `prefetched`: those the lookup thread had copied ahead into spare
SGLang slots (CPU), which the admission pass put into SGLang's tree (no copy on the scheduler thread). SGLang's
pool holds --pool-tokens (an engine's pool is far larger than what the batch's live requests take, and the
backend's spare stock is at most a quarter of it).

Last line: RESULT sched_p50_us_<mode>_<batch>=... extra_p50_us_<mode>_<batch>=... (over SGLang's own cache)
busy_extra_p50_us_<mode>_<batch>=... (less idle waits) busy_extra_less_copy_p50_us_<mode>_<batch>=... (less the
load-backs' KV copy too: the bytes a hit moves, which a GPU engine queues on its stream)
max_rpcs_per_step_<mode>_<batch>=... busy_over_own_hit_p50_us_<batch>=... busy_over_own_hit_less_copy_p50_us_<batch>=...
(the hit over SGLang's own hit)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYERS, HEADS, DIM = 2, 2, 32


def _python() -> str:
    for cand in (os.environ.get("RADIXD_SGLANG_PYTHON"), ROOT / ".venv-sglang" / "bin" / "python"):
        if cand and Path(cand).exists():
            return str(cand)
    raise SystemExit("no SGLang venv: run .ci/run once (it builds .venv-sglang) or set RADIXD_SGLANG_PYTHON")


def engine_side(target: str, batch: int, prompts: int, length: int, page: int, repeats: int = 3,
                forward_mb: int = 64, decode_steps: int = 1, pool: int = 65536) -> dict:
    """In SGLang's venv: at one batch size, `repeats` rounds of SGLang alone, then the backend on new prompts
    (miss), then a fresh backend on the same prompts (hit); per-request times and RPCs, per round."""
    import random
    from array import array

    sys.path.insert(0, str(ROOT))
    from tests.sglang_cpu import Kv, Req, stub_torchvision
    stub_torchvision()
    import numpy as np
    import torch
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InitLoadBackParams, InsertParams, MatchPrefixParams
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
    from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey
    from radixd.sglang.backend import RadixdRadixCache, hook_scheduler

    texts: list = []
    scratch = np.zeros(forward_mb << 18, np.float32)  # what a forward streams through the CPU's caches
    live = batch * (decode_steps + 3) + 2  # requests at once: queued, held back, running
    slots = max(live * (length + page) * 2, pool)

    def build(backend: bool):
        r2t = ReqToTokenPool(size=live + 1, max_context_len=length + page, device="cpu", enable_memory_saver=False)
        kv = MHATokenToKVPool(size=slots, page_size=page, dtype=torch.float32, head_num=HEADS, head_dim=DIM,
                              layer_num=LAYERS, device="cpu", enable_memory_saver=False)
        alloc = PagedTokenToKVPoolAllocator(slots, page, torch.float32, "cpu", kv, False)
        params = CacheInitParams(disable=False, req_to_token_pool=r2t, token_to_kv_pool_allocator=alloc, page_size=page)
        return (RadixdRadixCache(params, target=target) if backend else RadixCache(params)), r2t, kv, alloc

    class Running:
        """The running batch, as the backend's admission hook reads it."""

        def __init__(self, reqs: list):
            self.reqs = reqs

        def is_empty(self) -> bool:
            return not self.reqs

    class Scheduler:
        """SGLang's scheduler as the cache sees it: its waiting queue and the three methods the backend hooks (as
        `factory` does inside SGLang's Scheduler). The admission pass admits every waiting request."""

        def __init__(self, admit):
            self.waiting_queue: list = []
            self.chunked_req = None
            self.admit = admit

        def _add_request_to_queue(self, req) -> None:
            self.waiting_queue.append(req)

        def get_new_batch_prefill(self, running: Running) -> list:
            admitted, self.waiting_queue = list(self.waiting_queue), []
            for r in admitted:
                self.admit(r)
            return admitted

        def process_batch_result(self, results) -> None:
            results()

    def run(backend: bool, tag: str, own_hit: bool = False) -> dict:
        cache, r2t, kv, alloc = build(backend)
        rows = list(range(1, live + 1))  # free req_to_token rows
        spent: dict[str, float] = {}
        idled: dict[str, float] = {}
        copied: dict[str, float] = {}  # (the load-backs' KV copy, shared by the pass's requests)
        steps: list[tuple[int, int, int]] = []
        phases = dict(queued=0.0, admit=0.0, idle=0.0, copy=0.0, match=0.0, load_back=0.0, alloc=0.0,
                      checkpoint=0.0, release=0.0, evict=0.0, end_step=0.0)
        inner = [0.0]

        def admit(r) -> None:  # a request admitted: matched (+ loaded back), given slots (timed whole: SGLang
            t0 = time.perf_counter()  # alone allocates a prompt's slots here, the backend a hit's at its load-back)
            ids = r.full_untruncated_fill_ids
            key = RadixKey(ids, None, limit=len(ids) - 1)
            m = cache.match_prefix(MatchPrefixParams(key=key, req=r))
            t1 = time.perf_counter()
            phases["match"] += t1 - t0
            node = m.last_device_node
            if m.host_hit_length:
                _, node = cache.init_load_back(InitLoadBackParams(m.best_match_node, m.host_hit_length, req=r))
            t2 = time.perf_counter()
            phases["load_back"] += t2 - t1
            prefix = cache.path_device_indices(node).to(torch.int64)
            lock = cache.lock(node)
            have, n = len(prefix), len(ids)
            need = -(-(n - have) // page) * page
            new = alloc.alloc(need)
            if new is None:  # as SGLang's scheduler does: evict what it needs (the backend may wait for its
                t = time.perf_counter()  # stores to free SGLang's slots)
                cache.evict(EvictParams(num_tokens=need))
                phases["evict"] += time.perf_counter() - t
                new = alloc.alloc(need)
            assert new is not None, "the bench's pool is too small"
            new = new[:n - have]
            r2t.req_to_token[r.kv.req_pool_idx, :have] = prefix.to(torch.int32)
            r2t.req_to_token[r.kv.req_pool_idx, have:n] = new.to(torch.int32)
            r.kv.cache_protected_len, r.kv.kv_committed_len, r.last_node, r.lock = have, n, node, lock
            took = time.perf_counter() - t0
            phases["alloc"] += took - (t2 - t0)
            spent[r.rid] += took
            inner[0] += took

        sched = Scheduler(admit)
        if backend:
            hook_scheduler(sched, cache)
        running: list = []  # (request, the step whose results finish it)
        g = step = 0
        while g < prompts or sched.waiting_queue or running:
            before = (getattr(cache, "rpcs", 0), *((cache.lookups.rpcs, cache.stores.rpcs) if backend else (0, 0)))
            if g < prompts:  # the step's new requests arrive
                reqs = [Req(f"{tag}{g + i}", texts[g + i], Kv(rows.pop())) for i in range(min(batch, prompts - g))]
                if own_hit:  # (untimed) SGLang alone with their prefixes in its own tree already, as a radixd hit
                    for r in reqs:  # leaves them: its own hit, what the hit is measured against
                        ids = r.full_untruncated_fill_ids
                        m = (len(ids) - 1) // page * page
                        cache.insert(InsertParams(key=RadixKey(ids[:m], None), value=alloc.alloc(m)))
                    np.add(scratch, 1.0, out=scratch)  # (cold at admission, as the load-back's inserts are)
                g += len(reqs)
                t = time.perf_counter()
                for r in reqs:
                    sched._add_request_to_queue(r)
                took = time.perf_counter() - t
                phases["queued"] += took
                for r in reqs:
                    spent[r.rid], idled[r.rid], copied[r.rid] = took / len(reqs), 0.0, 0.0
            waiting = list(sched.waiting_queue)
            inner[0], idle0, copy0 = 0.0, getattr(cache, "idle_waited", 0.0), getattr(cache, "copied_in", 0.0)
            t = time.perf_counter()
            admitted = sched.get_new_batch_prefill(Running([r for r, _ in running]))  # (hooked)
            took = time.perf_counter() - t
            idle = getattr(cache, "idle_waited", 0.0) - idle0
            copy = getattr(cache, "copied_in", 0.0) - copy0
            phases["idle"] += idle
            phases["copy"] += copy
            phases["admit"] += took - inner[0] - idle - copy
            for r in waiting:  # the pass's own cost (beyond each admitted request's), any wait, the load-backs' copy:
                spent[r.rid] += (took - inner[0]) / len(waiting)  # the queue's
                idled[r.rid] += idle / len(waiting)
                copied[r.rid] += copy / len(waiting)
            for r in admitted:  # "the forward" (not timed)
                row = r2t.req_to_token[r.kv.req_pool_idx]
                new = row[r.kv.cache_protected_len:r.kv.kv_committed_len].to(torch.int64)
                for layer in range(LAYERS):
                    kv.k_buffer[layer][new] = 1.0
                    kv.v_buffer[layer][new] = 2.0
            if scratch.size:  # (a real forward leaves the scheduler's next calls cache-cold, backend or not)
                np.add(scratch, 1.0, out=scratch)
            running += [(r, step + decode_steps) for r in admitted]
            ending = [r for r, at in running if at == step]
            running = [(r, at) for r, at in running if at != step]
            stepped = ending + [r for r, _ in running]
            inside = [0.0]

            def results() -> None:  # the step's finished requests checkpointed and released
                t0 = time.perf_counter()
                for r in ending:
                    r.done = True
                    n = r.kv.kv_committed_len
                    t = time.perf_counter()
                    cache.checkpoint(r, up_to=n)
                    t1 = time.perf_counter()
                    phases["checkpoint"] += t1 - t
                    cache.unlock(r.lock)
                    cache.on_release(r, checkpointed=True)
                    phases["release"] += time.perf_counter() - t1
                    spent[r.rid] += time.perf_counter() - t
                    tail = r2t.req_to_token[r.kv.req_pool_idx, r.kv.cache_protected_len:n].to(torch.int64)
                    if tail.numel():
                        alloc.free(tail)
                    rows.append(r.kv.req_pool_idx)
                inside[0] = time.perf_counter() - t0
            if stepped:
                t = time.perf_counter()
                sched.process_batch_result(results)  # (hooked: the step's end follows)
                rest = time.perf_counter() - t - inside[0]
                phases["end_step"] += rest
                for r in stepped:
                    spent[r.rid] += rest / len(stepped)
            if backend:  # (not timed) the step's round done before the next step, as during a GPU forward of
                cache.lookups.wait_idle(1.0)  # this size: each step's calls are counted in it
                cache.stores.wait_idle(1.0)
            after = (getattr(cache, "rpcs", 0), *((cache.lookups.rpcs, cache.stores.rpcs) if backend else (0, 0)))
            steps.append(tuple(a - b for a, b in zip(after, before)))
            cache.evict(EvictParams(num_tokens=RadixCache.evictable_size(cache)))  # room for the next step's
            # prompts: the tree emptied (the backend's spare slots for copies ahead stay)
            step += 1
            yield None  # (the paired run's step next)
        loaded = getattr(cache, "loaded_tokens", 0)
        prefetched = getattr(cache, "prefetched_tokens", 0)
        if backend:
            cache.settle()
            cache.shutdown()
        s = sorted(spent.values())
        b = sorted(spent[k] - idled[k] for k in spent)
        c = sorted(spent[k] - idled[k] - copied[k] for k in spent)
        yield dict(p50_us=s[len(s) // 2] * 1e6, p99_us=s[min(len(s) - 1, int(0.99 * len(s)))] * 1e6,
                   busy_p50_us=b[len(b) // 2] * 1e6, busy_p99_us=b[min(len(b) - 1, int(0.99 * len(b)))] * 1e6,
                   nocopy_p50_us=c[len(c) // 2] * 1e6,
                   max_rpcs=max(x[0] for x in steps), mean_rpcs=float(np.mean([x[0] for x in steps])),
                   max_bg=max(x[1] + x[2] for x in steps), mean_bg=float(np.mean([x[1] + x[2] for x in steps])),
                   loaded=loaded, prefetched=prefetched, phases_us={k: v / prompts * 1e6 for k, v in phases.items()})

    from sglang.srt.runtime_context import publish
    from sglang.srt.server_args import ServerArgs
    publish(ServerArgs(model_path="dummy", device="cpu", page_size=page), role="scheduler")
    def paired(*runs) -> list[dict]:
        """Runs step by step in turn (SGLang alone, then the backend), so that drift hits them alike."""
        done = [None] * len(runs)
        while any(d is None for d in done):
            done = [d or next(r) for d, r in zip(done, runs)]
        return done

    rounds: dict[str, list] = {"plain_miss": [], "miss": [], "plain_hit": [], "hit": [], "own_hit": []}
    for k in range(repeats):
        rng = random.Random(5 + k)
        texts[:] = [array("q", [rng.randrange(1, 30000) for _ in range(length)]) for _ in range(prompts)]
        for mode, tag in (("miss", "a"), ("hit", "b")):  # miss: radixd has none of these prompts, every request
            # stores; hit: a fresh engine on the same prompts, every request loads
            if mode == "hit":
                plain, own, ours = paired(run(False, f"p{k}{tag}-"), run(False, f"o{k}{tag}-", own_hit=True),
                                          run(True, f"{tag}{k}-"))
                rounds["own_hit"].append(own)
            else:
                plain, ours = paired(run(False, f"p{k}{tag}-"), run(True, f"{tag}{k}-"))
            rounds[f"plain_{mode}"].append(plain)
            rounds[mode].append(ours)
    return rounds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,16,128")
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--length", type=int, default=256)
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--events", default="on", choices=["on", "off"],
                    help="radixd's --kv-events: on, the backend answers misses from its local index (no lookup)")
    ap.add_argument("--repeats", type=int, default=3, help="rounds of the three runs, interleaved (medians)")
    ap.add_argument("--forward-mb", type=int, default=64,
                    help="MB the untimed forward streams through the CPU's caches each step (0: none)")
    ap.add_argument("--decode-steps", type=int, default=1,
                    help="steps a request runs after its prefill step (0: the engine is idle when the next arrive)")
    ap.add_argument("--pool-tokens", type=int, default=65536,
                    help="SGLang's KV pool, in tokens (at least twice what the batch's live requests take)")
    ap.add_argument("--engine", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.engine:
        print(json.dumps(engine_side(args.engine, int(args.batches), args.prompts, args.length, args.page,
                                     args.repeats, args.forward_mb, args.decode_steps, args.pool_tokens)))
        return
    sys.path.insert(0, str(ROOT))
    from tests.conftest import ServerProc
    py = _python()
    results: dict[str, float] = {}
    print(f"{'batch':>5} {'mode':>5} {'p50 us':>8} {'p99 us':>8} {'busy p50':>8} {'SGLang alone p50':>16} "
          f"{'extra p50':>9} {'busy extra':>10} "
          f"{'rpcs/step max':>13} {'mean':>5} {'background rpcs/step max':>24} {'mean':>5} {'loaded':>7} {'prefetched':>10}")
    for batch in [int(x) for x in args.batches.split(",")]:
        prompts = max(args.prompts, 4 * batch)  # several steps at every batch size
        srv = ServerProc("--num-slots", str(3 * prompts * (args.length + args.page)), "--page-size",
                         str(args.page), "--layers", str(LAYERS), "--kv-heads", str(HEADS), "--head-dim", str(DIM),
                         "--dtype", "float32", *(("--kv-events",) if args.events == "on" else ()))
        try:
            r = subprocess.run([py, __file__, "--engine", srv.target, "--batches", str(batch), "--prompts",
                                str(prompts), "--length", str(args.length), "--page", str(args.page), "--repeats",
                                str(args.repeats), "--forward-mb", str(args.forward_mb),
                                "--decode-steps", str(args.decode_steps), "--pool-tokens", str(args.pool_tokens)],
                               capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ""}, timeout=1800)
        finally:
            srv.stop()
        if r.returncode != 0:
            raise SystemExit(r.stdout[-2000:] + r.stderr[-4000:])
        rounds = json.loads(r.stdout.strip().splitlines()[-1])
        for mode in ("miss", "hit"):
            ms, plains = rounds[mode], rounds[f"plain_{mode}"]
            base = statistics.median(x["p50_us"] for x in plains)
            p50 = statistics.median(x["p50_us"] for x in ms)
            p99 = statistics.median(x["p99_us"] for x in ms)
            extras = [m["p50_us"] - b["p50_us"] for m, b in zip(ms, plains)]  # each against its own pair
            extra = statistics.median(extras)
            busy = statistics.median(x["busy_p50_us"] for x in ms)
            busy_extras = [m["busy_p50_us"] - b["p50_us"] for m, b in zip(ms, plains)]
            busy_extra = statistics.median(busy_extras)
            nocopy_extra = statistics.median(m["nocopy_p50_us"] - b["p50_us"] for m, b in zip(ms, plains))
            mx, mean = max(x["max_rpcs"] for x in ms), statistics.mean(x["mean_rpcs"] for x in ms)
            mx_bg, mean_bg = max(x["max_bg"] for x in ms), statistics.mean(x["mean_bg"] for x in ms)
            print(f"{batch:5d} {mode:>5} {p50:8.0f} {p99:8.0f} {busy:8.0f} {base:16.0f} {extra:9.0f} "
                  f"{busy_extra:10.0f} "
                  f"{mx:13d} {mean:5.2f} {mx_bg:24d} {mean_bg:5.2f} {min(x['loaded'] for x in ms):7d} {min(x['prefetched'] for x in ms):10d}")
            results[f"sched_p50_us_{mode}_{batch}"] = p50
            results[f"extra_p50_us_{mode}_{batch}"] = extra
            results[f"busy_extra_p50_us_{mode}_{batch}"] = busy_extra
            results[f"busy_extra_less_copy_p50_us_{mode}_{batch}"] = nocopy_extra
            results[f"max_rpcs_per_step_{mode}_{batch}"] = mx

            def phases(runs: list) -> str:
                return ", ".join(f"{k} {statistics.mean(x['phases_us'][k] for x in runs):.0f}" for k in runs[0]["phases_us"])
            print(f"{'':11} extra p50 per round: {', '.join(f'{e:.0f}' for e in extras)} (busy: "
                  f"{', '.join(f'{e:.0f}' for e in busy_extras)}; busy less the load-backs' KV copy: "
                  f"{nocopy_extra:.0f}); per request, mean us: "
                  f"{phases(ms)}   (SGLang alone: {phases(plains)})")
            if mode == "hit":  # against SGLang's own hit of the same prefixes: what radixd adds to a hit
                owns = rounds["own_hit"]
                over = [m["busy_p50_us"] - o["p50_us"] for m, o in zip(ms, owns)]
                over_nocopy = statistics.median(m["nocopy_p50_us"] - o["p50_us"] for m, o in zip(ms, owns))
                print(f"{'':11} SGLang's own hit p50 {statistics.median(x['p50_us'] for x in owns):.0f}; busy over "
                      f"it per round: {', '.join(f'{e:.0f}' for e in over)} (less the load-backs' KV copy: "
                      f"{over_nocopy:.0f}); SGLang's own hit, per request, mean us: {phases(owns)}")
                results[f"busy_over_own_hit_p50_us_{batch}"] = statistics.median(over)
                results[f"busy_over_own_hit_less_copy_p50_us_{batch}"] = over_nocopy
    print("RESULT " + " ".join(f"{k}={v:.3f}" for k, v in results.items()))


if __name__ == "__main__":
    main()
