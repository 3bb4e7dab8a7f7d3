"""Pools and allocator: real shared memory, real separate processes, SIGKILL, restarts."""
import multiprocessing as mp
import os
import signal
import uuid

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixd.client.pools import PoolMappingError, map_pool
from radixd.server.pools import (
    FREE, HELD, TREE, KVPool, OutOfSlots, PoolDescriptor, PoolSpec, PRESETS, SlotAllocator, SlotError,
)
from radixd.server.pools.shm import cleanup_stale
from radixd.server.pools.spec import total_bytes
from radixd.server.transfer import copy_slots

CTX = mp.get_context("spawn")
SPEC = PoolSpec(num_layers=3, kv_heads=2, head_dim=8, dtype="float16", page_size=4, num_slots=64)


@pytest.fixture
def pool():
    p = KVPool(SPEC, "device", uuid.uuid4().hex)
    yield p
    p.close()


def _pattern(layer, slot, kind):
    return float((layer * 100 + slot) * (1 if kind == "k" else -1))


def _writer(desc_dict, slots, q):
    import torch
    m = map_pool(PoolDescriptor.from_dict(desc_dict))
    for layer in range(len(m.k_buffer)):
        for s in slots:
            m.k_buffer[layer][s] = _pattern(layer, s, "k")
            m.v_buffer[layer][s] = _pattern(layer, s, "v")
    q.put((str(m.k_buffer[0].dtype), str(m.device), m.k_buffer[0].data_ptr() != 0, isinstance(m.k_buffer[0], torch.Tensor)))
    m.close()


def _reader(desc_dict, slots, q):
    m = map_pool(PoolDescriptor.from_dict(desc_dict))
    out = {(layer, s, kind): float(buf[layer][s][0, 0]) for layer in range(len(m.k_buffer))
           for s in slots for kind, buf in (("k", m.k_buffer), ("v", m.v_buffer))}
    q.put(out)
    m.close()


def _mapper_that_hangs(desc_dict, q):
    m = map_pool(PoolDescriptor.from_dict(desc_dict))
    m.k_buffer[0][1] = 7.0
    q.put("mapped")
    signal.pause()


def _run(target, *args):
    q = CTX.Queue()
    p = CTX.Process(target=target, args=(*args, q))
    p.start()
    out = q.get(timeout=60)
    p.join(30)
    assert p.exitcode == 0
    return out


def test_write_in_one_process_read_in_another_and_in_the_server(pool):
    slots = [0, 5, 17, 63]
    dtype, device, ptr_ok, is_tensor = _run(_writer, pool.descriptor.to_dict(), slots)
    assert (dtype, device, ptr_ok, is_tensor) == ("torch.float16", "cpu", True, True)
    seen = _run(_reader, pool.descriptor.to_dict(), slots)
    for (layer, s, kind), value in seen.items():
        assert value == _pattern(layer, s, kind)
        assert float(pool.layer(layer, kind)[s, 1, 3]) == _pattern(layer, s, kind)  # the server sees it too
    assert float(pool.layer(0, "k")[1, 0, 0]) == 0.0  # untouched slots stay zero


def test_sigkilled_mapper_leaves_pool_intact(pool):
    q = CTX.Queue()
    p = CTX.Process(target=_mapper_that_hangs, args=(pool.descriptor.to_dict(), q))
    p.start()
    assert q.get(timeout=60) == "mapped"
    os.kill(p.pid, signal.SIGKILL)
    p.join(30)
    assert p.exitcode == -signal.SIGKILL
    assert float(pool.layer(0, "k")[1, 0, 0]) == 7.0
    pool.layer(2, "v")[9] = 3.0  # still writable and mappable
    seen = _run(_reader, pool.descriptor.to_dict(), [9])
    assert seen[(2, 9, "v")] == 3.0


def test_old_descriptor_fails_cleanly_after_restart():
    old = KVPool(SPEC, "device", uuid.uuid4().hex)
    desc = old.descriptor
    old.close()  # server instance gone
    new = KVPool(SPEC, "device", uuid.uuid4().hex)
    try:
        with pytest.raises(PoolMappingError, match="does not exist"):
            map_pool(desc)
        with pytest.raises(PoolMappingError, match="instance"):
            map_pool(new.descriptor, expected_instance=desc.instance_id)
        map_pool(new.descriptor, expected_instance=new.instance_id).close()
    finally:
        new.close()


def _create_and_die(name_q):
    p = KVPool(SPEC, "device", uuid.uuid4().hex)
    name_q.put(p.descriptor.handle.decode())
    signal.pause()


def test_stale_segments_of_a_crashed_server_are_cleaned():
    q = CTX.Queue()
    proc = CTX.Process(target=_create_and_die, args=(q,))
    proc.start()
    name = q.get(timeout=60)
    assert os.path.exists(f"/dev/shm/{name}")
    assert name not in cleanup_stale()  # owner alive: kept
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(30)
    assert name in cleanup_stale()
    assert not os.path.exists(f"/dev/shm/{name}")


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_copy_device_to_host_and_back(pool, layout):
    host = KVPool(SPEC.with_slots(32, layout), "host", pool.instance_id)
    try:
        rng = np.random.default_rng(0)
        for layer in range(SPEC.num_layers):
            for kind in SPEC.kinds:
                pool.layer(layer, kind)[:] = rng.standard_normal(pool.layer(layer, kind).shape)
        src = np.arange(8, 16)  # two whole pages (fast path) then scattered slots (slow path)
        for dst in (np.arange(4, 12), np.array([31, 2, 7, 9, 13, 20, 21, 0])):
            assert copy_slots(pool, src, host, dst) == 8 * SPEC.slot_bytes
            back = np.array([40, 41, 42, 43, 60, 61, 62, 63])
            copy_slots(host, dst, pool, back)
            for layer in range(SPEC.num_layers):
                for kind in SPEC.kinds:
                    v = pool.layer(layer, kind)
                    assert np.array_equal(v[back], v[src])
    finally:
        host.close()


def test_spec_presets_budget_and_mla():
    s = PoolSpec.from_budget(1 << 30, **PRESETS["llama-3-8b"], page_size=16)
    assert s.num_slots % 16 == 0 and s.num_slots * s.slot_bytes <= 1 << 30
    assert s.slot_bytes == 32 * 2 * 8 * 128 * 2
    mla = PoolSpec(num_slots=8, **PRESETS["deepseek-v3"])
    assert mla.kinds == ("kv",) and total_bytes(mla) >= 8 * mla.slot_bytes
    with pytest.raises(ValueError):
        PoolSpec(num_layers=1, kv_heads=1, head_dim=1, dtype="int7")
    with pytest.raises(ValueError):
        PoolSpec(num_layers=1, kv_heads=1, head_dim=1, page_size=3, num_slots=10)


def test_mla_and_fp8_map_in_process():
    spec = PoolSpec(num_layers=2, kv_heads=1, head_dim=16, dtype="fp8_e4m3", mla=True, num_slots=8)
    p = KVPool(spec, "device", uuid.uuid4().hex)
    try:
        m = map_pool(p.descriptor)
        assert len(m.kv_buffer) == 2 and not m.k_buffer and str(m.kv_buffer[0].dtype) == "torch.float8_e4m3fn"
        m.kv_buffer[1][3] = 1.0
        assert int(p.layer(1, "kv")[3, 0, 0]) == 0x38  # 1.0 in e4m3
        m.close()
        m.close()
    finally:
        p.close()


# ------------------------------------------------------------------ allocator
def test_allocator_basics_and_errors():
    a = SlotAllocator(16, page_size=4)
    s = a.alloc(5, owner=1)
    assert s.size == 8 and set(s // 4).__len__() == 2  # rounded up to whole pages
    assert a.counts == [8, 0, 8, 0] and a.check() == []
    with pytest.raises(SlotError, match="held by 2"):
        a.free(s, owner=2)
    with pytest.raises(SlotError, match="out of range"):
        a.free(np.array([99]), owner=1)
    with pytest.raises(SlotError, match="repeat"):
        a.free(np.array([s[0], s[0]]), owner=1)
    with pytest.raises(OutOfSlots):
        a.alloc(9, owner=1)
    assert a.counts == [8, 0, 8, 0]
    a.move(s[:4], HELD, TREE, owner=1)
    a.free(s[4:], owner=1)
    with pytest.raises(SlotError):
        a.free(s[4:], owner=1)  # double free
    assert a.counts == [12, 4, 0, 0] and a.check() == []
    a.move(s[:2], TREE, FREE)  # half a page: the page is not free yet
    assert a.free_pages() == 3
    a.move(s[2:4], TREE, FREE)
    assert a.free_pages() == 4 and a.check() == []


@settings(max_examples=40, deadline=None)
@given(page=st.sampled_from([1, 4]), ops=st.lists(st.tuples(st.sampled_from(["alloc", "free", "adopt", "evict"]),
                                                               st.integers(1, 40), st.integers(1, 3)), max_size=60))
def test_allocator_conservation_property(page, ops):
    a = SlotAllocator(128, page_size=page)
    held: dict[int, list[int]] = {1: [], 2: [], 3: []}
    tree: list[int] = []
    rng = np.random.default_rng(len(ops))
    for op, n, owner in ops:
        if op == "alloc":
            try:
                held[owner].extend(a.alloc(n, owner).tolist())
            except OutOfSlots:
                assert a.free_pages() < a.pages_for(n)
        elif op in ("free", "adopt") and held[owner]:
            k = min(n, len(held[owner]))
            pick = rng.choice(held[owner], size=k, replace=False)
            other = owner % 3 + 1
            if set(pick.tolist()) - set(held[other]):
                with pytest.raises(SlotError):
                    a.free(pick, other)  # someone else's slots: refused, nothing changes
            if op == "free":
                a.free(pick, owner)
            else:
                a.move(pick, HELD, TREE, owner)
                tree.extend(pick.tolist())
            held[owner] = [s for s in held[owner] if s not in set(pick.tolist())]
        elif op == "evict" and tree:
            k = min(n, len(tree))
            a.move(np.array(tree[:k]), TREE, FREE)
            tree = tree[k:]
        assert a.check() == []
        assert a.counts[HELD] == sum(map(len, held.values())) and a.counts[TREE] == len(tree)
