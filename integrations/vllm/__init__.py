"""radixd as vLLM's shared external KV tier: `RadixdConnector`. vLLM is imported only when the connector
is (lazily, here), so `radixd.vllm.layout` and `import radixd` work without it. `RadixdHybridConnector` is
the same for hybrid (sliding-window) models, with a radixd started with --hybrid-cache.

    --kv-transfer-config '{"kv_connector": "RadixdConnector", "kv_connector_module_path": "radixd.vllm",
                           "kv_role": "kv_both", "kv_connector_extra_config": {"radixd_target": "unix:///..."}}'
"""
from __future__ import annotations

import importlib

_EXPORTS = ("RadixdConnector", "RadixdHybridConnector", "RadixdConnectorMetadata", "RadixdWorkerMetadata", "SUPPORTED_VLLM")
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(".connector", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
