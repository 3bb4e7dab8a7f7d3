"""`radixd top`: a live view of a running server, refreshed every second (rich; `q` or Ctrl-C quits).

Everything comes from GetStats and the server's own Prometheus page (its address is in GetInfo): rates are
deltas between two refreshes, RPC p50/p99 come from the latency histogram's bucket deltas.
"""
from __future__ import annotations

import os
import select
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Optional

from prometheus_client.parser import text_string_to_metric_families


@dataclass
class Sample:
    """One refresh's readings."""

    t: float
    stats: dict
    requests: dict[str, float] = field(default_factory=dict)  # method -> calls so far
    errors: dict[str, float] = field(default_factory=dict)
    buckets: dict[str, dict[float, float]] = field(default_factory=dict)  # method -> le -> cumulative count
    gauges: dict[str, float] = field(default_factory=dict)


def scrape(url: str) -> tuple[dict, dict, dict, dict]:
    """RPC counts, errors, latency buckets per method, and the gauges top shows, from the metrics page."""
    reqs: dict[str, float] = {}
    errs: dict[str, float] = {}
    buckets: dict[str, dict[float, float]] = {}
    gauges: dict[str, float] = {}
    if not url:
        return reqs, errs, buckets, gauges
    with urllib.request.urlopen(url, timeout=2) as r:
        text = r.read().decode()
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            m = s.labels.get("method", "")
            if s.name == "radixd_rpc_requests_total":
                reqs[m] = reqs.get(m, 0.0) + s.value
            elif s.name == "radixd_rpc_errors_total":
                errs[m] = errs.get(m, 0.0) + s.value
            elif s.name == "radixd_rpc_latency_seconds_bucket":
                buckets.setdefault(m, {})[float(s.labels["le"])] = s.value
            elif s.name in ("radixd_oldest_receipt_age_seconds", "radixd_transfers_in_flight"):
                gauges[s.name] = s.value
            elif s.name == "radixd_transfer_bytes_total":
                gauges[f"transfer_{s.labels['direction']}"] = s.value
    return reqs, errs, buckets, gauges


def quantile(q: float, now: dict[float, float], before: dict[float, float]) -> Optional[float]:
    """The q-quantile of the calls between two readings of a cumulative histogram (bucket upper bound)."""
    les = sorted(now)
    counts = [now[le] - before.get(le, 0.0) for le in les]
    total = counts[-1] if counts else 0.0
    if total <= 0:
        return None
    for le, c in zip(les, counts):
        if c >= q * total:
            return le
    return les[-1]


def _ms(v: Optional[float]) -> str:
    if v is None:
        return "-"
    return ">1 s" if v == float("inf") else f"{v * 1e3:.2f} ms"


def render(info: dict, prev: Sample, cur: Sample):
    """The screen for two consecutive samples, as a rich renderable."""
    from rich.console import Group
    from rich.table import Table
    s, p = cur.stats, prev.stats
    dt = max(cur.t - prev.t, 1e-6)
    dq = s["queried_tokens_total"] - p["queried_tokens_total"]
    dh = s["hit_tokens_total"] - p["hit_tokens_total"] + s["host_hit_tokens_total"] - p["host_hit_tokens_total"]
    overall = (s["hit_tokens_total"] + s["host_hit_tokens_total"]) / max(s["queried_tokens_total"], 1)
    head = Table.grid(padding=(0, 3))
    head.add_row(f"radixd {info['version']}  instance {info['instance_id'][:12]}",
                 f"hit rate now {dh / dq:.1%}" if dq else "hit rate now -", f"overall {overall:.1%}",
                 f"sessions {s['sessions']}", f"receipts {s['receipts']}",
                 f"oldest lock {cur.gauges.get('radixd_oldest_receipt_age_seconds', 0.0):.1f} s")
    pools = Table(title="pools (tokens)", expand=True)
    for col in ("tier", "capacity", "free", "cached", "evictable", "protected", "held", "in flight"):
        pools.add_column(col, justify="right")
    keys_only = info.get("hybrid") and not info.get("device_pools")  # (no full-attention layer: keys, no KV)
    pools.add_row("keys" if keys_only else "device", str(s["capacity_tokens"]), str(s["free_tokens"]), str(s["cached_tokens"]),
                  str(s["evictable_tokens"]), str(s["protected_tokens"]), str(s["held_tokens"]),
                  str(s["in_flight_tokens"]))
    if s.get("host_capacity_tokens"):
        pools.add_row("host", str(s["host_capacity_tokens"]), str(s["host_free_tokens"]),
                      str(s["host_cached_tokens"]), str(s["host_evictable_tokens"]), str(s["host_protected_tokens"]),
                      "-", str(s["host_in_flight_tokens"]))
    if s.get("swa_capacity_tokens"):  # hybrid models: the SWA KV pool and the state pool (in states)
        cached = s["swa_evictable_tokens"] + s["swa_protected_tokens"]
        pools.add_row("swa", str(s["swa_capacity_tokens"]), str(s["swa_free_tokens"]), str(cached),
                      str(s["swa_evictable_tokens"]), str(s["swa_protected_tokens"]), str(s["swa_held_tokens"]), "-")
    if s.get("mamba_capacity"):
        cached = s["mamba_evictable"] + s["mamba_protected"]
        pools.add_row("states", str(s["mamba_capacity"]), str(s["mamba_free"]), str(cached),
                      str(s["mamba_evictable"]), str(s["mamba_protected"]), str(s["mamba_held"]), "-")
    if s.get("host_swa_capacity_tokens"):  # a hybrid model's host tier
        pools.add_row("host swa", str(s["host_swa_capacity_tokens"]), str(s["host_swa_free_tokens"]),
                      str(s["host_swa_cached_tokens"]), "-", "-", "-", "-")
    if s.get("host_mamba_capacity"):
        pools.add_row("host states", str(s["host_mamba_capacity"]), str(s["host_mamba_free"]),
                      str(s["host_mamba_cached"]), "-", "-", "-", "-")
    rates = Table.grid(padding=(0, 3))
    rates.add_row(f"evicted {(s['evicted_tokens_total'] - p['evicted_tokens_total']) / dt:,.0f} tok/s",
                  f"host evicted {(s['host_evicted_tokens_total'] - p['host_evicted_tokens_total']) / dt:,.0f} tok/s",
                  f"backups {(s['backup_tokens_total'] - p['backup_tokens_total']) / dt:,.0f} tok/s",
                  f"load-backs {(s['load_back_tokens_total'] - p['load_back_tokens_total']) / dt:,.0f} tok/s",
                  f"transfers in flight {s['transfers_in_flight']}")
    rpcs = Table(title="RPCs (since the last refresh)", expand=True)
    for col in ("method", "calls/s", "errors/s", "p50", "p99", "total"):
        rpcs.add_column(col, justify="right" if col != "method" else "left")
    for m in sorted(cur.requests, key=lambda k: -(cur.requests[k] - prev.requests.get(k, 0.0))):
        calls = cur.requests[m] - prev.requests.get(m, 0.0)
        errs = cur.errors.get(m, 0.0) - prev.errors.get(m, 0.0)
        b, pb = cur.buckets.get(m, {}), prev.buckets.get(m, {})
        rpcs.add_row(m, f"{calls / dt:,.1f}", f"{errs / dt:,.1f}", _ms(quantile(0.5, b, pb)),
                     _ms(quantile(0.99, b, pb)), f"{cur.requests[m]:,.0f}")
    return Group(head, rates, pools, rpcs)


def sample(client, url: str) -> Sample:
    reqs, errs, buckets, gauges = scrape(url)
    return Sample(time.monotonic(), client.stats(), reqs, errs, buckets, gauges)


def _key_pressed(timeout: float) -> Optional[str]:
    r, _, _ = select.select([sys.stdin], [], [], timeout)
    return os.read(sys.stdin.fileno(), 1).decode(errors="ignore") if r else None


def run(client, interval: float = 1.0, iterations: int = 0, console=None) -> None:
    """Refresh until `q`, Ctrl-C or `iterations` refreshes; plain frames when stdout is not a terminal."""
    from rich.console import Console
    from rich.live import Live
    console = console or Console()
    info = client.info()
    prev = sample(client, info["metrics_url"])
    interactive = console.is_terminal and sys.stdin.isatty() and not iterations
    if not interactive:
        for _ in range(iterations or 1):
            time.sleep(interval)
            cur = sample(client, info["metrics_url"])
            console.print(render(info, prev, cur))
            prev = cur
        return
    import termios
    import tty
    fd = sys.stdin.fileno()
    old = termios.tcgetattr(fd)
    try:
        tty.setcbreak(fd)
        with Live(console=console, screen=True, auto_refresh=False) as live:
            while True:
                if _key_pressed(interval) in ("q", "Q"):
                    return
                cur = sample(client, info["metrics_url"])
                live.update(render(info, prev, cur), refresh=True)
                prev = cur
    except KeyboardInterrupt:
        return
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, old)
