"""radixd as an SGLang radix-cache backend (SGLang 0.5.23): `SGLANG_PLUGINS=radixd python -m
sglang.launch_server ... --radix-cache-backend radixd` (radixd's target in $RADIXD_TARGET).

The `sglang.srt.plugins` entry point `radixd` calls `register()`, which registers the backend under the
name "radixd". SGLang is imported only then (and by `radixd.sglang.backend`), never by `import radixd`.
"""
from __future__ import annotations

import logging

log = logging.getLogger("radixd.sglang")


def _factory(ctx):
    from .backend import factory
    return factory(ctx)


def register() -> None:
    """Register the "radixd" backend with SGLang's registry (idempotent)."""
    from sglang.srt.mem_cache.registry import get_radix_cache_factory, register_radix_cache_backend
    if get_radix_cache_factory("radixd") is None:
        register_radix_cache_backend("radixd", _factory)
