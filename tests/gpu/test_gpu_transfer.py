"""The GPU copy backend: CUDA pools <-> a pinned host pool, byte-exact, and load-back through an interprocess
CUDA event that a separate worker process's stream waits on. Skipped without a GPU."""
from __future__ import annotations

import uuid

import numpy as np
import pytest

from radixd.server.pools.cuda import cuda_available

from ..test_pools import _run as _in_process  # a spawned process that answers through a queue
from ..test_service_tiers import pattern as _pattern  # the KV a worker writes, exact in bfloat16

pytestmark = pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU and cupy (none visible here)")


def _pools(layout: str, page: int):
    from radixd.server.pools import KVPool, PoolSpec
    spec = PoolSpec(num_layers=4, kv_heads=4, head_dim=64, dtype="bfloat16", num_slots=2048, page_size=page)
    iid = uuid.uuid4().hex
    dev = KVPool(spec, "device", iid, backend="cuda")
    host = KVPool(spec.with_slots(4096, layout), "host", iid, backend="shm", pin=True)
    return dev, host


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
@pytest.mark.parametrize("page", [1, 16])
def test_cuda_copier_round_trip_is_byte_exact(layout, page):
    import cupy
    import torch

    from radixd.server.transfer.cuda import CudaPageCopier
    from radixd.server.transfer.pages import chunk_view
    dev, host = _pools(layout, page)
    try:
        d = torch.as_tensor(chunk_view(dev), device="cuda")
        d.copy_(torch.randint(0, 256, d.shape, dtype=torch.uint8, device="cuda"))
        rng = np.random.default_rng(1)
        src_pages = rng.choice(dev.spec.num_pages, 40, replace=False)
        host_pages = np.concatenate([np.arange(10, 30), np.arange(100, 120)])  # two runs
        slots = lambda pages: (pages[:, None] * page + np.arange(page)).reshape(-1)  # noqa: E731
        d2h, h2d = CudaPageCopier(dev, host), CudaPageCopier(host, dev)
        assert d2h.copy(slots(src_pages), slots(host_pages)) == 40 * page * dev.spec.slot_bytes
        h = chunk_view(host)
        want = cupy.asnumpy(chunk_view(dev)[src_pages])
        assert np.array_equal(h[host_pages], want)
        back = rng.choice(np.setdiff1d(np.arange(dev.spec.num_pages), src_pages), 40, replace=False)
        event, handle = h2d.enqueue(slots(host_pages), slots(back), ipc=True)
        assert len(handle) == 64
        h2d.finish(event)
        assert np.array_equal(cupy.asnumpy(chunk_view(dev)[back]), want)
    finally:
        host.close()
        dev.close()


def _write(target, slots, tokens, q):
    import torch

    from radixd.client import CacheClient
    with CacheClient(target, name="writer") as c:
        pools = c.map_pools()
        dev = pools.device[0]
        idx = torch.from_numpy(slots).to(dev.device)
        for layer in range(len(dev.k_buffer)):
            val = torch.from_numpy(_pattern(tokens, layer)).to(dev.device, dev.k_buffer[layer].dtype)
            dev.k_buffer[layer][idx] = val[:, None, None]
            dev.v_buffer[layer][idx] = -val[:, None, None]
        torch.cuda.synchronize()
        pools.close()
    q.put("written")


def _read_after_event(target, slots, tokens, handle, q):
    """A worker that never asks the server whether the copy is done: its stream waits on the IPC event."""
    import torch

    from radixd.client import CacheClient
    from radixd.client.pools import wait_ipc_event
    with CacheClient(target, name="reader") as c:
        pools = c.map_pools()
        dev = pools.device[0]
        stream = torch.cuda.Stream(dev.device)
        wait_ipc_event(handle, dev.device, stream)
        ok = True
        with torch.cuda.stream(stream):
            idx = torch.from_numpy(slots).to(dev.device)
            got = [(dev.k_buffer[layer][idx].float(), dev.v_buffer[layer][idx].float())
                   for layer in range(len(dev.k_buffer))]
        stream.synchronize()
        for layer, (k, v) in enumerate(got):  # what the writer stored, rounded to the pool's dtype
            want = torch.from_numpy(_pattern(tokens, layer)).to(dev.k_buffer[layer].dtype).float().numpy()
            ok &= bool(np.array_equal(k.cpu().numpy(), np.broadcast_to(want[:, None, None], k.shape)))
            ok &= bool(np.array_equal(v.cpu().numpy(), np.broadcast_to(-want[:, None, None], v.shape)))
        pools.close()
    q.put(ok)


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_load_back_through_an_ipc_event_in_another_process(layout):
    from radixd.client import CacheClient

    from ..conftest import ServerProc
    srv = ServerProc("--device", "cuda", "--num-slots", "4096", "--page-size", "16", "--host-slots", "8192",
                     "--host-layout", layout, "--write-policy", "write_through", "--load-back-threshold", "1",
                     "--layers", "4", "--kv-heads", "4", "--head-dim", "64")
    try:
        with CacheClient(srv.target, name="scheduler") as c:
            tokens = np.arange(1000, 1000 + 512, dtype=np.int32)
            slots = c.alloc(512)
            assert _in_process(_write, srv.target, slots, tokens) == "written"
            ins = c.cache_finished([dict(tokens=tokens, indices=slots)])[0]
            done, failed = c.wait_transfers(ins.backup_transfer_ids)
            assert sorted(done) == sorted(ins.backup_transfer_ids) and not failed
            assert c.evict(512) == 512
            m = c.match_prefix(tokens, lock=True)
            assert (m.matched_len, m.host_hit_len) == (0, 512)
            lb = c.load_back(m.receipt_id)
            assert lb.loaded_len == 512 and len(lb.ipc_event_handle) == 64
            assert _in_process(_read_after_event, srv.target, lb.indices, tokens, lb.ipc_event_handle) is True
            done, failed = c.wait_transfers([lb.transfer_id])
            assert done == [lb.transfer_id] and not failed
            c.unlock([lb.receipt_id])
            assert c.check() == []
    finally:
        srv.stop()
