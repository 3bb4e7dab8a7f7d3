"""NVIDIA Dynamo's own KV indexer and KV router follow radixd's ZMQ events and answer what radixd holds.

Dynamo's standalone indexer (`python -m dynamo.indexer`, ai-dynamo-runtime in its own venv that .ci/run builds)
subscribes to radixd's PUB socket as it would to an engine's, hashes each event's `token_ids` with its
`lora_name` its own way, and identifies a worker's pages by the events' `block_hashes`; Dynamo's `KvRouter`, fed
by a `KvEventPublisher` relaying the same socket (tests/dynamo_router_check.py), does the same in a Dynamo
runtime. After every phase their overlap answers for each prompt must equal radixd's MatchPrefix, in pages on the
device and on device or host: shared prefixes with unaligned tails, the same tokens under two adapters and two
salts with one copy evicted and then all, host demotion and load-back, a worker registered late (the indexer's)
that replays what it missed from radixd's replay socket, and a reset. radixd's gRPC stream rebuilds the same
index (BlockIndex).
"""
from __future__ import annotations

import json
import subprocess
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

from radixd.client import CacheClient
from radixd.client.events import BlockIndex

from .conftest import ServerProc, venv_python
from .stores import _free_port

PAGE = 16
DYNAMO = venv_python("RADIXD_DYNAMO_PYTHON", ".venv-dynamo")
pytestmark = pytest.mark.skipif(DYNAMO is None, reason="no Dynamo venv (.ci/run builds .venv-dynamo)")
SPACES = (("", ""), ("adapter-a", ""), ("adapter-b", ""), ("", "tenant-1"), ("", "tenant-2"))


class Indexer:
    """Dynamo's standalone KV indexer process, spoken to over its HTTP API on loopback."""

    def __init__(self):
        self.port = _free_port()
        self.proc = subprocess.Popen([DYNAMO, "-m", "dynamo.indexer", "--port", str(self.port), "--threads", "1"],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        end = time.monotonic() + 60
        while True:
            try:
                self._call("/workers")
                break
            except (urllib.error.URLError, ConnectionError):
                if self.proc.poll() is not None or time.monotonic() > end:
                    raise AssertionError(f"Dynamo's indexer did not start: {self.output()}") from None
                time.sleep(0.05)

    def _call(self, path: str, body: dict | None = None):
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}",
                                     data=None if body is None else json.dumps(body).encode(),
                                     headers={"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as resp:
            return json.loads(resp.read())

    def register(self, worker: int, endpoint: str, replay: str) -> None:
        assert self._call("/register", dict(instance_id=worker, endpoint=endpoint, replay_endpoint=replay,
                                            model_name="m", block_size=PAGE)) == {"status": "ok"}

    def pages(self, worker: int, tokens, lora: str, salt: str) -> dict[str, int]:
        """Leading pages of `tokens` the worker holds, as Dynamo's indexer scores them: on the device, on any tier."""
        body = dict(token_ids=[int(t) for t in tokens], model_name="m", lora_name=lora or None,
                    cache_salt=salt or None)
        got = self._call("/query", body).get("instances", {}).get(str(worker), {})  # (its scores are in tokens)
        return {"GPU": got.get("gpu", 0) // PAGE, "any": got.get("cpu", 0) // PAGE}

    def output(self) -> str:
        if self.proc.poll() is None:
            self.proc.kill()
        return self.proc.communicate()[0][-4000:]

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


class Router:
    """Dynamo's KvRouter in its venv (tests/dynamo_router_check.py), asked for overlaps over a pipe."""

    def __init__(self, pub: str):
        import os
        self.proc = subprocess.Popen([DYNAMO, os.path.join(os.path.dirname(__file__), "dynamo_router_check.py"), pub,
                                      str(PAGE)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True)
        line = self.proc.stdout.readline()
        assert line.strip() == "ready", f"Dynamo's router did not start: {line!r}"

    def pages(self, tokens, lora: str, salt: str) -> dict[str, int]:
        self.proc.stdin.write(json.dumps(dict(tokens=[int(t) for t in tokens], lora=lora or None,
                                              salt=salt or None)) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


def _truth(c: CacheClient, prompts) -> list[dict[str, int]]:
    """What radixd holds of each prompt, in pages (MatchPrefix without a lock changes no placement)."""
    out = []
    for toks, lora, salt in prompts:
        m = c.match_prefix(toks, extra_key=lora, cache_salt=salt)
        out.append({"GPU": m.matched_len // PAGE, "any": (m.matched_len + m.host_hit_len) // PAGE})
    return out


def _agree(c: CacheClient, ix: Indexer, workers, prompts, idx: BlockIndex, what: str,
           router: "Router | None" = None) -> list[dict[str, int]]:
    """Wait until each worker's Dynamo view (the indexer's, and the router's), and the gRPC-fed BlockIndex equal
    radixd's answers (events arrive asynchronously), then return them; fails with every view past the deadline."""
    want = _truth(c, prompts)
    end = time.monotonic() + 30
    while True:
        views = {w: [ix.pages(w, t, lora, salt) for t, lora, salt in prompts] for w in workers}
        if router is not None:
            views["router"] = [router.pages(t, lora, salt) for t, lora, salt in prompts]
        mine = [idx.match(t, cache_salt=salt, extra_key=lora)["n"] for t, lora, salt in prompts]
        if all(v == want for v in views.values()) and mine == want:
            return want
        if time.monotonic() > end:
            for w, v in views.items():
                bad = [(i, prompts[i][1:], v[i], want[i]) for i in range(len(want)) if v[i] != want[i]]
                assert not bad, f"{what}: Dynamo worker {w} disagrees with MatchPrefix on {bad}"
            assert mine == want, f"{what}: the gRPC-fed BlockIndex disagrees with MatchPrefix"
        time.sleep(0.02)


def _store(c: CacheClient, toks, lora: str, salt: str) -> None:
    m = c.match_prefix(toks, lock=True, extra_key=lora, cache_salt=salt)
    prefix, receipt = m.indices, m.receipt_id
    new = c.alloc(len(toks) - len(prefix))
    ins = c.cache_finished([dict(tokens=toks, indices=np.concatenate([prefix, new[:len(toks) - len(prefix)]]),
                                 extra_key=lora, cache_salt=salt, prev_prefix_len=len(prefix), receipt_id=receipt)])
    if len(new) > len(toks) - len(prefix):
        c.free(new[len(toks) - len(prefix):])
    c.wait_transfers(ins[0].backup_transfer_ids)


def test_dynamos_indexer_agrees_with_match_prefix_through_every_phase():
    pub, replay = f"tcp://127.0.0.1:{_free_port()}", f"tcp://127.0.0.1:{_free_port()}"
    srv = ServerProc("--num-slots", "2048", "--page-size", str(PAGE), "--host-slots", "4096", "--kv-events",
                     "--kv-events-endpoint", pub, "--kv-events-replay-endpoint", replay)
    ix = Indexer()
    router = Router(pub)
    idx = BlockIndex(PAGE)
    rng = np.random.default_rng(56)
    try:
        with CacheClient(srv.target) as c:
            ix.register(1, pub, replay)
            idx.follow_grpc("n", srv.target, snapshot=True, retry_s=0.05)
            # the router's subscription is live once it sees a probe (a PUB drops what comes before that)
            probe = np.arange(40000, 40000 + PAGE, dtype=np.int32)
            end = time.monotonic() + 30
            while router.pages(probe, "", "")["GPU"] == 0:
                assert time.monotonic() < end, "Dynamo's router never saw radixd's events"
                _store(c, probe, "", "")
                time.sleep(0.05)
            c.evict(4096)
            c.evict_host(8192)
            _agree(c, ix, [1], [(probe, "", "")], idx, "the probe gone", router)
            # 1. shared prefixes with unaligned tails, in the default namespace
            roots = [rng.integers(0, 30000, int(rng.integers(3, 7)) * PAGE, dtype=np.int32) for _ in range(4)]
            prompts = []
            for _ in range(12):
                r = roots[int(rng.integers(len(roots)))]
                toks = np.concatenate([r[:int(rng.integers(PAGE, len(r) + 1))],
                                       rng.integers(0, 30000, int(rng.integers(1, 2 * PAGE)), dtype=np.int32)])
                _store(c, toks, "", "")
                prompts.append((toks, "", ""))
            first = _agree(c, ix, [1], prompts, idx, "shared prefixes", router)
            assert sum(v["GPU"] for v in first) > 20
            # 2. the same tokens in five namespaces: two adapters, two salts, the default
            same = roots[0][:3 * PAGE]
            spaces = [(same, lora, salt) for lora, salt in SPACES]
            for toks, lora, salt in spaces:
                _store(c, toks, lora, salt)
            assert _agree(c, ix, [1], spaces, idx, "five namespaces", router) == [{"GPU": 3, "any": 3}] * 5
            # one copy (adapter-b's) leaves the device and then the host; the others stay where they are
            held = [c.match_prefix(t, lock=True, extra_key=lora, cache_salt=salt).receipt_id
                    for t, lora, salt in spaces if lora != "adapter-b"]
            held += [c.match_prefix(t, lock=True).receipt_id for t, _, _ in prompts]
            c.evict(4096)
            c.evict_host(4096)
            got = _agree(c, ix, [1], spaces + prompts, idx, "adapter-b's copy evicted", router)
            assert got[2] == {"GPU": 0, "any": 0} and got[1] == got[0] == {"GPU": 3, "any": 3}
            c.unlock(held)
            # 3. the host tier: everything demoted (write-through backed it up), then one prompt loaded back
            c.evict(4096)
            got = _agree(c, ix, [1], spaces + prompts, idx, "demoted to host", router)
            assert all(v["GPU"] == 0 for v in got) and got[0]["any"] == 3
            m = c.match_prefix(prompts[0][0], lock=True)
            lb = c.load_back(m.receipt_id)
            c.wait_transfers([lb.transfer_id])
            c.unlock([lb.receipt_id])
            got = _agree(c, ix, [1], spaces + prompts, idx, "loaded back", router)
            assert got[len(spaces)]["GPU"] >= 1
            # 4. a worker registered late replays every batch it missed from radixd's replay socket
            ix.register(2, pub, replay)
            _store(c, rng.integers(0, 30000, 2 * PAGE, dtype=np.int32), "adapter-a", "")  # its first live batch
            _agree(c, ix, [1, 2], spaces + prompts, idx, "a late worker's replay", router)
            # every copy of the shared tokens leaves both tiers: no namespace's page is left behind in Dynamo
            c.evict(4096)
            c.evict_host(8192)
            got = _agree(c, ix, [1, 2], spaces + prompts, idx, "everything evicted", router)
            assert all(v == {"GPU": 0, "any": 0} for v in got)
            # 5. new traffic, then a reset clears Dynamo's view too
            for toks, lora, salt in spaces:
                _store(c, toks, lora, salt)
            assert _agree(c, ix, [1, 2], spaces, idx, "stored again", router) == [{"GPU": 3, "any": 3}] * 5
            c.reset()
            got = _agree(c, ix, [1, 2], spaces, idx, "reset", router)
            assert all(v == {"GPU": 0, "any": 0} for v in got)
    except AssertionError:
        print(ix.output())
        raise
    finally:
        ix.close()
        router.close()
        idx.close()
        srv.stop()
