"""A hybrid model through the service: real server processes, the wire, the three pools, against ground truth.

The workload plays an engine scheduler serving a FULL + sliding-window + Mamba model: match (lock, copy the
state), allocate, write KV and states, leave the window during decode, finish. Every value written into a
pool is a function of the token prefix it belongs to, computed here without radixd; every hit is checked
against it (FULL KV of every matched position, SWA KV of the window before the match end, the state copied for
the request). CheckInvariants (the hybrid checker, conservation per pool) runs after every RPC.
"""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import time

import grpc
import numpy as np
import pytest

from radixd.client import CacheClient
from radixd.client.errors import ResourceExhausted
from radixd.proto import cache_pb2 as pb

from .conftest import ServerProc

PAGE, WINDOW = 4, 16

TRI_CONFIG = {  # one layer of each kind, float32 so the values written come back exactly
    "architectures": ["TinyHybrid"], "num_hidden_layers": 3, "hidden_size": 32, "num_attention_heads": 2,
    "num_key_value_heads": 2, "head_dim": 8, "torch_dtype": "float32", "sliding_window": WINDOW,
    "layer_types": ["full_attention", "sliding_attention", "mamba"],
    "mamba_num_heads": 2, "mamba_head_dim": 4, "n_groups": 1, "ssm_state_size": 4, "conv_kernel": 4,
    "chunk_size": 8,
}


# models with no full-attention layer: the tree's keys are the backbone, with no FULL KV pool behind them
SWA_ONLY = {k: v for k, v in TRI_CONFIG.items() if not k.startswith(("mamba", "n_groups", "ssm", "conv", "chunk"))}
SWA_ONLY.update(num_hidden_layers=1, layer_types=["sliding_attention"])
SWA_MAMBA = dict(TRI_CONFIG, num_hidden_layers=2, layer_types=["sliding_attention", "mamba"])
MAMBA_ONLY = {"architectures": ["Mamba2ForCausalLM"], "model_type": "mamba2", "num_hidden_layers": 1,
              "hidden_size": 4, "expand": 2, "num_heads": 2, "head_dim": 4, "n_groups": 1, "state_size": 4,
              "conv_kernel": 4, "chunk_size": 8, "torch_dtype": "float32"}
COMPONENT_SETS = {"FSM": TRI_CONFIG, "S": SWA_ONLY, "SM": SWA_MAMBA, "M": MAMBA_ONLY}


def _config(tmp_path, cfg: dict, name: str = "config.json") -> str:
    path = tmp_path / name
    path.write_text(json.dumps(cfg))
    return str(path)


@pytest.fixture
def tri(tmp_path):
    s = ServerProc("--num-slots", "768", "--page-size", str(PAGE), "--model-config", _config(tmp_path, TRI_CONFIG),
                   "--hybrid-cache", "--swa-ratio", "0.5", "--mamba-states", "10", "--kv-events")
    yield s
    s.stop()


def prefix_values(tokens: np.ndarray) -> np.ndarray:
    """value[i] names the prefix tokens[:i + 1] (a rolling hash, exact in float32)."""
    out = np.empty(len(tokens), dtype=np.float32)
    h = 7
    for i, t in enumerate(tokens.tolist()):
        h = (h * 1000003 + t + 1) % (1 << 20)
        out[i] = h
    return out


class Engine:
    """One scheduler's view: its client, the mapped pools, and the checks of every hit."""

    def __init__(self, target: str):
        self.c = CacheClient(target, name="hybrid-engine")
        self.pools = self.c.map_pools()
        # (None: the model has no such layer)
        self.full = self.pools.device[0].k_buffer[0] if self.pools.device else None  # [slots, heads, dim]
        self.swa = self.pools.swa.k_buffer[0] if self.pools.swa else None
        self.conv = self.pools.state.conv_buffer[0] if self.pools.state else None  # [states, conv dim, kernel - 1]
        self.checked = dict(full=0, swa=0, state=0)
        self.refused = 0
        self.host = False

    def ok(self) -> None:
        assert self.c.check() == []
        st = self.c.stats()
        assert st["free_tokens"] + st["cached_tokens"] + st["held_tokens"] + st["in_flight_tokens"] == \
            st["capacity_tokens"]
        assert st["swa_free_tokens"] + st["swa_evictable_tokens"] + st["swa_protected_tokens"] + \
            st["swa_held_tokens"] == st["swa_capacity_tokens"]
        assert st["mamba_free"] + st["mamba_evictable"] + st["mamba_protected"] + st["mamba_held"] == \
            st["mamba_capacity"]
        if self.host:
            assert st["host_free_tokens"] + st["host_cached_tokens"] == st["host_capacity_tokens"]
            assert st["host_swa_free_tokens"] + st["host_swa_cached_tokens"] == st["host_swa_capacity_tokens"]
            assert st["host_mamba_free"] + st["host_mamba_cached"] == st["host_mamba_capacity"]

    def verify(self, tokens: np.ndarray, m, cow: bool = True) -> None:
        """The hit's FULL KV, its window's SWA KV and its copied state are the ones written for this prefix."""
        import torch
        n = m.matched_len
        if not n:
            return
        want = torch.from_numpy(prefix_values(tokens[:n]))
        if self.full is not None:
            assert torch.equal(self.full[torch.from_numpy(m.indices.copy()), 0, 0], want)
            self.checked["full"] += n
        if self.swa is not None:
            lo = max(0, n - WINDOW)
            twins = m.swa_indices[lo:n]
            assert (twins >= 0).all(), f"the window before the match end ({lo}..{n}) has no SWA KV"
            assert torch.equal(self.swa[torch.from_numpy(twins.copy()), 0, 0], want[lo:])
            self.checked["swa"] += n - lo
        if self.conv is None:
            assert m.mamba_src < 0 and m.mamba_slot < 0
            return
        assert m.mamba_src >= 0
        assert torch.all(self.conv[m.mamba_src] == want[-1]), "the tree's state is not the prefix's"
        if cow:
            assert m.mamba_slot >= 0 and m.mamba_slot != m.mamba_src
            assert torch.all(self.conv[m.mamba_slot] == want[-1]), "the copied state is not the prefix's"
        self.checked["state"] += 1

    def start(self, tokens: np.ndarray, rng) -> dict:
        """A request is scheduled: match+lock+copy the state, allocate, write its KV and state, and maybe decode
        out of the window (free the SWA twins behind it, release the SWA lock)."""
        import torch
        c = self.c
        m = c.match_hybrid([tokens], lock=True, mamba_cow=self.conv is not None)[0]
        self.ok()
        self.verify(tokens, m)
        n = len(tokens)
        try:
            a = c.alloc_hybrid([n - m.matched_len])
        except ResourceExhausted:  # too much in flight: the scheduler puts it back in the queue
            c.unlock([m.receipt_id])
            if m.mamba_slot >= 0:
                c.free_hybrid(states=[m.mamba_slot])
            self.ok()
            self.refused += 1
            return None
        self.ok()
        own, twins = a.full[0], a.swa[0]
        vals = torch.from_numpy(prefix_values(tokens))
        fresh = vals[m.matched_len:]
        if self.full is not None:
            self.full[torch.from_numpy(own[:len(fresh)].copy()), :, :] = fresh[:, None, None]
        if self.swa is not None:
            assert len(twins) == len(own) and (twins >= 0).all()
            self.swa[torch.from_numpy(twins[:len(fresh)].copy()), :, :] = fresh[:, None, None]
        else:
            assert not len(twins)
        aligned = n - n % PAGE
        if aligned and self.conv is not None:
            self.conv[m.mamba_slot] = vals[aligned - 1]  # the state after the last whole page
        evicted = 0
        if self.swa is not None and n - m.matched_len > WINDOW + 2 * PAGE and rng.random() < 0.6:  # decode left
            # the window
            evicted = (n - WINDOW - PAGE) // PAGE * PAGE
            mine = own[:evicted - m.matched_len]
            assert c.free_hybrid(mine, swa_only=True)[0] == len(mine)
            self.ok()
            c.release_swa([m.receipt_id])
            self.ok()
        return dict(tokens=tokens, indices=np.concatenate([m.indices, own]), prev_prefix_len=m.matched_len,
                    receipt_id=m.receipt_id, swa_evicted_seqlen=evicted,
                    **(dict(mamba_value=m.mamba_slot) if self.conv is not None else {}))

    def finish(self, item: dict, unfinished: bool = False) -> None:
        """The request is done (after a chunk checkpoint, sometimes)."""
        c = self.c
        tokens = item["tokens"]
        aligned = len(tokens) - len(tokens) % PAGE
        if unfinished and not item["swa_evicted_seqlen"]:
            (ins, m2), = c.cache_unfinished([item])
            self.ok()
            assert m2.matched_len == aligned
            self.verify(tokens, c.match_hybrid([tokens])[0], cow=False)
            # the tree may have kept its own slots where this request's were duplicates: continue on its
            c.cache_finished([dict(item, indices=np.concatenate([m2.indices, item["indices"][aligned:]]),
                                   prev_prefix_len=aligned, receipt_id=m2.receipt_id)])
        else:
            c.cache_finished([item])
        self.ok()

    def close(self) -> None:
        self.pools.close()
        self.c.close()


def test_a_hybrid_workload_hits_exactly_the_kv_and_states_written_for_each_prefix(tri):
    """Shared system prompts and multi-turn conversations under pool pressure in all three pools."""
    _workload(tri)


@pytest.mark.parametrize("components", ["S", "SM", "M"])
@pytest.mark.parametrize("host", [False, True], ids=["device", "host"])
def test_models_without_full_attention_keep_the_tree_on_keys_alone(tmp_path, components, host):
    """Every layer sliding, sliding and Mamba, pure Mamba2: no FULL KV pool exists; the FULL slots are the tree's
    keys (a budget, no bytes) and the same workload hits exactly the window KV and the states written for each
    prefix, with every pool conserved after every call (and, with a host tier, what the device evicts copied down
    and loaded back)."""
    cfg = COMPONENT_SETS[components]
    args = ["--num-slots", "384" if host else "768", "--page-size", str(PAGE), "--model-config",
            _config(tmp_path, cfg), "--hybrid-cache", "--swa-ratio", "0.5", "--mamba-states", "10"]
    if host:
        args += ["--host-slots", "1536", "--load-back-threshold", "0"]
    s = ServerProc(*args)
    try:
        st = _workload(s, host=host, components=components)
        assert st["capacity_tokens"] == (384 if host else 768)  # the keys' budget
        if host:
            assert st["backup_tokens_total"] > 300 and st["load_back_tokens_total"] > 100, st
        with CacheClient(s.target, name="pools") as c:
            assert c.info()["device_pools"] == []
    finally:
        s.stop()


@pytest.fixture
def tri_host(tmp_path):
    s = ServerProc("--num-slots", "384", "--page-size", str(PAGE), "--model-config", _config(tmp_path, TRI_CONFIG),
                   "--hybrid-cache", "--swa-ratio", "0.5", "--mamba-states", "10", "--host-slots", "1536",
                   "--load-back-threshold", "0")
    yield s
    s.stop()


def test_a_host_tier_keeps_what_the_device_evicts_and_loads_it_back_byte_exact(tri_host):
    """The same workload on a device half the size, with a host tier four times the device: evicted prefixes
    are copied down and come back inside MatchPrefix; every hit (from the device or loaded back from the host)
    reads exactly the values written for its prefix, and every pool of both tiers is conserved after every
    call."""
    import io
    import urllib.request

    from rich.console import Console

    from radixd.server.top import run
    st = _workload(tri_host, host=True)
    assert st["backup_tokens_total"] > 500 and st["load_back_tokens_total"] > 200, st
    assert st["host_hit_tokens_total"] >= st["load_back_tokens_total"]
    assert st["host_swa_capacity_tokens"] == 768 and st["host_mamba_capacity"] == 40  # the device's proportions
    text = urllib.request.urlopen(tri_host.metrics_url, timeout=5).read().decode()
    assert f'radixd_load_back_tokens_total {float(st["load_back_tokens_total"])}' in text
    assert f'radixd_pool_slots{{state="free",tier="host"}} {float(st["host_free_tokens"])}' in text
    assert f'radixd_host_component_slots{{component="mamba",state="cached"}} {float(st["host_mamba_cached"])}' in text
    with CacheClient(tri_host.target, name="top") as c:
        buf = io.StringIO()
        run(c, interval=0.05, iterations=1, console=Console(file=buf, width=150))
    cells = ([x for x in line.split() if x != "│"] for line in buf.getvalue().splitlines())
    rows = {" ".join(r[:2]): r[2:] for r in cells if len(r) > 3 and r[0] == "host"}
    assert rows["host swa"][:2] == ["768", str(st["host_swa_free_tokens"])], rows
    assert rows["host states"][:3] == ["40", str(st["host_mamba_free"]), str(st["host_mamba_cached"])], rows


def _host_server(tmp_path, components: str, *extra: str) -> ServerProc:
    """A small device over a host tier three times its size, every component of the set."""
    return ServerProc("--num-slots", "384", "--page-size", str(PAGE), "--model-config",
                      _config(tmp_path, COMPONENT_SETS[components]), "--hybrid-cache", "--swa-ratio", "0.5",
                      "--mamba-states", "10", "--host-slots", "1536", "--load-back-threshold", "0", *extra)


@pytest.mark.parametrize("components", ["FSM", "S", "M"])
def test_a_write_through_host_tier_copies_every_prefix_at_once_and_serves_it_under_device_pressure(tmp_path,
                                                                                                   components):
    """--write-policy write_through: a prefix is on the host as soon as the device takes it (before any eviction);
    then the workload on a small device hits exactly the values written, device and host pools conserved."""
    s = _host_server(tmp_path, components, "--write-policy", "write_through")
    try:
        with CacheClient(s.target, name="wt") as c:
            state = "M" in components
            a = c.alloc_hybrid([32], mamba_states=1 if state else 0)
            tokens = np.arange(100, 132, dtype=np.int32)
            c.cache_finished([dict(tokens=tokens, indices=a.full[0],
                                   **(dict(mamba_value=int(a.states[0])) if state else {}))])
            st = c.stats()
            assert st["evicted_tokens_total"] == 0 and st["host_cached_tokens"] == 32, st
            assert st["backup_tokens_total"] == 32 and c.check() == []
            c.evict_hybrid(1 << 20)
            assert c.match_hybrid([tokens])[0].matched_len == 32  # loaded back from the host
            assert c.stats()["load_back_tokens_total"] == 32
        st = _workload(s, host=True, components=components)
        assert st["load_back_tokens_total"] > 100, st
    finally:
        s.stop()


@pytest.mark.parametrize("components", ["FSM", "S", "M"])
def test_a_selective_write_through_host_tier_copies_a_prefix_once_it_is_cached_again(tmp_path, components):
    """--write-policy write_through_selective (threshold 2): a prompt cached once stays on the device only; cached
    a second time (a hit whose request finished), it is copied to the host, every component, and loads back
    after the device is emptied; then the workload on a small device, pools conserved."""
    s = _host_server(tmp_path, components, "--write-policy", "write_through_selective")
    try:
        with CacheClient(s.target, name="wts") as c:
            state = "M" in components
            tokens = np.arange(100, 132, dtype=np.int32)
            for turn in range(2):
                m = c.match_hybrid([tokens])[0]
                a = c.alloc_hybrid([32 - m.matched_len], mamba_states=1 if state else 0)
                c.cache_finished([dict(tokens=tokens, indices=np.concatenate([m.indices, a.full[0]]),
                                       prev_prefix_len=m.matched_len,
                                       **(dict(mamba_value=int(a.states[0])) if state else {}))])
                st = c.stats()
                assert st["host_cached_tokens"] == 32 * turn and st["backup_tokens_total"] == 32 * turn, (turn, st)
                assert c.check() == []
            c.evict_hybrid(1 << 20)
            assert c.match_hybrid([tokens])[0].matched_len == 32  # loaded back from the host
            assert c.stats()["load_back_tokens_total"] == 32
        st = _workload(s, host=True, components=components)
        assert st["backup_tokens_total"] > 0, st
    finally:
        s.stop()


def _workload(server, host: bool = False, components: str = "FSM") -> dict:
    rng = np.random.default_rng(11)
    e = Engine(server.target)
    e.host = host
    try:
        h = e.c.info()["hybrid"]
        assert h["sliding_window"] == (WINDOW if "S" in components else 0)
        assert h["mamba_chunk"] == (8 if "M" in components else 0)
        at = iter(range(3))
        assert h["full_layers"] == ([next(at)] if "F" in components else [])
        assert h["swa_layers"] == ([next(at)] if "S" in components else [])
        assert h["state_layers"] == ([next(at)] if "M" in components else [])
        systems = [rng.integers(0, 1000, int(rng.integers(8, 40)), dtype=np.int32) for _ in range(4)]
        convs: list[np.ndarray] = []
        running: list[dict] = []
        for step in range(300):
            if running and (len(running) >= 4 or rng.random() < 0.45):  # up to 4 requests in flight
                e.finish(running.pop(int(rng.integers(len(running)))), unfinished=rng.random() < 0.15)
            else:
                if convs and rng.random() < 0.4:  # a conversation's next turn extends its history
                    i = int(rng.integers(len(convs)))
                    tokens = np.concatenate([convs[i], rng.integers(0, 1000, int(rng.integers(4, 30)),
                                                                    dtype=np.int32)])
                    convs[i] = tokens
                else:
                    tokens = np.concatenate([systems[int(rng.integers(4))],
                                             rng.integers(0, 1000, int(rng.integers(1, 60)), dtype=np.int32)])
                    convs.append(tokens)
                req = e.start(tokens, rng)
                if req is not None:
                    running.append(req)
            if rng.random() < 0.15:
                e.c.evict_hybrid(int(rng.integers(0, 64)), int(rng.integers(0, 48)) if "S" in components else 0,
                                 int(rng.integers(0, 3)) if "M" in components else 0)
                e.ok()
        for item in running:
            e.finish(item)
        st = e.c.stats()
        assert st["receipts"] == 0 and st["held_tokens"] == 0 and st["mamba_held"] == 0
        assert st["swa_held_tokens"] == 0
        assert st["evicted_tokens_total"] > 0, "the workload never filled the FULL pool"
        assert e.checked["full"] > 1000 or "F" not in components, e.checked
        assert e.checked["swa"] > 300 or "S" not in components, e.checked
        assert e.checked["state"] > 30 or "M" not in components, e.checked
        assert e.checked["full"] + e.checked["swa"] + e.checked["state"] > 0
        assert e.refused < 30, f"{e.refused} requests found no room"
        return st
    finally:
        e.close()


def test_a_plain_client_and_plain_calls_keep_working_on_a_hybrid_server(tri):
    """Today's client code, unchanged: alloc, insert with a state, match, unlock."""
    with CacheClient(tri.target, name="plain") as c:
        a = c.alloc_hybrid([8], mamba_states=1)
        toks = np.arange(8, dtype=np.int32)
        ins = c.cache_finished([dict(tokens=toks, indices=a.full[0], mamba_value=int(a.states[0]))])[0]
        assert ins.adopted == 8 and not ins.mamba_exist
        m = c.match_prefix(toks, lock=True)
        assert m.matched_len == 8 and m.receipt_id
        c.unlock([m.receipt_id])
        assert c.check() == []


def test_namespaces_keep_hybrid_prefixes_apart(tri):
    """The same tokens cached under a cache_salt, an extra_key and none: each namespace matches only its own pages,
    state and window; a never-seen namespace matches nothing; evicting a namespace's last prefix leaves nothing
    of it behind (the checker refuses an empty namespace root)."""
    toks = np.arange(12, dtype=np.int32)
    with CacheClient(tri.target, name="ns") as c:
        own = {}
        for ns in (dict(), dict(cache_salt="tenant-a"), dict(extra_key="lora-1")):
            a = c.alloc_hybrid([12], mamba_states=1)
            ins = c.cache_finished([dict(tokens=toks, indices=a.full[0], mamba_value=int(a.states[0]), **ns)])[0]
            assert ins.adopted == 12 and not ins.mamba_exist
            own[tuple(sorted(ns.items()))] = (a.full[0].tolist(), int(a.states[0]))
        assert len({tuple(v[0]) for v in own.values()}) == 3
        for key, (slots, state) in own.items():
            m = c.match_hybrid([toks], lock=True, **dict(key))[0]
            assert m.matched_len == 12 and m.indices.tolist() == slots and m.mamba_src == state
            assert (m.swa_indices[-WINDOW // 2:] >= 0).all()
            c.unlock([m.receipt_id])
        assert c.match_hybrid([toks], cache_salt="tenant-b")[0].matched_len == 0
        assert c.match_prefix(toks, extra_key="lora-1").matched_len == 12  # the plain call speaks namespaces too
        assert c.evict_hybrid(num_tokens=1 << 20)[0] == 36
        assert c.stats()["num_nodes"] == 0 and c.check() == []


def _bad(c, call, request, code, text):
    before = c.stats()
    with pytest.raises(grpc.RpcError) as e:
        getattr(c._stub, call)(request, metadata=c._meta)
    assert e.value.code() == code, e.value.details()
    assert text in e.value.details(), e.value.details()
    after = c.stats()
    assert before == after, "a refused call changed the server"
    assert c.check() == []


def test_bad_hybrid_input_gets_a_precise_status_and_changes_nothing(tri):
    INV, DENIED, CONFLICT = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.PERMISSION_DENIED, \
        grpc.StatusCode.FAILED_PRECONDITION
    with CacheClient(tri.target, name="bad") as c:
        a = c.alloc_hybrid([12], mamba_states=2)
        sid = c.session_id
        toks = np.arange(12, dtype=np.int32).tobytes()
        idx = a.full[0].tobytes()
        _bad(c, "CacheFinished", pb.CacheFinishedRequest(session_id=sid, items=[pb.FinishedItem(tokens=toks, indices=idx)]),
             INV, "every insert donates a state")
        _bad(c, "CacheFinished", pb.CacheFinishedRequest(session_id=sid, items=[
            pb.FinishedItem(tokens=toks, indices=idx, mamba_value=9)]), DENIED, "mamba_value")
        _bad(c, "CacheFinished", pb.CacheFinishedRequest(session_id=sid, items=[
            pb.FinishedItem(tokens=toks, indices=idx, mamba_value=int(a.states[0]), swa_evicted_seqlen=3)]),
            INV, "not a page-aligned")
        c.free_hybrid(a.full[0][4:8], swa_only=True)
        _bad(c, "CacheFinished", pb.CacheFinishedRequest(session_id=sid, items=[
            pb.FinishedItem(tokens=toks, indices=idx, mamba_value=int(a.states[0]), swa_evicted_seqlen=4)]),
            INV, "lost their SWA twins")
        _bad(c, "Free", pb.FreeRequest(session_id=sid, states=np.array([7], "<i8").tobytes()), DENIED, "states")
        _bad(c, "Evict", pb.EvictRequest(host_tokens=4), CONFLICT, "host tier is off")
        _bad(c, "LoadBack", pb.LoadBackRequest(session_id=sid, items=[pb.LoadBackItem(receipt_id=1)]),
             CONFLICT, "host tier is off")
        ins = c.cache_finished([dict(tokens=np.arange(12, dtype=np.int32), indices=a.full[0], mamba_value=int(a.states[0]),
                                     swa_evicted_seqlen=8)])[0]
        assert ins.adopted == 12
        m = c.match_hybrid([np.arange(12, dtype=np.int32)], lock=True)[0]
        c.release_swa([m.receipt_id])
        _bad(c, "Unlock", pb.UnlockRequest(session_id=sid, receipt_id=[m.receipt_id], swa_only=True), CONFLICT,
             "already released its SWA window")
        c.unlock([m.receipt_id])
        _bad(c, "Alloc", pb.AllocRequest(session_id=sid, num_tokens=[4], mamba_states=11), grpc.StatusCode.RESOURCE_EXHAUSTED,
             "state pool has 10")


def test_a_checkpoint_batch_short_of_state_slots_is_refused_whole(tri):
    """CacheUnfinished forks each donated state into the tree: two items and one free state slot (nothing
    evictable) is refused before the first item is applied."""
    with CacheClient(tri.target, name="forks") as c:
        a = c.alloc_hybrid([8, 8], mamba_states=2)
        filler = c.alloc_hybrid([], mamba_states=7)
        assert c.stats()["mamba_free"] == 1
        sid = c.session_id
        items = [pb.FinishedItem(tokens=np.arange(k, k + 8, dtype=np.int32).tobytes(), indices=a.full[i].tobytes(),
                                   mamba_value=int(a.states[i])) for i, k in enumerate((0, 100))]
        _bad(c, "CacheUnfinished", pb.CacheUnfinishedRequest(session_id=sid, items=items),
             grpc.StatusCode.RESOURCE_EXHAUSTED, "need 2 free state slots, 1 free")
        c.free_hybrid(states=filler.states[:1])
        res = c.cache_unfinished([dict(tokens=np.arange(k, k + 8, dtype=np.int32), indices=a.full[i],
                                       mamba_value=int(a.states[i])) for i, k in enumerate((0, 100))])
        assert len(res) == 2 and c.stats()["mamba_evictable"] + c.stats()["mamba_protected"] == 2
        assert c.check() == []


def test_a_plain_server_refuses_hybrid_fields(server):
    with CacheClient(server.target, name="p") as c:
        _bad(c, "Alloc", pb.AllocRequest(session_id=c.session_id, num_tokens=[4], mamba_states=1),
             grpc.StatusCode.INVALID_ARGUMENT, "holds a plain model")
        _bad(c, "Unlock", pb.UnlockRequest(session_id=c.session_id, swa_only=True), grpc.StatusCode.INVALID_ARGUMENT,
             "holds a plain model")


def _holder(target: str, ready) -> None:
    """Another engine: holds FULL slots with twins, states, a cow copy and a lock, then waits to be killed."""
    c = CacheClient(target, name="doomed")
    a = c.alloc_hybrid([40], mamba_states=2)
    toks = np.arange(40, dtype=np.int32)
    c.cache_finished([dict(tokens=toks[:20], indices=a.full[0][:20], mamba_value=int(a.states[0]))])
    c.match_hybrid([toks[:20]], lock=True, mamba_cow=True)
    ready.set()
    time.sleep(60)


def test_a_killed_engine_loses_its_slots_states_and_locks_within_a_second(tri):
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    p = ctx.Process(target=_holder, args=(tri.target, ready))
    p.start()
    try:
        assert ready.wait(60)
        with CacheClient(tri.target, name="watch") as c:
            st = c.stats()
            assert st["held_tokens"] and st["swa_held_tokens"] and st["mamba_held"] and st["receipts"]
            os.kill(p.pid, signal.SIGKILL)
            deadline = time.monotonic() + 1.0
            while time.monotonic() < deadline:
                st = c.stats()
                if st["sessions"] == 1:
                    break
            assert st["sessions"] == 1, "the dead engine's session outlived a second"
            assert st["held_tokens"] == st["swa_held_tokens"] == st["mamba_held"] == st["receipts"] == 0
            assert st["free_tokens"] + st["cached_tokens"] == st["capacity_tokens"]
            assert c.check() == []
    finally:
        p.kill()
        p.join()


def test_hybrid_events_name_each_component(tri):
    """Stores of all three components arrive on WatchEvents with their group and kind."""
    from radixd.client.events import event_dicts, watch
    with CacheClient(tri.target, name="ev") as c:
        a = c.alloc_hybrid([8], mamba_states=1)
        c.cache_finished([dict(tokens=np.arange(8, dtype=np.int32), indices=a.full[0], mamba_value=int(a.states[0]))])
        kinds = set()
        for batch in watch(tri.target, from_seq=0, follow=False):
            for ev in event_dicts(batch):
                kinds.add((ev.get("group_idx"), ev.get("kv_cache_spec_kind"), ev.get("kv_cache_spec_sliding_window")))
        assert kinds == {(0, "full_attention", None), (1, "sliding_window", WINDOW), (2, "mamba", None)}


@pytest.mark.parametrize("components,kinds", [("S", {(0, "sliding_window", WINDOW)}),
                                              ("SM", {(0, "sliding_window", WINDOW), (1, "mamba", None)}),
                                              ("M", {(0, "mamba", None)})])
def test_a_model_without_full_attention_announces_no_full_pages(tmp_path, components, kinds):
    """Its FULL slots are keys with no KV: a router must not count them as cached; the other components are the
    event groups from 0, as vLLM numbers such a model's KV cache groups."""
    from radixd.client.events import event_dicts, watch
    s = ServerProc("--num-slots", "256", "--page-size", str(PAGE), "--model-config",
                   _config(tmp_path, COMPONENT_SETS[components]), "--hybrid-cache", "--mamba-states", "4",
                   "--kv-events")
    try:
        with CacheClient(s.target, name="ev") as c:
            a = c.alloc_hybrid([8], mamba_states=1 if "M" in components else 0)
            extra = dict(mamba_value=int(a.states[0])) if "M" in components else {}
            c.cache_finished([dict(tokens=np.arange(8, dtype=np.int32), indices=a.full[0], **extra)])
            assert c.match_hybrid([np.arange(8, dtype=np.int32)])[0].matched_len == 8
            got = set()
            for batch in watch(s.target, from_seq=0, follow=False):
                for ev in event_dicts(batch):
                    got.add((ev.get("group_idx"), ev.get("kv_cache_spec_kind"),
                             ev.get("kv_cache_spec_sliding_window")))
            assert got == kinds
    finally:
        s.stop()


@pytest.mark.parametrize("config,pools", [
    ("gemma3-text.json", {"device", "swa"}), ("gpt-oss.json", {"device", "swa"}),
    ("nemotron-h-4b.json", {"device", "state"}), ("qwen3-next.json", {"device", "state"}),
    ("jamba.json", {"device", "state"})])
def test_real_configs_are_sized_into_their_pools(config, pools):
    """Each real config's layers land in the right pool, with the state pool's per-buffer dtypes."""
    from radixd.server.layouts import model_layout
    path = os.path.join(os.path.dirname(__file__), "configs", config)
    with open(path) as f:
        hf = json.load(f)
    lay = model_layout(hf)
    s = ServerProc("--num-slots", "1024", "--page-size", "16", "--model-config", path, "--hybrid-cache",
                   "--mamba-states", "2")
    try:
        with CacheClient(s.target, name="size") as c:
            info = c.info()
            got = {info["device_pools"][0].tier} | {p.tier for p in (info["swa_pool"], info["state_pool"]) if p}
            assert got == pools
            assert info["device_pools"][0].num_layers == len(lay.full_layers)
            assert info["hybrid"]["full_layers"] == list(lay.full_layers)
            if info["swa_pool"]:
                assert info["swa_pool"].num_layers == len(lay.swa_layers)
                assert info["hybrid"]["sliding_window"] == lay.window
            if info["state_pool"]:
                sp = info["state_pool"]
                assert sp.num_layers == len(lay.state_layers) and sp.num_slots == 2
                conv = next(b for b in sp.buffers if b.name == "conv.0")
                temporal = next(b for b in sp.buffers if b.name == "temporal.0")
                assert tuple(conv.shape[1:]) == lay.state.conv_shape and conv.dtype == lay.state.conv_dtype
                assert tuple(temporal.shape[1:]) == lay.state.temporal_shape
                assert temporal.dtype == lay.state.temporal_dtype
                mapped = c.map_pools()
                assert tuple(mapped.state.temporal_buffer[0].shape) == (2, *lay.state.temporal_shape)
                mapped.close()
    finally:
        s.stop()


def test_top_and_prometheus_show_each_components_pool(tri):
    """`radixd top` gets an SWA and a states row, Prometheus a radixd_component_slots family, both live."""
    import io
    import urllib.request

    from rich.console import Console

    from radixd.server.top import run
    with CacheClient(tri.target, name="top") as c:
        a = c.alloc_hybrid([8], mamba_states=1)
        c.cache_finished([dict(tokens=np.arange(8, dtype=np.int32), indices=a.full[0], mamba_value=int(a.states[0]))])
        buf = io.StringIO()
        run(c, interval=0.05, iterations=1, console=Console(file=buf, width=150))
        cells = [[x for x in line.split() if x != "│"] for line in buf.getvalue().splitlines()]
        rows = {r[0]: r[1:] for r in cells if len(r) > 2 and r[0] in ("swa", "states")}
        st = c.stats()
        assert rows["swa"][:2] == [str(st["swa_capacity_tokens"]), str(st["swa_free_tokens"])], rows
        assert rows["states"][:3] == ["10", "9", "1"], rows  # capacity, free, cached
        text = urllib.request.urlopen(tri.metrics_url, timeout=5).read().decode()
        assert 'radixd_component_slots{component="mamba",state="evictable"} 1.0' in text
        assert f'radixd_component_slots{{component="swa",state="free"}} {float(st["swa_free_tokens"])}' in text


def test_device_mem_sizes_full_tokens_with_their_swa_share_and_the_states_first(tmp_path):
    from radixd.server.config import load, slot_bytes_of
    from radixd.server.layouts import model_layout
    path = _config(tmp_path, TRI_CONFIG)
    cfg = load(dict(model_config=path, hybrid_cache=True, device_mem="16MiB", page_size=PAGE, mamba_states=10,
                    swa_ratio=0.5))
    lay = model_layout(TRI_CONFIG)
    per_token = slot_bytes_of(cfg) * 1.5  # one full layer, and half a token's worth of the one sliding layer
    budget = (16 << 20) - 10 * lay.state_bytes()
    assert cfg.num_slots % PAGE == 0 and budget - per_token * PAGE < cfg.num_slots * per_token <= budget


def test_the_asyncio_client_speaks_the_hybrid_calls(tri):
    import asyncio

    from radixd.client import AsyncCacheClient

    async def go():
        async with AsyncCacheClient(tri.target, name="aio") as c:
            a = await c.alloc_hybrid([12], mamba_states=1)
            assert len(a.full[0]) == len(a.swa[0]) == 12 and len(a.states) == 1
            toks = np.arange(500, 512, dtype=np.int32)
            await c.cache_finished([dict(tokens=toks, indices=a.full[0], mamba_value=int(a.states[0]))])
            m = (await c.match_hybrid([toks], lock=True, mamba_cow=True))[0]
            assert m.matched_len == 12 and m.mamba_slot >= 0 and (m.swa_indices >= 0).all()
            await c.release_swa([m.receipt_id])
            await c.unlock([m.receipt_id])
            assert await c.free_hybrid(states=[m.mamba_slot]) == (0, 1)
            assert await c.check() == []
    asyncio.run(go())
