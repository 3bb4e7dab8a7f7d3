"""client/_pagecopy.c: an engine backend's whole-page KV copies (check and copy in one call) against numpy's."""
from __future__ import annotations

import numpy as np
import pytest

pagecopy = pytest.importorskip("radixd.client._pagecopy", reason="client/_pagecopy.c was not built")
copy_pages = pagecopy.copy_pages

PAGE = 4


def buffers(rng: np.random.Generator, slots: int, n: int = 3) -> list[np.ndarray]:
    """n KV buffers (slots x heads x dim, float32), random bytes."""
    return [rng.standard_normal((slots, 2, 3)).astype(np.float32) for _ in range(n)]


def plan(src: list[np.ndarray], dst: list[np.ndarray]) -> np.ndarray:
    row = PAGE * src[0][0].nbytes
    return np.array([[s.ctypes.data, len(s) // PAGE, d.ctypes.data, len(d) // PAGE, row] for s, d in zip(src, dst)],
                    dtype=np.int64).ravel()


def slots_of(pages: np.ndarray) -> np.ndarray:
    return (pages[:, None] * PAGE + np.arange(PAGE)).ravel().astype(np.int64)


@pytest.mark.parametrize("nogil", [False, True])
def test_copies_the_bytes_numpy_copies_and_nothing_else(nogil):
    rng = np.random.default_rng(1)
    src, dst = buffers(rng, 64 + 3), buffers(rng, 40 + 2)  # (a partial last page on each side)
    for _ in range(20):
        k = int(rng.integers(1, 10))
        at = slots_of(rng.choice(len(src[0]) // PAGE, k, replace=False))
        to = slots_of(rng.choice(len(dst[0]) // PAGE, k, replace=False))
        want = [d.copy() for d in dst]
        for s, w in zip(src, want):
            w[to] = s[at]
        assert copy_pages(plan(src, dst), at, to, PAGE, nogil=nogil) is True
        for d, w in zip(dst, want):
            assert d.tobytes() == w.tobytes()


@pytest.mark.parametrize("at, to", [
    ([4, 5, 6, 7], [9, 10, 11, 12]),  # not page-aligned
    ([4, 5, 7, 6], [8, 9, 10, 11]),  # out of order inside a page
    ([4, 5, 6], [8, 9, 10]),  # a partial page
    ([4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15]),  # lengths differ
    ([64, 65, 66, 67], [8, 9, 10, 11]),  # past the source's last whole page (slots 64-66 are a partial page)
    ([4, 5, 6, 7], [40, 41, 42, 43]),  # past the destination's
    ([-4, -3, -2, -1], [8, 9, 10, 11]),  # negative
])
def test_refuses_slots_that_are_not_whole_pages_within_the_buffers_and_writes_nothing(at, to):
    rng = np.random.default_rng(2)
    src, dst = buffers(rng, 64 + 3), buffers(rng, 40 + 2)
    before = [d.tobytes() for d in dst]
    assert copy_pages(plan(src, dst), np.array(at, dtype=np.int64), np.array(to, dtype=np.int64), PAGE) is False
    assert [d.tobytes() for d in dst] == before


def test_no_slots_is_a_copy_of_nothing():
    rng = np.random.default_rng(5)
    src, dst = buffers(rng, 16), buffers(rng, 16)
    before = [d.tobytes() for d in dst]
    assert copy_pages(plan(src, dst), np.zeros(0, np.int64), np.zeros(0, np.int64), PAGE) is True
    assert [d.tobytes() for d in dst] == before


def test_page_one_takes_any_slots():
    rng = np.random.default_rng(3)
    src, dst = buffers(rng, 10), buffers(rng, 10)
    row = src[0][0].nbytes
    p = np.array([[s.ctypes.data, len(s), d.ctypes.data, len(d), row] for s, d in zip(src, dst)], np.int64).ravel()
    at, to = np.array([7, 3, 9], np.int64), np.array([0, 8, 2], np.int64)
    want = [d.copy() for d in dst]
    for s, w in zip(src, want):
        w[to] = s[at]
    assert copy_pages(p, at, to, 1)
    assert all(d.tobytes() == w.tobytes() for d, w in zip(dst, want))


def test_bad_arguments_raise_precisely():
    rng = np.random.default_rng(4)
    src, dst = buffers(rng, 16), buffers(rng, 16)
    p, at = plan(src, dst), slots_of(np.array([1]))
    with pytest.raises(TypeError, match="src must be a 1-d native int64 vector"):
        copy_pages(p, at.astype(np.int32), at, PAGE)
    with pytest.raises(TypeError, match="dst must be a 1-d native int64 vector"):
        copy_pages(p, at, at.astype(">i8"), PAGE)
    with pytest.raises(TypeError, match="plan must be"):
        copy_pages(p.reshape(-1, 5), at, at, PAGE)
    with pytest.raises(ValueError, match="5 int64s per buffer pair"):
        copy_pages(p[:-1], at, at, PAGE)
    with pytest.raises(ValueError, match="null address"):
        copy_pages(np.zeros(5, np.int64), at, at, PAGE)
    with pytest.raises(ValueError, match="page must be >= 1"):
        copy_pages(p, at, at, 0)
    with pytest.raises(TypeError):
        copy_pages(p, [4, 5, 6, 7], at, PAGE)  # (a list has no buffer)


# ------------------------------------------------ vLLM's CPU blocks <-> radixd's pages (integrations/vllm/layout.py)
def _strided_geometry(nb: int, b: int, h: int, d: int, dtype, heads_out: bool, k_cols: bool, v_cols: bool):
    """A probed CPU geometry whose blocks are the strided form given by the three flags (as `_strided` reads it)."""
    import torch

    from radixd.vllm.layout import Geometry
    ids = torch.arange(2 * b * h * d, dtype=torch.int64).view(2, b, h, d)
    chunk = {(kind, head): ids[kind, :, head].t() if (k_cols, v_cols)[kind] else ids[kind, :, head]
             for kind in (0, 1) for head in range(h)}
    order = [(kind, head) for head in range(h) for kind in (0, 1)] if heads_out else \
        [(kind, head) for kind in (0, 1) for head in range(h)]
    source = torch.cat([chunk[o].reshape(-1) for o in order])
    return Geometry("cpu", nb, b, h, d, dtype, source, torch.ones(2 * b * h * d, dtype=torch.bool))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "uint8", "float64"])
@pytest.mark.parametrize("heads_out, k_cols, v_cols", [(a, b, c) for a in (True, False) for b in (False, True)
                                                       for c in (False, True)])
def test_vllm_block_copies_write_the_bytes_numpys_views_write(dtype, heads_out, k_cols, v_cols):
    """copy_kv_blocks against the layer's numpy views (`CpuViews` without its spec) for every strided block form
    and element width: saves into radixd's pages and loads back into blocks, byte for byte, nothing else touched."""
    import dataclasses

    import torch

    from radixd.vllm import layout
    dt = getattr(torch, dtype)
    nb, b, h, d = 7, 4, 3, 5
    g = _strided_geometry(nb, b, h, d, dt, heads_out, k_cols, v_cols)
    assert layout._strided(g) == (heads_out, k_cols, v_cols)
    gen = torch.Generator().manual_seed(7)

    def rand(*shape):
        return torch.randint(0, 255, shape, generator=gen, dtype=torch.uint8).view(-1).view(dt).view(*shape) \
            if dt.itemsize == 1 else torch.randint(-1000, 1000, shape, generator=gen).to(dt)
    kv = rand(nb, h, b, 2 * d)
    slots = 6 * b
    k, v = rand(slots, h, d), rand(slots, h, d)
    views = layout.cpu_views(kv, g, k, v)
    assert views is not None and views.spec is not None
    plain = dataclasses.replace(views, spec=None)
    blocks, pages = np.array([5, 0, 3], np.int64), np.array([2, 5, 0], np.int64)
    ref_k, ref_v, ref_kv = k.clone(), v.clone(), kv.clone()
    plain.save(blocks, pages)  # numpy's result, then restore and do it natively
    want_k, want_v = k.clone(), v.clone()
    k.copy_(ref_k)
    v.copy_(ref_v)
    assert pagecopy.copy_kv_blocks(views.spec, blocks, pages, False)
    assert torch.equal(k.view(torch.uint8), want_k.view(torch.uint8))
    assert torch.equal(v.view(torch.uint8), want_v.view(torch.uint8))
    k2, v2 = rand(slots, h, d), rand(slots, h, d)  # new pages, loaded into the blocks both ways
    k.copy_(k2)
    v.copy_(v2)
    plain.load(blocks, pages)
    want_kv = kv.clone()
    kv.copy_(ref_kv)
    assert pagecopy.copy_kv_blocks(views.spec, blocks, pages, True)
    assert torch.equal(kv.view(torch.uint8), want_kv.view(torch.uint8))
    assert not torch.equal(kv.view(torch.uint8), ref_kv.view(torch.uint8))  # (the load did write)


def test_vllm_block_copies_refuse_indices_out_of_range_and_bad_specs():
    import torch

    from radixd.vllm import layout
    nb, b, h, d = 4, 4, 2, 3
    g = _strided_geometry(nb, b, h, d, torch.float32, True, True, False)
    kv, k, v = torch.randn(nb, h, b, 2 * d), torch.randn(3 * b, h, d), torch.randn(3 * b, h, d)
    spec = layout.cpu_views(kv, g, k, v).spec
    before = (kv.clone(), k.clone())
    for blocks, pages in (([4], [0]), ([0], [3]), ([-1], [0]), ([0, 1], [0])):
        assert pagecopy.copy_kv_blocks(spec, np.array(blocks, np.int64), np.array(pages, np.int64), False) is False
        assert pagecopy.copy_kv_blocks(spec, np.array(blocks, np.int64), np.array(pages, np.int64), True) is False
    assert torch.equal(kv, before[0]) and torch.equal(k, before[1])
    with pytest.raises(ValueError, match="13 int64s"):
        pagecopy.copy_kv_blocks(spec[:-1], np.zeros(1, np.int64), np.zeros(1, np.int64), False)
    bad = spec.copy()
    bad[8] = 3  # an element of 3 bytes
    with pytest.raises(ValueError, match="bad geometry"):
        pagecopy.copy_kv_blocks(bad, np.zeros(1, np.int64), np.zeros(1, np.int64), False)
    with pytest.raises(TypeError, match="blocks must be"):
        pagecopy.copy_kv_blocks(spec, np.zeros(1, np.int32), np.zeros(1, np.int64), False)


def _blocks_holding(g, ks, vs):
    """vLLM blocks [n, h, b, 2d] holding K and V [n, b, h, d] as the probed geometry places each element (element e
    of a block holds element source[e] of [2, b, h, d]): built from the probe's own description, not the copy code."""
    import torch
    both = torch.stack([ks, vs], dim=1).reshape(ks.shape[0], -1)
    return both[:, g.source].view(ks.shape[0], g.kv_heads, g.block_size, 2 * g.head_dim).clone()


@pytest.mark.parametrize("path", ["native", "numpy", "gather"])
@pytest.mark.parametrize("heads, tp", [(4, 2), (4, 4), (2, 4), (6, 3)])
def test_tensor_parallel_ranks_each_copy_their_own_heads_of_radixds_pages(path, heads, tp):
    """radixd holds every KV head of a page; a TP rank holds heads/tp of them (or one replica where heads < tp, as vLLM
    shards them). Each rank's save writes exactly its heads of each slot (a replica: its first rank only), through the
    native copy, numpy's views and torch's gather alike; a TP-1 engine then loads the whole pages, and every rank
    loads its own heads back, both equal to the K and V each rank held."""
    import dataclasses

    import torch

    from radixd.vllm import layout
    nb, b, d, slots = 5, 4, 8, 6 * 4
    gen = torch.Generator().manual_seed(heads * 10 + tp)
    local = heads // tp if heads >= tp else 1
    true_k = torch.randn(nb, b, heads, d, generator=gen)  # the model's K, V per vLLM block (each rank's blocks alike)
    true_v = torch.randn(nb, b, heads, d, generator=gen)
    k, v = torch.full((slots, heads, d), float("nan")), torch.full((slots, heads, d), float("nan"))
    blocks, pages = np.array([4, 1, 2], np.int64), np.array([3, 0, 5], np.int64)
    starts = torch.from_numpy(pages * b + (1 if path == "gather" else 0))  # (unaligned: the general gather)
    if path == "gather":
        k, v = torch.full((slots + 1, heads, d), float("nan")), torch.full((slots + 1, heads, d), float("nan"))

    def run(g, kv, first, load):
        views = layout.cpu_views(kv, g, k, v, first)
        if path == "gather":
            (layout.load_blocks if load else layout.save_blocks)(kv, g, torch.from_numpy(blocks), k, v, starts, first)
            return
        assert views is not None and (views.spec is not None) == True  # noqa: E712 (built: the native copy exists)
        if path == "numpy":
            views = dataclasses.replace(views, spec=None)
        (views.load if load else views.save)(blocks, pages)

    ranks = []
    for rank in range(tp):
        first, count, writes = layout.head_share(heads, local, tp, rank)
        assert count == local and (writes or heads < tp)
        g = _strided_geometry(nb, b, local, d, torch.float32, True, True, False)
        kv = _blocks_holding(g, true_k[:, :, first:first + count], true_v[:, :, first:first + count])
        ranks.append((g, kv, first, writes))
        if writes:
            run(g, kv, first, load=False)
    rows = torch.from_numpy(starts.numpy()[:, None] + np.arange(b)).reshape(-1)
    assert torch.equal(k[rows].view(3, b, heads, d), true_k[blocks])
    assert torch.equal(v[rows].view(3, b, heads, d), true_v[blocks])
    assert int(torch.isnan(k).any(dim=(1, 2)).sum()) == len(k) - 3 * b  # nothing written outside those pages
    whole = _strided_geometry(nb, b, heads, d, torch.float32, True, True, False)  # a TP-1 engine reads every head
    kv1 = torch.zeros(nb, heads, b, 2 * d)
    run(whole, kv1, 0, load=True)
    assert torch.equal(kv1[blocks], _blocks_holding(whole, true_k, true_v)[blocks])
    for g, kv, first, _ in ranks:  # and every rank reads its own heads back
        mine = torch.zeros_like(kv)
        run(g, mine, first, load=True)
        assert torch.equal(mine[blocks], kv[blocks])


def test_head_shares_follow_vllms_sharding_and_refuse_what_it_would_not_build():
    from radixd.vllm.layout import head_share
    assert [head_share(8, 2, 4, r) for r in range(4)] == [(0, 2, True), (2, 2, True), (4, 2, True), (6, 2, True)]
    assert [head_share(2, 1, 4, r) for r in range(4)] == [(0, 1, True), (0, 1, False), (1, 1, True), (1, 1, False)]
    assert [head_share(1, 1, 2, r, mla=True) for r in range(2)] == [(0, 1, True), (0, 1, False)]
    assert head_share(4, 4, 1, 0) == (0, 4, True)
    for total, local, tp in ((4, 1, 2), (6, 2, 4), (2, 2, 4), (4, 3, 1)):
        with pytest.raises(ValueError, match="radixd connector: rank"):
            head_share(total, local, tp, 0)


def _layers(nb: int, b: int, h: int, d: int, slots: int, seed: int) -> list:
    """Two layers of strided vLLM blocks (K column-major in one, row-major in the other) and empty radixd pages."""
    import torch

    from radixd.vllm import layout
    gen = torch.Generator().manual_seed(seed)
    out = []
    for cols in (True, False):
        g = _strided_geometry(nb, b, h, d, torch.float32, True, cols, False)
        kv, k, v = (torch.randn(nb, h, b, 2 * d, generator=gen), torch.zeros(slots, h, d), torch.zeros(slots, h, d))
        out.append((layout.cpu_views(kv, g, k, v), kv, k, v))
    return out


@pytest.mark.parametrize("as_lists", [False, True])
def test_the_copy_queue_writes_what_the_call_writes_in_order_and_says_when(as_lists):
    """CopyQueue: each layer's save on its native thread gives the bytes copy_kv_blocks gives, from int64 vectors or
    from lists, pages given as page numbers or as first slots (unit: the page size); tickets count up and
    completed() reaches the last once wait() returns; a later job into the same pages lands after an earlier one
    (one thread, in order); a job submitted without start runs once start() or a wait() wakes the thread; the
    Ticket handle reads it as a CUDA event."""
    import torch

    from radixd.vllm import layout
    nb, b, h, d = 9, 4, 2, 8
    layers = _layers(nb, b, h, d, 7 * b, 3)
    blocks, pages = [8, 2, 5, 0], [6, 0, 3, 1]
    want = []
    for views, kv, k, v in layers:
        assert pagecopy.copy_kv_blocks(views.spec, np.array(blocks, np.int64), np.array(pages, np.int64), False)
        want.append((k.clone(), v.clone()))
        k.zero_()
        v.zero_()
    q = pagecopy.CopyQueue()
    firsts = [p * b for p in pages]
    arg = (lambda x: x) if as_lists else (lambda x: np.array(x, np.int64))
    t1 = q.submit(layers[0][0].spec, arg(blocks), arg(pages))
    t2 = q.submit(layers[1][0].spec, arg(blocks), arg(firsts), False, b)
    assert (t1, t2) == (1, 2)
    ticket = layout.Ticket(q, t2)
    ticket.synchronize()
    assert ticket.query() and q.completed() == 2
    for (_, _, k, v), (wk, wv) in zip(layers, want):
        assert torch.equal(k, wk) and torch.equal(v, wv)
    views, kv, k, v = layers[0]  # the same pages written twice: the later job's bytes stay
    kv2 = kv.clone()
    kv.mul_(-1)
    t3 = q.submit(views.spec, [0], [6])
    kv.copy_(kv2)  # (the queue keeps the indices, never the bytes: the first job may already have read these)
    q.wait(t3)
    t4 = q.submit(views.spec, [8], [6])
    q.wait(t4)
    assert torch.equal(k[6 * b:7 * b], want[0][0][6 * b:7 * b]) and q.completed() == 4
    t5 = q.submit(views.spec, [2], [6], False, 1, False)  # not started: it runs at the next start, or a wait
    t6 = q.submit(views.spec, [5], [5], False, 1, False)
    q.start()
    q.wait(t6)
    assert q.completed() == t6 == t5 + 1 == 6
    assert torch.equal(k[6 * b:7 * b], want[0][0][0:b])  # (page 0 held block 2's K in `want`)
    t7 = q.submit(views.spec, [8], [6], False, 1, False)
    q.wait(t7)  # (the wait itself wakes the thread)
    assert torch.equal(k[6 * b:7 * b], want[0][0][6 * b:7 * b])
    q.close()
    q.close()  # (closing twice is fine)
    with pytest.raises(ValueError, match="closed"):
        q.submit(views.spec, [0], [0])


def test_the_copy_queue_refuses_what_it_cannot_copy_and_queues_nothing_then():
    """An index out of range or a first slot that is not a whole page: None, nothing queued or written; a bad spec
    or a bad vector raises; a ticket never handed out cannot be waited for."""
    import torch
    nb, b, h, d = 4, 4, 2, 3
    views, kv, k, v = _layers(nb, b, h, d, 3 * b, 5)[0]
    q = pagecopy.CopyQueue()
    for blocks, pages, unit in (([4], [0], 1), ([0], [3], 1), ([-1], [0], 1), ([0, 1], [0], 1), ([0], [2], b),
                                ([0], [3 * b], b)):
        assert q.submit(views.spec, blocks, pages, False, unit) is None
        assert q.submit(views.spec, blocks, pages, True, unit) is None
    assert q.completed() == 0 and not k.any() and not v.any()
    with pytest.raises(ValueError, match="13 int64s"):
        q.submit(views.spec[:5], [0], [0])
    with pytest.raises(TypeError, match="blocks must be"):
        q.submit(views.spec, np.zeros(1, np.int32), [0])
    with pytest.raises(TypeError):
        q.submit(views.spec, ["x"], [0])
    with pytest.raises(ValueError, match="unit"):
        q.submit(views.spec, [0], [0], False, 0)
    with pytest.raises(ValueError, match="never handed out"):
        q.wait(1)
    t = q.submit(views.spec, [], [])  # (nothing to copy is a job like any other)
    q.wait(t)
    assert q.completed() == t == 1
    del q  # (deallocation joins the thread)
