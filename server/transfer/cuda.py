"""Page copies between a CUDA device pool and a pinned host pool: one stream per direction, an event per copy.

Backup (device -> host): one gather on the device into a staging block [layers x kinds, pages, chunk], then
per run of consecutive host pages one `cudaMemcpy2DAsync` (all layers at once into a layer_first host
pool's equally spaced buffers) or one contiguous copy (page_first). Load-back (host -> device): one gather
on the CPU into a pinned staging block, one host-to-device copy, one `index_copy_` scatter on the device.
Every copy records an event; with `ipc=True` an interprocess event whose handle a worker's stream can wait
on (`radixd.client.pools.wait_ipc_event`), so it never waits through the RPC. Imported only with a GPU.

Limits a GPU sets, planned by the pure functions below (tested without one): a 2D copy's pitches may not exceed
the device's maximum pitch (about 2 GiB; a larger layer_first host pool copies layer by layer instead), and
staging memory is bounded (STAGING_BYTES per transfer, on the device and pinned on the host), a large transfer
going through it in batches of pages.
"""
from __future__ import annotations

from typing import Any, Optional

import numpy as np

from radixd.server.pools.pool import KVPool

from .pages import chunk_view, pages_of, runs_of

_D2H = 2  # cudaMemcpyDeviceToHost
_ATTR_MAX_PITCH = 11  # cudaDevAttrMaxPitch
STAGING_BYTES = 256 << 20  # staging a transfer may take at once (device gather and its transpose; pinned host)


def plan_2d(dst: int, dst_pitch: int, src: int, src_pitch: int, width: int, height: int,
            max_pitch: int) -> list[tuple[int, int, int, int, int, int]]:
    """Copies (dst, dst_pitch, src, src_pitch, width, height) for `height` rows of `width` bytes: one 2D copy
    while both pitches are within the device's limit, else one single-row copy per row."""
    if dst_pitch <= max_pitch and src_pitch <= max_pitch:
        return [(dst, dst_pitch, src, src_pitch, width, height)]
    return [(dst + r * dst_pitch, width, src + r * src_pitch, width, width, 1) for r in range(height)]


def batches(pages: int, page_bytes: int, copies: int, limit: int = STAGING_BYTES) -> list[tuple[int, int]]:
    """[a, b) ranges of a transfer's pages whose staging (`copies` buffers of page_bytes a page) fits `limit`."""
    per = max(1, limit // max(1, page_bytes * copies))
    return [(a, min(a + per, pages)) for a in range(0, pages, per)]


class CudaPageCopier:
    """Whole-page copies between a CUDA pool and a pinned shared-memory pool (either direction)."""

    def __init__(self, src: KVPool, dst: KVPool):
        import torch
        if (src.backend == "cuda") == (dst.backend == "cuda"):
            raise ValueError("a CUDA copy needs exactly one CUDA pool")
        if src.spec.kinds != dst.spec.kinds or src.spec.dtype != dst.spec.dtype or \
                (src.spec.num_layers, src.spec.kv_heads, src.spec.head_dim, src.spec.page_size) != \
                (dst.spec.num_layers, dst.spec.kv_heads, dst.spec.head_dim, dst.spec.page_size):
            raise ValueError("pools differ in geometry or dtype")
        self.t = torch
        self.d2h = src.backend == "cuda"
        dev_pool, host_pool = (src, dst) if self.d2h else (dst, src)
        self.device = torch.device("cuda", dev_pool.descriptor.device_index)
        self.page = src.spec.page_size
        self.slot_bytes = src.spec.slot_bytes
        self._dev = torch.as_tensor(chunk_view(dev_pool), device=self.device)  # [pages, lk, chunk], no copy
        self._np_host = chunk_view(host_pool)
        self._host = torch.from_numpy(self._np_host)
        self._host_page_first = host_pool.spec.layout == "page_first"
        self._lk, self._chunk = self._np_host.shape[1], self._np_host.shape[2]
        self._layer_stride = self._np_host.strides[1]
        self.stream = torch.cuda.Stream(self.device)
        self._staging: Optional[Any] = None  # pinned host block for load-backs, grown on demand
        import cupy
        with cupy.cuda.Device(self.device.index):
            self.max_pitch = cupy.cuda.runtime.deviceGetAttribute(_ATTR_MAX_PITCH, self.device.index)

    def _pinned(self, pages: int) -> Any:
        if self._staging is None or self._staging.shape[0] < pages:
            self._staging = self.t.empty((pages, self._lk, self._chunk), dtype=self.t.uint8, pin_memory=True)
        return self._staging[:pages]

    def enqueue(self, src_slots: np.ndarray, dst_slots: np.ndarray, ipc: bool = False) -> tuple[Any, bytes]:
        """Queue the copy on this direction's stream; returns its event and (ipc) the event's IPC handle."""
        t = self.t
        sp, dp = pages_of(src_slots, self.page), pages_of(dst_slots, self.page)
        if sp.shape != dp.shape:
            raise ValueError("source and destination page counts differ")
        event = t.cuda.Event(interprocess=True) if ipc else t.cuda.Event()
        page_bytes = self._lk * self._chunk
        with t.cuda.device(self.device), t.cuda.stream(self.stream):
            parts = batches(sp.size, page_bytes, 2 if self.d2h else 1)
            for a, b in parts:
                if self.d2h:
                    self._backup(sp[a:b], dp[a:b])
                else:
                    if a:  # the pinned staging block is reused: the previous batch's copy must have read it
                        self.stream.synchronize()
                    self._load(sp[a:b], dp[a:b])
            event.record(self.stream)
        return event, (bytes(event.ipc_handle()) if ipc else b"")

    def _backup(self, sp: np.ndarray, dp: np.ndarray) -> None:
        t = self.t
        idx = t.from_numpy(sp).to(self.device, non_blocking=False)
        staged = self._dev.index_select(0, idx)  # [n, lk, chunk] contiguous on the device
        if self._host_page_first:
            for a, b in runs_of(dp):
                d0 = int(dp[a])
                self._host[d0:d0 + b - a].copy_(staged[a:b], non_blocking=True)
            self._keep = staged
            return
        import cupy
        by_layer = staged.transpose(0, 1).contiguous()  # [lk, n, chunk]: a run is one 2D copy, all layers
        n = sp.size
        host0 = self._np_host.__array_interface__["data"][0]
        for a, b in runs_of(dp):
            for d, dpitch, s, spitch, w, h in plan_2d(host0 + int(dp[a]) * self._chunk, self._layer_stride,
                                                      by_layer.data_ptr() + a * self._chunk, n * self._chunk,
                                                      (b - a) * self._chunk, self._lk, self.max_pitch):
                cupy.cuda.runtime.memcpy2DAsync(d, dpitch, s, spitch, w, h, _D2H, self.stream.cuda_stream)
        self._keep = by_layer  # alive until the event: the copies still read it

    def _load(self, sp: np.ndarray, dp: np.ndarray) -> None:
        t = self.t
        staging = self._pinned(sp.size)
        t.index_select(self._host, 0, t.from_numpy(sp), out=staging)  # CPU gather, strided reads in place
        on_dev = staging.to(self.device, non_blocking=True)
        self._dev.index_copy_(0, t.from_numpy(dp).to(self.device, non_blocking=False), on_dev)
        self._keep = on_dev

    def copy(self, src_slots: np.ndarray, dst_slots: np.ndarray) -> int:
        """Copy and wait for it (the GIL is released while the stream works); returns bytes moved."""
        event, _ = self.enqueue(src_slots, dst_slots)
        event.synchronize()
        self._keep = None
        return int(np.asarray(src_slots).size) * self.slot_bytes

    def finish(self, event: Any) -> None:
        """Wait for an enqueued copy; its staging memory may be reused afterwards."""
        event.synchronize()
        self._keep = None
