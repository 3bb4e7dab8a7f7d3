"""Which layers of a Hugging Face model keep what: full-attention KV, sliding-window KV, or a recurrent state.

A hybrid model's cache is three pools, not one: FULL KV for the full-attention layers, SWA KV for the
sliding-window layers (only the last `window` tokens of a request matter), and one state slot per cached
prefix for the Mamba / linear-attention layers (a conv state and a temporal state per layer). Sizing all
layers as full attention, as a plain model, over-sizes FULL and leaves the others unsized.

The config is read through the model's own config class where transformers is importable (`read_model_config`:
`AutoConfig`, whose classes compute the layer list a config.json may leave out, as for Falcon-H1, Mamba2, Jamba and
the Qwen families), and by hand from the file's JSON where it is not; both go through `model_layout`, which reads,
in this order (the first that the config has decides):
  * `layer_types` (Gemma 3, gpt-oss, Qwen3-Next, Granite 4 and transformers' newer configs; every class that
    computes one): "full_attention" or "attention", "sliding_attention" (with `sliding_window`), "mamba",
    "hybrid" (Falcon-H1: attention and Mamba2 in one layer) or "linear_attention": a Mamba2 mixer in the Mamba2
    families (Granite 4, Nemotron-H, Falcon-H1, Mamba2, which transformers writes so), Mamba1 in Jamba, else
    Qwen3-Next's gated delta net (with its `linear_*` dims);
  * `hybrid_override_pattern` (Nemotron-H): "M" Mamba2, "*" attention, "-" MLP and "E" MoE (no cache);
  * `layers_block_type` (transformers' Nemotron-H): "mamba" or "linear_attention" for Mamba2, "attention" or
    "full_attention", "mlp", "moe";
  * `attn_layer_period` and `attn_layer_offset` (Jamba): attention where i % period == offset, Mamba1 elsewhere;
  * `sliding_window_pattern` with `sliding_window` (older Gemma 3 configs): every pattern-th layer is global;
  * Falcon-H1 without a layer list (transformers computes it): every layer holds attention and Mamba2;
  * Mamba2 (`model_type` mamba2, pure state: transformers computes its layer list): every layer Mamba2;
  * a `sliding_window` with no layer list: every layer slides in the families whose config class and vLLM apply it
    to all layers (Mistral, Mixtral, Starcoder2, Phi-3); the Qwen families only with `use_sliding_window`, from
    layer `max_window_layers` on (as Qwen2Config computes it); elsewhere it makes no layer sliding;
  * otherwise every layer is full attention.
A model need not have a full-attention layer (every layer sliding, pure Mamba2): the hybrid tree's keys are its
backbone then, with no FULL KV pool behind them.
State shapes follow vLLM's `MambaStateShapeCalculator` (tests compare them), conv state as (dim, kernel - 1). A
Mamba2 field has each family's names (Nemotron-H's `mamba_num_heads`, Granite's and Falcon-H1's `mamba_n_heads`...).
A field radixd cannot interpret fails in one line that names it.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Optional

_DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}


class LayoutError(ValueError):
    """A config field that radixd cannot interpret (the message names it)."""


@dataclass(frozen=True)
class StateSpec:
    """One layer's recurrent state: conv and temporal shapes (per TP rank) and their dtypes."""

    kind: str  # "mamba1", "mamba2" or "gated_delta_net"
    conv_shape: tuple[int, ...]
    temporal_shape: tuple[int, ...]
    conv_dtype: str
    temporal_dtype: str

    @property
    def nbytes(self) -> int:
        """Bytes of one layer's state."""
        conv = _DTYPE_BYTES[self.conv_dtype]
        temp = _DTYPE_BYTES[self.temporal_dtype]
        n_conv = n_temp = 1
        for d in self.conv_shape:
            n_conv *= d
        for d in self.temporal_shape:
            n_temp *= d
        return n_conv * conv + n_temp * temp


@dataclass(frozen=True)
class ModelLayout:
    """Layer indices per kind, the window and the state of a (possibly hybrid) model."""

    full_layers: tuple[int, ...]
    swa_layers: tuple[int, ...] = ()
    window: Optional[int] = None
    state_layers: tuple[int, ...] = ()
    state: Optional[StateSpec] = None

    @property
    def hybrid(self) -> bool:
        return bool(self.swa_layers or self.state_layers)

    def state_bytes(self) -> int:
        """Bytes of one cached state slot: every state layer's conv and temporal state."""
        return len(self.state_layers) * self.state.nbytes if self.state else 0

    def describe(self) -> str:
        parts = [f"{len(self.full_layers)} full-attention layers" if self.full_layers else "no full-attention layer"]
        if self.swa_layers:
            parts.append(f"{len(self.swa_layers)} sliding-window layers (window {self.window})")
        if self.state_layers:
            parts.append(f"{len(self.state_layers)} {self.state.kind} state layers "
                         f"({self.state_bytes()} bytes per state)")
        return ", ".join(parts)


def _need(cfg: dict, name: str) -> Any:
    if cfg.get(name) is None:
        raise LayoutError(f"field {name!r} is missing, and the layer layout needs it")
    return cfg[name]


def _int(cfg: dict, name: str) -> int:
    v = _need(cfg, name)
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise LayoutError(f"field {name!r} is {v!r}, not a positive integer")
    return v


def _split(n: int, tp: int, what: str) -> int:
    if n % tp:
        raise LayoutError(f"{what} ({n}) does not split over tp_size {tp}")
    return n // tp


def _dtype(cfg: dict, *names: str) -> str:
    for name in names:
        v = cfg.get(name)
        if v is not None:
            v = str(v).replace("torch.", "")
            v = {"half": "float16", "float": "float32"}.get(v, v)
            if v not in _DTYPE_BYTES:
                raise LayoutError(f"field {name!r} is {cfg.get(name)!r}, not one of {sorted(_DTYPE_BYTES)}")
            return v
    return "bfloat16"


_MAMBA2_TYPES = ("nemotron_h", "granitemoehybrid", "falcon_h1", "mamba2")  # their "linear_attention" is Mamba2
_EVERY_LAYER_SLIDES = ("mistral", "mixtral", "starcoder2", "phi3")  # a bare `sliding_window` is every layer's
# each Mamba2 dimension under the names the families give it (Nemotron-H first: its names are the ones errors cite)
_MAMBA2_NAMES = {"heads": ("mamba_num_heads", "mamba_n_heads"), "head_dim": ("mamba_head_dim", "mamba_d_head"),
                 "groups": ("n_groups", "mamba_n_groups"), "state": ("ssm_state_size", "mamba_d_state"),
                 "kernel": ("conv_kernel", "mamba_d_conv")}
_PURE_MAMBA2_NAMES = {"heads": ("num_heads",), "head_dim": ("head_dim",), "groups": ("n_groups",),
                      "state": ("state_size",), "kernel": ("conv_kernel",)}  # (Mamba2Config's: no mamba_ prefix)


def _int_of(cfg: dict, names: tuple[str, ...]) -> int:
    """The first of a field's names that the config has (a family's own), as a positive integer."""
    for name in names:
        if cfg.get(name) is not None:
            return _int(cfg, name)
    raise LayoutError(f"field {names[0]!r} (or {', '.join(repr(n) for n in names[1:])}) is missing, and the layer "
                      "layout needs it")


def _mamba2(cfg: dict, tp: int) -> StateSpec:
    names = _PURE_MAMBA2_NAMES if cfg.get("model_type") == "mamba2" else _MAMBA2_NAMES
    heads, head_dim = _int_of(cfg, names["heads"]), _int_of(cfg, names["head_dim"])
    groups, dstate = _int_of(cfg, names["groups"]), _int_of(cfg, names["state"])
    kernel = _int_of(cfg, names["kernel"])
    inner = heads * head_dim
    if cfg.get("mamba_d_ssm") is not None and _int(cfg, "mamba_d_ssm") != inner:  # (Falcon-H1's own inner width)
        raise LayoutError(f"field 'mamba_d_ssm' is {cfg['mamba_d_ssm']}, not heads x head dim ({inner})")
    if groups % tp:
        groups += tp - groups  # groups replicate to follow the head shards (vLLM's extra_groups_for_head_shards)
    conv_dim = inner + 2 * groups * dstate
    dt = _dtype(cfg, "torch_dtype", "dtype")
    return StateSpec("mamba2", (_split(conv_dim, tp, "the Mamba2 conv dim"), kernel - 1),
                     (_split(heads, tp, "field 'mamba_num_heads'"), head_dim, dstate), dt,
                     _dtype(cfg, "mamba_ssm_cache_dtype", "torch_dtype", "dtype"))


def _mamba1(cfg: dict, tp: int) -> StateSpec:
    inner = _int(cfg, "mamba_expand") * _int(cfg, "hidden_size")
    kernel, dstate = _int(cfg, "mamba_d_conv"), _int(cfg, "mamba_d_state")
    dt = _dtype(cfg, "torch_dtype", "dtype")
    local = _split(inner, tp, "the Mamba inner dim")
    return StateSpec("mamba1", (local, kernel - 1), (local, dstate), dt,
                     _dtype(cfg, "mamba_ssm_cache_dtype", "torch_dtype", "dtype"))


def _gated_delta(cfg: dict, tp: int) -> StateSpec:
    kh, vh = _int(cfg, "linear_num_key_heads"), _int(cfg, "linear_num_value_heads")
    kd, vd = _int(cfg, "linear_key_head_dim"), _int(cfg, "linear_value_head_dim")
    kernel = _int(cfg, "linear_conv_kernel_dim")
    conv_dim = kd * kh * 2 + vd * vh
    dt = _dtype(cfg, "torch_dtype", "dtype")
    return StateSpec("gated_delta_net", (_split(conv_dim, tp, "the linear-attention conv dim"), kernel - 1),
                     (_split(vh, tp, "field 'linear_num_value_heads'"), vd, kd), dt,
                     _dtype(cfg, "mamba_ssm_cache_dtype", "torch_dtype", "dtype"))


def _first_sliding(cfg: dict, family: Optional[str], n: int) -> int:
    """The first sliding layer of a config without a layer list (n: none slides), as its config class reads a bare
    `sliding_window` (see the module docstring)."""
    if not cfg.get("sliding_window"):
        return n
    if "use_sliding_window" in cfg or str(family).startswith("qwen"):
        if not cfg.get("use_sliding_window"):
            return n
        first = cfg.get("max_window_layers", n)
        if not isinstance(first, int) or isinstance(first, bool) or first < 0:
            raise LayoutError(f"field 'max_window_layers' is {first!r}, not a layer count")
        return min(first, n)
    return 0 if family in _EVERY_LAYER_SLIDES else n


def model_layout(hf: dict[str, Any], tp_size: int = 1) -> ModelLayout:
    """The layer layout of a Hugging Face config.json (multimodal configs: their text_config)."""
    cfg = hf.get("text_config") or hf
    family = cfg.get("model_type") or hf.get("model_type")
    mamba2_family = family in _MAMBA2_TYPES
    full: list[int] = []
    swa: list[int] = []
    state: list[int] = []
    spec: Optional[StateSpec] = None
    window = None
    if cfg.get("layer_types") is not None:
        types = cfg["layer_types"]
        if not isinstance(types, list):
            raise LayoutError(f"field 'layer_types' is {type(types).__name__}, not a list")
        for i, t in enumerate(types):
            if t in ("full_attention", "attention"):
                full.append(i)
            elif t in ("sliding_attention", "sliding_window"):
                swa.append(i)
            elif t in ("mamba", "linear_attention", "hybrid"):
                if t == "hybrid":
                    full.append(i)
                state.append(i)
                spec = spec or (_mamba1(cfg, tp_size) if family == "jamba" else
                                _gated_delta(cfg, tp_size) if t == "linear_attention" and not mamba2_family else
                                _mamba2(cfg, tp_size))
            elif t not in ("mlp", "moe"):
                raise LayoutError(f"field 'layer_types'[{i}] is {t!r}: radixd knows full_attention, "
                                  "sliding_attention, linear_attention, mamba, hybrid, mlp and moe")
    elif cfg.get("hybrid_override_pattern") is not None:
        pattern = cfg["hybrid_override_pattern"]
        for i, ch in enumerate(str(pattern)):
            if ch == "*":
                full.append(i)
            elif ch == "M":
                state.append(i)
            elif ch not in "-E":
                raise LayoutError(f"field 'hybrid_override_pattern'[{i}] is {ch!r}: radixd knows M (Mamba2), "
                                  "* (attention), - (MLP) and E (MoE)")
        spec = _mamba2(cfg, tp_size) if state else None
    elif isinstance(cfg.get("layers_block_type"), list):
        for i, t in enumerate(cfg["layers_block_type"]):
            if t in ("attention", "full_attention"):
                full.append(i)
            elif t in ("mamba", "linear_attention"):
                state.append(i)
            elif t not in ("mlp", "moe"):
                raise LayoutError(f"field 'layers_block_type'[{i}] is {t!r}: radixd knows mamba, attention, "
                                  "mlp and moe")
        spec = _mamba2(cfg, tp_size) if state else None
    elif cfg.get("attn_layer_period") is not None:
        period, offset, n = _int(cfg, "attn_layer_period"), cfg.get("attn_layer_offset", 0), \
            _int(cfg, "num_hidden_layers")
        for i in range(n):
            (full if i % period == offset else state).append(i)
        spec = _mamba1(cfg, tp_size) if state else None
    elif cfg.get("sliding_window_pattern") is not None and cfg.get("sliding_window"):
        pattern, n = _int(cfg, "sliding_window_pattern"), _int(cfg, "num_hidden_layers")
        for i in range(n):
            (full if (i + 1) % pattern == 0 else swa).append(i)
    elif family == "falcon_h1":
        full = list(range(_int(cfg, "num_hidden_layers")))
        state = list(full)
        spec = _mamba2(cfg, tp_size)
    elif family == "mamba2":
        state = list(range(_int(cfg, "num_hidden_layers")))
        spec = _mamba2(cfg, tp_size)
    else:
        n = _int(cfg, "num_hidden_layers")
        first = _first_sliding(cfg, family, n)
        full, swa = list(range(first)), list(range(first, n))
    if swa:
        window = _int(cfg, "sliding_window")
    if not (full or swa or state):
        raise LayoutError("no layer keeps a cache (every layer is an MLP or MoE block)")
    return ModelLayout(tuple(full), tuple(swa), window, tuple(state), spec)


def config_dict(config: Any) -> dict[str, Any]:
    """A transformers config object (its language model's part) as `model_layout` reads it: its fields, and the
    layer list its class computes (`layer_types`, a property in some classes) where it has one."""
    text = config.get_text_config() if callable(getattr(config, "get_text_config", None)) else config
    d = text.to_dict()
    types = getattr(text, "layer_types", None)
    if types is not None:
        d["layer_types"] = list(types)
    d["model_type"] = getattr(text, "model_type", None) or d.get("model_type")
    return d


def read_model_config(path: str, use_transformers: bool = True) -> tuple[dict[str, Any], str]:
    """A config.json, or a model directory holding one, read through the model's own config class (transformers'
    AutoConfig, offline) where transformers is importable, else by hand: (the config, how it was read)."""
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    why = "by hand"
    try:
        import transformers
    except ImportError:
        if use_transformers:
            why = "by hand (transformers is not installed)"
    else:
        if use_transformers:
            try:
                config = transformers.AutoConfig.from_pretrained(file, local_files_only=True)
            except (ValueError, KeyError) as e:  # (a model type this transformers has no class for)
                why = f"by hand (transformers {transformers.__version__}: {str(e).splitlines()[0][:120]})"
            else:
                return config_dict(config), f"transformers {transformers.__version__} {type(config).__name__}"
    with open(file) as fh:
        hf = json.load(fh)
    if not isinstance(hf, dict):
        raise LayoutError(f"the file holds a JSON {type(hf).__name__}, not a config object")
    return hf, why
