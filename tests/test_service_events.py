"""KV events from a real server: gRPC WatchEvents and ZMQ (vLLM's wire format), replay, gaps, slow consumers."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import msgspec
import numpy as np
import pytest
import zmq

from radixd.client import CacheClient
from radixd.client.events import (BlockIndex, decode_zmq_payload, event_dicts, replay_zmq, token_block_hashes,
                                  watch)

from .conftest import ServerProc, venv_python

PAGE = 4


DECODE = Path(__file__).resolve().parent / "engine_events_decode.py"
ENGINES = {"vllm": venv_python("RADIXD_VLLM_PYTHON", ".venv-vllm"),
           "sglang": venv_python("RADIXD_SGLANG_PYTHON", ".venv-sglang")}
ADAPTER = "adapter-1"


def decoded_by_engine(engine: str, payloads: list[bytes], tmp: Path) -> dict:
    """What the engine's own `KVEventBatch` decoder makes of these payloads (in its venv)."""
    py = ENGINES[engine]
    if py is None:
        if os.environ.get("CI"):
            raise AssertionError(f"CI must decode with {engine}'s own classes, and its venv is missing")
        pytest.skip(f"no {engine} venv (.ci/run builds it)")
    path = tmp / f"payloads-{engine}.msgpack"
    path.write_bytes(msgspec.msgpack.encode(payloads))
    r = subprocess.run([py, str(DECODE), engine, str(path)], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": ""})
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def _zmq_replay(endpoint: str, start: int) -> list[tuple[int, bytes]]:
    """Ask the ROUTER for every batch since `start`, as a vLLM consumer does; returns (seq, payload)."""
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.RCVTIMEO, 20000)
    s.connect(endpoint)
    s.send_multipart([b"", start.to_bytes(8, "big")])
    out = []
    while True:
        _, topic, seq, payload = s.recv_multipart()
        if int.from_bytes(seq, "big", signed=True) == -1:
            break
        out.append((int.from_bytes(seq, "big"), payload))
    s.close(linger=0)
    assert out == replay_zmq(endpoint, start)  # the client library's replay agrees
    return out


def _workload(c: CacheClient, rng: np.random.Generator) -> list[tuple[np.ndarray, str, str]]:
    prompts = [(rng.integers(0, 50, int(rng.integers(2, 10)) * PAGE, dtype=np.int32), salt, lora)
               for salt, lora in (("", ""), ("", ""), ("tenant-a", ""), ("", ADAPTER)) for _ in range(4)]
    for step in range(300):
        toks, salt, lora = prompts[int(rng.integers(len(prompts)))]
        toks = np.concatenate([toks[:int(rng.integers(1, len(toks) + 1))], rng.integers(0, 50, 3, dtype=np.int32)])
        op = int(rng.integers(6))
        if op <= 1:
            m = c.match_prefix(toks, lock=True, cache_salt=salt, extra_key=lora)
            prefix, receipt = m.indices, m.receipt_id
            if m.host_hit_len:
                lb = c.load_back(receipt)
                if lb.loaded_len:
                    c.wait_transfers([lb.transfer_id])
                prefix, receipt = lb.indices, lb.receipt_id
            need = len(toks) - len(prefix)
            new = c.alloc(need)
            if len(new) > need:  # whole pages: give back what the prompt does not use
                c.free(new[need:])
                new = new[:need]
            ins = c.cache_finished([dict(tokens=toks, indices=np.concatenate([prefix, new]), cache_salt=salt,
                                         extra_key=lora, prev_prefix_len=len(prefix), receipt_id=receipt)])[0]
            c.wait_transfers(ins.backup_transfer_ids)
        elif op == 2:
            c.evict(int(rng.integers(1, 40)))
        elif op == 3:
            c.evict_host(int(rng.integers(1, 40)))
        else:
            c.match_prefix(toks, cache_salt=salt, extra_key=lora)
    return prompts


@pytest.fixture
def events_server(tmp_path):
    pub, rep = f"ipc://{tmp_path}/ev.pub", f"ipc://{tmp_path}/ev.rep"
    s = ServerProc("--num-slots", "256", "--page-size", str(PAGE), "--host-slots", "512", "--load-back-threshold",
                   "1", "--kv-events-endpoint", pub, "--kv-events-replay-endpoint", rep, "--kv-events-buffer",
                   "100000")
    s.pub, s.rep = pub, rep
    yield s
    s.stop()


def test_events_over_grpc_and_zmq_rebuild_the_cache(events_server, tmp_path):
    """Every batch, over gRPC, the PUB stream and the replay, rebuilds what the cache holds; vLLM's and
    SGLang's own decoders (their real classes, in their venvs) accept every batch and agree."""
    srv = events_server
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(srv.pub)
    with CacheClient(srv.target) as c:
        probe = np.arange(900, 900 + PAGE, dtype=np.int32)
        while not sub.poll(50):  # the subscription is live once a probe's batch arrives
            c.cache_finished([dict(tokens=probe, indices=c.alloc(PAGE))])
            c.evict(10**6)
        while sub.poll(200):
            sub.recv_multipart()
        prompts = _workload(c, np.random.default_rng(5))
        grpc_batches = list(watch(srv.target, 0, follow=False))
        assert [b.seq for b in grpc_batches] == list(range(len(grpc_batches))) and not any(b.gap for b in grpc_batches)
        replayed = _zmq_replay(srv.rep, 0)
        assert [s for s, _ in replayed] == [b.seq for b in grpc_batches]
        live = []
        while sub.poll(500):
            topic, seq, payload = sub.recv_multipart()
            live.append((int.from_bytes(seq, "big"), payload))
        assert live and live == replayed[-len(live):]  # the PUB stream is the replay's tail, byte for byte

        by_grpc, by_zmq, mid = (BlockIndex(PAGE) for _ in range(3))
        for b in grpc_batches:
            by_grpc.apply("n", event_dicts(b))
        for seq, payload in replayed:
            by_zmq.apply("n", decode_zmq_payload(payload)[1])
        engines = {e: decoded_by_engine(e, [p for _, p in replayed], tmp_path) for e in ENGINES}
        k = len(grpc_batches) // 2
        for b in grpc_batches[:k]:
            mid.apply("n", event_dicts(b))
        for b in watch(srv.target, k, follow=False):  # replay from a mid-stream sequence number
            mid.apply("n", event_dicts(b))
        for medium in ("GPU", "CPU_PINNED"):
            want = by_grpc.blocks("n", medium)
            assert by_zmq.blocks("n", medium) == want == mid.blocks("n", medium)
            for name, got in engines.items():
                assert {int(h): n for h, n in got["blocks"].get(medium, {}).items()} == dict(+want), name
        assert sum(by_grpc.blocks("n", "CPU_PINNED").values()) > 0
        adapters = 0
        for toks, salt, lora in prompts:  # the index answers what the cache itself answers
            m = c.match_prefix(toks, cache_salt=salt, extra_key=lora)
            got = by_grpc.match(toks, cache_salt=salt, extra_key=lora)["n"]
            assert got == {"GPU": m.matched_len // PAGE, "any": (m.matched_len + m.host_hit_len) // PAGE}
            if m.matched_len + m.host_hit_len:  # each block says which adapter it belongs to
                first = str(token_block_hashes(toks, PAGE, salt, lora)[0])
                for name, dec in engines.items():
                    assert dec["lora"][first] == (lora or None), (name, lora)
                adapters += bool(lora)
        assert adapters, "no adapter prompt stayed cached: the lora_name check ran on nothing"
        assert c.check() == []
        out = subprocess.run([sys.executable, "-m", "radixd.server.cli", "events", "--target", srv.target,
                              "--from", "0"], capture_output=True, text=True, timeout=60)
        lines = [json.loads(x) for x in out.stdout.splitlines()]
        assert len(lines) == sum(len(b.events) for b in grpc_batches) and lines[0]["seq"] == 0
        with urllib.request.urlopen(f"http://{srv.metrics_url.split('//')[1]}", timeout=10) as r:
            metrics = {ln.rsplit(" ", 1)[0]: float(ln.rsplit(" ", 1)[1]) for ln in r.read().decode().splitlines()
                       if ln.startswith("radixd_kv_event")}
        assert metrics["radixd_kv_event_batches_total"] == len(grpc_batches)  # nothing changed since the replay
        assert metrics["radixd_kv_event_backlog_batches"] == 0
        assert metrics['radixd_kv_events_lost_total{reason="queue_bound"}'] == 0
        assert metrics['radixd_kv_events_lost_total{reason="build_failed"}'] == 0
    sub.close(linger=0)


def test_a_replay_right_after_a_change_includes_it(tmp_path):
    """The publisher thread may still be hashing a batch when a replay arrives: the replay waits for it."""
    rep = f"ipc://{tmp_path}/ev.rep"
    n = 100_000  # tokens an insert, at page size 1: milliseconds of hashing for the publisher thread
    srv = ServerProc("--num-slots", str(10 * n), "--layers", "1", "--kv-heads", "1", "--head-dim", "8",
                     "--kv-events-replay-endpoint", rep)
    try:
        with CacheClient(srv.target) as c:
            for i in range(10):  # each replayed at once
                toks = np.arange(i * n, (i + 1) * n, dtype=np.int32)
                c.cache_finished([dict(tokens=toks, indices=c.alloc(n))])
                last = list(watch(srv.target, i, follow=False))[-1]
                assert last.seq == i and event_dicts(last)[0]["token_ids"][-1] == int(toks[-1])
                seq, payload = replay_zmq(rep, i)[-1]
                assert seq == i and decode_zmq_payload(payload)[1][0]["token_ids"][-1] == int(toks[-1])
    finally:
        srv.stop()


def test_a_replay_older_than_the_buffer_says_so_first(tmp_path):
    srv = ServerProc("--num-slots", "256", "--kv-events", "--kv-events-buffer", "3")
    try:
        with CacheClient(srv.target) as c:
            for i in range(6):
                c.cache_finished([dict(tokens=[i, i + 1], indices=c.alloc(2))])
            first, *rest = list(watch(srv.target, 0, follow=False))
            assert first.gap and first.first_seq == 3 and [b.seq for b in rest] == [3, 4, 5]
    finally:
        srv.stop()


def test_a_slow_consumer_is_cut_off_and_the_cache_goes_on(tmp_path):
    import threading
    env = dict(os.environ, RADIXD_KV_EVENTS_WATCHER_QUEUE="4")
    srv = ServerProc("--num-slots", str(1 << 20), "--layers", "1", "--kv-heads", "1", "--head-dim", "8",
                     "--kv-events", env=env)
    try:
        with CacheClient(srv.target) as c:
            stream = watch(srv.target, 0, follow=True)
            c.cache_finished([dict(tokens=[1, 2], indices=c.alloc(2))])
            assert next(stream).seq == 0  # the watcher is registered and reading
            n = 2500
            for i in range(n):  # the consumer does not read meanwhile: its queue overflows
                c.cache_finished([dict(tokens=np.arange(i * 300, i * 300 + 300), indices=c.alloc(300))])
            seen = []
            reader = threading.Thread(target=lambda: seen.extend(stream), daemon=True)
            reader.start()
            reader.join(60)  # the backlog it still had, then the notice, then the end of the stream
            assert not reader.is_alive(), "the slow consumer's stream was never cut off"
            assert seen[-1].lost and all(not b.lost for b in seen[:-1]) and len(seen) < n
            assert c.stats()["cached_tokens"] == 2 + n * 300 and c.check() == []
    finally:
        srv.stop()


def test_watch_events_off_is_a_clear_error(server):
    import grpc
    with pytest.raises(grpc.RpcError) as e:
        list(watch(server.target, 0, follow=False))
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "--kv-events" in e.value.details()


def test_events_equal_sglang_publishers_on_the_same_operations():
    """SGLang's own RadixCache publisher and radixd's, one seeded sequence of inserts and evictions, page
    sizes 1 and 4, plain and bigram (EAGLE) keys: the same events, byte-level fields and hashes included."""
    py = ENGINES["sglang"]
    if py is None:
        if os.environ.get("CI"):
            raise AssertionError("CI must compare with SGLang's own publisher, and its venv is missing")
        pytest.skip("no SGLang venv (.ci/run builds it)")
    check = Path(__file__).resolve().parent / "sglang_events_check.py"
    r = subprocess.run([py, str(check)], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "PYTHONPATH": ""})
    assert r.returncode == 0 and "ok events_match_sglang" in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]
