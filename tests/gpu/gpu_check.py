"""radixd's GPU checks beyond the pytest suite, strict: where nvidia-smi sees a GPU, nothing here may skip.

    python3 tests/gpu/gpu_check.py            (run_gpu_checks.sh calls it, then prints the one SUMMARY line)

* the stack: torch's CUDA build and CuPy import and see the GPUs nvidia-smi lists (a missing or CPU-only one fails);
* UUIDs: radixd's read of every GPU's UUID equals nvidia-smi's and torch's, zero bytes included;
* IPC: a pool on the last GPU is written by a worker process that sees the GPUs in reverse order
  (CUDA_VISIBLE_DEVICES), mapped by UUID, and read back by the server's own view (never imported where exported);
* the interprocess event: a load-back queued behind a delay on the server's stream; a worker in another process
  waits on the event's handle and reads at once: it must see the new bytes;
* copies: radixd's backup and load-back byte-exact for bfloat16, fp8, float32 and MLA, both host layouts, and a
  layer_first host pool whose per-layer buffer is over 2 GiB (past the device's 2D-copy pitch);
* bandwidth: backup and load-back of a large transfer at >= 80% of a plain pinned copy of the same bytes;
* a state pool on the last GPU copies on that GPU (not GPU 0);
* vLLM's FlashAttention block copies (integrations/vllm/layout.py) on CUDA tensors equal the CPU's, tensor-parallel
  ranks' head shares and an MLA latent copy between a rank's GPU and radixd's pool on another, and the SGLang
  backend's rank copies (integrations/sglang/copies.py) store and load every head, the pool on another GPU than
  the ranks' where there are two.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import traceback
import uuid

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULTS: list[tuple[str, bool, str]] = []


def check(fn):
    """Run one check now; a failure is recorded with its reason, never skipped."""
    t0 = time.perf_counter()
    try:
        detail = fn() or ""
        RESULTS.append((fn.__name__, True, detail))
    except Exception as e:  # noqa: BLE001 - every failure is reported, and the run goes on to the next check
        traceback.print_exc()
        RESULTS.append((fn.__name__, False, f"{type(e).__name__}: {e}"))
    ok, detail = RESULTS[-1][1], RESULTS[-1][2]
    print(f"{'ok  ' if ok else 'FAIL'} {fn.__name__} ({time.perf_counter() - t0:.1f}s) {detail}", flush=True)
    return fn


def nvidia_smi_uuids() -> list[str]:
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.split("UUID: ")[1].rstrip(")") for line in out.splitlines() if "UUID: GPU-" in line]


def child(mode: str, payload: dict, env: dict) -> dict:
    """This script in another process (a worker), answering one JSON line."""
    r = subprocess.run([sys.executable, __file__, "--child", mode, json.dumps(payload)], capture_output=True,
                       text=True, timeout=300, env={**os.environ, **env})
    if r.returncode != 0:
        raise RuntimeError(f"worker {mode} failed: {r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def pattern(n: int, salt: int) -> np.ndarray:
    return ((np.arange(n, dtype=np.int64) * 2654435761 + salt) % 251).astype(np.uint8)


# ----------------------------------------------------------------------------------------------- workers
def worker_write(p: dict) -> dict:
    import torch

    from radixd.client.pools import map_pool
    from radixd.server.pools.descriptor import PoolDescriptor
    m = map_pool(PoolDescriptor.from_dict(p["desc"]))
    raw = m.k_buffer[0].view(torch.uint8).reshape(-1)
    raw[:p["n"]] = torch.from_numpy(pattern(p["n"], 7)).to(raw.device)
    torch.cuda.synchronize()
    dev = str(raw.device)
    m.close()
    return {"device": dev}


def worker_read_after_event(p: dict) -> dict:
    import torch

    from radixd.client.pools import map_pool, wait_ipc_event
    from radixd.server.pools.descriptor import PoolDescriptor
    m = map_pool(PoolDescriptor.from_dict(p["desc"]))
    raw = m.k_buffer[0].view(torch.uint8).reshape(-1)
    stream = torch.cuda.Stream(raw.device)
    wait_ipc_event(bytes.fromhex(p["event"]), raw.device, stream)
    with torch.cuda.stream(stream):
        got = raw[:p["n"]].clone()
    stream.synchronize()
    import hashlib
    ok = hashlib.sha256(got.cpu().numpy().tobytes()).hexdigest() == p["want"]
    m.close()
    return {"new_bytes": ok}


# ----------------------------------------------------------------------------------------------- checks
def main() -> int:
    sys.path.insert(0, ROOT)
    smi = nvidia_smi_uuids()
    if not smi:
        print("gpu_check: no GPU listed by nvidia-smi: nothing checked")
        return 0

    @check
    def stack():
        import cupy
        import torch
        assert torch.cuda.is_available(), f"torch {torch.__version__} has no CUDA here (a CPU build?)"
        n = cupy.cuda.runtime.getDeviceCount()
        assert torch.cuda.device_count() == n == len(smi), (torch.cuda.device_count(), n, smi)
        return f"torch {torch.__version__} (CUDA {torch.version.cuda}), cupy {cupy.__version__}, {n} GPU(s)"

    if not RESULTS[-1][1]:
        return summary()

    import torch

    from radixd.server.pools import KVPool, PoolSpec
    from radixd.server.pools import cuda as rc
    from radixd.server.transfer.cuda import CudaPageCopier
    from radixd.server.transfer.pages import chunk_view
    last = len(smi) - 1

    @check
    def uuids():
        mine = [rc.gpu_uuid(i) for i in range(len(smi))]
        theirs = [f"GPU-{torch.cuda.get_device_properties(i).uuid}" for i in range(len(smi))]
        assert mine == smi == theirs, (mine, smi, theirs)
        return ", ".join(mine)

    @check
    def ipc_in_another_process_with_another_gpu_order():
        spec = PoolSpec(num_layers=2, kv_heads=4, head_dim=64, dtype="bfloat16", num_slots=4096, page_size=16)
        pool = KVPool(spec, "device", uuid.uuid4().hex, backend="cuda", device_index=last)
        try:
            order = ",".join(str(i) for i in reversed(range(len(smi))))
            n = 1 << 16
            got = child("write", {"desc": pool.descriptor.to_dict(), "n": n}, {"CUDA_VISIBLE_DEVICES": order})
            want_dev = "cuda:0"  # the last GPU is the worker's first under the reversed order
            assert got["device"] == want_dev, got
            import cupy
            with cupy.cuda.Device(last):
                mine = cupy.asnumpy(pool.views["k.0"].view(cupy.uint8).reshape(-1)[:n])
            assert np.array_equal(mine, pattern(n, 7))
            return f"pool on GPU {last}, worker order {order}"
        finally:
            pool.close()

    def pools(dtype: str, layout: str, host_slots: int, mla: bool = False, layers: int = 4, heads: int = 4,
              dim: int = 64, dev_slots: int = 4096):
        spec = PoolSpec(num_layers=layers, kv_heads=heads, head_dim=dim, dtype=dtype, num_slots=dev_slots,
                        page_size=16, mla=mla)
        iid = uuid.uuid4().hex
        dev = KVPool(spec, "device", iid, backend="cuda", device_index=last)
        host = KVPool(spec.with_slots(host_slots, layout), "host", iid, backend="shm", pin=True,
                      device_index=last)
        return dev, host

    def round_trip(dev, host, pages: int) -> None:
        import cupy
        d = torch.as_tensor(chunk_view(dev), device=f"cuda:{last}")
        d.copy_(torch.randint(0, 256, d.shape, dtype=torch.uint8, device=d.device))
        rng = np.random.default_rng(1)
        page = dev.spec.page_size
        slots = lambda p: (p[:, None] * page + np.arange(page)).reshape(-1)  # noqa: E731
        src = rng.choice(dev.spec.num_pages, pages, replace=False)
        hp = np.concatenate([np.arange(3, 3 + pages // 2), host.spec.num_pages - 1 - np.arange(pages - pages // 2)])
        CudaPageCopier(dev, host).copy(slots(src), slots(hp))
        with cupy.cuda.Device(last):
            want = cupy.asnumpy(chunk_view(dev)[src])
        assert np.array_equal(chunk_view(host)[hp], want), "backup bytes differ"
        back = rng.choice(np.setdiff1d(np.arange(dev.spec.num_pages), src), pages, replace=False)
        CudaPageCopier(host, dev).copy(slots(hp), slots(back))
        with cupy.cuda.Device(last):
            assert np.array_equal(cupy.asnumpy(chunk_view(dev)[back]), want), "load-back bytes differ"

    @check
    def copies_for_every_dtype_layout_and_mla():
        done = []
        for dtype, mla in (("bfloat16", False), ("fp8_e4m3", False), ("float32", False), ("bfloat16", True)):
            for layout in ("page_first", "layer_first"):
                dev, host = pools(dtype, layout, 8192, mla=mla)
                try:
                    round_trip(dev, host, 40)
                finally:
                    host.close()
                    dev.close()
                done.append(f"{dtype}{'/mla' if mla else ''}/{layout}")
        return f"{len(done)} combinations byte-exact"

    @check
    def a_host_layer_buffer_over_2_gib():
        # 2 layers x (k, v), 8 heads x 128 x bf16 = 2 KiB a slot per buffer: 1.1M slots = 2.2 GiB per buffer
        dev, host = pools("bfloat16", "layer_first", 1_100_000, layers=2, heads=8, dim=128, dev_slots=8192)
        try:
            stride = chunk_view(host).strides[1]
            assert stride > (2 << 30), stride
            round_trip(dev, host, 64)
            return f"layer stride {stride / 2**30:.2f} GiB, device max pitch {CudaPageCopier(dev, host).max_pitch}"
        finally:
            host.close()
            dev.close()

    @check
    def the_ipc_event_makes_another_process_wait():
        import hashlib

        import cupy
        dev, host = pools("bfloat16", "page_first", 8192)
        try:
            hv = chunk_view(host)  # [pages, layers x kinds, chunk]: contiguous for page_first
            hv.reshape(-1)[:] = pattern(hv.size, 11)
            chunk = hv.shape[2]
            n = 1 << 16
            pages = -(-n // chunk)
            want = hv[:pages, 0, :].reshape(-1)[:n]  # what layer 0's K buffer holds after the load-back
            with cupy.cuda.Device(last):
                dev.views["k.0"].view(cupy.uint8).reshape(-1)[:n] = 0
            cp = CudaPageCopier(host, dev)
            slots = np.arange(pages * dev.spec.page_size)
            with torch.cuda.device(last), torch.cuda.stream(cp.stream):
                torch.cuda._sleep(2_000_000_000)  # about a second of spinning before the copy starts
            event, handle = cp.enqueue(slots, slots, ipc=True)
            got = child("read", {"desc": dev.descriptor.to_dict(), "n": n, "event": handle.hex(),
                                 "want": hashlib.sha256(want.tobytes()).hexdigest()}, {})
            cp.finish(event)
            assert got["new_bytes"], "the worker read before the copy it was told to wait for"
            return "the worker saw the loaded bytes"
        finally:
            host.close()
            dev.close()

    @check
    def bandwidth_at_least_80_percent_of_a_plain_pinned_copy():
        dev, host = pools("bfloat16", "layer_first", 65536, layers=32, heads=8, dim=128, dev_slots=65536)
        try:
            n = 16384
            nbytes = n * dev.spec.slot_bytes
            plain_dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            plain_src = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{last}")

            def timed(fn) -> float:
                fn()
                torch.cuda.synchronize(last)
                t0 = time.perf_counter()
                for _ in range(5):
                    fn()
                torch.cuda.synchronize(last)
                return (time.perf_counter() - t0) / 5
            d2h_plain = timed(lambda: plain_dst.copy_(plain_src, non_blocking=True))
            h2d_plain = timed(lambda: plain_src.copy_(plain_dst, non_blocking=True))
            src = np.random.default_rng(2).permutation(dev.spec.num_slots // 16)[:n // 16]
            src = (src[:, None] * 16 + np.arange(16)).reshape(-1)
            dst = np.arange(n)
            backup, load = CudaPageCopier(dev, host), CudaPageCopier(host, dev)
            d2h = timed(lambda: backup.copy(src, dst))
            h2d = timed(lambda: load.copy(dst, src))
            r_b, r_l = d2h_plain / d2h, h2d_plain / h2d
            detail = (f"backup {nbytes / d2h / 1e9:.1f} GB/s ({r_b:.2f}x plain), load-back "
                      f"{nbytes / h2d / 1e9:.1f} GB/s ({r_l:.2f}x plain)")
            assert r_b >= 0.8 and r_l >= 0.8, detail
            return detail
        finally:
            host.close()
            dev.close()

    @check
    def a_state_pool_on_the_last_gpu_copies_there():
        import cupy

        from radixd.server.layouts import StateSpec
        from radixd.server.pools.hybrid import StatePool
        pool = StatePool(8, 2, StateSpec("mamba2", (160, 3), (4, 32, 16), "bfloat16", "float32"),
                         uuid.uuid4().hex, backend="cuda", device_index=last)
        try:
            with cupy.cuda.Device(last):
                for v in pool.views.values():
                    v[3] = 1
            with cupy.cuda.Device(0):  # another GPU current, as on a server thread that never chose
                pool.copy(np.array([3]), np.array([5]))
            with cupy.cuda.Device(last):
                assert all(bool((v[5] == 1).all()) for v in pool.views.values())
            return f"state pool on GPU {last}"
        finally:
            pool.close()

    @check
    def vllm_flash_block_copies_on_cuda_equal_the_cpus():
        from radixd.vllm.layout import geometry, load_blocks, save_blocks  # (no vLLM import)
        out = []
        for device in ("cpu", f"cuda:{last}"):
            nb, b, h, d = 8, 16, 4, 64
            kv = torch.zeros((2, nb, b, h, d), dtype=torch.bfloat16, device=device)
            g = geometry(kv, b)
            k = torch.arange(128 * h * d, dtype=torch.float32).view(128, h, d).to(torch.bfloat16).to(device)
            v = -k
            load_blocks(kv, g, torch.tensor([5, 1], device=device), k, v, torch.tensor([16, 64], device=device))
            k2, v2 = torch.zeros_like(k), torch.zeros_like(v)
            save_blocks(kv, g, torch.tensor([5, 1], device=device), k2, v2, torch.tensor([0, 32], device=device))
            out.append((kv.cpu(), k2.cpu(), v2.cpu()))
        assert all(torch.equal(a, b) for a, b in zip(out[0], out[1]))
        assert torch.equal(out[1][1][0:16], torch.arange(128 * 4 * 64, dtype=torch.float32).view(128, 4, 64)
                           .to(torch.bfloat16)[16:32])
        return "load and save"

    @check
    def vllm_tensor_parallel_ranks_copy_their_heads_across_gpus():
        from radixd.vllm.layout import geometry, head_share, load_blocks, save_blocks  # (no vLLM import)
        pool_dev, rank_dev = f"cuda:{last}", "cuda:0"  # with two GPUs, the ranks on GPU 0 and radixd's pool on the last
        nb, b, heads, d, tp = 6, 16, 4, 64, 2
        true_k = torch.randn(nb, b, heads, d, device=rank_dev).to(torch.bfloat16)
        k = torch.zeros(8 * b, heads, d, dtype=torch.bfloat16, device=pool_dev)
        v = torch.zeros_like(k)
        blocks, starts = torch.tensor([4, 1], device=rank_dev), torch.tensor([2 * b, 5 * b], device=rank_dev)
        for rank in range(tp):
            first, count, writes = head_share(heads, heads // tp, tp, rank)
            kv = torch.stack([true_k[:, :, first:first + count], -true_k[:, :, first:first + count]]).contiguous()
            save_blocks(kv, geometry(kv, b), blocks, k, v, starts, first)
        whole = torch.zeros(2, nb, b, heads, d, dtype=torch.bfloat16, device=rank_dev)
        load_blocks(whole, geometry(whole, b), blocks, k, v, starts)
        torch.cuda.synchronize()
        assert torch.equal(whole[0, blocks], true_k[blocks]) and torch.equal(whole[1, blocks], -true_k[blocks])
        lat = torch.randn(nb, 1, b, 576, device=rank_dev).to(torch.bfloat16)  # MLA: one latent, rank 0 writes it
        buf = torch.zeros(8 * b, 1, 576, dtype=torch.bfloat16, device=pool_dev)
        save_blocks(lat, geometry(lat, b, mla=True), blocks, buf, None, starts)
        back = torch.zeros_like(lat)
        load_blocks(back, geometry(back, b, mla=True), blocks, buf, None, starts)
        torch.cuda.synchronize()
        assert torch.equal(back[blocks], lat[blocks])
        return f"pool on {pool_dev}, ranks on {rank_dev}; FlashAttention heads and an MLA latent"

    @check
    def sglang_rank_copies_on_cuda_across_gpus():
        from radixd.sglang.copies import load_rows, store_rows  # (no SGLang import)
        pool_dev, rank_dev = f"cuda:{last}", "cuda:0"  # with two GPUs, a rank on GPU 0 and the pool on the last
        layers, heads, dim = 2, 4, 64
        full = [torch.randn(32, heads, dim, device=rank_dev).to(torch.bfloat16) for _ in range(layers)]
        rk = [torch.zeros(128, heads, dim, dtype=torch.bfloat16, device=pool_dev) for _ in range(layers)]
        rv = [torch.zeros_like(x) for x in rk]
        dst = np.arange(32, 64)
        for rank in range(2):
            sh = slice(2 * rank, 2 * rank + 2)
            store_rows([x[:, sh].contiguous() for x in full], [(-x)[:, sh].contiguous() for x in full], rk, rv,
                       torch.arange(32, device=rank_dev), dst, sh)
        torch.cuda.synchronize()
        back = [torch.zeros(32, heads, dim, dtype=torch.bfloat16, device=rank_dev) for _ in range(layers)]
        backv = [torch.zeros_like(x) for x in back]
        load_rows(back, backv, rk, rv, dst, torch.arange(32, device=rank_dev), slice(0, heads))
        torch.cuda.synchronize()
        assert all(torch.equal(back[i], full[i]) and torch.equal(backv[i], -full[i]) for i in range(layers))
        return f"pool on {pool_dev}, ranks on {rank_dev}"

    return summary()


def summary() -> int:
    failed = [name for name, ok, _ in RESULTS if not ok]
    print(f"gpu_check: {len(RESULTS) - len(failed)} passed, {len(failed)} failed"
          + (f" ({', '.join(failed)})" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        sys.path.insert(0, ROOT)
        fn = {"write": worker_write, "read": worker_read_after_event}[sys.argv[2]]
        print(json.dumps(fn(json.loads(sys.argv[3]))))
        sys.exit(0)
    sys.exit(main())
