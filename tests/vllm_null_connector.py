"""A vLLM KV connector that does nothing: what vLLM 0.32.0 itself costs an engine for having a connector at all
(its per-layer hooks, the metadata round, the scheduler's connector calls), the floor that bench/vllm_bench.py
`--floor` measures radixd's connector against in the same run. Loaded by tests/vllm_engine.py --null-connector."""
from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata


class NullMetadata(KVConnectorMetadata):
    pass


class NullConnector(KVConnectorBase_V1):
    """Every hook answers at once: no cache hit, nothing loaded or saved."""

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return NullMetadata()
