"""Differential test of radixd's hybrid tree (`server/tree/hybrid.py`) against SGLang 0.5.23's own
`UnifiedRadixCache` (run in SGLang's venv by tests/test_tree_hybrid.py).

    python tests/hybrid_differential.py CONFIG PAGE CORE SEED STEPS [CAP]

CONFIG is swa, mamba or tri (FULL+SWA, FULL+MAMBA, FULL+SWA+MAMBA); CORE is python or rust (SGLang's tree
core); CAP is SGLang's mamba_max_states_per_path (-1: off, its default). One seeded sequence of scheduler
operations runs on both: match, lock (some without the MAMBA state, as a decode hold may), allocate (evicting FULL when
short), insert with prev_prefix_len, the SWA evicted seqlen and a donated MAMBA state (freed again on
mamba_exist), the early SWA release, unlock (now or many operations later), and evictions of each component.
After every operation both must agree on: matched length and slots, the full hit, both branching seqlens, the
MAMBA source state, insert prefix and mamba_exist, evict counts per component, the exact slots freed per
component (FULL, SWA twins by FULL slot, MAMBA), and evictable and protected sizes per component; radixd's
checker runs after every operation, and slots are conserved (free + tree + held by requests == capacity).

SGLang's cache gets no real allocator traffic: its frees and SWA rebuilds are intercepted where the cache
applies them (`_apply_cache_action`), recorded, and the SWA value a rebuild stores is the FULL slots
themselves, which is what radixd's tree models (the SWA twins are the pool layer's translation).
"""
from __future__ import annotations

import os
import random
import sys
from array import array

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests.sglang_cpu import stub_torchvision  # noqa: E402

stub_torchvision()
import numpy as np  # noqa: E402
import torch  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams  # noqa: E402
from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixKey  # noqa: E402
from sglang.srt.mem_cache.unified_cache import cache_action as ca  # noqa: E402
from sglang.srt.mem_cache.unified_cache.components import ComponentType as CT  # noqa: E402
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache  # noqa: E402
from sglang.test.unified_allocator_fixtures import build_swa_pool, build_tri_pool, setup_allocator_context  # noqa: E402

from radixd.server.tree.hybrid import HybridTree  # noqa: E402
from radixd.server.tree.hybrid_check import check_hybrid  # noqa: E402

WINDOW_PAGES = 4  # the window in pages: small, so windows, tombstones and splits happen all the time
FULL_CAP_PAGES = 96
MAMBA_CAP = 24
CHUNK = 64  # setup_allocator_context's mamba chunk


class Recorder:
    """Frees SGLang's cache applies, per component; SWA rebuilds are stored as FULL slots."""

    def __init__(self, cache: UnifiedRadixCache, has_swa: bool):
        self.cache = cache
        self.has_swa = has_swa
        self.full: list[int] = []
        self.swa: list[int] = []
        self.mamba: list[int] = []
        self.moves = 0
        self.trims = 0

    def take(self) -> tuple[list[int], list[int], list[int]]:
        out = (sorted(self.full), sorted(self.swa), sorted(self.mamba))
        self.full, self.swa, self.mamba = [], [], []
        return out

    def __call__(self, action) -> None:
        tc = self.cache.tree_core
        if isinstance(action, ca.FreeDeviceKV):
            for t in action.indices:
                self.full += t.tolist()
                if self.has_swa:  # without SWA layers the combined free is a FULL free
                    self.swa += t.tolist()
        elif isinstance(action, ca.FreeDeviceKVFullOnly):
            for t in action.indices:
                self.full += t.tolist()
        elif isinstance(action, ca.FreeComponentDeviceSlot):
            dst = {CT.FULL: self.full, CT.SWA: self.swa, CT.MAMBA: self.mamba}[action.component_type]
            for t in action.indices:
                dst += t.reshape(-1).tolist()
        elif isinstance(action, ca.SWARebuild):
            tc.set_component_device_value(action.node_id, CT.SWA, action.source_value.clone())
        elif isinstance(action, ca.RecoverSWAWithLockedFull):
            self.full += action.incoming_full.tolist()
            self.moves += 1
            tc.set_component_device_value(action.node_id, CT.SWA, action.kept_full.clone())
        elif isinstance(action, ca.UpdatePendingBackupOnNodeSplit):
            pass
        elif isinstance(action, ca.MambaEvictExcessPathStates):
            self.trims += 1
            self.cache.components[CT.MAMBA].apply_component_action(action)  # its frees come back through here
        else:
            raise AssertionError(f"unexpected cache action {type(action).__name__}")


def build(config: str, page: int, core: str, window: int = 0, cap: int = -1, events: bool = True):
    setup_allocator_context()
    if cap != -1:
        from sglang.srt.runtime_context import publish, reset_context
        from sglang.srt.server_args import ServerArgs
        reset_context()
        args = ServerArgs(model_path="dummy", device="cpu", mamba_max_states_per_path=cap)
        args._mamba_cache_chunk_size = CHUNK
        publish(args, role="tokenizer")
    comps = {"swa": (CT.FULL, CT.SWA), "mamba": (CT.FULL, CT.MAMBA), "tri": (CT.FULL, CT.SWA, CT.MAMBA)}[config]
    if config == "swa":
        alloc = build_swa_pool(page_size=page, lazy=False)
        req_pool = None
        from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
        req_pool = ReqToTokenPool(size=4, max_context_len=256 * page, device="cpu", enable_memory_saver=False)
    else:
        bundle, alloc = build_tri_pool(page_size=page, lazy=False, temporal=(0, 0, 0))
        req_pool = bundle.req_to_token_pool
    window = window or WINDOW_PAGES * page
    cache = UnifiedRadixCache(CacheInitParams(
        disable=False, req_to_token_pool=req_pool, token_to_kv_pool_allocator=alloc, page_size=page,
        sliding_window_size=window, tree_components=comps, enable_mamba_extra_buffer=page > 1,
        tree_core_backend=core))
    name = type(cache.tree_core).__name__
    assert ("Rust" in name) == (core == "rust"), f"asked for the {core} core, got {name}"
    rec = Recorder(cache, CT.SWA in comps)
    cache._apply_cache_action = rec
    mine = HybridTree(page, window=window if CT.SWA in comps else None,
                      mamba_chunk=CHUNK if CT.MAMBA in comps else None, events=events,
                      mamba_max_states_per_path=cap if CT.MAMBA in comps else -1)
    if CT.MAMBA in comps:
        grid = cache.components[CT.MAMBA].mamba_checkpoint_grid
        assert grid == mine.mamba.grid, (grid, mine.mamba.grid)
        assert cache.components[CT.MAMBA].mamba_max_states_per_path == cap
    if CT.SWA in comps:
        assert cache.components[CT.SWA].gates_prefix_match
    return cache, rec, mine, comps


def sizes_of(cache, comps) -> dict:
    out = {"full": (cache.full_evictable_size(), cache.full_protected_size())}
    if CT.SWA in comps:
        out["swa"] = (cache.swa_evictable_size(), cache.swa_protected_size())
    if CT.MAMBA in comps:
        out["mamba"] = (cache.mamba_evictable_size(), cache.mamba_protected_size())
    return out


def run(config: str, page: int, core: str, seed: int, steps: int, cap: int = -1) -> None:
    rnd = random.Random(seed)
    cache, rec, mine, comps = build(config, page, core, cap=cap)
    has_swa, has_mamba = CT.SWA in comps, CT.MAMBA in comps
    free_full = list(range(1, FULL_CAP_PAGES * page + 1))
    free_mamba = list(range(1, MAMBA_CAP + 1))
    held: list[tuple] = []  # (their lock, my receipt, released swa)
    prefixes = [[rnd.randrange(1, 50) for _ in range(rnd.randrange(1, 12) * page)] for _ in range(6)]
    counts = {"match": 0, "insert": 0, "evict": 0, "release_swa": 0, "unlock": 0, "exist": 0, "blind": 0}

    def agree(what: str, a, b) -> None:
        if a != b:
            raise AssertionError(f"step {step} ({what}): SGLang {a!r} != radixd {b!r}")

    def frees_agree(what: str, f) -> None:
        full, swa, mamba = rec.take()
        agree(what + " FULL frees", full, sorted(f.full_slots().tolist()))
        agree(what + " SWA frees", swa, sorted(f.swa_slots().tolist()))
        agree(what + " MAMBA frees", mamba, sorted(int(x) for x in f.mamba))
        free_full.extend(full)
        free_mamba.extend(mamba)

    def evict(full: int = 0, swa: int = 0, mamba: int = 0) -> None:
        r = cache.evict(EvictParams(num_tokens=full, swa_num_tokens=swa, mamba_num=mamba))
        m = mine.evict(full, swa, mamba)
        agree("evict counts", (r.num_tokens_evicted, r.swa_num_tokens_evicted, r.mamba_num_evicted),
              (m.full, m.swa if has_swa else 0, m.mamba if has_mamba else 0))
        frees_agree("evict", m.frees)
        counts["evict"] += 1

    def unlock_one() -> None:
        lk, rid, released = held.pop(rnd.randrange(len(held)))
        cache.unlock(lk)
        mine.unlock(rid)
        counts["unlock"] += 1

    for step in range(steps):
        op = rnd.random()
        if op < 0.7:  # a request: match, lock, allocate, insert, maybe early SWA release, unlock or hold
            base = rnd.choice(prefixes)
            tail = rnd.randrange(0, 40) if rnd.random() < 0.7 else 0  # no tail: ends where a state may be
            toks = base[:rnd.randrange(0, len(base) + 1)] + [rnd.randrange(1, 50) for _ in range(tail)]
            r = cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", toks))))
            m = mine.match_prefix(toks)
            counts["match"] += 1
            n = r.device_prefix_len
            agree("matched", n, m.matched_len)
            agree("full hit", r.full_kv_hit_length, m.full_hit_len)
            got = cache.path_device_indices(r.last_device_node)[:n].tolist() if n else []
            agree("matched slots", got, m.indices.tolist())
            if has_swa:
                agree("swa branching", r.swa_branching_seqlen, m.swa_branching_seqlen)
            if has_mamba:
                agree("mamba branching", r.mamba_branching_seqlen, m.mamba_branching_seqlen)
                src = cache.tree_core.get_component_device_value(r.best_match_node, CT.MAMBA)
                agree("mamba source", -1 if src is None else int(src.reshape(-1)[0]), m.mamba_src)
            skip = has_mamba and rnd.random() < 0.2
            lk = cache.lock(r.last_device_node, (CT.MAMBA,) if skip else ())
            rid = mine.lock(m.node_id, skip_mamba=skip)
            agree("sizes after lock", sizes_of(cache, comps), mine.sizes())
            total = len(toks) - len(toks) % page
            need = total - n
            if need > len(free_full):
                evict(full=need - len(free_full))
            if need > len(free_full):  # everything else is locked: give up this request
                cache.unlock(lk)
                mine.unlock(rid)
                continue
            new = [free_full.pop() for _ in range(need)]
            value = got + new
            mval = -1
            if has_mamba:
                if not free_mamba:
                    evict(mamba=1)
                if not free_mamba:
                    cache.unlock(lk)
                    mine.unlock(rid)
                    free_full.extend(new)
                    continue
                mval = free_mamba.pop()
            floor = 0
            if has_swa and total > n and rnd.random() < 0.5:  # the request freed SWA below a page boundary
                floor = rnd.randrange(n // page, total // page + 1) * page
            params = InsertParams(key=RadixKey(array("q", toks[:total])), value=torch.tensor(value, dtype=torch.int64),
                                  prev_prefix_len=n,
                                  mamba_value=torch.tensor([mval], dtype=torch.int64) if has_mamba else None)
            if has_swa:
                params.set_evicted_seqlen(CT.SWA, floor)
            ir = cache.insert(params)
            mi = mine.insert(toks[:total], np.array(value, dtype=np.int64), prev_prefix_len=n,
                             swa_evicted_seqlen=floor, mamba_value=mval)
            counts["insert"] += 1
            agree("insert prefix", ir.prefix_len, mi.prefix_len)
            if has_mamba:
                agree("mamba_exist", bool(ir.mamba_exist), mi.mamba_exist)
                if mi.mamba_exist and total:
                    free_mamba.append(mval)
                    counts["exist"] += 1
                elif not total:
                    free_mamba.append(mval)
            frees_agree("insert", mi.frees)
            released = False
            if has_swa and rnd.random() < 0.3:
                cache.release_swa(lk)
                f = mine.release_swa(rid)
                frees_agree("release_swa", f)
                released = True
                counts["release_swa"] += 1
            held.append((lk, rid, released))
            if len(held) > 3 or rnd.random() < 0.6:
                unlock_one()
        elif op < 0.75:  # an insert with no match before it (a stale or skipped lookup): its key often ends or
            # turns inside an edge the tree has now, which no match has split
            toks = rnd.choice(prefixes)[:rnd.randrange(1, 4) * page] + [rnd.randrange(1, 50) for _ in range(
                rnd.choice((0, 0, page)))]
            total = len(toks) - len(toks) % page
            if total > len(free_full):
                evict(full=total - len(free_full))
            mval = -1
            if has_mamba and not free_mamba:
                evict(mamba=1)
            if total > len(free_full) or (has_mamba and not free_mamba):
                continue
            new = [free_full.pop() for _ in range(total)]
            if has_mamba:
                mval = free_mamba.pop()
            params = InsertParams(key=RadixKey(array("q", toks[:total])), value=torch.tensor(new, dtype=torch.int64),
                                  prev_prefix_len=0,
                                  mamba_value=torch.tensor([mval], dtype=torch.int64) if has_mamba else None)
            if has_swa:
                params.set_evicted_seqlen(CT.SWA, 0)
            ir = cache.insert(params)
            mi = mine.insert(toks[:total], np.array(new, dtype=np.int64), mamba_value=mval)
            counts["blind"] += 1
            agree("blind insert prefix", ir.prefix_len, mi.prefix_len)
            if has_mamba:
                agree("blind mamba_exist", bool(ir.mamba_exist), mi.mamba_exist)
                if mi.mamba_exist:
                    free_mamba.append(mval)
            frees_agree("blind insert", mi.frees)
        elif op < 0.78 and held:
            unlock_one()
        elif op < 0.86:
            evict(full=rnd.randrange(0, 3 * page + 1))
        elif op < 0.93 and has_swa:
            evict(swa=rnd.randrange(1, 3 * page + 1))
        elif has_mamba:
            evict(mamba=rnd.randrange(1, 3))
        agree("sizes", sizes_of(cache, comps), mine.sizes())
        mine.take_events()  # recorded on every path above; their content is tests/test_tree_hybrid.py's
        bad = check_hybrid(mine)
        if bad:
            raise AssertionError(f"step {step}: checker: {bad[:5]}")
        tree_held = mine.held()
        held_full = len(tree_held["full"])
        if held_full + len(free_full) != FULL_CAP_PAGES * page:
            raise AssertionError(f"step {step}: FULL slots not conserved: tree {held_full} + free {len(free_full)}")
        if len(set(free_full)) != len(free_full) or set(free_full) & set(tree_held["full"].tolist()):
            raise AssertionError(f"step {step}: a FULL slot is both free and held")
        if has_mamba and len(tree_held["mamba"]) + len(free_mamba) != MAMBA_CAP:
            raise AssertionError(f"step {step}: MAMBA slots not conserved")
    while held:
        unlock_one()
    agree("sizes at the end", sizes_of(cache, comps), mine.sizes())
    print(f"ok {config} page={page} core={core} seed={seed} steps={steps} {counts} swa_moves={rec.moves} "
          f"cap={cap} trimmed={mine.mamba.trimmed if has_mamba else 0} nodes={mine.node_count()}")


if __name__ == "__main__":
    cfg, pg, core_name, sd, n_steps = sys.argv[1:6]
    run(cfg, int(pg), core_name, int(sd), int(n_steps), int(sys.argv[6]) if len(sys.argv) > 6 else -1)
