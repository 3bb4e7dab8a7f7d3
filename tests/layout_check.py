"""radixd's reading of hybrid configs against the counterparts' own (run in vLLM's venv by tests/test_layouts.py).

    python tests/layout_check.py

For every config under tests/configs: the layer kinds transformers' own config class derives (its
`layer_types` or `layers_block_type`; Falcon-H1's "hybrid" layer holds attention and Mamba2) must equal radixd's
classification, and the state shapes vLLM's own model class gives (`get_mamba_state_shape_from_config`, TP 1 and 2)
must equal radixd's; and the config read through its own class (`read_model_config`: AutoConfig, as radixd's server
reads it where transformers is installed) must give the layout and geometry of the file read by hand. Prints one
line per config.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import importlib  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import transformers  # noqa: E402
from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first  # noqa: E402

from radixd.server.config import model_geometry  # noqa: E402
from radixd.server.layouts import model_layout, read_model_config  # noqa: E402

CONFIGS = Path(__file__).resolve().parent / "configs"
CLASSES = {"gemma3_text": "Gemma3TextConfig", "gemma3": "Gemma3Config", "gpt_oss": "GptOssConfig",
           "qwen3_next": "Qwen3NextConfig", "jamba": "JambaConfig", "nemotron_h": "NemotronHConfig",
           "granitemoehybrid": "GraniteMoeHybridConfig", "falcon_h1": "FalconH1Config", "qwen3": "Qwen3Config",
           "mistral": "MistralConfig", "mamba2": "Mamba2Config"}
MODELS = {"qwen3_next": ("qwen3_next", "Qwen3NextForCausalLM"), "jamba": ("jamba", "JambaForCausalLM"),
          "nemotron_h": ("nemotron_h", "NemotronHForCausalLM"),
          "granitemoehybrid": ("granitemoehybrid", "GraniteMoeHybridForCausalLM"),
          "falcon_h1": ("falcon_h1", "FalconH1ForCausalLM"), "mamba2": ("mamba2", "Mamba2ForCausalLM")}  # vLLM's model classes, for their state shapes
KIND = {"full_attention": "full", "attention": "full", "sliding_attention": "swa", "linear_attention": "state",
        "mamba": "state", "hybrid": "both", "mlp": None, "moe": None}


def conv(shape: tuple) -> tuple:
    return tuple(shape) if is_conv_state_dim_first() else tuple(reversed(shape))


def theirs(hf: dict, path: Path) -> tuple[list, object]:
    cfg = getattr(transformers, CLASSES[hf["model_type"]]).from_json_file(str(path))  # (as from_pretrained reads it)
    text = getattr(cfg, "text_config", None) or cfg
    if hf["model_type"] == "nemotron_h":
        types = list(text.layers_block_type)
    elif hf["model_type"] == "jamba":
        types = list(text.layers_block_type)
    elif hf["model_type"] == "mistral":  # no layer list: vLLM gives every attention layer the config's window
        types = ["sliding_attention" if text.sliding_window else "full_attention"] * text.num_hidden_layers
    else:
        types = list(text.layer_types)
    return [KIND[t] for t in types], text


def main() -> None:
    for path in sorted(CONFIGS.glob("*.json")):
        hf = json.loads(path.read_text())
        kinds, text = theirs(hf, path)
        for tp in (1, 2):
            mine = model_layout(hf, tp)
            got = [None] * len(kinds)
            for name, layers in (("full", mine.full_layers), ("swa", mine.swa_layers), ("state", mine.state_layers)):
                for i in layers:
                    got[i] = "both" if got[i] == "full" and name == "state" else name
            assert got == kinds, (path.name, got, kinds)
            if mine.swa_layers:
                assert mine.window == text.sliding_window, (path.name, mine.window, text.sliding_window)
            if not mine.state_layers:
                continue
            s = mine.state
            module, name = MODELS[hf["model_type"]]
            model = getattr(importlib.import_module(f"vllm.model_executor.models.{module}"), name)
            vllm_config = SimpleNamespace(  # (what the classes read of a VllmConfig)
                parallel_config=SimpleNamespace(tensor_parallel_size=tp),
                model_config=SimpleNamespace(hf_config=text, hf_text_config=text),
                cache_config=SimpleNamespace(use_replayssm=False), speculative_config=None, num_speculative_tokens=0)
            c, t = model.get_mamba_state_shape_from_config(vllm_config)
            assert (s.conv_shape, s.temporal_shape) == (conv(c), tuple(t)), (path.name, tp, s, c, t)
        # what radixd's server reads where transformers is installed: the config through its own class (AutoConfig),
        # which must lay out and size the model exactly as the hand reader does on the file's JSON
        classed, source = read_model_config(str(path))
        assert source.startswith(f"transformers {transformers.__version__} ") and \
            source.endswith(type(theirs(hf, path)[1]).__name__ if "text_config" not in hf else "Config"), source
        for tp in (1, 2):
            assert model_layout(classed, tp) == model_layout(hf, tp), (path.name, tp)
            hybrid = model_layout(hf, tp).hybrid
            assert model_geometry(classed, tp, hybrid) == model_geometry(hf, tp, hybrid), (path.name, tp)
        print(f"ok {path.name}: {model_layout(hf).describe()} (also through {source.split()[-1]})")


if __name__ == "__main__":
    main()
