"""KV pool geometry: what a slot holds, how buffers are laid out, and model presets."""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace

# name -> (bytes per element, numpy storage dtype of the same width, torch dtype name)
DTYPES: dict[str, tuple[int, str, str]] = {
    "float16": (2, "float16", "float16"),
    "bfloat16": (2, "uint16", "bfloat16"),
    "float32": (4, "float32", "float32"),
    "fp8_e4m3": (1, "uint8", "float8_e4m3fn"),
}
LAYOUTS = ("layer_first", "page_first")
ALIGN = 256  # byte alignment of each buffer inside one allocation


@dataclass(frozen=True)
class PoolSpec:
    """Geometry of one KV pool; slot i holds token i's K and V for every layer."""

    num_layers: int
    kv_heads: int
    head_dim: int
    dtype: str = "float16"
    page_size: int = 1
    num_slots: int = 4096
    mla: bool = False  # one latent buffer per layer (kv_buffer) instead of K and V
    layout: str = "layer_first"

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} not in {sorted(DTYPES)}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout {self.layout!r} not in {LAYOUTS}")
        for name in ("num_layers", "kv_heads", "head_dim", "page_size", "num_slots"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.num_slots % self.page_size:
            raise ValueError(f"num_slots {self.num_slots} is not a multiple of page_size {self.page_size}")

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype][0]

    @property
    def kinds(self) -> tuple[str, ...]:
        """Buffers per layer: ('kv',) for MLA, else ('k', 'v')."""
        return ("kv",) if self.mla else ("k", "v")

    @property
    def slot_bytes(self) -> int:
        """Bytes one slot occupies across all layers and buffers."""
        return self.num_layers * len(self.kinds) * self.kv_heads * self.head_dim * self.itemsize

    @property
    def num_pages(self) -> int:
        return self.num_slots // self.page_size

    def with_slots(self, num_slots: int, layout: str | None = None) -> "PoolSpec":
        """The same geometry with another slot count (e.g. the host pool)."""
        return replace(self, num_slots=num_slots, layout=layout or self.layout)

    @classmethod
    def from_budget(cls, budget_bytes: int, **geometry) -> "PoolSpec":
        """As many whole pages as fit in budget_bytes."""
        probe = cls(num_slots=geometry.get("page_size", 1), **{k: v for k, v in geometry.items() if k != "num_slots"})
        pages = budget_bytes // (probe.slot_bytes * probe.page_size)
        if pages < 1:
            raise ValueError(f"budget {budget_bytes} bytes holds no page")
        return replace(probe, num_slots=pages * probe.page_size)

    def to_dict(self) -> dict:
        return asdict(self)


# Per-rank KV geometry of common models (tensor parallel 1).
PRESETS: dict[str, dict] = {
    "llama-3-8b": dict(num_layers=32, kv_heads=8, head_dim=128, dtype="bfloat16"),
    "llama-3-70b": dict(num_layers=80, kv_heads=8, head_dim=128, dtype="bfloat16"),
    "qwen2.5-7b": dict(num_layers=28, kv_heads=4, head_dim=128, dtype="bfloat16"),
    "mistral-7b": dict(num_layers=32, kv_heads=8, head_dim=128, dtype="bfloat16"),
    "deepseek-v3": dict(num_layers=61, kv_heads=1, head_dim=576, dtype="bfloat16", mla=True),
    "tiny": dict(num_layers=2, kv_heads=2, head_dim=8, dtype="float16"),
}


def buffer_table(spec: PoolSpec) -> list[tuple[str, int, tuple[int, ...]]]:
    """(name, byte offset, shape) of every buffer in one allocation, in layout order."""
    h, d, s, p = spec.kv_heads, spec.head_dim, spec.num_slots, spec.page_size
    out, off = [], 0
    if spec.layout == "page_first":
        # One buffer; each page holds all layers contiguously (good for whole-page copies to storage).
        shape = (spec.num_pages, spec.num_layers, len(spec.kinds), p, h, d)
        return [("pages", 0, shape)]
    for layer in range(spec.num_layers):
        for kind in spec.kinds:
            out.append((f"{kind}.{layer}", off, (s, h, d)))
            off += -(-s * h * d * spec.itemsize // ALIGN) * ALIGN
    return out


def total_bytes(spec: PoolSpec) -> int:
    """Bytes of the single allocation backing a pool (before backend rounding)."""
    name, off, shape = buffer_table(spec)[-1]
    n = 1
    for x in shape:
        n *= x
    return -(-(off + n * spec.itemsize) // ALIGN) * ALIGN
