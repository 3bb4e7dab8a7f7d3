"""`radixd simulate`: what-if replays of a trace through the real tree, in process, over a grid of cache sizes,
host tiers, eviction policies and page sizes (a hybrid model: SWA pool sizes and state slots); a table, a CSV and
(with matplotlib) PNG plots.

Each request: match (device, then host: a load-back brings the host part in), lock the prefix, evict for the
rest, insert (write-through backups to the host tier happen at once; copies are not simulated), unlock. Slots
are plain numbers; only the tree's decisions are simulated, so the result is the tree's hit rate on that
traffic, not a timing. Traces are Mooncake JSONL (`hash_ids` of 512-token blocks, `input_length`), expanded
to token ids block by block (deterministic per block id, as ../shared/traces/README.md describes), one
request at a time, so memory stays at the tree's own size.
"""
from __future__ import annotations

import csv
import itertools
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from typing import Callable, Iterable, Iterator, Optional

import numpy as np

from .tree import RadixTree

BLOCK = 512


def trace_requests(path: str, limit: Optional[int] = None) -> Iterator[np.ndarray]:
    """Token ids of each request of a Mooncake-format trace (blocks regenerated from their ids)."""
    with open(path) as fh:
        for i, line in enumerate(fh):
            if limit is not None and i >= limit:
                return
            req = json.loads(line)
            parts = [np.random.default_rng(b).integers(0, 32000, BLOCK, dtype=np.int32) for b in req["hash_ids"]]
            yield np.concatenate(parts)[:req["input_length"]] if parts else np.zeros(0, np.int32)


def synthetic_requests(n: int, seed: int = 0) -> Iterator[np.ndarray]:
    """Multi-turn conversations over a few shared system prompts (a stand-in when no trace is given)."""
    rng = np.random.default_rng(seed)
    systems = [rng.integers(0, 32000, int(rng.integers(200, 1200)), dtype=np.int32) for _ in range(8)]
    convs: list[np.ndarray] = []
    for _ in range(n):
        if convs and rng.random() < 0.6:
            i = int(rng.integers(len(convs)))
            convs[i] = np.concatenate([convs[i], rng.integers(0, 32000, int(rng.integers(50, 400)), dtype=np.int32)])
            yield convs[i]
        else:
            c = np.concatenate([systems[int(rng.integers(len(systems)))],
                                rng.integers(0, 32000, int(rng.integers(50, 600)), dtype=np.int32)])
            convs.append(c)
            if len(convs) > 200:
                convs.pop(0)
            yield c


class _Slots:
    """A free list of slot numbers (a stack in a numpy array)."""

    def __init__(self, n: int):
        self.free = np.arange(n, dtype=np.int32)
        self.top = n

    def take(self, n: int) -> np.ndarray:
        self.top -= n
        return self.free[self.top:self.top + n].copy()

    def give(self, slots: np.ndarray) -> None:
        k = int(slots.size)
        self.free[self.top:self.top + k] = slots
        self.top += k


@dataclass
class Result:
    """One cell of the grid."""

    device_tokens: int
    host_tokens: int
    policy: str
    page: int
    requests: int = 0
    tokens: int = 0
    device_hit: int = 0
    host_hit: int = 0
    evicted: int = 0
    loaded_back: int = 0
    swa_tokens: int = 0  # a hybrid layout's SWA pool (0: none)
    states: int = 0  # a hybrid layout's state slots (0: none)

    @property
    def hit_rate(self) -> float:
        return (self.device_hit + self.host_hit) / self.tokens if self.tokens else 0.0

    @property
    def host_share(self) -> float:
        hits = self.device_hit + self.host_hit
        return self.host_hit / hits if hits else 0.0


class Simulator:
    """The tree of one grid cell with plain-number slots; `step(tokens)` serves one request."""

    def __init__(self, device_tokens: int, host_tokens: int = 0, policy: str = "lru", page: int = 16):
        self.tree = RadixTree(page_size=page, policy=policy, write_policy="write_through" if host_tokens else None,
                              load_back_threshold=page)
        self.dev, self.host = _Slots(device_tokens), _Slots(host_tokens)
        self.page = page
        self.r = Result(device_tokens, host_tokens, policy, page)

    def _room(self, n: int) -> bool:
        if self.dev.top < n:
            ev = self.tree.evict(n - self.dev.top)
            self.dev.give(ev.freed)
            self.r.evicted += ev.evicted_tokens
        return self.dev.top >= n

    def _backups(self, actions) -> None:
        for i, a in enumerate(actions):
            if self.host.top < a.tokens:
                self.host.give(self.tree.evict_host(a.tokens - self.host.top).freed)
            if self.host.top < a.tokens:  # no host room: this and the rest stay device-only
                for b in reversed(actions[i:]):
                    f = self.tree.abort_backup(b.ack)
                    self.host.give(f.host)
                    self.dev.give(f.device)
                return
            self.tree.commit_backup(a.ack, self.host.take(a.tokens))
            self.dev.give(self.tree.finish_backup(a.ack).device)

    def step(self, tokens: np.ndarray) -> None:
        t, r = self.tree, self.r
        n = len(tokens) - len(tokens) % self.page
        r.requests += 1
        r.tokens += len(tokens)  # hit rates over every prompt token, at any page size (as SGLang's)
        if n == 0:
            return
        m = t.match_prefix(tokens[:n])
        prefix, receipt = m.indices, t.lock(m.best_node_id)  # the host part too, until it is loaded
        r.device_hit += m.matched_len
        if m.host_hit_len:
            plan = t.load_back(m.best_node_id, None, self.dev.top)
            if plan.op and self._room(plan.tokens):
                path = t.commit_load_back(plan.op, self.dev.take(plan.tokens))
                t.finish_load_back(plan.op)
                t.unlock(receipt)
                prefix, receipt = path, plan.op
                r.host_hit += plan.tokens
                r.loaded_back += plan.tokens
            elif plan.op:
                self.dev.give(t.abort_load_back(plan.op))
        need = n - len(prefix)
        if need and self._room(need):
            new = self.dev.take(need)
            ins = t.insert(tokens[:n], np.concatenate([prefix, new]), prev_prefix_len=len(prefix))
            self.dev.give(ins.duplicates)
            self.dev.give(ins.tail)
            self._backups(ins.backups)
        t.unlock(receipt)


@dataclass(frozen=True)
class HybridLayout:
    """What the hybrid simulation needs of a model (server/layouts.py reads it from config.json): its window,
    its state checkpoint interval, and whether it has full-attention layers (else the tree's keys are free)."""

    window: Optional[int]
    mamba_chunk: Optional[int]
    full_kv: bool = True


class HybridSimulator:
    """The hybrid tree of one grid cell, slots as plain numbers per pool: FULL (or the keys' budget), SWA, states.

    Each request: match (as deep as every component restores), lock, evict per component for the rest, take
    the new tokens' FULL slots, SWA slots for its last window (and for the window before a branch point the match
    reported) and a state slot (two where the match asks for a checkpoint at a branch point), insert donating the
    state, unlock. No host tier."""

    def __init__(self, device_tokens: int, layout: HybridLayout, swa_tokens: int = 0, states: int = 0,
                 policy: str = "lru", page: int = 16):
        from .tree.hybrid import HybridTree
        if policy != "lru":
            raise ValueError("the hybrid tree evicts by LRU only")
        self.tree = HybridTree(page, window=layout.window, mamba_chunk=layout.mamba_chunk, full_kv=layout.full_kv)
        self.dev = _Slots(device_tokens)
        self.swa_free = swa_tokens if layout.window else 0
        self.states = _Slots(states if layout.mamba_chunk else 0)
        self.layout, self.page = layout, page
        self.r = Result(device_tokens, 0, policy, page, swa_tokens=self.swa_free, states=self.states.top)

    def _apply(self, frees) -> None:
        self.dev.give(frees.full_slots())
        self.swa_free += len(frees.swa_slots())
        if frees.mamba:
            self.states.give(np.asarray(frees.mamba, dtype=np.int32))

    def _room(self, full: int, swa: int, state: int) -> bool:
        want = (full - self.dev.top, swa - self.swa_free, state - self.states.top)
        if max(want) > 0:
            ev = self.tree.evict(max(want[0], 0), max(want[1], 0) if self.layout.window else 0,
                                 max(want[2], 0) if self.layout.mamba_chunk else 0)
            self._apply(ev.frees)
            self.r.evicted += ev.full
        return self.dev.top >= full and self.swa_free >= swa and self.states.top >= state

    def step(self, tokens: np.ndarray) -> None:
        t, r, lay = self.tree, self.r, self.layout
        n = len(tokens) - len(tokens) % self.page
        r.requests += 1
        r.tokens += len(tokens)
        if n == 0:
            return
        m = t.match_prefix(tokens[:n])
        r.device_hit += m.matched_len
        receipt = t.lock(m.node_id)
        need = n - m.matched_len
        # the request's SWA KV behind its window is gone once prefill is done (chunked prefill frees it as it goes,
        # so it is never taken here), but what a later request branching inside this prefix needs stays (the window
        # before the branch point, R5's swa_branching_seqlen)
        branch = m.mamba_branching_seqlen if lay.mamba_chunk else None
        keep = min(m.swa_branching_seqlen or n, branch or n)  # (a checkpoint needs its window too)
        below = (keep - lay.window) // self.page * self.page if lay.window else 0
        swa = n - max(below, m.matched_len) if lay.window else 0
        if need and self._room(need, swa, 1 + (branch is not None) if lay.mamba_chunk else 0):
            new = self.dev.take(need)
            self.swa_free -= swa
            slots, prev = np.concatenate([m.indices, new]), m.matched_len
            if branch:  # the prefill checkpoints the state where the tree's keys branch (R5: mamba_branching_seqlen)
                st = self.states.take(1)
                ins = t.insert(tokens[:branch], slots[:branch], prev_prefix_len=prev, mamba_value=int(st[0]),
                               swa_evicted_seqlen=min(below, branch) if below > prev else 0)
                self._apply(ins.frees)  # (the keys below the branch were the tree's: these slots came back)
                if ins.mamba_exist:
                    self.states.give(st)
                held = t.match_prefix(tokens[:n]).indices  # the tree's slots up to the checkpoint, at least
                if len(held) < branch:
                    raise RuntimeError(f"the checkpoint at {branch} is not a match end ({len(held)})")
                slots, prev = np.concatenate([held, new[len(held) - prev:]]), len(held)
            state = int(self.states.take(1)[0]) if lay.mamba_chunk else -1
            evicted = below if below > prev else 0
            ins = t.insert(tokens[:n], slots, prev_prefix_len=prev, swa_evicted_seqlen=evicted,
                           mamba_value=state, swa_branching_seqlen=m.swa_branching_seqlen)
            self._apply(ins.frees)
            if ins.mamba_exist and state >= 0:
                self.states.give(np.array([state], dtype=np.int32))
        t.unlock(receipt)


def run_grid(make_requests: Callable[[], Iterable[np.ndarray]], capacities: list[int], host_x: list[float],
             policies: list[str], pages: list[int], every: int = 100, progress: bool = True,
             total: Optional[int] = None, hybrid: Optional[HybridLayout] = None, swa_ratios: tuple = (0.0,),
             states: tuple = (0,)):
    """Every cell of the grid over the same requests; returns (results, timelines of hit rate per window). With
    a hybrid layout the grid spans SWA pool sizes (ratios of the device's tokens) and state slots instead of host
    tiers.

    Progress goes to stderr: a bar on a terminal (tqdm), one line per cell when stderr is a file or a pipe."""
    from tqdm import tqdm

    if hybrid is None:
        cells = [(cap, hx, pol, page, 0.0, 0) for cap, hx, pol, page in itertools.product(capacities, host_x,
                                                                                           policies, pages)]
    else:
        cells = [(cap, 0.0, pol, page, sr, ns) for cap, pol, page, sr, ns in itertools.product(
            capacities, policies, pages, swa_ratios if hybrid.window else (0.0,),
            states if hybrid.mamba_chunk else (0,))]
    results, timelines = [], {}
    for i, (cap, hx, pol, page, sr, ns) in enumerate(cells):
        name = f"cell {i + 1}/{len(cells)}: device {cap}, host {hx:g}x, {pol}, page {page}"
        if hybrid is None:
            sim = Simulator(cap, int(cap * hx), pol, page)
        else:
            swa = int(cap * sr) // page * page
            name = f"cell {i + 1}/{len(cells)}: device {cap}, swa {swa}, states {ns}, page {page}"
            sim = HybridSimulator(cap, hybrid, swa, ns, pol, page)
        line, last = [], (0, 0)
        t0 = time.perf_counter()
        count = 0
        bar = tqdm(total=total, desc=name, unit=" requests", file=sys.stderr, leave=True, mininterval=0.5,
                   disable=None if progress else True)  # None: no bar unless stderr is a terminal
        for tokens in make_requests():
            sim.step(tokens)
            count += 1
            bar.update()
            if count % every == 0:
                hits = sim.r.device_hit + sim.r.host_hit
                line.append((count, (hits - last[0]) / max(sim.r.tokens - last[1], 1)))
                last = (hits, sim.r.tokens)
        bar.close()
        total = count
        if progress and bar.disable:
            rate = count / max(time.perf_counter() - t0, 1e-9)
            sys.stderr.write(f"{name}: {count} requests, {rate:,.0f}/s\n")
            sys.stderr.flush()
        results.append(sim.r)
        timelines[(cap, _label(sim.r), pol, page)] = line
    return results, timelines


def table(results: list[Result]) -> str:
    hybrid = any(r.swa_tokens or r.states for r in results)
    extra = f" {'swa':>9} {'states':>7}" if hybrid else ""
    rows = [f"{'device':>9} {'host':>9}{extra} {'policy':>8} {'page':>4} {'hit rate':>9} {'host share':>10} "
            f"{'evicted':>10} {'loaded back':>12}"]
    for r in results:
        extra = f" {r.swa_tokens:9d} {r.states:7d}" if hybrid else ""
        rows.append(f"{r.device_tokens:9d} {r.host_tokens:9d}{extra} {r.policy:>8} {r.page:4d} {r.hit_rate:9.3f} "
                    f"{r.host_share:10.3f} {r.evicted:10d} {r.loaded_back:12d}")
    return "\n".join(rows)


def write_csv(results: list[Result], path: str) -> None:
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        fields = list(asdict(results[0])) + ["hit_rate", "host_share"]
        w.writerow(fields)
        for r in results:
            w.writerow(list(asdict(r).values()) + [f"{r.hit_rate:.6f}", f"{r.host_share:.6f}"])


def _figure(plt, lines: list[tuple[list, list, str]], xlabel: str, ylabel: str, path: str, logx: bool = False,
            marker: str = "") -> str:
    """One line chart written as a PNG."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for xs, ys, label in lines:
        ax.plot(xs, ys, marker=marker or None, label=label)
    if logx:
        ax.set_xscale("log", base=2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=6)
    ax.grid(alpha=0.3)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def _label(r: Result) -> str:
    """A cell's tier settings besides the device size: the host tier, or a hybrid layout's SWA share and states."""
    if r.swa_tokens or r.states:
        return f"swa {r.swa_tokens / r.device_tokens:g}x, {r.states} states"
    return f"host {r.host_tokens / r.device_tokens:g}x"


def plot(results: list[Result], timelines: dict, out_dir: str) -> list[str]:
    """hit rate vs device capacity (a line per policy, host tier and page) and hit rate over time."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def cell(r: Result) -> tuple:
        return r.policy, _label(r), r.page
    by_capacity = []
    for pol, label, page in sorted({cell(r) for r in results}):
        pts = sorted((r.device_tokens, r.hit_rate) for r in results if cell(r) == (pol, label, page))
        by_capacity.append(([p[0] for p in pts], [p[1] for p in pts], f"{pol} {label} page {page}"))
    over_time = os.path.join(out_dir, "hit_rate_over_time.png")
    fig = over_time_figure(plt, timelines)
    fig.savefig(over_time, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return [_figure(plt, by_capacity, "device capacity (tokens)", "token hit rate",
                    os.path.join(out_dir, "hit_rate_vs_capacity.png"), logx=True, marker="o"), over_time]


MAX_LINES = 8  # lines one panel shows; more capacities are thinned to an even spread


def over_time_figure(plt, timelines: dict):
    """Hit rate over time, one panel per (policy, host tier, page) and a line per device size on an ordered
    colour scale, so a 40-cell grid stays readable (a single panel with 40 lines and a legend was not)."""
    groups: dict[tuple, list] = {}
    for (cap, label, pol, page), line in timelines.items():
        if line:
            groups.setdefault((pol, label if isinstance(label, str) else f"host {label:g}x", page), []).append(
                (cap, line))
    keys = sorted(groups)
    cols = min(4, max(len(keys), 1))
    rows = -(-len(keys) // cols) if keys else 1
    fig, axes = plt.subplots(rows, cols, figsize=(3.6 * cols, 2.8 * rows), sharex=True, sharey=True,
                             squeeze=False)
    cmap = plt.get_cmap("viridis")
    for ax, key in zip(axes.flat, keys):
        lines = sorted(groups[key], key=lambda x: x[0])
        shown = lines
        if len(lines) > MAX_LINES:
            pick = np.linspace(0, len(lines) - 1, MAX_LINES).round().astype(int)
            shown = [lines[i] for i in sorted(set(pick.tolist()))]
        for j, (cap, line) in enumerate(shown):
            ax.plot([p[0] for p in line], [p[1] for p in line], color=cmap(j / max(len(shown) - 1, 1)),
                    label=f"{cap:,}")
        pol, label, page = key
        extra = f" ({len(shown)} of {len(lines)} sizes)" if len(shown) < len(lines) else ""
        ax.set_title(f"{pol}, {label}, page {page}{extra}", fontsize=8)
        ax.grid(alpha=0.3)
        ax.legend(title="device tokens", fontsize=6, title_fontsize=6, loc="lower right")
    for ax in list(axes.flat)[len(keys):]:
        ax.set_visible(False)
    for ax in axes[-1]:
        ax.set_xlabel("requests", fontsize=8)
    for ax in axes[:, 0]:
        ax.set_ylabel("token hit rate (window)", fontsize=8)
    fig.tight_layout()
    return fig
