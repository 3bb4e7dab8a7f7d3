"""Row copies between SGLang's KV buffers and radixd's pool (no SGLang import: a GPU host checks them without it).

radixd's pool holds every tensor-parallel rank's KV heads side by side ([slots, heads of all ranks, head_dim] per
layer); a rank copies its own heads (`shard`). The pool may sit on another GPU than the rank's (one pool serves
every rank of an engine): indices go to the device of the tensor they index, rows move across with `.to`.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch


def load_rows(k: Sequence[torch.Tensor], v: Sequence[torch.Tensor], rk: Sequence[torch.Tensor],
              rv: Sequence[torch.Tensor], at: np.ndarray, dst: torch.Tensor, shard: slice) -> None:
    """radixd's KV at slots `at` (this rank's heads) into SGLang's buffers at `dst`, every layer."""
    src = torch.from_numpy(np.ascontiguousarray(at, dtype=np.int64)).to(rk[0].device)
    here = k[0].device
    dst = dst.to(here, torch.int64)
    for i in range(len(k)):  # index_select / index_copy_: several times faster than indexing
        k[i].index_copy_(0, dst, rk[i].index_select(0, src)[:, shard].to(here, non_blocking=True))
        v[i].index_copy_(0, dst, rv[i].index_select(0, src)[:, shard].to(here, non_blocking=True))


def store_rows(k: Sequence[torch.Tensor], v: Sequence[torch.Tensor], rk: Sequence[torch.Tensor],
               rv: Sequence[torch.Tensor], src: torch.Tensor, dst: np.ndarray, shard: slice) -> None:
    """SGLang's KV at its slots `src` into radixd's slots `dst` (this rank's heads of them), every layer."""
    there = rk[0].device
    d = torch.from_numpy(np.ascontiguousarray(dst, dtype=np.int64)).to(there)
    s = src.to(k[0].device, torch.int64)
    for i in range(len(k)):
        rk[i][:, shard].index_copy_(0, d, k[i].index_select(0, s).to(there, non_blocking=True))
        rv[i][:, shard].index_copy_(0, d, v[i].index_select(0, s).to(there, non_blocking=True))
