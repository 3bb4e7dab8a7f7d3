"""Whole-page copies between two CPU pools, one pass over the bytes, whatever the two layouts.

Every pool is seen as `[pages, layers x kinds, chunk bytes]`: contiguous for `page_first`, strided for
`layer_first` (its per-layer buffers are equally spaced in one allocation). Where client/_pagecopy.c is built, a
copy is one native call that copies each page's row of each buffer (split between threads from 1 MiB on, the GIL
released): it stays near memcpy on scattered pages, where one gather per run of pages cost more in calls than in
bytes (a device's fragmented free pages: 64 pages of 64 KiB ran at 0.16x memcpy). Without it, a copy is split
into runs of consecutive destination pages, each run one gather straight into the destination (torch's
`index_select(out=...)`, which reads strided sources in place), so no byte is copied twice.
"""
from __future__ import annotations

import os
from typing import Any

import numpy as np

from radixd.server.pools.pool import KVPool

_MAX_CALLS = 256  # beyond this many gathers a fragmented copy goes through one temporary instead
_BIG_PAGE = 128 << 10  # page_first -> layer_first pages this large: one strided block copy per page
_SMALL_ROW = 8 << 10  # layer_first -> page_first rows smaller than this: one gather per buffer, not per page


_THREADS = max(1, min(4, os.cpu_count() or 1))  # copy threads of one large native copy
_PARALLEL_BYTES = 1 << 20  # copies from this size on are split between _THREADS threads


def _address(a: Any) -> int:
    iface = getattr(a, "__cuda_array_interface__", None) or a.__array_interface__
    return iface["data"][0]


def chunk_view(pool: KVPool) -> Any:
    """The pool as a uint8 array [pages, layers x kinds, page bytes of one buffer] (no copy): numpy for a
    shared-memory pool, cupy for a CUDA one."""
    spec = pool.spec
    if pool.backend == "cuda":
        import cupy as xp
    else:
        xp = np
    lk = spec.num_layers * len(spec.kinds)
    chunk = spec.page_size * spec.kv_heads * spec.head_dim * spec.itemsize
    if spec.layout == "page_first":
        return pool.views["pages"].view(xp.uint8).reshape(spec.num_pages, lk, chunk)
    names = [f"{k}.{layer}" for layer in range(spec.num_layers) for k in spec.kinds]
    addrs = [_address(pool.views[n]) for n in names]
    stride = addrs[1] - addrs[0] if lk > 1 else chunk * spec.num_pages
    if any(b - a != stride for a, b in zip(addrs, addrs[1:])):
        raise ValueError("layer buffers are not equally spaced")  # the pool builder guarantees they are
    base = pool.views[names[0]].view(xp.uint8).reshape(-1)
    return xp.lib.stride_tricks.as_strided(base, shape=(spec.num_pages, lk, chunk), strides=(chunk, stride, 1))


def _widen(view: np.ndarray) -> np.ndarray:
    """The same bytes as int64 elements where alignment allows: gathers then move 8 bytes per element,
    which is what makes small pages (page size 1: a few KiB a row) copy near memcpy speed."""
    if view.shape[2] % 8 or view.strides[0] % 8 or view.strides[1] % 8 or _address(view) % 8:
        return view
    return view.view(np.int64)


def pages_of(slots: np.ndarray, page: int) -> np.ndarray:
    """Page numbers of whole, in-order pages; raises if slots are not whole pages."""
    slots = np.asarray(slots, dtype=np.int64)
    if page == 1:
        return slots
    heads = slots[::page]
    if slots.size % page or (heads % page).any() or not np.array_equal(
            (heads[:, None] + np.arange(page)).reshape(-1), slots):
        raise ValueError("a transfer must move whole pages in order")
    return heads // page


def runs_of(dp: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) index ranges of consecutive destination pages."""
    breaks = np.flatnonzero(np.diff(dp) != 1) + 1
    return list(zip(np.concatenate([[0], breaks]).tolist(), np.concatenate([breaks, [dp.size]]).tolist()))


def _native() -> Any:
    try:
        from radixd.client._pagecopy import copy_pages
        return copy_pages
    except ImportError:  # pragma: no cover - setup.py builds it where a C compiler is
        return None


def _plan(src: np.ndarray, dst: np.ndarray) -> np.ndarray:
    """copy_pages' strided plan of two [pages, layers x kinds, chunk] uint8 views: one entry per buffer."""
    out = []
    for j in range(src.shape[1]):
        out += [_address(src) + j * src.strides[1], src.shape[0], src.strides[0],
                _address(dst) + j * dst.strides[1], dst.shape[0], dst.strides[0], src.shape[2]]
    return np.array(out, dtype=np.int64)


def _torch() -> Any:
    try:
        import torch
        return torch
    except ImportError:  # pragma: no cover - the README installs torch; numpy still works without it
        return None


class PageCopier:
    """Copies whole pages from one pool to another; built once per (source, destination) pair."""

    def __init__(self, src: KVPool, dst: KVPool, native: bool = True):
        if src.spec.kinds != dst.spec.kinds or src.spec.dtype != dst.spec.dtype or \
                (src.spec.num_layers, src.spec.kv_heads, src.spec.head_dim, src.spec.page_size) != \
                (dst.spec.num_layers, dst.spec.kv_heads, dst.spec.head_dim, dst.spec.page_size):
            raise ValueError("pools differ in geometry or dtype")
        self.page = src.spec.page_size
        self.page_bytes = src.spec.slot_bytes * self.page
        self._np_src, self._np_dst = _widen(chunk_view(src)), _widen(chunk_view(dst))
        row = self.page_bytes // (src.spec.num_layers * len(src.spec.kinds))
        # one gather of whole pages, unless a strided source's small rows go faster buffer by buffer
        self._whole_pages = dst.spec.layout == "page_first" and not (
            src.spec.layout == "layer_first" and row < _SMALL_ROW)
        self._per_page = (src.spec.layout == "page_first" and dst.spec.layout == "layer_first"
                          and self.page_bytes >= _BIG_PAGE)
        self._native = _native() if native else None
        if self._native is not None:
            self._plan = _plan(chunk_view(src), chunk_view(dst))
        self._t = _torch()
        if self._t is not None:
            self._src = self._t.from_numpy(self._np_src)
            self._dst = self._t.from_numpy(self._np_dst)

    def pages_of(self, slots: np.ndarray) -> np.ndarray:
        """Page numbers of whole, in-order pages; raises if slots are not whole pages."""
        return pages_of(slots, self.page)

    def copy(self, src_slots: np.ndarray, dst_slots: np.ndarray) -> int:
        """Copy every layer of src_slots' pages into dst_slots' pages; returns bytes moved."""
        if self._native is not None:  # every row of every page in one call (it checks the pages), whatever the layouts
            a = np.ascontiguousarray(src_slots, dtype=np.int64)
            b = np.ascontiguousarray(dst_slots, dtype=np.int64)
            if a.size != b.size:
                raise ValueError("source and destination page counts differ")
            nbytes = a.size // self.page * self.page_bytes
            if a.size and not self._native(self._plan, a, b, self.page, nogil=True, strided=True,
                                           threads=_THREADS if nbytes >= _PARALLEL_BYTES else 1):
                raise ValueError("a transfer must move whole pages in order, as many as it reads")
            return nbytes
        sp, dp = self.pages_of(src_slots), self.pages_of(dst_slots)
        if sp.shape != dp.shape:
            raise ValueError("source and destination page counts differ")
        if sp.size == 0:
            return 0
        runs = runs_of(dp)
        starts, ends = [a for a, _ in runs], [b for _, b in runs]
        lk = self._np_src.shape[1]
        calls = len(starts) * (1 if self._whole_pages else lk)
        if self._per_page:  # one strided block copy per page beats the per-buffer gathers here
            src, dst = self._np_src, self._np_dst
            for a, b in zip(sp.tolist(), dp.tolist()):
                dst[b] = src[a]
        elif self._t is None:
            self._np_dst[dp] = self._np_src[sp]
        elif calls > _MAX_CALLS:
            t = self._t
            self._dst.index_copy_(0, t.from_numpy(dp), self._src.index_select(0, t.from_numpy(sp)))
        else:
            self._runs(sp, dp, starts, ends, lk)
        return int(sp.size) * self.page_bytes

    def _runs(self, sp: np.ndarray, dp: np.ndarray, starts: list[int], ends: list[int], lk: int) -> None:
        t = self._t
        idx_all = t.from_numpy(sp)
        for a, b in zip(starts, ends):
            idx = idx_all[a:b]
            d0 = int(dp[a])
            n = b - a
            if self._whole_pages:
                t.index_select(self._src, 0, idx, out=self._dst[d0:d0 + n])
            else:  # one gather per buffer into its run (torch's gather beats numpy's take here)
                for j in range(lk):
                    t.index_select(self._src[:, j], 0, idx, out=self._dst[d0:d0 + n, j])
