"""Replay a Mooncake trace through a real radixd server: token hit rate with the device tier alone and with a
host tier of --host-x times its size (same device capacity), for each write policy.

Each request: MatchPrefix(lock) -> LoadBack when the host holds more of the prefix (waits for the copy)
-> Alloc for the rest -> CacheFinished. Token ids come from the trace's block ids (512 pseudo-random tokens
per id, as ../shared/traces/README.md says).

    python bench/trace_replay.py [--trace conversation_trace.jsonl] [--requests 1500] [--device-tokens 262144]

Last line: RESULT device_only=<hit rate> write_through=<..> write_through_selective=<..> write_back=<..>
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from radixd.client import CacheClient

HERE = Path(__file__).resolve().parent
BLOCK = 512


def requests(name: str, n: int) -> list[np.ndarray]:
    for root in (HERE.parent.parent / "shared" / "traces", HERE.parent / "shared" / "traces", HERE / "traces"):
        if (root / name).exists():  # (the last: a slice of the conversation trace kept in the repository)
            break
    else:
        raise SystemExit(f"trace {name} not found next to the repository (../shared/traces)")
    blocks: dict[int, np.ndarray] = {}
    out = []
    with open(root / name) as f:
        for i, line in enumerate(f):
            if i >= n:
                break
            req = json.loads(line)
            parts = [blocks.setdefault(b, np.random.default_rng(b).integers(0, 32000, BLOCK, dtype=np.int32))
                     for b in req["hash_ids"]]
            out.append(np.concatenate(parts)[:req["input_length"]])
    return out


def request_cycle(c: CacheClient, toks: np.ndarray) -> tuple[int, int]:
    """One request as an engine makes it; returns (device hit tokens, tokens loaded back from the host)."""
    m = c.match_prefix(toks, lock=True)
    prefix, receipt, loaded = m.indices, m.receipt_id, 0
    if m.host_hit_len:
        lb = c.load_back(receipt)
        if lb.loaded_len:
            c.wait_transfers([lb.transfer_id])
            loaded = lb.loaded_len
        prefix, receipt = lb.indices, lb.receipt_id
    need = len(toks) - len(prefix)
    new = c.alloc(need)  # whole pages: give back the slots past the prompt
    if len(new) > need:
        c.free(new[need:])
        new = new[:need]
    c.cache_finished([dict(tokens=toks, indices=np.concatenate([prefix, new]), prev_prefix_len=len(prefix),
                           receipt_id=receipt)])
    return m.matched_len, loaded


def replay(reqs: list[np.ndarray], device_tokens: int, host_tokens: int, policy: str, page: int) -> dict:
    d = tempfile.mkdtemp(prefix="radixd-replay-")
    sock = os.path.join(d, "s.sock")
    host = ["--host-slots", str(host_tokens), "--write-policy", policy] if host_tokens else []
    server = subprocess.Popen([sys.executable, "-m", "radixd.server.cli", "serve", "--listen", f"unix:{sock}",
                               "--device", "cpu", "--num-slots", str(device_tokens), "--page-size", str(page),
                               "--layers", "2", "--kv-heads", "1", "--head-dim", "16", *host],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert "ready" in server.stdout.readline()
        total = device_hit = loaded = 0
        t0 = time.perf_counter()
        with CacheClient(f"unix://{sock}", name="replay") as c:
            for toks in reqs:
                if len(toks) > device_tokens // 2:
                    continue  # a prompt must fit beside what the cache keeps locked
                hit, back = request_cycle(c, toks)
                device_hit += hit
                loaded += back
                total += len(toks)
            s = c.stats()
            assert c.check() == []
        return dict(hit=(device_hit + loaded) / total, device_hit=device_hit / total, loaded=loaded,
                    backups=s["backup_tokens_total"], host_evicted=s["host_evicted_tokens_total"],
                    seconds=time.perf_counter() - t0)
    finally:
        server.terminate()
        server.wait(10)


def replay_args(doc: str, device_tokens: int) -> argparse.ArgumentParser:
    """The flags of a benchmark that replays a trace through servers (this one, events_service_bench.py)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", default="conversation_trace.jsonl")
    ap.add_argument("--requests", type=int, default=1500)
    ap.add_argument("--device-tokens", type=int, default=device_tokens)
    ap.add_argument("--host-x", type=float, default=4.0)
    ap.add_argument("--page", type=int, default=16)
    return ap


def main() -> None:
    args = replay_args(__doc__, 262144).parse_args()
    reqs = requests(args.trace, args.requests)
    print(f"{args.trace}: {len(reqs)} requests, {sum(map(len, reqs))} prompt tokens; device {args.device_tokens} "
          f"tokens, host {args.host_x:g}x")
    print(f"{'config':26} {'hit rate':>9} {'device hit':>11} {'loaded back':>12} {'backed up':>10} "
          f"{'host evicted':>13} {'s':>6}")
    results = {}
    host = int(args.device_tokens * args.host_x)
    for name, h, policy in [("device_only", 0, ""), ("write_through", host, "write_through"),
                            ("write_through_selective", host, "write_through_selective"),
                            ("write_back", host, "write_back")]:
        r = replay(reqs, args.device_tokens, h, policy, args.page)
        results[name] = r["hit"]
        print(f"{name:26} {r['hit']:9.3f} {r['device_hit']:11.3f} {r['loaded']:12d} {r['backups']:10d} "
              f"{r['host_evicted']:13d} {r['seconds']:6.1f}")
    print("RESULT " + " ".join(f"{k}={v:.3f}" for k, v in results.items()))


if __name__ == "__main__":
    main()
