"""Page copies between pools: every layout pair, small and large pages, contiguous and scattered runs."""
import uuid

import numpy as np
import pytest

from radixd.server.pools import KVPool, PoolSpec
from radixd.server.transfer.pages import PageCopier, _native

LAYOUTS = ["layer_first", "page_first"]
# the native row copy (client/_pagecopy.c, where built) and the torch/numpy gathers it stands in for
NATIVE = [pytest.param(True, marks=pytest.mark.skipif(_native() is None, reason="client/_pagecopy.c not built")),
          False]


def _slots(pages: np.ndarray, page: int) -> np.ndarray:
    return (pages[:, None] * page + np.arange(page)).reshape(-1)


def _read(pool: KVPool, slots: np.ndarray) -> np.ndarray:
    """Every layer and buffer of these slots, through the pool's own per-layer views."""
    p = pool.spec.page_size
    out = []
    for layer in range(pool.spec.num_layers):
        for kind in pool.spec.kinds:
            v = pool.layer(layer, kind)
            out.append(v[slots // p, slots % p] if pool.spec.layout == "page_first" else v[slots])
    return np.stack(out)


@pytest.mark.parametrize("src_layout", LAYOUTS)
@pytest.mark.parametrize("dst_layout", LAYOUTS)
# (16, 8, 128): 128 KiB pages; (1, 1, 3): 6-byte rows, not a multiple of 8, copied as bytes rather than int64
@pytest.mark.parametrize("page,heads,dim", [(1, 2, 8), (16, 2, 8), (16, 8, 128), (1, 1, 3)])
@pytest.mark.parametrize("scattered", [False, True])
@pytest.mark.parametrize("native", NATIVE)
def test_copies_are_exact(src_layout, dst_layout, page, heads, dim, scattered, native):
    iid = uuid.uuid4().hex
    spec = PoolSpec(num_layers=2, kv_heads=heads, head_dim=dim, dtype="float16", page_size=page,
                    num_slots=page * 512)
    src = KVPool(spec.with_slots(spec.num_slots, src_layout), "device", iid)
    dst = KVPool(spec.with_slots(spec.num_slots, dst_layout), "host", iid)
    try:
        rng = np.random.default_rng(page + heads)
        for view in src.views.values():
            view.view(np.uint16)[...] = rng.integers(0, 1 << 16, view.shape, dtype=np.uint16)
        # 300 scattered runs: past the gathers' per-call limit, through one temporary; natively, 128 KiB pages copy
        # on several threads from 1 MiB on
        n = 300 if scattered else 64
        sp = _slots(rng.permutation(512)[:n], page)
        dp = _slots(rng.permutation(512)[:n] if scattered else np.arange(100, 100 + n), page)
        copier = PageCopier(src, dst, native=native)
        assert (copier._native is not None) == native
        moved = copier.copy(sp, dp)
        assert moved == sp.size * spec.slot_bytes
        assert np.array_equal(_read(dst, dp).view(np.uint16), _read(src, sp).view(np.uint16))
        untouched = np.setdiff1d(np.arange(spec.num_slots), dp)
        assert not _read(dst, untouched).view(np.uint16).any()
    finally:
        src.close()
        dst.close()


@pytest.mark.parametrize("native", NATIVE)
def test_partial_pages_are_refused(native):
    iid = uuid.uuid4().hex
    spec = PoolSpec(num_layers=1, kv_heads=1, head_dim=8, page_size=4, num_slots=64)
    a, b = KVPool(spec, "device", iid), KVPool(spec, "host", iid)
    try:
        with pytest.raises(ValueError):
            PageCopier(a, b, native=native).copy(np.arange(1, 5), np.arange(4))
        with pytest.raises(ValueError):
            PageCopier(a, b, native=native).copy(np.arange(4), np.arange(8))
    finally:
        a.close()
        b.close()
