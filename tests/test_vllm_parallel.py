"""radixd behind tensor- and pipeline-parallel vLLM engines (the CPU build: a worker process per rank, gloo between
them; slow and erratic on two CPUs, so these tests assert tokens and bytes, never times).

radixd holds every KV head of a page whatever the engine's parallelism: each rank copies its own heads (and, for a
Mamba layer, its own channels and heads of the state), each pipeline stage its own layers, and the scheduler side
publishes a store once every worker has reported its copy. Ground truth as for one rank: transformers' forward for
what radixd holds, an engine without a connector for the tokens."""
from __future__ import annotations

import json
import os
import random
import subprocess
import tempfile
import time

import pytest

from radixd.client import CacheClient

from .conftest import ServerProc
from .test_vllm_connector import (BLOCK, ENGINE, P, SUFFIX, VLLM_PY, _build, _engine, _kill_group, _overwrite, _server,
                                  _settled, _true_kv, model_dir, needs_vllm)

__all__ = ["model_dir"]  # (the fixture, shared with the connector tests)

Q = [random.Random(9).randrange(3, 512) for _ in range(200)]  # a second prompt, stored by the parallel engine
TWO = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}  # (the CPU build binds each rank's OpenMP threads to one CPU list)
enough_cpus = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="a CPU per rank: vLLM refuses fewer")


# a lookup may take its time here (three busy processes per engine on two CPUs, beside other tests): these tests are
# about which bytes go where, and a lookup past the default 200 ms deadline would be a miss
PATIENT = ("--extra", json.dumps({"lookup_deadline_ms": 20000}))


def _parallel(model: str, prompts: list, target: str, *flags: str) -> list:
    """An engine with a worker process per rank (vLLM's mp executor), its engine core in a process of its own."""
    return _engine(model, prompts, target, multiprocess=True, extra=flags + (PATIENT if target else ()), env=TWO)


def _one(model: str, prompts: list, target: str, *flags: str) -> list:
    """A single-rank engine in one process, as patient."""
    return _engine(model, prompts, target, extra=flags + PATIENT)


@needs_vllm
@enough_cpus
def test_a_tensor_parallel_engine_and_a_single_rank_engine_share_pages_both_ways(model_dir):
    """The model has 2 KV heads: a TP-2 engine's ranks hold one each. A TP-1 engine stores P; the TP-2 engine hits
    all of it (each rank loads its head of radixd's pages) and generates what an engine without a connector does, and
    stores Q, whose pages radixd then holds as the model's true K and V for both heads of every layer; the TP-1 engine
    hits Q in turn. Overwriting head 1 alone of P's pages in radixd changes the TP-2 engine's output: rank 1 loads
    its own head. Nothing stays locked or held."""
    reference = _engine(model_dir, [P + SUFFIX, Q + SUFFIX, Q])
    srv = _server(model_dir)
    try:
        with CacheClient(srv.target, name="test") as c:
            a = _one(model_dir, [P], srv.target)  # TP 1
            assert a[0]["cached"] == 0 and _settled(c)["cached_tokens"] == 192
            b = _parallel(model_dir, [P + SUFFIX, Q], srv.target, "--tp", "2")
            assert b[0]["cached"] == 192 and b[0]["tokens"] == reference[0]["tokens"]  # a hit on both ranks
            assert b[1]["cached"] == 0 and b[1]["tokens"] == reference[2]["tokens"]
            assert _settled(c)["cached_tokens"] == 2 * 192  # Q's six blocks: published once both ranks copied them
            res = _true_kv(model_dir, srv.target, prompt=Q)
            assert res["ok"] and [x["compared"] for x in res["layers"]] == [192, 192], res
            back = _one(model_dir, [Q + SUFFIX], srv.target)  # TP 1 reads what the two ranks wrote
            assert back[0]["cached"] == 192 and back[0]["tokens"] == reference[1]["tokens"]
            _overwrite(c, P[:192], 2, heads=slice(1, 2))
            bad = _parallel(model_dir, [P + SUFFIX], srv.target, "--tp", "2")
            assert bad[0]["cached"] == 192 and bad[0]["tokens"] != reference[0]["tokens"]
            _settled(c)
    finally:
        srv.stop()


@needs_vllm
@enough_cpus
def test_a_pipeline_parallel_engine_copies_each_stages_layers(model_dir):
    """PP 2 over the 2-layer model: each stage holds, loads and stores its own layer. A TP-1 engine stores P; the
    PP-2 engine hits it (generating what an engine without a connector does) and stores Q, which radixd then holds
    as the model's true K and V in both layers (one copied by each stage)."""
    reference = _engine(model_dir, [P + SUFFIX, Q])
    srv = _server(model_dir)
    try:
        with CacheClient(srv.target, name="test") as c:
            _one(model_dir, [P], srv.target)
            b = _parallel(model_dir, [P + SUFFIX, Q], srv.target, "--pp", "2")
            assert b[0]["cached"] == 192 and b[0]["tokens"] == reference[0]["tokens"]
            assert b[1]["tokens"] == reference[1]["tokens"]
            assert _settled(c)["cached_tokens"] == 2 * 192
            res = _true_kv(model_dir, srv.target, prompt=Q)
            assert res["ok"] and [x["compared"] for x in res["layers"]] == [192, 192], res
    finally:
        srv.stop()


def _rank_pid(engine_pid: int, rank: int) -> int:
    """The process of an engine's TP worker `rank` (vLLM names it VLLM::Worker_TP<rank>), in the engine's group."""
    for pid in os.listdir("/proc"):
        try:
            if pid.isdigit() and os.getpgid(int(pid)) == engine_pid and \
                    open(f"/proc/{pid}/cmdline").read().strip("\0") == f"VLLM::Worker_TP{rank}":
                return int(pid)
        except (OSError, ProcessLookupError):
            continue
    raise AssertionError(f"no VLLM::Worker_TP{rank} in process group {engine_pid}")


@needs_vllm
@enough_cpus
def test_a_rank_that_dies_takes_its_engines_session_with_it(model_dir):
    """SIGKILL of one worker rank of a serving TP-2 engine: vLLM's executor sees it and the engine goes, and with it
    its radixd session (the relay's socket closes): radixd then holds no session, lock or slot of it."""
    srv = _server(model_dir)
    d = tempfile.mkdtemp(prefix="radixd-vllm-rank-")
    json.dump([P], open(os.path.join(d, "prompts.json"), "w"))
    r, w = os.pipe()
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONPATH": "",
           **TWO}
    log = open(os.path.join(d, "engine.log"), "w+")
    eng = subprocess.Popen([VLLM_PY, str(ENGINE), model_dir, os.path.join(d, "prompts.json"), "--serve", str(w),
                            "--radixd", srv.target, "--tp", "2"], env=env, stdin=subprocess.PIPE, stdout=log,
                           stderr=subprocess.STDOUT, text=True, pass_fds=(w,), start_new_session=True)
    os.close(w)
    reply = os.fdopen(r)
    try:
        with CacheClient(srv.target, name="test") as c:
            assert reply.readline().strip() == "ready", open(log.name).read()[-4000:]
            eng.stdin.write("0\n")
            eng.stdin.flush()
            assert json.loads(reply.readline())[0]["cached"] == 0
            assert c.stats()["sessions"] == 2  # this test's and the engine's
            os.kill(_rank_pid(eng.pid, 1), 9)
            t0 = time.monotonic()
            while c.stats()["sessions"] > 1 and time.monotonic() - t0 < 60:
                time.sleep(0.05)
            gone = time.monotonic() - t0
            print(f"the engine's session went {gone:.2f} s after its rank 1 was killed")
            s = _settled(c)
            assert gone < 60 and s["cached_tokens"] in (0, 192), (gone, s)
    finally:
        _kill_group(eng)
        srv.stop()


@needs_vllm
@enough_cpus
@pytest.mark.parametrize("arch", ["gemma3", "nemotron-h"])
def test_a_tensor_parallel_hybrid_engine_splits_windows_and_states_by_rank(arch):
    """RadixdHybridConnector with TP 2. Gemma 3 (sliding-window and full layers, 2 KV heads): each rank copies its
    head of the FULL and SWA pools. Nemotron-H (Mamba2 with 4 heads and one group, attention): each rank holds half
    the heads and x channels of every state and the whole of its B and C groups (vLLM replicates a single group), so
    rank 0 writes those and every rank its own part. A TP-1 engine stores P; the TP-2 engine hits it and generates
    what an engine without a connector does, and stores Q, whose K/V (and states at every block boundary) radixd then
    holds as transformers computes them."""
    model = _build(arch)
    mamba = arch == "nemotron-h"
    reference = _engine(model, [P + SUFFIX, Q])
    srv = ServerProc("--num-slots", "8192", "--page-size", "64" if mamba else str(BLOCK), "--model-config",
                     os.path.join(model, "config.json"), "--hybrid-cache",
                     *(["--mamba-states", "32"] if mamba else ["--swa-ratio", "0.5"]))
    try:
        with CacheClient(srv.target, name="test") as c:
            _one(model, [P], srv.target, "--hybrid")
            b = _parallel(model, [P + SUFFIX, Q], srv.target, "--hybrid", "--tp", "2")
            assert b[0]["cached"] == 192 and b[0]["tokens"] == reference[0]["tokens"]
            assert b[1]["tokens"] == reference[1]["tokens"]
            assert _settled(c)["cached_tokens"] == 2 * 192
            res = _true_kv(model, srv.target, states_every=64 if mamba else 0, prompt=Q)
            assert res["ok"], res
            if mamba:
                assert [x["tokens"] for x in res["states"]] == [64, 128, 192], res
            else:
                assert [x["pool"] for x in res["layers"]] == ["swa"] * 3 + ["full"], res
    finally:
        srv.stop()


@needs_vllm
@enough_cpus
def test_an_mla_model_is_written_by_one_rank_and_read_by_all():
    """DeepSeek-V2 (MLA: one 576-wide latent per token, which every rank holds whole). A TP-1 engine stores P and a
    second TP-1 engine hits it and generates what an engine without a connector does. A TP-2 engine hits P too (both
    ranks load the latent) and stores Q (rank 0 writes the latent): radixd then holds for every token of Q layer 0's
    compressed latent exactly as transformers computes it. vLLM's CPU MLA is checked no further: without any
    connector its TP-2 engine generates other tokens than its TP-1 engine, and its rotated key part differs from
    transformers' (as if rotated at nine times the position), so neither is a ground truth for the rest."""
    model = _build("deepseek-v2")
    reference = _engine(model, [P + SUFFIX])
    srv = ServerProc("--num-slots", "8192", "--page-size", "16", "--model-config", os.path.join(model, "config.json"))
    try:
        with CacheClient(srv.target, name="test") as c:
            assert c.info()["device_pools"][0].mla
            _one(model, [P], srv.target)
            b = _one(model, [P + SUFFIX], srv.target)
            assert b[0]["cached"] == 192 and b[0]["tokens"] == reference[0]["tokens"]
            two = _parallel(model, [P + SUFFIX, Q], srv.target, "--tp", "2")
            assert two[0]["cached"] == 192 and two[1]["cached"] == 0
            assert _settled(c)["cached_tokens"] == 2 * 192
            res = _true_kv(model, srv.target, prompt=Q)
            first = res["layers"][0]
            assert first["compared"] == 192 and first["latent"] <= 1e-4 * max(first["scale"], 1.0), res
    finally:
        srv.stop()
