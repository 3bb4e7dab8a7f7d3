"""Configuration: defaults < TOML file < RADIXD_* environment < command-line flags."""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field, fields
from typing import Any, Optional

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

DEFAULT_SOCKET = f"unix:/tmp/radixd-{os.getuid()}.sock"


@dataclass
class Config:
    """Everything `radixd serve` can be told."""

    listen: list[str] = field(default_factory=lambda: [DEFAULT_SOCKET])
    device: str = "auto"  # auto | cpu | cuda
    gpus: list[int] = field(default_factory=lambda: [0])
    num_slots: int = 65536
    page_size: int = 1
    eviction_policy: str = "lru"
    layers: int = 4
    kv_heads: int = 4
    head_dim: int = 64
    dtype: str = "float16"
    mla: bool = False
    host_slots: int = 0
    host_mem: Optional[str] = None  # host pool size in bytes ("200GiB"); alternative to host_slots
    host_ratio: float = 0.0  # host tokens = ratio x device tokens (SGLang's --hicache-ratio)
    host_layout: str = "page_first"
    write_policy: str = "write_through"  # with a host pool: write_through | write_through_selective | write_back
    write_through_threshold: Optional[int] = None  # default 1 (write_through) or 2 (selective)
    load_back_threshold: int = 10
    storage: str = ""  # L3: file:///DIR | valkey://HOST:PORT | redis://... | valkey+cluster://... | mooncake://MASTER
    storage_write_policy: str = "write_through"  # to L3 on host backup (write_through) or on host eviction
    prefetch_threshold: int = 256  # tokens beyond the host prefix that make a match fetch from L3
    prefetch_policy: str = "best_effort"  # best_effort | wait_complete | timeout (how long a match waits)
    prefetch_timeout_ms: int = 1000
    model_id: str = ""  # names the model in storage keys (servers of different models never share pages)
    kv_events: bool = False  # record KV events (on by itself when a ZMQ endpoint is given)
    kv_events_endpoint: str = ""  # ZMQ PUB, e.g. tcp://127.0.0.1:5557 (vLLM / SGLang wire format)
    kv_events_replay_endpoint: str = ""  # ZMQ ROUTER answering replay requests
    kv_events_topic: str = ""
    kv_events_buffer: int = 10000  # batches kept for replay (ZMQ and gRPC WatchEvents)
    kv_events_watcher_queue: int = 4096  # batches a gRPC watcher may fall behind before it is cut off
    bigram: bool = False
    metrics_addr: str = "127.0.0.1:0"
    token: Optional[str] = None
    tls_cert: Optional[str] = None
    tls_key: Optional[str] = None
    allow_remote: bool = False  # bind TCP beyond loopback without a token
    grace_seconds: float = 5.0
    lock_lease_seconds: float = 0.0  # > 0: a receipt held longer is released (hung clients); off by default
    prefault: bool = False  # touch every pool page at start, so a memory shortage shows there
    model_config: Optional[str] = None  # a Hugging Face config.json: layers, KV heads, head dim, dtype, MLA
    model: Optional[str] = None  # a bundled preset (server/models.py) instead of --model-config
    device_mem: Optional[str] = None  # device pool size in bytes ("40GiB"); the slot count is derived
    tp_size: int = 1  # tensor-parallel size of the engine: divides the model's KV heads
    config: Optional[str] = None

    def summary(self) -> str:
        """One line of the effective config, secrets hidden."""
        parts = []
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name == "token":
                v = "***" if v else None
            parts.append(f"{f.name}={v}")
        return " ".join(parts)


_LISTS = {"listen", "gpus"}


def _coerce(name: str, value: Any) -> Any:
    typ = {f.name: f.type for f in fields(Config)}[name]
    if name in _LISTS:
        items = value if isinstance(value, list) else [x for x in str(value).split(",") if x]
        return [int(x) for x in items] if name == "gpus" else [str(x) for x in items]
    if isinstance(value, str) and "bool" in str(typ):
        return value.lower() in ("1", "true", "yes", "on")
    if "int" in str(typ) and "Optional" not in str(typ):
        return int(value)
    if name == "write_through_threshold":
        return int(value)
    if "float" in str(typ):
        return float(value)
    return value


_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": 1 << 20, "mb": 1000**2, "mib": 1 << 20,
          "g": 1 << 30, "gb": 1000**3, "gib": 1 << 30, "t": 1 << 40, "tb": 1000**4, "tib": 1 << 40}


def parse_bytes(text: str) -> int:
    """'200GiB', '1.5g', '4096' -> bytes."""
    t = text.strip().lower().replace(" ", "")
    num = t.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = t[len(num):]
    if not num or unit not in _UNITS:
        raise ValueError(f"cannot read {text!r} as a size (e.g. 512MiB, 200GiB)")
    return int(float(num) * _UNITS[unit])


def host_slots_for(cfg: Config, slot_bytes: int) -> int:
    """Host pool slots from --host-slots, --host-mem or --host-ratio (whole pages; 0 = no host tier)."""
    given = [n for n, v in (("host_slots", cfg.host_slots), ("host_mem", cfg.host_mem), ("host_ratio", cfg.host_ratio))
             if v]
    if len(given) > 1:
        raise ValueError(f"give one of --host-slots, --host-mem, --host-ratio (got {', '.join(given)})")
    if cfg.host_mem:
        slots = parse_bytes(cfg.host_mem) // slot_bytes
    elif cfg.host_ratio:
        slots = int(cfg.num_slots * cfg.host_ratio)
    else:
        slots = cfg.host_slots
    return slots - slots % cfg.page_size


class ConfigError(ValueError):
    """A bad setting; the message names where it came from (flag, environment variable or file)."""


# Lower bounds of numeric settings (what a pool, a tree or a buffer can be built with).
_MIN = {"num_slots": 1, "page_size": 1, "layers": 1, "kv_heads": 1, "head_dim": 1, "host_slots": 0,
        "host_ratio": 0.0, "write_through_threshold": 1, "load_back_threshold": 0, "kv_events_buffer": 1,
        "kv_events_watcher_queue": 1, "grace_seconds": 0.0, "prefetch_threshold": 1, "prefetch_timeout_ms": 0,
        "tp_size": 1, "lock_lease_seconds": 0.0}


def _set(cfg: Config, name: str, value: Any, source: str, origin: dict[str, str]) -> None:
    try:
        v = _coerce(name, value)
    except (TypeError, ValueError):
        typ = {f.name: f.type for f in fields(Config)}[name]
        raise ConfigError(f"{source}: {value!r} is not a valid {typ.replace('Optional[', '').rstrip(']')}") from None
    setattr(cfg, name, v)
    origin[name] = source


def _check(cfg: Config, origin: dict[str, str]) -> None:
    def src(name: str) -> str:
        return origin.get(name, f"default {name}")
    for name, lo in _MIN.items():
        v = getattr(cfg, name)
        if v is not None and v < lo:
            raise ConfigError(f"{src(name)}: {v!r} is below the minimum {lo}")
    if cfg.num_slots % cfg.page_size:
        raise ConfigError(f"{src('num_slots')}: {cfg.num_slots} slots is not a multiple of the page size "
                          f"{cfg.page_size} ({src('page_size')})")
    for name, allowed in (("storage_write_policy", ("write_through", "write_back")),
                          ("prefetch_policy", ("best_effort", "wait_complete", "timeout"))):
        if getattr(cfg, name) not in allowed:
            raise ConfigError(f"{src(name)}: {getattr(cfg, name)!r} is not one of {', '.join(allowed)}")
    if bool(cfg.tls_cert) != bool(cfg.tls_key):
        given = "tls_cert" if cfg.tls_cert else "tls_key"
        raise ConfigError(f"{src(given)}: TLS needs both --tls-cert and --tls-key")
    if cfg.metrics_addr and not _host_port(cfg.metrics_addr):
        raise ConfigError(f"{src('metrics_addr')}: {cfg.metrics_addr!r} is not HOST:PORT with a port in 0-65535 "
                          "(or empty to turn metrics off)")
    for addr in cfg.listen:
        if not addr.startswith("unix:") and not _host_port(addr):
            raise ConfigError(f"{src('listen')}: {addr!r} is neither unix:PATH nor HOST:PORT (port 0-65535)")
    for name in ("kv_events_endpoint", "kv_events_replay_endpoint"):
        v = getattr(cfg, name)
        if v and not v.startswith(("tcp://", "ipc://", "inproc://")):
            raise ConfigError(f"{src(name)}: {v!r} is not a ZMQ endpoint (tcp://HOST:PORT, ipc://PATH)")
    if cfg.host_mem:
        try:
            parse_bytes(cfg.host_mem)
        except ValueError as e:
            raise ConfigError(f"{src('host_mem')}: {e}") from None


def _host_port(addr: str) -> bool:
    host, sep, port = addr.rpartition(":")
    return bool(sep) and bool(host) and port.isdigit() and 0 <= int(port) <= 65535


def load(flags: dict[str, Any], flag_names: Optional[dict[str, str]] = None) -> Config:
    """Merge the sources; flags holds only what was given on the command line. Raises ConfigError with
    the source of the first bad value (flag, RADIXD_* variable, or TOML file and key)."""
    cfg = Config()
    origin: dict[str, str] = {}
    names = {f.name for f in fields(Config)}
    path = flags.get("config") or os.environ.get("RADIXD_CONFIG")
    if path:
        try:
            with open(path, "rb") as fh:
                data = tomllib.load(fh)
        except OSError as e:
            raise ConfigError(f"config file {path}: {e.strerror or e}") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {path}: not valid TOML ({e})") from None
        data = data.get("radixd", data)
        for k, v in data.items():
            k = k.replace("-", "_")
            if k not in names:
                raise ConfigError(f"config file {path}: unknown setting {k!r}")
            _set(cfg, k, v, f"{path}: {k}", origin)
    for k in names:
        env = os.environ.get(f"RADIXD_{k.upper()}")
        if env is not None:
            _set(cfg, k, env, f"RADIXD_{k.upper()}", origin)
    for k, v in flags.items():
        if v is not None:
            _set(cfg, k, v, (flag_names or {}).get(k, f"--{k.replace('_', '-')}"), origin)
    if cfg.model_config and cfg.model:
        raise ConfigError(f"{origin['model']} and {origin['model_config']}: give one of --model, --model-config")
    if cfg.model_config or cfg.model:
        _apply_model(cfg, origin)
    if cfg.device_mem:
        _size_device(cfg, origin)
    _check(cfg, origin)
    return cfg


def slot_bytes_of(cfg: Config) -> int:
    """Bytes one token's KV takes across all layers (K and V, or the MLA latent)."""
    from .pools.spec import DTYPES
    return cfg.layers * (1 if cfg.mla else 2) * cfg.kv_heads * cfg.head_dim * DTYPES[cfg.dtype][0]


def _size_device(cfg: Config, origin: dict[str, str]) -> None:
    """--device-mem: as many whole pages as fit."""
    src = origin["device_mem"]
    if "num_slots" in origin:
        raise ConfigError(f"{src} and {origin['num_slots']}: give one of --device-mem, --num-slots")
    try:
        budget = parse_bytes(cfg.device_mem)
    except ValueError as e:
        raise ConfigError(f"{src}: {e}") from None
    if cfg.dtype not in _DTYPE_NAMES or cfg.page_size < 1:
        return  # _check reports those
    slots = budget // slot_bytes_of(cfg)
    slots -= slots % cfg.page_size
    if slots < cfg.page_size:
        raise ConfigError(f"{src}: {cfg.device_mem} holds less than one page ({slot_bytes_of(cfg) * cfg.page_size} "
                          "bytes) of this model's KV")
    cfg.num_slots = slots
    origin["num_slots"] = f"{src} ({cfg.device_mem})"


_DTYPE_NAMES = ("float16", "bfloat16", "float32", "fp8_e4m3")


_HF_DTYPES = {"float16": "float16", "half": "float16", "bfloat16": "bfloat16", "float32": "float32",
              "float": "float32"}


def model_geometry(hf: dict[str, Any], tp_size: int = 1) -> dict[str, Any]:
    """KV geometry of a Hugging Face model config: layers, KV heads per TP rank, head dim, dtype, MLA."""
    text = hf.get("text_config") or hf  # multimodal configs nest the language model's
    layers = text["num_hidden_layers"]
    dtype = _HF_DTYPES.get(str(text.get("torch_dtype") or text.get("dtype") or hf.get("torch_dtype") or "bfloat16")
                           .replace("torch.", ""), "bfloat16")
    if text.get("kv_lora_rank"):  # MLA (DeepSeek V2/V3): one latent "head" of rank + rope dims per token
        return dict(layers=layers, kv_heads=1, head_dim=text["kv_lora_rank"] + text.get("qk_rope_head_dim", 0),
                    dtype=dtype, mla=True)
    heads = text["num_attention_heads"]
    kv = text.get("num_key_value_heads") or heads
    head_dim = text.get("head_dim") or text["hidden_size"] // heads
    if kv % tp_size and tp_size % kv:
        raise ValueError(f"{kv} KV heads do not split over tp_size {tp_size}")
    return dict(layers=layers, kv_heads=max(kv // tp_size, 1), head_dim=head_dim, dtype=dtype, mla=False)


def _apply_model(cfg: Config, origin: dict[str, str]) -> None:
    """Fill the KV geometry from --model-config or a --model preset; settings given explicitly win."""
    import json
    if cfg.model:
        from .models import PRESETS
        if cfg.model not in PRESETS:
            raise ConfigError(f"{origin['model']}: unknown model {cfg.model!r}; presets: {', '.join(sorted(PRESETS))} "
                              "(or give --model-config PATH/config.json)")
        for name, value in model_geometry(PRESETS[cfg.model], cfg.tp_size).items():
            if name not in origin:
                setattr(cfg, name, value)
                origin[name] = f"{origin['model']} ({cfg.model})"
        return
    src = origin.get("model_config", "--model-config")
    try:
        with open(cfg.model_config) as fh:
            hf = json.load(fh)
        geo = model_geometry(hf, cfg.tp_size)
    except OSError as e:
        raise ConfigError(f"{src}: {cfg.model_config}: {e.strerror or e}") from None
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"{src}: {cfg.model_config} is not a usable model config ({type(e).__name__}: {e})") \
            from None
    for name, value in geo.items():
        if name not in origin:
            setattr(cfg, name, value)
            origin[name] = f"{src} ({cfg.model_config})"
