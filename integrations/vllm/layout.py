"""Whole-page copies between vLLM's paged KV blocks and radixd's `k_buffer` / `v_buffer` (no vLLM import).

radixd keeps one buffer per layer and kind: [slots, kv_heads, head_dim], a page being `block_size`
consecutive slots, K after RoPE, exactly as the model computed it. vLLM's block layouts:
  cpu    [num_blocks, kv_heads, block_size, 2 * head_dim]. How a block's bytes hold K and V is the CPU
         attention kernel's business and differs between kernels (vLLM 0.32.0's vec/vec16 kernels store
         each head's K column-major, [head_dim, block_size], and V row-major after it; AMX packs K and V
         for its tiles). So the layout is never assumed: `probe_cpu_layout` has the engine's own
         `reshape_and_cache` write two probe blocks and reads back where every K and V element went,
         giving a permutation of the block that converts exactly; a kernel whose block is not a
         permutation of K and V (quantized, padded in ways that lose elements) is refused at start.
  flash  [2, num_blocks, block_size, kv_heads, head_dim] (FlashAttention on GPU; index 0 is K).
  mla    [num_blocks, 1, block_size, latent] or [num_blocks, block_size, latent] (MLA: each token's compressed KV
         and its rotated key part, one "head" that every tensor-parallel rank holds whole); radixd's latent buffer
         is [slots, 1, latent].
radixd holds every KV head of a page, whatever the engine's parallelism: a tensor-parallel rank copies its own heads
of each slot (`head_share`, as vLLM shards them), so engines of any TP size read the same pages.
A page moves in one gather or scatter per layer; values are copied exactly. A CPU block that is a strided view of
K and V (the vec kernels') is copied through numpy views of it (`CpuViews`), or client/_pagecopy.c's
copy_kv_blocks where it is built, without the general per-element gather.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch

try:  # (optional: numpy's fancy indexing without it)
    from radixd.client._pagecopy import copy_kv_blocks as _copy_kv_blocks
    from radixd.client._pagecopy import CopyQueue
except ImportError:
    _copy_kv_blocks = CopyQueue = None


@dataclass(frozen=True)
class Geometry:
    """What a vLLM layer tensor holds, read off its shape (and, on CPU, probed from the kernel)."""

    layout: str  # "cpu" | "flash" | "mla"
    num_blocks: int
    block_size: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    # cpu: for each element of a block (flattened), which element of [2 (K, V), block_size, kv_heads,
    # head_dim] it holds; `written` marks the elements the kernel writes (the rest is padding)
    source: Optional[torch.Tensor] = None
    written: Optional[torch.Tensor] = None


def geometry(kv: torch.Tensor, block_size: int, mla: bool = False) -> Geometry:
    """Recognise a layer tensor's layout given the engine's block size (and whether the model uses MLA: its latent
    cache has the CPU layout's rank)."""
    if mla:
        if kv.dim() == 4 and kv.shape[1] == 1 and kv.shape[2] == block_size or \
                kv.dim() == 3 and kv.shape[1] == block_size:
            return Geometry("mla", kv.shape[0], block_size, 1, kv.shape[-1], kv.dtype)
        raise ValueError(f"unsupported vLLM MLA KV layout {tuple(kv.shape)} for block size {block_size}")
    if kv.dim() == 5 and kv.shape[0] == 2 and kv.shape[2] == block_size:
        return Geometry("flash", kv.shape[1], block_size, kv.shape[3], kv.shape[4], kv.dtype)
    if kv.dim() == 4 and kv.shape[2] == block_size and kv.shape[3] % 2 == 0:
        return Geometry("cpu", kv.shape[0], block_size, kv.shape[1], kv.shape[3] // 2, kv.dtype)
    if kv.dim() == 3 and kv.shape[1] == block_size:
        return Geometry("mla", kv.shape[0], block_size, 1, kv.shape[2], kv.dtype)
    raise ValueError(f"unsupported vLLM KV layout {tuple(kv.shape)} for block size {block_size}")


def head_share(total: int, local: int, tp: int, rank: int, mla: bool = False) -> tuple[int, int, bool]:
    """A tensor-parallel rank's KV heads among radixd's `total` (first, count) and whether it writes them: vLLM gives
    each rank total/tp heads, or, with fewer heads than ranks, one head that tp/total ranks share (replicas), and an
    MLA latent to every rank; a shared head is written by its first rank only and read by all."""
    if mla:
        total = 1  # (one latent per token, the same on every rank)
    if total >= tp:
        if total % tp or local != total // tp:
            raise ValueError(f"radixd connector: rank {rank} of {tp} holds {local} KV heads; radixd's pages hold "
                             f"{total}, so each rank should hold {total / tp:g}")
        return rank * local, local, True
    if tp % total or local != 1:
        raise ValueError(f"radixd connector: rank {rank} of {tp} holds {local} KV heads; radixd's pages hold "
                         f"{total} (fewer than the ranks), so each rank should hold one replica")
    replicas = tp // total
    return rank // replicas, 1, rank % replicas == 0


def _heads_view(a: np.ndarray, b: int, first: int, count: int) -> np.ndarray:
    """radixd's [slots, heads, dim] buffer as [pages, b, count, dim] heads first..first+count: a view, never a copy
    (a reshape that had to copy would write nowhere)."""
    pages = np.reshape(a, (-1, b) + a.shape[1:], copy=False)
    return pages[:, :, first:first + count]


Writer = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


def probe_cpu_layout(g: Geometry, write: Writer, what: str = "the CPU attention kernel") -> Geometry:
    """Learn where the kernel puts each K and V element of a block.

    `write(key, value, key_cache, value_cache, slot_mapping)` is the engine's own reshape_and_cache. Each
    element gets an id, written in two passes of small integers (exact in every float dtype: 1..256), K
    positive and V negative; the block read back gives the permutation."""
    b, h, d = g.block_size, g.kv_heads, g.head_dim
    n = b * h * d
    ids = torch.arange(n, dtype=torch.int64).view(b, h, d)
    seen = []
    for part in (ids % 256, ids // 256):
        cache = torch.zeros(2, h, b, 2 * d, dtype=g.dtype)
        kc, vc = cache.view(2, h, 2 * b, d).chunk(2, dim=2)
        vals = (part + 1).to(torch.float32)
        write(vals.to(g.dtype), (-vals).to(g.dtype), kc, vc, torch.arange(b, 2 * b, dtype=torch.int64))
        if cache[0].abs().sum() != 0:
            raise ValueError(f"radixd connector: {what} wrote outside the block it was given; cannot convert")
        seen.append(cache[1].reshape(-1).to(torch.float32))
    lo, hi = seen
    written = lo != 0
    sign = torch.sign(lo)
    if not torch.equal(written, hi != 0) or not torch.equal(sign[written], torch.sign(hi[written])) or \
            not torch.equal(lo.abs().round(), lo.abs()) or not torch.equal(hi.abs().round(), hi.abs()):
        raise ValueError(f"radixd connector: {what} does not store K and V as exact values (quantized or "
                         "packed); radixd cannot convert its blocks exactly")
    elem = (hi.abs().long() - 1) * 256 + (lo.abs().long() - 1)
    elem = torch.where(sign < 0, elem + n, elem)  # V ids follow K ids
    got = torch.sort(elem[written]).values
    if got.numel() != 2 * n or not torch.equal(got, torch.arange(2 * n)):
        raise ValueError(f"radixd connector: {what} does not keep every K and V element of a block exactly "
                         "once; radixd cannot convert its blocks exactly")
    # elem is indexed [kind, token, head, dim]: kind * n + (token * h + head) * d + dim
    return Geometry(g.layout, g.num_blocks, b, h, d, g.dtype, elem, written)


def _page_index(slots: torch.Tensor, block_size: int) -> torch.Tensor:
    """First slots of whole pages -> every slot, page by page: [pages * block_size]."""
    return (slots.view(-1, 1) + torch.arange(block_size, device=slots.device)).view(-1)


@functools.lru_cache(maxsize=16)
def _probed(g: Geometry, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]:
    """Worked out once per geometry: the positions the kernel writes, the element each holds, where each element
    of [2, b, H, D] sits in the block, and whether every position is written (no padding)."""
    if g.source is None:
        raise ValueError("a CPU block layout must be probed first (probe_cpu_layout)")
    pos = torch.nonzero(g.written).view(-1)
    src = g.source[g.written]
    gather = torch.empty_like(pos)
    gather[src] = pos
    return pos.to(device), src.to(device), gather.to(device), bool(g.written.all())


@functools.lru_cache(maxsize=16)
def _strided(g: Geometry) -> Optional[tuple[bool, bool, bool]]:
    """The probed block as strided views, when it is one (vLLM 0.32.0's vec kernels: per head, K column-major
    then V row-major): (heads outermost, K column-major, V column-major); None for any other permutation or
    padding, which takes the general gather."""
    if g.source is None or not bool(g.written.all()):
        return None
    b, h, d = g.block_size, g.kv_heads, g.head_dim
    ids = torch.arange(2 * b * h * d, dtype=torch.int64).view(2, b, h, d)  # the probe's element ids
    for heads_out in (True, False):
        for k_cols in (False, True):
            for v_cols in (False, True):
                chunk = {(kind, head): (ids[kind, :, head].t() if (k_cols, v_cols)[kind] else ids[kind, :, head])
                         for kind in (0, 1) for head in range(h)}
                order = [(kind, head) for head in range(h) for kind in (0, 1)] if heads_out else \
                    [(kind, head) for kind in (0, 1) for head in range(h)]
                if torch.equal(torch.cat([chunk[o].reshape(-1) for o in order]), g.source):
                    return heads_out, k_cols, v_cols
    return None


_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # numpy has no bfloat16: bytes as ints


def _np(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor's memory as a numpy array of integers of its element's width (the same bytes, no copy)."""
    return t.view(_INT[t.element_size()]).numpy()


@dataclass(frozen=True)
class CpuViews:
    """One layer's copies as numpy fancy indexing between views: vLLM's whole cache as K and V [blocks, block_size,
    kv_heads, head_dim] (strided views into its blocks) and radixd's buffers as [pages, block_size, kv_heads,
    head_dim]. numpy moves these shapes 3.5x faster than torch's index_copy_ (bf16, 32-token blocks, 2 heads of
    64 bytes: torch's strided copy kernel pays per element run), and the views are built once per layer. With
    client/_pagecopy.c built, the same copies go through it (`spec`), a block at a time with no temporary: numpy
    gathers into one and scatters it again."""

    block_k: np.ndarray
    block_v: np.ndarray
    page_k: np.ndarray
    page_v: np.ndarray
    spec: Optional[np.ndarray] = None  # copy_kv_blocks' description of the layer (addresses: the buffers outlive it)

    def save(self, blocks: np.ndarray, pages: np.ndarray) -> None:
        if self.spec is not None and _copy_kv_blocks(self.spec, blocks, pages, False):
            return
        self.page_k[pages] = self.block_k[blocks]  # (an index out of range raises here)
        self.page_v[pages] = self.block_v[blocks]

    def load(self, blocks: np.ndarray, pages: np.ndarray) -> None:
        if self.spec is not None and _copy_kv_blocks(self.spec, blocks, pages, True):
            return
        self.block_k[blocks] = self.page_k[pages]
        self.block_v[blocks] = self.page_v[pages]


def cpu_views(kv: torch.Tensor, g: Geometry, k: torch.Tensor, v: torch.Tensor, first: int = 0) -> Optional[CpuViews]:
    """The layer's `CpuViews` when its copies can go through them: a CPU block that is a strided view of K and V
    (vLLM 0.32.0's vec kernels), one dtype, radixd's buffers whole pages (its heads `first`.. of every slot: a
    tensor-parallel rank's); else None (the general gather)."""
    form = _strided(g) if g.layout == "cpu" and kv.dtype == k.dtype == v.dtype else None
    b = g.block_size
    if form is None or not (kv.is_contiguous() and k.is_contiguous() and v.is_contiguous()) or \
            k.shape[0] % b or v.shape[0] % b or k.shape[1:] != v.shape[1:] or k.shape[2] != g.head_dim or \
            first + g.kv_heads > k.shape[1]:
        return None
    n, h, d = g.num_blocks, g.kv_heads, g.head_dim
    heads_out, k_cols, v_cols = form
    rows = _np(kv).reshape(n, -1)
    x = rows.reshape(n, h, 2, b * d) if heads_out else rows.reshape(n, 2, h, b * d).transpose(0, 2, 1, 3)
    kinds = []
    for kind, cols in ((0, k_cols), (1, v_cols)):
        part = x[:, :, kind]  # [n, h, b * d]: its last axis is contiguous, so the reshapes below are views
        kinds.append(part.reshape(n, h, d, b).transpose(0, 3, 1, 2) if cols else
                     part.reshape(n, h, b, d).transpose(0, 2, 1, 3))
    skip = first * d * k.element_size()  # (this rank's first head in each slot)
    spec = None if _copy_kv_blocks is None else np.array(
        [kv.data_ptr(), n, k.data_ptr() + skip, v.data_ptr() + skip, min(k.shape[0], v.shape[0]) // b, b, h, d,
         kv.element_size(), heads_out, k_cols, v_cols, k.shape[1]], dtype=np.int64)
    views = CpuViews(kinds[0], kinds[1], _heads_view(_np(k), b, first, h), _heads_view(_np(v), b, first, h), spec)
    if not all(np.shares_memory(a, base) for a, base in ((views.block_k, rows), (views.block_v, rows))):
        return None  # (never expected: a reshape that had to copy would write nowhere)
    return views


class Ticket:
    """A `CopyQueue` job as a handle with a CUDA event's query() and synchronize() (one thread runs the queue's jobs
    in order: every ticket up to the last done is done)."""

    __slots__ = ("queue", "ticket")

    def __init__(self, queue: Any, ticket: int):
        self.queue, self.ticket = queue, ticket

    def query(self) -> bool:
        return self.queue.completed() >= self.ticket

    def synchronize(self) -> None:
        self.queue.wait(self.ticket)


def aligned_pages(page_starts: Sequence[int], block_size: int) -> Optional[np.ndarray]:
    """Page numbers of pages' first slots, when every one is at a page boundary (radixd's allocator hands out
    aligned pages; anything else takes the slot-by-slot path)."""
    starts = np.asarray(page_starts, dtype=np.int64)
    return None if (starts % block_size).any() else starts // block_size


def _latent(kv: torch.Tensor) -> torch.Tensor:
    """An MLA layer's blocks as [num_blocks, block_size, latent] (a view: writes land in the engine's cache)."""
    return kv.squeeze(1) if kv.dim() == 4 else kv


def load_blocks(kv: torch.Tensor, g: Geometry, blocks: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                page_starts: torch.Tensor, first: int = 0) -> None:
    """radixd pages (first slot of each) -> vLLM blocks, for one layer (radixd's heads first.. of each slot)."""
    views = cpu_views(kv, g, k, v, first)
    pages = aligned_pages(page_starts.tolist(), g.block_size) if views is not None else None
    if pages is not None:
        views.load(blocks.numpy(), pages)
        return
    idx = _page_index(page_starts.to(k.device), g.block_size)  # (radixd's pool may sit on another GPU: peer copies)
    n, b = blocks.numel(), g.block_size
    if g.layout == "mla":  # (v is None: one latent buffer)
        _latent(kv)[blocks.to(kv.device)] = k.index_select(0, idx).view(n, b, g.head_dim).to(kv.device, kv.dtype)
        return
    k, v = k[:, first:first + g.kv_heads], v[:, first:first + g.kv_heads]
    ks = k.index_select(0, idx).view(n, b, g.kv_heads, g.head_dim).to(kv.device)
    vs = v.index_select(0, idx).view(n, b, g.kv_heads, g.head_dim).to(kv.device)
    if g.layout == "cpu":
        pos, src, _, dense = _probed(g, kv.device)
        both = torch.stack([ks, vs], dim=1).reshape(n, -1).to(kv.dtype)  # [n, 2 * b * H * D]
        flat = kv.view(g.num_blocks, -1)
        if dense:  # every position is written: one gather builds whole blocks (pos is then 0..len-1)
            flat.index_copy_(0, blocks, both.index_select(1, src))
        else:  # the padding stays as it is
            rows = flat[blocks]
            rows[:, pos] = both[:, src]
            flat[blocks] = rows
    else:
        kv[0, blocks] = ks.to(kv.dtype)
        kv[1, blocks] = vs.to(kv.dtype)


def save_blocks(kv: torch.Tensor, g: Geometry, blocks: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                page_starts: torch.Tensor, first: int = 0) -> None:
    """vLLM blocks -> radixd pages (first slot of each), for one layer (radixd's heads first.. of each slot)."""
    views = cpu_views(kv, g, k, v, first)
    pages = aligned_pages(page_starts.tolist(), g.block_size) if views is not None else None
    if pages is not None:
        views.save(blocks.numpy(), pages)
        return
    idx = _page_index(page_starts.to(k.device), g.block_size)  # (radixd's pool may sit on another GPU: peer copies)
    n, b = blocks.numel(), g.block_size
    if g.layout == "mla":
        k.index_copy_(0, idx, _latent(kv)[blocks.to(kv.device)].reshape(-1, 1, g.head_dim).to(k.device, k.dtype))
        return
    k, v = k[:, first:first + g.kv_heads], v[:, first:first + g.kv_heads]
    if g.layout == "cpu":
        _, _, gather, _ = _probed(g, kv.device)
        both = kv.view(g.num_blocks, -1).index_select(0, blocks).index_select(1, gather)  # one gather per block
        both = both.view(n, 2, b * g.kv_heads, g.head_dim)
        ks = both[:, 0].reshape(-1, g.kv_heads, g.head_dim)
        vs = both[:, 1].reshape(-1, g.kv_heads, g.head_dim)
    else:
        ks = kv[0, blocks].reshape(-1, g.kv_heads, g.head_dim)
        vs = kv[1, blocks].reshape(-1, g.kv_heads, g.head_dim)
    k.index_copy_(0, idx, ks.to(k.device, k.dtype))
    v.index_copy_(0, idx, vs.to(v.device, v.dtype))
