"""`radixd simulate`: its hit counts against a direct model, its slot accounting, and the CLI's outputs."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from radixd.server.simulate import Simulator, synthetic_requests, trace_requests

CLI = [sys.executable, "-m", "radixd.server.cli"]


def _prefix_model_hits(reqs: list[np.ndarray], page: int) -> int:
    """With room for everything, a request hits the longest page-aligned prefix any earlier request had."""
    seen: set[bytes] = set()
    hits = 0
    for r in reqs:
        n = len(r) - len(r) % page
        k = 0
        while k + page <= n and r[:k + page].tobytes() in seen:
            k += page
        hits += k
        for j in range(page, n + 1, page):
            seen.add(r[:j].tobytes())
    return hits


@pytest.mark.parametrize("page", [1, 16])
def test_unbounded_cache_hits_exactly_what_was_seen_before(page):
    reqs = list(synthetic_requests(150, seed=page))
    sim = Simulator(device_tokens=sum(map(len, reqs)) + 1024, page=page)
    for r in reqs:
        sim.step(r)
    assert sim.r.device_hit == _prefix_model_hits(reqs, page) and sim.r.evicted == 0
    assert sim.tree.check() == []


@pytest.mark.parametrize("policy", ["lru", "lfu", "slru"])
def test_a_host_tier_adds_hits_and_every_slot_is_accounted_for(policy):
    reqs = list(synthetic_requests(400, seed=3))
    alone, tiered = Simulator(8192, 0, policy, 16), Simulator(8192, 4 * 8192, policy, 16)
    for r in reqs:
        alone.step(r)
        tiered.step(r)
    assert tiered.r.hit_rate > alone.r.hit_rate and tiered.r.host_hit > 0 and tiered.r.loaded_back > 0
    assert alone.r.evicted > 0
    for sim in (alone, tiered):
        assert sim.tree.check() == []
        assert sim.dev.top + sim.tree.cached_tokens == sim.r.device_tokens  # free + cached = capacity
        assert sim.host.top + sim.tree.host_cached_tokens == sim.r.host_tokens


def test_trace_expansion_is_deterministic_per_block(tmp_path):
    f = tmp_path / "t.jsonl"
    f.write_text(json.dumps(dict(timestamp=0, input_length=700, output_length=5, hash_ids=[7, 9])) + "\n"
                 + json.dumps(dict(timestamp=1, input_length=300, output_length=5, hash_ids=[7])) + "\n")
    a, b = list(trace_requests(str(f)))
    assert len(a) == 700 and len(b) == 300 and np.array_equal(a[:300], b)


def test_the_cli_prints_a_table_writes_a_csv_and_plots(tmp_path):
    f = tmp_path / "trace.jsonl"
    rng = np.random.default_rng(0)
    with open(f, "w") as fh:
        for i in range(120):
            ids = list(range(int(rng.integers(0, 4)) * 10, int(rng.integers(0, 4)) * 10 + int(rng.integers(1, 6))))
            fh.write(json.dumps(dict(timestamp=i, input_length=len(ids) * 512 - 7, output_length=1, hash_ids=ids)) + "\n")
    out = tmp_path / "out"
    r = subprocess.run(CLI + ["simulate", "--trace", str(f), "--capacity", "2048,16384", "--host-x", "0,2",
                              "--policy", "lru,lfu", "--page", "16", "--out", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "hit rate" in r.stdout and r.stdout.count("\n") >= 9  # the table
    # progress into a pipe: one line per cell, no carriage-return bar
    assert "\r" not in r.stderr and r.stderr.count(" requests, ") == 8, r.stderr[-2000:]
    rows = (out / "simulate.csv").read_text().strip().splitlines()
    assert len(rows) == 1 + 8 and rows[0].startswith("device_tokens,host_tokens,policy,page")
    small = [line for line in rows[1:] if line.startswith("2048,0,lru")][0].split(",")
    big = [line for line in rows[1:] if line.startswith("16384,0,lru")][0].split(",")
    assert float(big[-2]) >= float(small[-2])  # more room never hits less on the same traffic (LRU)
    pngs = [out / "hit_rate_vs_capacity.png", out / "hit_rate_over_time.png"]
    for p in pngs:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and os.path.getsize(p) > 5000
    assert f"wrote {out / 'simulate.csv'}" in r.stdout


def test_bad_simulate_arguments_are_one_line(tmp_path):
    for argv, text in ((["--policy", "best"], "--policy"), (["--trace", "/nonexistent.jsonl"], "--trace"),
                       (["--capacity", "lots"], "simulate")):
        r = subprocess.run(CLI + ["simulate", "--out", str(tmp_path), *argv], capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and text in r.stderr, r.stderr


def test_hit_rates_count_every_prompt_token_at_any_page_size(tmp_path):
    """As SGLang's cache_hit_rate: hits over all prompt tokens, not over page-aligned ones."""
    reqs = list(synthetic_requests(60, seed=9))
    total = sum(len(r) for r in reqs)
    for page in (1, 16):
        sim = Simulator(device_tokens=total + 1024, page=page)
        for r in reqs:
            sim.step(r)
        assert sim.r.tokens == total
    from radixd.server.tree import RadixTree
    t = RadixTree(page_size=16)
    t.match_prefix(np.arange(37, dtype=np.int32))
    assert t.counters.queried_tokens == 37


def test_the_hit_rate_over_time_plot_stays_readable_at_40_cells():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from radixd.server.simulate import MAX_LINES, over_time_figure
    caps = [1024 * 2 ** i for i in range(10)]
    timelines = {(cap, hx, pol, 16): [(k * 100, (k + i) / 50) for k in range(1, 20)]
                 for i, cap in enumerate(caps) for hx in (0, 2) for pol in ("lru", "lfu")}
    assert len(timelines) == 40
    fig = over_time_figure(plt, timelines)
    panels = [ax for ax in fig.axes if ax.get_visible()]
    assert len(panels) == 4  # one per (policy, host tier, page)
    for ax in panels:
        labels = [t.get_text() for t in ax.get_legend().get_texts()]
        colours = {tuple(line.get_color()) for line in ax.get_lines()}
        assert len(labels) == MAX_LINES == len(colours)  # thinned to 8 sizes, each its own colour
        assert labels[0] == "1,024" and labels[-1] == f"{caps[-1]:,}"  # the smallest and largest stay
        assert "8 of 10 sizes" in ax.get_title()
    plt.close(fig)


def test_a_window_longer_than_every_request_makes_the_hybrid_tree_hit_what_full_attention_does():
    """With room for everything and a window no request outgrows, SWA KV is never freed below a window, so every
    prefix seen before is a hit, as in the plain tree."""
    from radixd.server.simulate import HybridLayout, HybridSimulator
    reqs = list(synthetic_requests(150, seed=3))
    room = sum(map(len, reqs)) + 1024
    sim = HybridSimulator(room, HybridLayout(window=1 << 20, mamba_chunk=None), swa_tokens=room, page=16)
    for r in reqs:
        sim.step(r)
    assert sim.r.device_hit == _prefix_model_hits(reqs, 16) and sim.r.evicted == 0


@pytest.mark.parametrize("window,chunk,full_kv", [(128, None, True), (None, 64, True), (128, 64, False),
                                                  (128, None, False), (None, 64, False)],
                         ids=["F+S", "F+M", "S+M", "S", "M"])
def test_the_hybrid_simulation_accounts_for_every_slot_of_every_pool(window, chunk, full_kv):
    """Under pressure in every pool: after each request the hybrid tree's checker is clean and each pool's free
    slots plus what the tree holds are its capacity; a larger SWA pool or more states never lose hits here."""
    from radixd.server.simulate import HybridLayout, HybridSimulator
    from radixd.server.tree.hybrid_check import check_hybrid
    lay = HybridLayout(window, chunk, full_kv)
    reqs = list(synthetic_requests(250, seed=5))
    rates = []
    for swa, states in ((512, 8), (4096, 64)):
        sim = HybridSimulator(8192, lay, swa_tokens=swa if window else 0, states=states if chunk else 0, page=16)
        for r in reqs:
            sim.step(r)
            sizes = {c: e + p for c, (e, p) in sim.tree.sizes().items()}
            assert sim.dev.top + sizes["full"] == 8192
            if window:
                assert sim.swa_free + sizes["swa"] == swa
            if chunk:
                assert sim.states.top + sizes["mamba"] == states
            assert check_hybrid(sim.tree) == []
        assert sim.r.evicted > 0
        rates.append(sim.r.hit_rate)
    assert 0 < rates[0] <= rates[1], rates


def test_the_cli_simulates_a_hybrid_models_pools_from_its_config(tmp_path):
    """--model-config: the grid spans SWA pool sizes and state slots; the table and the CSV say which."""
    cfg = os.path.join(os.path.dirname(__file__), "configs", "gpt-oss.json")
    r = subprocess.run(CLI + ["simulate", "--model-config", cfg, "--capacity", "8192", "--swa-ratio", "0.125,1",
                              "--requests", "200", "--out", str(tmp_path), "--no-plots", "--quiet"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].split()[:4] == ["device", "host", "swa", "states"]
    rows = [ln.split() for ln in lines[1:3]]
    assert [x[2] for x in rows] == ["1024", "8192"] and float(rows[0][6]) < float(rows[1][6]), r.stdout
    assert "swa_tokens" in open(tmp_path / "simulate.csv").readline()
    for bad, says in ((["--host-x", "1"], "no --host-x"),
                      (["--model-config", os.path.join(os.path.dirname(__file__), "configs", "missing.json")],
                       "missing.json")):
        args = ["simulate", "--model-config", cfg, "--out", str(tmp_path), "--quiet"] + bad
        r = subprocess.run(CLI + args, capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and says in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
