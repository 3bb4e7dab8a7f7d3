"""The GPU paths' logic, run without a GPU: UUIDs read whole and pools picked by UUID, CuPy's absence in one line,
copy plans within the device's pitch limit and bounded staging, and what a failed pin or a closed mapping leaves."""
from __future__ import annotations

import ctypes
import os

import numpy as np
import pytest

from radixd.client.pools import MappedPool, PoolMappingError, map_pool, select_device_pools
from radixd.server.pools import cuda
from radixd.server.pools.descriptor import PoolDescriptor
from radixd.server.pools.pool import KVPool
from radixd.server.pools.spec import PoolSpec
from radixd.server.transfer.cuda import batches, plan_2d

RAW = bytes.fromhex("130961397ada8313ee08000dd8540fe1")  # a real GPU's UUID, a zero byte in its middle


class FakeDriver:
    """The three driver calls gpu_uuid makes, answering like libcuda for a list of GPUs (by visible ordinal)."""

    def __init__(self, raws: list[bytes]):
        self.raws = raws

    def cuDeviceGetCount(self, n) -> int:
        n._obj.value = len(self.raws)
        return 0

    def cuDeviceGet(self, dev, ordinal) -> int:
        if not 0 <= ordinal.value < len(self.raws):
            return 101  # CUDA_ERROR_INVALID_DEVICE
        dev._obj.value = ordinal.value
        return 0

    def cuDeviceGetUuid(self, buf, dev) -> int:
        ctypes.memmove(buf, self.raws[dev.value], 16)
        return 0


def test_a_uuid_with_zero_bytes_is_read_whole():
    """CuPy's getDeviceProperties()['uuid'] converts the char[16] as a C string and stops at the zero byte;
    the driver read keeps all 16 bytes, as nvidia-smi prints them."""
    want = "GPU-13096139-7ada-8313-ee08-000dd8540fe1"
    assert cuda.format_uuid(RAW) == want
    assert cuda.uuid_from_driver(FakeDriver([RAW]), 0) == want
    assert ctypes.c_char_p(RAW).value == RAW[:10]  # what a C-string conversion keeps: 10 of 16 bytes
    with pytest.raises(ValueError):
        cuda.format_uuid(RAW[:10])
    with pytest.raises(LookupError, match="no GPU 3"):
        cuda.uuid_from_driver(FakeDriver([RAW]), 3)


def test_ordinals_follow_each_processs_view_and_an_unseen_gpu_is_refused_in_one_line():
    a, b = bytes(range(16)), bytes(range(16, 32))
    ua, ub = cuda.format_uuid(a), cuda.format_uuid(b)
    assert cuda.visible_uuids(FakeDriver([a, b])) == [ua, ub]
    assert cuda.uuid_to_ordinal(ub, lambda: [ua, ub]) == 1
    assert cuda.uuid_to_ordinal(ub, lambda: [ub, ua]) == 0  # CUDA_VISIBLE_DEVICES=1,0: the same GPU, ordinal 0
    with pytest.raises(LookupError) as e:
        cuda.uuid_to_ordinal(ub, lambda: [ua])
    assert "cannot see" in str(e.value) and "\n" not in str(e.value) and ub in str(e.value)


def _desc(uuid: str, backend: str = "cuda", index: int = 0) -> PoolDescriptor:
    return PoolDescriptor("i", "device", backend, b"h", 1 << 20, "float16", 1, 1, 8, 1, 16, False, "layer_first",
                          gpu_uuid=uuid, device_index=index)


def test_device_pools_are_chosen_by_uuid_not_by_ordinal():
    a, b, c = "GPU-a", "GPU-b", "GPU-c"
    pools = [_desc(a, index=0), _desc(b, index=1)]
    # the engine's GPU is radixd's ordinal 1 but its own ordinal 0: the UUID decides
    assert select_device_pools(pools, b, lambda: [b]) == [pools[1]]
    with pytest.raises(PoolMappingError, match="no device pool on this process's GPU GPU-c") as e:
        select_device_pools(pools, c, lambda: [c])
    assert "\n" not in str(e.value)
    # an engine rank that copies across GPUs takes a pool on another GPU it sees
    assert select_device_pools(pools, c, lambda: [c, b], elsewhere=True) == [pools[1]]
    assert select_device_pools(pools, None, lambda: [b, c]) == [pools[1]]  # without a device: what it sees
    with pytest.raises(PoolMappingError, match="none of radixd's GPUs"):
        select_device_pools(pools, None, lambda: [c])
    shm = [_desc("", backend="shm", index=-1)]
    assert select_device_pools(shm, None, lambda: []) == shm  # no GPU involved: shared memory is always mapped


def test_a_missing_cupy_is_one_line_that_names_the_wheel(monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "cupy", None)  # as on a machine without CuPy
    with pytest.raises(RuntimeError, match=r"pip install cupy-cuda\d+x") as e:
        cuda.need_cupy()
    assert "\n" not in str(e.value)
    with pytest.raises(PoolMappingError, match="needs CuPy"):
        map_pool(_desc("GPU-a"))


def _run_copies(mem: np.ndarray, plan) -> None:
    for dst, dpitch, src, spitch, width, height in plan:
        for r in range(height):
            mem[dst + r * dpitch:dst + r * dpitch + width] = mem[src + r * spitch:src + r * spitch + width]


def test_a_pitch_over_the_devices_limit_becomes_row_copies_of_the_same_bytes():
    rng = np.random.default_rng(6)
    for dpitch, spitch, width, height, limit in ((64, 40, 24, 5, 1 << 31), (64, 40, 24, 5, 50), (30, 100, 30, 3, 64)):
        mem = rng.integers(0, 255, 2048, dtype=np.uint8)
        one = plan_2d(1000, dpitch, 0, spitch, width, height, 1 << 40)
        split = plan_2d(1000, dpitch, 0, spitch, width, height, limit)
        assert len(one) == 1
        assert all(p[1] <= limit and p[3] <= limit for p in split)  # every copy is legal on that device
        assert len(split) == (1 if max(dpitch, spitch) <= limit else height)
        a, b = mem.copy(), mem.copy()
        _run_copies(a, one)
        _run_copies(b, split)
        assert np.array_equal(a, b) and not np.array_equal(a, mem)


def test_staging_batches_cover_every_page_once_within_the_bound():
    for pages, page_bytes, copies, limit in ((0, 10, 2, 100), (1, 10, 2, 100), (17, 10, 2, 100), (5, 1000, 2, 100),
                                             (1 << 20, 4096, 2, 256 << 20)):
        parts = batches(pages, page_bytes, copies, limit)
        assert [i for a, b in parts for i in range(a, b)] == list(range(pages))
        per = max(1, limit // (page_bytes * copies))
        assert all(b - a <= per for a, b in parts) and len(parts) == -(-pages // per)


def _segments() -> set[str]:
    return set(os.listdir("/dev/shm"))


def test_a_failed_pin_leaves_no_segment_behind(monkeypatch):
    def refuse(*_a, **_k):
        raise RuntimeError("cudaErrorHostMemoryAlreadyRegistered")

    monkeypatch.setattr(cuda, "pin_host", refuse)
    before = _segments()
    spec = PoolSpec(num_slots=64, num_layers=2, kv_heads=2, head_dim=8, dtype="float16", page_size=4)
    with pytest.raises(RuntimeError, match="AlreadyRegistered"):
        KVPool(spec, "host", "pin-fails", "shm", pin=True)
    assert _segments() == before


def test_a_client_unpins_what_it_pinned_when_it_lets_the_pool_go(monkeypatch):
    calls = []
    monkeypatch.setattr(cuda, "pin_host", lambda at, size, dev=0: calls.append(("pin", at, size)))
    monkeypatch.setattr(cuda, "unpin_host", lambda at, dev=0: calls.append(("unpin", at)))
    spec = PoolSpec(num_slots=64, num_layers=2, kv_heads=2, head_dim=8, dtype="float16", page_size=4)
    pool = KVPool(spec, "host", "pin-ok", "shm", pin=True)
    try:
        assert pool.descriptor.pinned and calls[0][0] == "pin"
        calls.clear()
        m = MappedPool(pool.descriptor)
        assert calls and calls[0][0] == "pin"
        m.close()
        assert calls[-1] == ("unpin", calls[0][1])
        calls.clear()
        unpinned = MappedPool(pool.descriptor, pin=False)  # a process that never DMAs from it
        unpinned.close()
        assert calls == []

        def refuse(*_a, **_k):
            raise RuntimeError("no driver")

        monkeypatch.setattr(cuda, "pin_host", refuse)
        with pytest.raises(PoolMappingError, match="cannot pin"):
            MappedPool(pool.descriptor)
    finally:
        pool.close()


def test_engines_map_the_device_pools_without_the_host_pool(server_with_host):
    from radixd.client import CacheClient
    with CacheClient(server_with_host.target) as c:
        every = c.map_pools()
        assert every.host is not None
        every.close()
        workers = c.map_pools(host=False)
        assert workers.host is None and len(workers.device) == 1
        workers.close()


@pytest.fixture
def server_with_host():
    from .conftest import ServerProc
    s = ServerProc("--num-slots", "256", "--host-slots", "512")
    yield s
    s.stop()


def test_sglang_ranks_write_their_heads_and_any_split_reads_them_back():
    """The SGLang backend's row copies (radixd.sglang.copies, no SGLang import): two TP ranks store their halves of
    the heads into one pool, and a TP-1 engine and each rank load back exactly the heads the model computed."""
    import torch

    from radixd.sglang.copies import load_rows, store_rows
    layers, heads, dim, slots = 3, 4, 8, 64
    full = [torch.randn(32, heads, dim) for _ in range(layers)]  # the model's K per layer, all heads, 32 tokens
    fullv = [-x for x in full]
    rk = [torch.zeros(slots, heads, dim) for _ in range(layers)]
    rv = [torch.zeros(slots, heads, dim) for _ in range(layers)]
    dst = np.arange(16, 48)
    src = torch.arange(32)
    for rank in range(2):  # each rank's engine buffers hold its own heads only
        sh = slice(rank * 2, rank * 2 + 2)
        store_rows([x[:, sh].contiguous() for x in full], [x[:, sh].contiguous() for x in fullv], rk, rv, src, dst, sh)
    for i in range(layers):
        assert torch.equal(rk[i][16:48], full[i]) and torch.equal(rv[i][16:48], fullv[i])
        assert not rk[i][:16].any() and not rk[i][48:].any()
    one_k = [torch.zeros(40, heads, dim) for _ in range(layers)]  # a TP-1 engine's buffers
    one_v = [torch.zeros(40, heads, dim) for _ in range(layers)]
    load_rows(one_k, one_v, rk, rv, dst, torch.arange(8, 40), slice(0, heads))
    assert all(torch.equal(one_k[i][8:40], full[i]) and torch.equal(one_v[i][8:40], fullv[i]) for i in range(layers))
    half = [torch.zeros(32, 2, dim) for _ in range(layers)]
    halfv = [torch.zeros(32, 2, dim) for _ in range(layers)]
    load_rows(half, halfv, rk, rv, dst, torch.arange(32), slice(2, 4))  # rank 1 reads its heads
    assert all(torch.equal(half[i], full[i][:, 2:4]) for i in range(layers))
