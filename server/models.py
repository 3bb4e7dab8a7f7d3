"""Bundled model presets for sizing (`radixd serve --model NAME`): the KV-relevant part of each model's
Hugging Face config.json, so an operator sizes a cache by model name instead of by geometry flags."""
from __future__ import annotations

from typing import Any

_GQA = ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "hidden_size")

PRESETS: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": dict(zip(_GQA, (32, 32, 8, 4096)), torch_dtype="bfloat16"),
    "llama-3.1-70b": dict(zip(_GQA, (80, 64, 8, 8192)), torch_dtype="bfloat16"),
    "llama-3.1-405b": dict(zip(_GQA, (126, 128, 8, 16384)), torch_dtype="bfloat16"),
    "mistral-7b": dict(zip(_GQA, (32, 32, 8, 4096)), torch_dtype="bfloat16"),
    "qwen2.5-7b": dict(zip(_GQA, (28, 28, 4, 3584)), torch_dtype="bfloat16"),
    "qwen2.5-72b": dict(zip(_GQA, (80, 64, 8, 8192)), torch_dtype="bfloat16"),
    "qwen3-8b": dict(zip(_GQA, (36, 32, 8, 4096)), head_dim=128, torch_dtype="bfloat16"),
    "qwen3-32b": dict(zip(_GQA, (64, 64, 8, 5120)), head_dim=128, torch_dtype="bfloat16"),
    "deepseek-v3": dict(num_hidden_layers=61, num_attention_heads=128, hidden_size=7168, kv_lora_rank=512,
                        qk_rope_head_dim=64, torch_dtype="bfloat16"),
}
