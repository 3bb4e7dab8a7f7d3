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
    prefault: bool = False  # touch every pool page and the kept heap at start: a shortage shows there, no fault later
    heap_retain_mb: int = 256  # freed heap the server keeps for reuse (0: the C library's default)
    model_config: Optional[str] = None  # a Hugging Face config.json: layers, KV heads, head dim, dtype, MLA
    model: Optional[str] = None  # a bundled preset (server/models.py) instead of --model-config
    device_mem: Optional[str] = None  # device pool size in bytes ("40GiB"); the slot count is derived
    tp_size: int = 1  # tensor-parallel size of the engine: divides the model's KV heads
    hybrid_cache: bool = False  # a hybrid model's SWA KV and recurrent states in their own pools (hybrid tree)
    swa_ratio: float = 0.8  # SWA pool slots = R x FULL slots (SGLang's swa_full_tokens_ratio)
    mamba_states: int = 256  # state slots in the state pool (SGLang's max_mamba_cache_size)
    mamba_chunk: int = 0  # where a state checkpoint may sit (0: the config's chunk_size, else 64)
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


@dataclass(frozen=True)
class Setting:
    """How one setting is read, whatever its source: its kind, its range or choices, what it means."""

    kind: str  # int | float | bool | str | choice | size | listen | gpus
    help: str
    minimum: Optional[float] = None
    choices: tuple[str, ...] = ()
    optional: bool = False  # None (unset) is a value; an empty string from a variable means unset


_POLICIES = ("lru", "lfu", "fifo", "mru", "filo", "priority", "slru")
DTYPE_NAMES = ("float16", "bfloat16", "float32", "fp8_e4m3")

SCHEMA: dict[str, Setting] = {
    "listen": Setting("listen", "unix:PATH or HOST:PORT to serve on (repeatable; a comma list in a variable)"),
    "device": Setting("choice", "where the pools live: cuda (GPU), cpu (shared memory), auto",
                      choices=("auto", "cpu", "cuda")),
    "gpus": Setting("gpus", "GPU ordinals for device pools (comma list)"),
    "num_slots": Setting("int", "device pool size in tokens", minimum=1),
    "page_size": Setting("int", "tokens per page (the engine's page / block size)", minimum=1),
    "eviction_policy": Setting("choice", "which unlocked leaf is evicted first", choices=_POLICIES),
    "layers": Setting("int", "model layers", minimum=1),
    "kv_heads": Setting("int", "KV heads per layer on this engine rank", minimum=1),
    "head_dim": Setting("int", "dimension of one K (or V) head", minimum=1),
    "dtype": Setting("choice", "KV element type", choices=DTYPE_NAMES),
    "mla": Setting("bool", "one latent buffer per layer (DeepSeek MLA)"),
    "host_slots": Setting("int", "host pool size in tokens (0: no host tier)", minimum=0),
    "host_mem": Setting("size", "host pool size in bytes, e.g. 200GiB", optional=True),
    "host_ratio": Setting("float", "host tokens = R x device tokens", minimum=0.0),
    "host_layout": Setting("choice", "host pool layout", choices=("layer_first", "page_first")),
    "write_policy": Setting("choice", "when device KV is copied to the host tier",
                            choices=("write_through", "write_through_selective", "write_back")),
    "write_through_threshold": Setting("int", "inserts before write_through_selective backs a node up",
                                       minimum=1, optional=True),
    "load_back_threshold": Setting("int", "smallest host segment (tokens) worth loading back", minimum=0),
    "storage": Setting("str", "L3 store URL (file://, valkey://, redis+cluster://, mooncake://)"),
    "storage_write_policy": Setting("choice", "copy host pages to L3 on backup or on host eviction",
                                    choices=("write_through", "write_back")),
    "prefetch_threshold": Setting("int", "tokens beyond the host prefix that make a match fetch from L3",
                                  minimum=1),
    "prefetch_policy": Setting("choice", "whether a match waits for its L3 prefetch",
                               choices=("best_effort", "wait_complete", "timeout")),
    "prefetch_timeout_ms": Setting("int", "how long a match waits under prefetch_policy timeout", minimum=0),
    "model_id": Setting("str", "model name in storage keys"),
    "kv_events": Setting("bool", "record KV events (gRPC WatchEvents)"),
    "kv_events_endpoint": Setting("str", "ZMQ PUB endpoint for KV events (tcp://, ipc://)"),
    "kv_events_replay_endpoint": Setting("str", "ZMQ ROUTER endpoint replaying KV event batches"),
    "kv_events_topic": Setting("str", "ZMQ topic of the KV event messages"),
    "kv_events_buffer": Setting("int", "KV event batches kept for replay", minimum=1),
    "kv_events_watcher_queue": Setting("int", "batches a gRPC watcher may fall behind", minimum=1),
    "bigram": Setting("bool", "EAGLE bigram keys (token pairs)"),
    "metrics_addr": Setting("str", "HOST:PORT of the Prometheus endpoint (port 0 picks one; empty: off)"),
    "token": Setting("str", "bearer token every call must carry", optional=True),
    "tls_cert": Setting("str", "PEM certificate for TCP listeners (with tls_key)", optional=True),
    "tls_key": Setting("str", "PEM private key for tls_cert", optional=True),
    "allow_remote": Setting("bool", "listen beyond loopback without a token"),
    "grace_seconds": Setting("float", "how long a shutdown waits for calls in progress", minimum=0.0),
    "lock_lease_seconds": Setting("float", "release a lock receipt held longer (0: off)", minimum=0.0),
    "prefault": Setting("bool", "touch every pool page and the retained heap (--heap-retain-mb) at start"),
    "heap_retain_mb": Setting("int", "MiB of freed heap kept for the next request's buffers instead of returned to the kernel (0: the C library's default)", minimum=0),
    "model_config": Setting("str", "a Hugging Face config.json (or a model directory) for the KV geometry, "
                            "read through the model's config class where transformers is installed", optional=True),
    "model": Setting("str", "a bundled model preset for the KV geometry", optional=True),
    "device_mem": Setting("size", "device pool size in bytes, e.g. 40GiB (instead of num_slots)", optional=True),
    "tp_size": Setting("int", "the engine's tensor-parallel size (divides the model's KV heads)", minimum=1),
    "hybrid_cache": Setting("bool", "hold a hybrid model's sliding-window KV and recurrent states in their own "
                            "pools (needs --model-config; without it, SWA layers are cached as full attention)"),
    "swa_ratio": Setting("float", "SWA pool slots = R x device slots (with --hybrid-cache)", minimum=0.0),
    "mamba_states": Setting("int", "state slots for Mamba / linear-attention layers (with --hybrid-cache)",
                            minimum=1),
    "mamba_chunk": Setting("int", "tokens between state checkpoints (0: the config's chunk_size, else 64)",
                           minimum=0),
    "config": Setting("str", "TOML file of settings", optional=True),
}

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _parse(name: str, value: Any, source: str) -> Any:
    """One value of one setting, from a flag or variable (a string) or a TOML file (typed), strictly."""
    st = SCHEMA[name]
    text = isinstance(value, str)
    if text and st.optional and value == "":
        return None

    def bad(what: str) -> ConfigError:
        return ConfigError(f"{source}: {value!r} is not {what}")
    if st.kind == "bool":
        if isinstance(value, bool):
            return value
        if text and value.strip().lower() in _TRUE + _FALSE:
            return value.strip().lower() in _TRUE
        raise bad("a boolean (true/false, 1/0, yes/no, on/off)")
    if st.kind == "int":
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if text and value.strip().lstrip("+-").isdigit():
            return int(value)
        raise bad("a whole number")
    if st.kind == "float":
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            v = float(value)
        elif text:
            try:
                v = float(value)
            except ValueError:
                raise bad("a number") from None
        else:
            raise bad("a number")
        if v != v or v in (float("inf"), float("-inf")):
            raise bad("a finite number")
        return v
    if st.kind == "choice":
        if text and value in st.choices:
            return value
        raise ConfigError(f"{source}: {value!r} is not one of {', '.join(st.choices)}")
    if st.kind == "size":
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return str(value)
        if text:
            try:
                parse_bytes(value)
            except ValueError as e:
                raise ConfigError(f"{source}: {e}") from None
            return value
        raise bad("a size in bytes (e.g. 512MiB, 200GiB)")
    if st.kind == "listen":
        items = value if isinstance(value, list) else [x for x in value.split(",") if x] if text else None
        if not items or not all(isinstance(x, str) and x for x in items):
            raise bad("a list of addresses (unix:PATH or HOST:PORT)")
        return list(items)
    if st.kind == "gpus":
        items = value if isinstance(value, list) else [x.strip() for x in value.split(",") if x.strip()] \
            if text else None
        try:
            gpus = [int(x) for x in items if not isinstance(x, bool)] if items else []
        except (TypeError, ValueError):
            gpus = []
        if not gpus or len(gpus) != len(items) or min(gpus) < 0:
            raise bad("a list of GPU ordinals (e.g. 0,1)")
        return gpus
    if text:  # str
        return value
    raise bad("a string")


_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": 1 << 20, "mb": 1000**2, "mib": 1 << 20,
          "g": 1 << 30, "gb": 1000**3, "gib": 1 << 30, "t": 1 << 40, "tb": 1000**4, "tib": 1 << 40}


def parse_bytes(text: str) -> int:
    """'200GiB', '1.5g', '4096' -> bytes."""
    t = text.strip().lower().replace(" ", "")
    num = t.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = t[len(num):]
    try:
        value = float(num) if num and unit in _UNITS else -1.0
    except ValueError:
        value = -1.0
    if not value > 0 or value == float("inf"):
        raise ValueError(f"cannot read {text!r} as a size (e.g. 512MiB, 200GiB)")
    return int(value * _UNITS[unit])


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


def _set(cfg: Config, name: str, value: Any, source: str, origin: dict[str, str]) -> None:
    setattr(cfg, name, _parse(name, value, source))
    origin[name] = source


def _check(cfg: Config, origin: dict[str, str]) -> None:
    def src(name: str) -> str:
        return origin.get(name, f"default {name}")
    if cfg.num_slots % cfg.page_size:
        raise ConfigError(f"{src('num_slots')}: {cfg.num_slots} slots is not a multiple of the page size "
                          f"{cfg.page_size} ({src('page_size')})")
    given = [n for n in ("host_slots", "host_mem", "host_ratio") if getattr(cfg, n)]
    if len(given) > 1:
        raise ConfigError(f"{' and '.join(src(n) for n in given)}: give one of host_slots, host_mem, host_ratio")
    if bool(cfg.tls_cert) != bool(cfg.tls_key):
        given1 = "tls_cert" if cfg.tls_cert else "tls_key"
        raise ConfigError(f"{src(given1)}: TLS needs both --tls-cert and --tls-key")
    if cfg.tls_cert and cfg.tls_key:
        import ssl
        try:
            ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cfg.tls_cert, cfg.tls_key)
        except OSError as e:  # ssl.SSLError is one
            why = e.strerror or getattr(e, "reason", None) or str(e)
            raise ConfigError(f"{src('tls_cert')} / {src('tls_key')}: not a usable PEM certificate and key "
                              f"({why})") from None
    for name in ("kv_events_endpoint", "kv_events_replay_endpoint"):
        if getattr(cfg, name):
            _needs(src(name), ("zmq", "pyzmq"), ("msgspec", "msgspec"), extra="events")
    scheme = cfg.storage.split(":", 1)[0].lower()
    if scheme.split("+")[0] in ("redis", "rediss", "valkey", "valkeys"):
        _needs(src("storage"), ("redis", "redis"), extra="storage")
    elif scheme == "mooncake":
        _needs(src("storage"), ("mooncake.store", "mooncake-transfer-engine-non-cuda"), extra="mooncake")
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


NO_FULL_SWA_RATIO = 0.125  # every layer sliding: the tree's keys (no KV) may reach 8x the SWA pool's tokens


def _check_hybrid(cfg: Config, origin: dict[str, str]) -> None:
    """What the hybrid cache does not have yet is refused at start, in one line."""
    src = origin["hybrid_cache"]
    if cfg.bigram:
        raise ConfigError(f"{src} and {origin['bigram']}: a hybrid model has no bigram keys yet")
    lay = cfg._layout
    if not lay.full_layers and lay.swa_layers and "swa_ratio" not in origin:
        cfg.swa_ratio = NO_FULL_SWA_RATIO
        origin["swa_ratio"] = "no full-attention layer (keys cost no KV)"
    if lay.swa_layers and not cfg.swa_ratio:
        raise ConfigError(f"{origin.get('swa_ratio', 'swa_ratio')}: 0 leaves the sliding-window layers no pool")


def _needs(source: str, *modules: tuple[str, str], extra: str) -> None:
    """A setting that needs an optional package: one line naming it and the extra that installs it."""
    import importlib
    for module, package in modules:
        try:
            importlib.import_module(module)
        except ImportError:
            raise ConfigError(f"{source}: needs {package}, which is not installed: pip install 'radixd[{extra}]'") \
                from None


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
    _ranges(cfg, origin)  # first: what follows divides by, or sizes with, these
    if cfg.model_config and cfg.model:
        raise ConfigError(f"{origin['model']} and {origin['model_config']}: give one of --model, --model-config")
    if cfg.hybrid_cache and not cfg.model_config:
        raise ConfigError(f"{origin['hybrid_cache']}: needs --model-config (the hybrid layout comes from the "
                          "model's config.json)")
    if cfg.model_config or cfg.model:
        _apply_model(cfg, origin)
        _ranges(cfg, origin)
    if cfg.hybrid_cache:
        _check_hybrid(cfg, origin)
    if cfg.device_mem:
        _size_device(cfg, origin)
    _check(cfg, origin)
    cfg._origin = origin
    return cfg


def settings_table() -> str:
    """The README's table of every setting: flag, variable, TOML key, default, range (kept equal by a test)."""
    defaults = Config()
    rows = ["| flag | variable | TOML key | default | range | what |", "| --- | --- | --- | --- | --- | --- |"]
    for name, st in SCHEMA.items():
        d = getattr(defaults, name)
        default = "unset" if d is None or d == "" else ",".join(map(str, d)) if isinstance(d, list) else str(d)
        if name == "listen":
            default = "unix:/tmp/radixd-UID.sock"
        kind = {"int": "whole number", "float": "number", "bool": "true/false", "str": "text",
                "size": "bytes (512MiB, 40GiB)", "listen": "unix:PATH or HOST:PORT, repeatable",
                "gpus": "GPU ordinals"}.get(st.kind, "")
        rng = " \\| ".join(st.choices) if st.choices else kind
        if st.minimum is not None:
            rng += f" >= {st.minimum:g}"
        rows.append(f"| `--{name.replace('_', '-')}` | `RADIXD_{name.upper()}` | `{name}` | `{default}` | {rng} | "
                    f"{st.help} |")
    return "\n".join(rows)


def source_of(cfg: Config, name: str) -> str:
    """Where a setting's value came from (the flag, RADIXD_* variable or file and key), for error lines."""
    origin = getattr(cfg, "_origin", {})
    return origin.get(name) or f"--{name.replace('_', '-')}"


def _ranges(cfg: Config, origin: dict[str, str]) -> None:
    lay = getattr(cfg, "_layout", None)
    for name, st in SCHEMA.items():
        v = getattr(cfg, name)
        if name == "layers" and v == 0 and lay is not None and not lay.full_layers:
            continue  # (a hybrid model without full-attention layers: no FULL KV pool)
        if st.minimum is not None and v is not None and v < st.minimum:
            where = origin.get(name, f"default {name}")
            raise ConfigError(f"{where}: {v!r} is below the minimum {st.minimum:g}")


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
    per_token = slot_bytes_of(cfg)
    lay = getattr(cfg, "_layout", None)
    if cfg.hybrid_cache and lay is not None:  # the states first, then FULL tokens with their SWA share
        from .pools.spec import DTYPES
        if not (lay.full_layers or lay.swa_layers):  # pure state: the budget is the state pool's (keys cost none)
            if "mamba_states" not in origin:
                cfg.mamba_states = max(budget // lay.state_bytes(), 0)
                origin["mamba_states"] = f"{src} ({cfg.device_mem})"
            if cfg.mamba_states < 1:
                raise ConfigError(f"{src}: {cfg.device_mem} holds less than one state ({lay.state_bytes()} bytes)")
            return
        budget -= cfg.mamba_states * lay.state_bytes() if lay.state_layers else 0
        per_token += int(cfg.swa_ratio * len(lay.swa_layers) * (1 if cfg.mla else 2) * cfg.kv_heads *
                         cfg.head_dim * DTYPES[cfg.dtype][0])
    slots = max(budget, 0) // per_token
    slots -= slots % cfg.page_size
    if slots < cfg.page_size:
        raise ConfigError(f"{src}: {cfg.device_mem} holds less than one page ({slot_bytes_of(cfg) * cfg.page_size} "
                          "bytes) of this model's KV")
    cfg.num_slots = slots
    origin["num_slots"] = f"{src} ({cfg.device_mem})"


_DTYPE_NAMES = DTYPE_NAMES


_HF_DTYPES = {"float16": "float16", "half": "float16", "bfloat16": "bfloat16", "float32": "float32",
              "float": "float32"}


def model_geometry(hf: dict[str, Any], tp_size: int = 1, hybrid: bool = False) -> dict[str, Any]:
    """KV geometry of a Hugging Face model config: layers, KV heads per TP rank, head dim, dtype, MLA. With
    `hybrid`, `layers` counts the full-attention layers only (the others get pools of their own)."""
    text = hf.get("text_config") or hf  # multimodal configs nest the language model's
    layers = text.get("num_hidden_layers")  # newer Nemotron-H configs list their layers instead
    if layers is None:
        listed = text.get("layers_block_type") or text.get("layer_types") or text.get("hybrid_override_pattern")
        if not listed:
            from .layouts import LayoutError
            raise LayoutError("field 'num_hidden_layers' is missing, and no layer list (layers_block_type, "
                              "layer_types, hybrid_override_pattern) gives the layer count")
        layers = len(listed)
    dtype = _HF_DTYPES.get(str(text.get("torch_dtype") or text.get("dtype") or hf.get("torch_dtype") or "bfloat16")
                           .replace("torch.", ""), "bfloat16")
    if text.get("kv_lora_rank"):  # MLA (DeepSeek V2/V3): one latent "head" of rank + rope dims per token
        return dict(layers=layers, kv_heads=1, head_dim=text["kv_lora_rank"] + text.get("qk_rope_head_dim", 0),
                    dtype=dtype, mla=True)
    from .layouts import LayoutError, model_layout
    layout = model_layout(hf, tp_size)
    if hybrid:
        if not layout.hybrid:
            raise LayoutError(f"--hybrid-cache, but the model has no sliding-window or state layers "
                              f"({layout.describe()})")
        layers = len(layout.full_layers)
        if not (layout.full_layers or layout.swa_layers):  # pure state (Mamba2): no KV pool at all
            return dict(layers=0, kv_heads=1, head_dim=1, dtype=dtype, mla=False)
    elif layout.state_layers:
        raise LayoutError(f"a hybrid model ({layout.describe()}): its Mamba / linear-attention states need "
                          "--hybrid-cache")
    elif layout.swa_layers:  # cached as full attention, as vLLM does with a connector without hybrid support
        layers = len(layout.full_layers) + len(layout.swa_layers)
    heads = text["num_attention_heads"]
    kv = text.get("num_key_value_heads") or heads
    head_dim = text.get("head_dim") or text["hidden_size"] // heads
    if kv % tp_size and tp_size % kv:
        raise ValueError(f"{kv} KV heads do not split over tp_size {tp_size}")
    return dict(layers=layers, kv_heads=max(kv // tp_size, 1), head_dim=head_dim, dtype=dtype, mla=False)


def _apply_model(cfg: Config, origin: dict[str, str]) -> None:
    """Fill the KV geometry from --model-config or a --model preset; settings given explicitly win."""
    from .layouts import LayoutError, read_model_config
    if cfg.model:
        from .models import PRESETS
        if cfg.model not in PRESETS:
            raise ConfigError(f"{origin['model']}: unknown model {cfg.model!r}; presets: {', '.join(sorted(PRESETS))} "
                              "(or give --model-config PATH/config.json)")
        try:
            geo = model_geometry(PRESETS[cfg.model], cfg.tp_size)
        except ValueError as e:
            raise ConfigError(f"{origin['model']} with {origin.get('tp_size', 'tp_size 1')}: {e}") from None
        for name, value in geo.items():
            if name not in origin:
                setattr(cfg, name, value)
                origin[name] = f"{origin['model']} ({cfg.model})"
        return
    src = origin.get("model_config", "--model-config")
    try:
        hf, cfg._config_source = read_model_config(cfg.model_config)
        geo = model_geometry(hf, cfg.tp_size, cfg.hybrid_cache)
        if cfg.hybrid_cache:
            from .layouts import model_layout
            cfg._layout = model_layout(hf, cfg.tp_size)
            text = hf.get("text_config") or hf
            if not cfg.mamba_chunk and cfg._layout.state_layers:
                chunk = text.get("chunk_size") or 64
                cfg.mamba_chunk = chunk if isinstance(chunk, int) and chunk > 0 else 64
    except OSError as e:
        raise ConfigError(f"{src}: {cfg.model_config}: {e.strerror or e}") from None
    except LayoutError as e:
        raise ConfigError(f"{src}: {cfg.model_config}: {e}") from None
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"{src}: {cfg.model_config} is not a usable model config ({type(e).__name__}: {e})") \
            from None
    for name, value in geo.items():
        if name not in origin:
            setattr(cfg, name, value)
            origin[name] = f"{src} ({cfg.model_config})"
