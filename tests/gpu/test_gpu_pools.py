"""GPU pools over CUDA IPC: cross-process write/read, pinned host pool, dtypes. Skipped without a GPU."""
from __future__ import annotations

import multiprocessing as mp
import uuid

import numpy as np
import pytest

from radixd.server.pools.cuda import cuda_available

pytestmark = pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU and cupy (none visible here)")

CTX = mp.get_context("spawn")


def _child_write(desc_dict, q):
    from radixd.client.pools import map_pool
    from radixd.server.pools import PoolDescriptor
    m = map_pool(PoolDescriptor.from_dict(desc_dict))
    for layer in range(len(m.k_buffer)):
        m.k_buffer[layer][[3, 9, 100]] = float(layer + 1)
        m.v_buffer[layer][[3, 9, 100]] = -float(layer + 1)
    import torch
    torch.cuda.synchronize()
    q.put((str(m.device), str(m.k_buffer[0].dtype)))
    m.close()


def _child_read(desc_dict, q):
    from radixd.client.pools import map_pool
    from radixd.server.pools import PoolDescriptor
    m = map_pool(PoolDescriptor.from_dict(desc_dict))
    q.put([float(m.k_buffer[layer][9].float().mean()) for layer in range(len(m.k_buffer))])
    m.close()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "fp8_e4m3"])
def test_cuda_ipc_cross_process(dtype):
    import cupy
    from radixd.server.pools import KVPool, PoolSpec
    spec = PoolSpec(num_layers=4, kv_heads=8, head_dim=128, dtype=dtype, num_slots=4096, page_size=16)
    pool = KVPool(spec, "device", uuid.uuid4().hex, backend="cuda")
    try:
        assert pool.descriptor.size_bytes % (2 << 20) == 0 and pool.descriptor.gpu_uuid.startswith("GPU-")
        q = CTX.Queue()
        p = CTX.Process(target=_child_write, args=(pool.descriptor.to_dict(), q))
        p.start()
        device, tdtype = q.get(timeout=120)
        p.join(60)
        assert p.exitcode == 0 and device.startswith("cuda")
        p = CTX.Process(target=_child_read, args=(pool.descriptor.to_dict(), q))
        p.start()
        assert q.get(timeout=120) == [1.0, 2.0, 3.0, 4.0]
        p.join(60)
        raw = cupy.asnumpy(pool.layer(2, "k")[100]).view(pool.layer(2, "k").dtype)
        assert raw.any()  # the server sees the worker's write
    finally:
        pool.close()


def test_pinned_host_pool_and_copy_bandwidth():
    import torch
    from radixd.client.pools import map_pool
    from radixd.server.pools import KVPool, PoolSpec
    spec = PoolSpec(num_layers=4, kv_heads=8, head_dim=128, dtype="bfloat16", num_slots=8192, page_size=16)
    dev = KVPool(spec, "device", uuid.uuid4().hex, backend="cuda")
    host = KVPool(spec.with_slots(8192, "layer_first"), "host", dev.instance_id, backend="shm", pin=True)
    try:
        assert host.descriptor.pinned
        # the exporting process uses its own views: CUDA cannot open an IPC handle where it was made
        d = torch.as_tensor(dev.layer(0, "k"), device=f"cuda:{dev.descriptor.device_index}")
        h = map_pool(host.descriptor)  # shared memory maps anywhere
        assert h.k_buffer[0].device.type == "cpu"
        d.fill_(1.5)
        h.k_buffer[0].copy_(d, non_blocking=True)
        torch.cuda.synchronize()
        assert float(h.k_buffer[0][77, 3, 5]) == 1.5
        h.close()
    finally:
        host.close()
        dev.close()


def test_killed_importer_leaves_device_pool_usable():
    import os
    import signal
    from radixd.server.pools import KVPool, PoolSpec
    spec = PoolSpec(num_layers=2, kv_heads=2, head_dim=64, dtype="bfloat16", num_slots=1024)
    pool = KVPool(spec, "device", uuid.uuid4().hex, backend="cuda")
    try:
        q = CTX.Queue()
        p = CTX.Process(target=_child_write, args=(pool.descriptor.to_dict(), q))
        p.start()
        q.get(timeout=120)
        os.kill(p.pid, signal.SIGKILL)
        p.join(60)
        p = CTX.Process(target=_child_read, args=(pool.descriptor.to_dict(), q))
        p.start()
        assert q.get(timeout=120)[:2] == [1.0, 2.0]
        p.join(60)
    finally:
        pool.close()


def test_a_device_pool_beyond_the_gpus_free_memory_fails_the_start_in_one_line(tmp_path):
    import subprocess
    import sys
    from radixd.server.pools.cuda import free_bytes
    slots = int(free_bytes(0) // (32 * 2 * 8 * 128 * 2)) + 4096  # 32 layers x (k, v) x 8 heads x 128 dims x 2 B
    slots -= slots % 16
    r = subprocess.run([sys.executable, "-m", "radixd.server.cli", "serve", "--device", "cuda", "--listen",
                        f"unix:{tmp_path}/s.sock", "--layers", "32", "--kv-heads", "8", "--head-dim", "128",
                        "--page-size", "16", "--num-slots", str(slots)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "on GPU 0" in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]


def _child_state(desc_dict, slot, value, q):
    """Write `value` into one state slot (value None: read it back) through CUDA IPC, as a model worker."""
    from radixd.client.pools import map_pool
    from radixd.server.pools import PoolDescriptor
    import torch
    m = map_pool(PoolDescriptor.from_dict(desc_dict))
    if value is not None:
        for buf in m.conv_buffer + m.temporal_buffer:
            buf[slot] = value
        torch.cuda.synchronize()
        q.put(str(m.conv_buffer[0].device))
    else:
        q.put([float(b[slot].float().mean()) for b in m.conv_buffer + m.temporal_buffer])
    m.close()


def test_a_state_pool_in_gpu_memory_is_shared_over_cuda_ipc_and_copies_on_the_device():
    """A hybrid model's state pool on the GPU: a worker writes a state, the server's copy-on-write copies it
    slot to slot on the device, another worker reads the copy (conv bf16, SSM float32, as Nemotron-H)."""
    from radixd.server.layouts import StateSpec
    from radixd.server.pools.hybrid import StatePool
    state = StateSpec("mamba2", (160, 3), (4, 32, 16), "bfloat16", "float32")
    pool = StatePool(8, 2, state, uuid.uuid4().hex, backend="cuda")
    try:
        d = pool.descriptor
        assert d.backend == "cuda" and d.gpu_uuid.startswith("GPU-")
        q = CTX.Queue()
        p = CTX.Process(target=_child_state, args=(d.to_dict(), 3, 1.5, q))
        p.start()
        assert q.get(timeout=120).startswith("cuda")
        p.join(60)
        pool.copy(np.array([3]), np.array([5]))
        p = CTX.Process(target=_child_state, args=(d.to_dict(), 5, None, q))
        p.start()
        assert q.get(timeout=120) == [1.5] * 4
        p.join(60)
    finally:
        pool.close()


def test_a_hybrid_host_tier_copies_between_gpu_pools_and_pinned_host_pools():
    """A hybrid model on the GPU with a host tier: values written into the device FULL, SWA and state pools
    survive an eviction to the pinned host pools and come back, byte exact, through a match."""
    import asyncio
    import json
    import tempfile

    import torch

    from radixd.server.app import build_core
    from radixd.server.config import load
    from radixd.server.core import Item

    from ..test_service_hybrid import PAGE, TRI_CONFIG, WINDOW, prefix_values
    path = f"{tempfile.mkdtemp()}/config.json"
    with open(path, "w") as f:
        json.dump(TRI_CONFIG, f)
    cfg = load(dict(model_config=path, hybrid_cache=True, num_slots=256, page_size=PAGE, swa_ratio=0.5,
                    mamba_states=8, device="cuda", metrics_addr="", host_slots=1024, load_back_threshold=0))
    core = build_core(cfg, uuid.uuid4().hex)
    try:
        s = core.attach("gpu")
        tokens = np.random.default_rng(3).integers(0, 300, 64, dtype=np.int32)
        full, twins, states, _ = asyncio.run(core.alloc_slots(s, [64], 1))
        vals = torch.from_numpy(prefix_values(tokens)).cuda()

        def gpu(a):  # a cupy view as a torch tensor over the same memory
            return torch.as_tensor(a, device="cuda")
        kv, swa = gpu(core.device_pools[0].layer(0, "k")), gpu(core.swa_pool.layer(0, "k"))
        conv = gpu(core.state_pool.views["conv.0"])
        kv[torch.from_numpy(full[0]).cuda()] = vals[:, None, None]
        swa[torch.from_numpy(twins[0]).cuda()] = vals[:, None, None]
        conv[int(states[0])] = vals[-1]
        torch.cuda.synchronize()
        core.cache_finished(s, [Item(tokens, full[0], ("", ""), 0, 0, 0, None, 0, int(states[0]))])
        assert asyncio.run(core.evict(1 << 20))[0] == 64 and core.stats()["host_cached_tokens"] == 64
        (m, _, _), = core.match_hybrid(s, [(tokens, ("", ""), False, False, False)])
        assert m.matched_len == 64 and core.stats()["load_back_tokens_total"] == 64
        assert torch.equal(kv[torch.from_numpy(m.indices).cuda(), 0, 0], vals)
        tw = torch.from_numpy(core.swa_twins(m.indices)[-WINDOW:]).cuda()
        assert torch.equal(swa[tw, 0, 0], vals[-WINDOW:])
        assert bool((conv[m.mamba_src] == vals[-1]).all())
        assert core.check() == []
    finally:
        for p in core.all_pools():
            p.close()
