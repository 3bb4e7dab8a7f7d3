"""Storage keys: a namespace tag for the KV format, then the frozen page-hash chain (tree/hashes.py).

Key of one page: `radixd1-<format tag>-<extra tag>-<page digest, hex>`. FROZEN like the chain itself.
* format tag: first 16 hex digits of SHA-256 over "model=..|layers=..|kv_heads=..|head_dim=..|dtype=..|
  page=..|mla=..|kinds=..|object=layer-major-v1": servers of different models or KV geometry never read
  each other's pages. The host layout is not part of it: a stored page is always layer-major
  ([layer x (k, v), page tokens, heads, dim]), whatever layout the host pool uses, so the bytes are the same.
* extra tag: "0" for no extra_key, else the first 16 hex digits of SHA-256(extra_key): a LoRA adapter's KV is
  not the base model's. The cache_salt already seeds the digest chain.
"""
from __future__ import annotations

import hashlib

from ..pools.spec import PoolSpec

OBJECT_FORMAT = "layer-major-v1"


def format_descriptor(spec: PoolSpec, model_id: str) -> str:
    """The human-readable description of what a stored page holds (hashed into every key)."""
    return (f"model={model_id}|layers={spec.num_layers}|kv_heads={spec.kv_heads}|head_dim={spec.head_dim}|"
            f"dtype={spec.dtype}|page={spec.page_size}|mla={int(spec.mla)}|kinds={','.join(spec.kinds)}|"
            f"object={OBJECT_FORMAT}")


def format_tag(spec: PoolSpec, model_id: str) -> str:
    """16 hex digits naming the KV format."""
    return hashlib.sha256(format_descriptor(spec, model_id).encode()).hexdigest()[:16]


def extra_tag(extra_key: str) -> str:
    """'0' for the base namespace, else 16 hex digits of the extra key (LoRA name and the like)."""
    return hashlib.sha256(extra_key.encode()).hexdigest()[:16] if extra_key else "0"


def page_keys(fmt: str, extra_key: str, digests: bytes) -> list[str]:
    """One key per 32-byte page digest, in order."""
    prefix = f"radixd1-{fmt}-{extra_tag(extra_key)}-"
    hexed = digests.hex()
    return [prefix + hexed[i:i + 64] for i in range(0, len(hexed), 64)]
