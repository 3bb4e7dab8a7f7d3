"""CPU copy engine: move KV of given slots between two pools (device stand-in <-> host), per layer."""
from __future__ import annotations

import numpy as np

from radixd.server.pools.pool import KVPool


def _whole_pages(slots: np.ndarray, page: int) -> np.ndarray | None:
    """Page numbers if slots are whole pages in order (the fast path), else None."""
    if page == 1 or slots.size % page:
        return None
    pages = slots[::page] // page
    expect = (pages[:, None] * page + np.arange(page)).reshape(-1)
    return pages if np.array_equal(expect, slots) and not (slots[::page] % page).any() else None


def _gather(pool: KVPool, layer: int, kind: str, slots: np.ndarray) -> np.ndarray:
    view = pool.layer(layer, kind)
    if pool.spec.layout == "page_first":
        p = pool.spec.page_size
        pages = _whole_pages(slots, p)
        if pages is not None:
            return view[pages].reshape(-1, *view.shape[2:])
        return view[slots // p, slots % p]
    return view[slots]


def _scatter(pool: KVPool, layer: int, kind: str, slots: np.ndarray, data: np.ndarray) -> None:
    view = pool.layer(layer, kind)
    if pool.spec.layout == "page_first":
        p = pool.spec.page_size
        pages = _whole_pages(slots, p)
        if pages is not None:
            view[pages] = data.reshape(-1, p, *data.shape[1:])
        else:
            view[slots // p, slots % p] = data
    else:
        view[slots] = data


def _runs(slots: np.ndarray, unit: int) -> list[tuple[int, int, int]] | None:
    """(first destination unit, count, offset into slots) of each ascending contiguous run, or None."""
    if slots.size == 0 or slots.size % unit:
        return None
    heads = slots[::unit]
    if unit > 1 and ((heads % unit).any() or not np.array_equal(
            (heads[:, None] + np.arange(unit)).reshape(-1), slots)):
        return None
    firsts = heads // unit
    breaks = np.flatnonzero(np.diff(firsts) != 1) + 1
    starts = np.concatenate([[0], breaks])
    ends = np.concatenate([breaks, [firsts.size]])
    if starts.size > max(8, firsts.size // 8):
        return None  # too fragmented: the generic path is as good
    return [(int(firsts[a]), int(b - a), int(a * unit)) for a, b in zip(starts, ends)]


def _copy_direct(src: KVPool, src_slots: np.ndarray, dst: KVPool, runs: list, kinds) -> None:
    """Gather straight into contiguous destination runs (no temporary): np.take with out=."""
    p = dst.spec.page_size if dst.spec.layout == "page_first" else 1
    for layer in range(src.spec.num_layers):
        for kind in kinds:
            sv = src.layer(layer, kind)
            dv = dst.layer(layer, kind)
            for first, count, at in runs:
                idx = src_slots[at:at + count * p]
                np.take(sv, idx.reshape(count, p) if p > 1 else idx, axis=0, out=dv[first:first + count], mode="clip")


def copy_slots(src: KVPool, src_slots: np.ndarray, dst: KVPool, dst_slots: np.ndarray) -> int:
    """Copy every layer's KV of src_slots into dst_slots; returns bytes moved."""
    if src.spec.kinds != dst.spec.kinds or src.spec.dtype != dst.spec.dtype:
        raise ValueError("pools differ in geometry or dtype")
    src_slots = np.asarray(src_slots, dtype=np.int64)
    dst_slots = np.asarray(dst_slots, dtype=np.int64)
    if src_slots.shape != dst_slots.shape:
        raise ValueError("source and destination slot counts differ")
    # Direct gathers pay off when the destination run is one contiguous block (layer_first); into
    # page_first's strided pages numpy buffers anyway, so the generic path is as fast there.
    runs = _runs(dst_slots, 1) if dst.spec.layout == "layer_first" else None
    if runs is not None and src.spec.layout == "layer_first":
        _copy_direct(src, src_slots, dst, runs, src.spec.kinds)
        return int(src_slots.size) * src.spec.slot_bytes
    for layer in range(src.spec.num_layers):
        for kind in src.spec.kinds:
            _scatter(dst, layer, kind, dst_slots, _gather(src, layer, kind, src_slots))
    return int(src_slots.size) * src.spec.slot_bytes
