"""radixd's reading of hybrid configs against the counterparts' own (run in vLLM's venv by tests/test_layouts.py).

    python tests/layout_check.py

For every config under tests/configs: the layer kinds transformers' own config class derives (its
`layer_types` or `layers_block_type`) must equal radixd's classification, and the state shapes vLLM's
`MambaStateShapeCalculator` gives (TP 1 and 2) must equal radixd's. Prints one line per config.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import transformers  # noqa: E402
from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator as Calc  # noqa: E402
from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first  # noqa: E402

from radixd.server.layouts import model_layout  # noqa: E402

CONFIGS = Path(__file__).resolve().parent / "configs"
CLASSES = {"gemma3_text": "Gemma3TextConfig", "gemma3": "Gemma3Config", "gpt_oss": "GptOssConfig",
           "qwen3_next": "Qwen3NextConfig", "jamba": "JambaConfig", "nemotron_h": "NemotronHConfig"}
KIND = {"full_attention": "full", "attention": "full", "sliding_attention": "swa", "linear_attention": "state",
        "mamba": "state", "mlp": None, "moe": None}


def conv(shape: tuple) -> tuple:
    return tuple(shape) if is_conv_state_dim_first() else tuple(reversed(shape))


def theirs(hf: dict) -> tuple[list, object]:
    cls = getattr(transformers, CLASSES[hf["model_type"]])
    cfg = cls(**{k: v for k, v in hf.items() if k not in ("model_type", "architectures")})
    text = getattr(cfg, "text_config", None) or cfg
    if hf["model_type"] == "nemotron_h":
        types = list(text.layers_block_type)
    elif hf["model_type"] == "jamba":
        types = list(text.layers_block_type)
    else:
        types = list(text.layer_types)
    return [KIND[t] for t in types], text


def main() -> None:
    for path in sorted(CONFIGS.glob("*.json")):
        hf = json.loads(path.read_text())
        kinds, text = theirs(hf)
        for tp in (1, 2):
            mine = model_layout(hf, tp)
            got = [None] * len(kinds)
            for name, layers in (("full", mine.full_layers), ("swa", mine.swa_layers), ("state", mine.state_layers)):
                for i in layers:
                    got[i] = name
            assert got == kinds, (path.name, got, kinds)
            if mine.swa_layers:
                assert mine.window == text.sliding_window, (path.name, mine.window, text.sliding_window)
            if not mine.state_layers:
                continue
            s = mine.state
            if s.kind == "mamba2":
                c, t = Calc.mamba2_state_shape(tp, text.mamba_num_heads * text.mamba_head_dim, text.n_groups,
                                               text.mamba_num_heads, text.mamba_head_dim, text.ssm_state_size,
                                               text.conv_kernel)
            elif s.kind == "mamba1":
                c, t = Calc.mamba1_state_shape(tp, text.mamba_expand * text.hidden_size, text.mamba_d_state,
                                               text.mamba_d_conv)
            else:
                c, t = Calc.gated_delta_net_state_shape(tp, text.linear_num_key_heads, text.linear_num_value_heads,
                                                        text.linear_key_head_dim, text.linear_value_head_dim,
                                                        text.linear_conv_kernel_dim)
            assert (s.conv_shape, s.temporal_shape) == (conv(c), tuple(t)), (path.name, tp, s, c, t)
        print(f"ok {path.name}: {model_layout(hf).describe()}")


if __name__ == "__main__":
    main()
