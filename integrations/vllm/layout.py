"""Whole-page copies between vLLM's paged KV blocks and radixd's `k_buffer` / `v_buffer` (no vLLM import).

vLLM block layouts handled (one tensor per layer):
  cpu    [num_blocks, kv_heads, block_size, 2 * head_dim]: per (block, head), rows viewed as
         [2 * block_size, head_dim] hold K in the first block_size rows and V in the rest;
  flash  [2, num_blocks, block_size, kv_heads, head_dim] (FlashAttention on GPU; index 0 is K).
radixd keeps one buffer per layer and kind: [slots, kv_heads, head_dim], a page being `block_size`
consecutive slots. A page moves in one gather or scatter per layer and kind; values are copied exactly.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Geometry:
    """What a vLLM layer tensor holds, read off its shape."""

    layout: str  # "cpu" | "flash"
    num_blocks: int
    block_size: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype


def geometry(kv: torch.Tensor, block_size: int) -> Geometry:
    """Recognise a layer tensor's layout given the engine's block size."""
    if kv.dim() == 5 and kv.shape[0] == 2 and kv.shape[2] == block_size:
        return Geometry("flash", kv.shape[1], block_size, kv.shape[3], kv.shape[4], kv.dtype)
    if kv.dim() == 4 and kv.shape[2] == block_size and kv.shape[3] % 2 == 0:
        return Geometry("cpu", kv.shape[0], block_size, kv.shape[1], kv.shape[3] // 2, kv.dtype)
    raise ValueError(f"unsupported vLLM KV layout {tuple(kv.shape)} for block size {block_size}")


def _page_index(slots: torch.Tensor, block_size: int) -> torch.Tensor:
    """First slots of whole pages -> every slot, page by page: [pages * block_size]."""
    return (slots.view(-1, 1) + torch.arange(block_size, device=slots.device)).view(-1)


def load_blocks(kv: torch.Tensor, g: Geometry, blocks: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                page_starts: torch.Tensor) -> None:
    """radixd pages (first slot of each) -> vLLM blocks, for one layer."""
    idx = _page_index(page_starts, g.block_size)
    n, b = blocks.numel(), g.block_size
    ks = k.index_select(0, idx).view(n, b, g.kv_heads, g.head_dim)
    vs = v.index_select(0, idx).view(n, b, g.kv_heads, g.head_dim)
    if g.layout == "cpu":
        dst = kv.view(g.num_blocks, g.kv_heads, 2 * b, g.head_dim)
        dst[blocks, :, :b] = ks.permute(0, 2, 1, 3).to(kv.dtype)
        dst[blocks, :, b:] = vs.permute(0, 2, 1, 3).to(kv.dtype)
    else:
        kv[0, blocks] = ks.to(kv.dtype)
        kv[1, blocks] = vs.to(kv.dtype)


def save_blocks(kv: torch.Tensor, g: Geometry, blocks: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                page_starts: torch.Tensor) -> None:
    """vLLM blocks -> radixd pages (first slot of each), for one layer."""
    idx = _page_index(page_starts, g.block_size)
    b = g.block_size
    if g.layout == "cpu":
        src = kv.view(g.num_blocks, g.kv_heads, 2 * b, g.head_dim)[blocks]  # [n, H, 2b, D]
        ks = src[:, :, :b].permute(0, 2, 1, 3).reshape(-1, g.kv_heads, g.head_dim)
        vs = src[:, :, b:].permute(0, 2, 1, 3).reshape(-1, g.kv_heads, g.head_dim)
    else:
        ks = kv[0, blocks].reshape(-1, g.kv_heads, g.head_dim)
        vs = kv[1, blocks].reshape(-1, g.kv_heads, g.head_dim)
    k.index_copy_(0, idx, ks.to(k.dtype))
    v.index_copy_(0, idx, vs.to(v.dtype))
