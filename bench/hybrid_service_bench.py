"""Hybrid round trips: MatchPrefix and CacheFinished on a hybrid model's server against the same RPCs on a
plain model's server of the same FULL size, timed pairwise in one run (goal: within 10%).

Two pairs of servers: Gemma 3 (sliding window) with --hybrid-cache against the same model cached as full
attention, and Nemotron-H (Mamba2) with --hybrid-cache against a plain model with its attention layers' geometry.
Each call is timed back to back with its twin on the other server, in random order, the client pinned to one
CPU and both servers to another (as bench/service_bench.py does; `--no-pin` to not). A request is a
conversation turn: a system prompt shared by many, a history, a new question. MatchPrefix locks (and unlocks,
untimed); CacheFinished inserts a fresh turn whose slots (and state) were allocated untimed.

    python bench/hybrid_service_bench.py [--requests 1500] [--runs 3] [--no-pin]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from radixd.client import CacheClient

sys.path.insert(0, str(Path(__file__).resolve().parent))
from service_bench import paired, pin_to  # noqa: E402

CONFIGS = Path(__file__).resolve().parent.parent / "tests" / "configs"
PAGE = 16
PAIRS = {
    "swa (gemma3-text)": (["--model-config", str(CONFIGS / "gemma3-text.json"), "--hybrid-cache"],
                          ["--model-config", str(CONFIGS / "gemma3-text.json")]),
    "mamba (nemotron-h-4b)": (["--model-config", str(CONFIGS / "nemotron-h-4b.json"), "--hybrid-cache",
                               "--mamba-states", "48"],
                              ["--layers", "4", "--kv-heads", "8", "--head-dim", "128", "--dtype", "bfloat16"]),
}


def start(args: list[str], d: str, name: str) -> tuple[subprocess.Popen, str]:
    sock = os.path.join(d, f"{name}.sock")
    p = subprocess.Popen([sys.executable, "-m", "radixd.server.cli", "serve", "--listen", f"unix:{sock}",
                          "--device", "cpu", "--num-slots", "65536", "--page-size", str(PAGE),
                          "--metrics-addr", "", *args], stdout=subprocess.PIPE, text=True)
    line = p.stdout.readline()
    assert "ready" in line, line
    return p, f"unix://{sock}"


class Side:
    """One server as a scheduler sees it: finish a turn, match a prompt."""

    def __init__(self, target: str):
        self.c = CacheClient(target, name="bench")
        self.states = bool(self.c.info().get("state_pool"))

    def prepare(self, tokens: np.ndarray) -> dict:
        """Allocate a turn's slots (and state), untimed."""
        if self.states:
            a = self.c.alloc_hybrid([len(tokens)], mamba_states=1)
            return dict(tokens=tokens, indices=a.full[0], mamba_value=int(a.states[0]))
        return dict(tokens=tokens, indices=self.c.alloc(len(tokens)))

    def finish(self, item: dict) -> None:
        self.c.cache_finished([item])

    def match(self, tokens: np.ndarray) -> int:
        return self.c.match_prefix(tokens, lock=True).receipt_id


def turns(n: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    systems = [rng.integers(0, 32000, 512, dtype=np.int32) for _ in range(6)]
    out = []
    for _ in range(n):
        hist = rng.integers(0, 32000, int(rng.integers(1, 40)) * PAGE, dtype=np.int32)
        out.append(np.concatenate([systems[int(rng.integers(6))], hist]))
    return out


def one_run(name: str, hybrid_args, plain_args, n: int, seed: int, pin: bool) -> tuple[float, float]:
    d = tempfile.mkdtemp(prefix="radixd-hbench-")
    procs = []
    try:
        (ph, th), (pp, tp) = start(hybrid_args, d, "hybrid"), start(plain_args, d, "plain")
        procs = [ph, pp]
        if pin and len(os.sched_getaffinity(0)) >= 2:
            cpus = sorted(os.sched_getaffinity(0))
            pin_to(os.getpid(), {cpus[0]})
            for p in procs:
                pin_to(p.pid, {cpus[1]})
        h, p = Side(th), Side(tp)
        reqs = turns(n, seed)
        for tok in reqs[:200]:  # warm both trees the same way
            h.finish(h.prepare(tok))
            p.finish(p.prepare(tok))
        fin_h, fin_p = [], []
        for at in range(200, len(reqs), 25):  # slots for 25 turns at a time (held slots do not fit the pools)
            items_h = [h.prepare(t) for t in reqs[at:at + 25]]
            items_p = [p.prepare(t) for t in reqs[at:at + 25]]
            a, b = paired(lambda i: h.finish(items_h[i]), lambda i: p.finish(items_p[i]), len(items_h), seed + at)
            fin_h += a
            fin_p += b
        prompts = [np.concatenate([t, np.arange(37, dtype=np.int32)]) for t in reqs]
        rh: list[int] = []
        rp: list[int] = []
        m_h, m_p = paired(lambda i: rh.append(h.match(prompts[i])), lambda i: rp.append(p.match(prompts[i])),
                          len(prompts), seed + 1)
        h.c.unlock(rh)
        p.c.unlock(rp)
        assert h.c.check() == [] and p.c.check() == []
        match = float(np.median(m_h) / np.median(m_p))
        fin = float(np.median(fin_h) / np.median(fin_p))
        print(f"  {name}: MatchPrefix p50 {np.median(m_h) * 1e6:.0f} vs {np.median(m_p) * 1e6:.0f} us ({match:.3f}x), "
              f"CacheFinished p50 {np.median(fin_h) * 1e6:.0f} vs {np.median(fin_p) * 1e6:.0f} us ({fin:.3f}x)",
              flush=True)
        h.c.close()
        p.c.close()
        return match, fin
    finally:
        for p in procs:
            p.terminate()
            p.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=1500)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--no-pin", action="store_true")
    a = ap.parse_args()
    for name, (hy, pl) in PAIRS.items():
        res = [one_run(name, hy, pl, a.requests, 11 + r, not a.no_pin) for r in range(a.runs)]
        m = float(np.median([r[0] for r in res]))
        f = float(np.median([r[1] for r in res]))
        print(f"RESULT {name}: hybrid/plain p50, median of {a.runs} runs: MatchPrefix {m:.3f}x, "
              f"CacheFinished {f:.3f}x (goal <= 1.10)", flush=True)


if __name__ == "__main__":
    main()
