"""A hybrid model's extra pools: the FULL->SWA translation (conserved under the hybrid tree's own frees), and
the state pool mapped by a separate process through its descriptor."""
from __future__ import annotations

import json
import multiprocessing as mp
import os
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from radixd.server.layouts import model_layout
from radixd.server.pools import OutOfSlots, SlotError
from radixd.server.pools.descriptor import PoolDescriptor
from radixd.server.pools.hybrid import StatePool, SwaTranslation, take_pages
from radixd.server.tree.hybrid import HybridTree

CONFIGS = Path(__file__).resolve().parent / "configs"


def test_translation_keeps_the_offset_in_the_page_and_refuses_what_would_break_it():
    t = SwaTranslation(64, 16, page_size=4)
    swa = t.assign(np.array([8, 9, 10, 11, 20, 21, 22, 23]))
    assert (swa % 4 == np.array([0, 1, 2, 3, 0, 1, 2, 3])).all() and len(set(swa // 4)) == 2
    assert t.free_slots == 8 and t.check() == []
    with pytest.raises(SlotError, match="already has"):
        t.assign(np.array([8]))
    with pytest.raises(OutOfSlots):
        t.assign(np.arange(32, 64))  # 8 pages wanted, 2 free: nothing changes
    assert t.free_slots == 8 and (t.translate(np.arange(32, 40)) == -1).all()
    t.move(np.array([40, 41, 42, 43]), np.array([20, 21, 22, 23]))
    assert (t.translate(np.array([40, 43])) == swa[4:][[0, 3]]).all() and t.translate(np.array([20]))[0] == -1
    with pytest.raises(SlotError, match="has none"):
        t.move(np.array([44]), np.array([20]))
    paged = np.arange(16 * 4).reshape(4, 4, 4)  # an SWA buffer as [pages, page, ...]
    out = np.empty((1, 4, 4), dtype=paged.dtype)
    take_pages(paged, t.translate_pages(np.array([10])), out)  # FULL page 10 (slots 40-43) after the move
    assert (out[0] == paged[swa[4] // 4]).all()
    with pytest.raises(SlotError, match="page index"):
        take_pages(paged, t.translate_pages(np.array([5])), out)  # FULL page 5 has no SWA page: -1
    assert t.release(np.arange(0, 64)) == 8 and t.free_slots == 16 and t.check() == []


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.lists(st.integers(1, 3), max_size=20), st.integers(0, 10), st.integers(0, 6),
                          st.booleans()), min_size=1, max_size=40))
def test_the_hybrid_trees_frees_conserve_the_swa_pool(ops):
    """Requests allocate FULL slots with SWA twins, free their own twins below swa_evicted_seqlen, and insert;
    the tree's frees (both, swa, swa_moves) go through the translation. After every step the FULL pages with
    SWA KV are exactly those the tree holds SWA for."""
    page, cap = 2, 120
    tree = HybridTree(page, window=4)
    tr = SwaTranslation(cap, cap, page)
    free = list(range(0, cap, page))  # FULL pages

    def apply(frees):
        for s in frees.full_slots().tolist():
            if s % page == 0:
                free.append(s)
        tr.release(frees.swa_slots())
        for kept, incoming in frees.swa_moves:
            tr.release(incoming)  # the incoming FULL goes (it is in `full`); kept takes twins
            tr.assign(kept)

    for tokens, floor_pages, evict_n, early in ops:
        m = tree.match_prefix(tokens)
        rid = tree.lock(m.node_id)
        total = len(tokens) - len(tokens) % page
        need = (total - m.matched_len) // page
        if need > len(free):
            apply(tree.evict(full=(need - len(free)) * page).frees)
        if need > len(free):
            tree.unlock(rid)
            continue
        new = np.concatenate([np.arange(p, p + page) for p in (free.pop() for _ in range(need))]) if need else \
            np.zeros(0, dtype=np.int64)
        tr.assign(new)
        floor = min(floor_pages * page, total)
        own_gone = new[:max(0, floor - m.matched_len)]
        tr.release(own_gone)  # the request freed its out-of-window SWA KV itself
        r = tree.insert(tokens[:total], np.concatenate([m.indices, new]), prev_prefix_len=m.matched_len,
                        swa_evicted_seqlen=floor)
        apply(r.frees)
        if early:
            apply(tree.release_swa(rid))
        tree.unlock(rid)
        apply(tree.evict(swa=evict_n).frees)
        assert tr.check() == []
        held = tree.held()["swa"]
        with_swa = np.flatnonzero(tr.map != -1) * page
        assert set(with_swa.tolist()) == set((held - held % page).tolist())


def _child_writes(desc: dict, slot: int, q) -> None:
    from radixd.client.pools import map_pool
    pool = map_pool(PoolDescriptor.from_dict(desc))
    for i, (c, t) in enumerate(zip(pool.conv_buffer, pool.temporal_buffer)):
        c[slot].fill_(i + 1)
        t[slot].fill_(-(i + 1))
    q.put((str(pool.conv_buffer[0].dtype), str(pool.temporal_buffer[0].dtype), tuple(pool.temporal_buffer[0].shape)))
    pool.close()


def test_a_state_pool_is_mapped_by_another_process_with_each_buffers_own_dtype():
    lay = model_layout(json.loads((CONFIGS / "nemotron-h-4b.json").read_text()), tp_size=8)
    pool = StatePool(6, 3, lay.state, "feedbeefcafe0123")
    try:
        q = mp.get_context("spawn").Queue()
        p = mp.get_context("spawn").Process(target=_child_writes, args=(pool.descriptor.to_dict(), 4, q))
        p.start()
        p.join(120)
        assert p.exitcode == 0  # a child that failed says so in the captured stderr
        conv_dt, temp_dt, temp_shape = q.get(timeout=10)
        assert (conv_dt, temp_dt) == ("torch.bfloat16", "torch.float32")  # Nemotron-H: bf16 conv, fp32 SSM
        assert temp_shape == (6, *lay.state.temporal_shape)
        for i in range(3):
            assert (pool.views[f"temporal.{i}"][4] == -(i + 1)).all()
            assert (pool.views[f"temporal.{i}"][3] == 0).all()
        pool.copy(np.array([4]), np.array([1]))  # copy-on-write: a hit's state into the request's slot
        assert (pool.views["temporal.2"][1] == -3).all() and (pool.views["conv.0"][1] == pool.views["conv.0"][4]).all()
        assert pool.slot_bytes == 3 * lay.state.nbytes
    finally:
        name = pool.descriptor.handle.decode()
        pool.close()
    assert not os.path.exists(f"/dev/shm/{name}")
