"""What a client needs to map a pool: backend handle, geometry, buffer offsets, owning instance."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class BufferDesc:
    """One buffer inside the pool's single allocation (contiguous, row-major)."""

    name: str
    offset: int
    shape: tuple[int, ...]
    dtype: str = ""  # "" : the pool's dtype (a state pool's conv and temporal buffers differ)


@dataclass(frozen=True)
class PoolDescriptor:
    """Serializable description of one pool; `handle` is a shm path (cpu) or a CUDA IPC handle (cuda)."""

    instance_id: str
    tier: str  # "device" | "host"
    backend: str  # "shm" | "cuda"
    handle: bytes
    size_bytes: int
    dtype: str
    num_layers: int
    kv_heads: int
    head_dim: int
    page_size: int
    num_slots: int
    mla: bool
    layout: str
    buffers: tuple[BufferDesc, ...] = field(default_factory=tuple)
    gpu_uuid: str = ""
    device_index: int = -1
    pinned: bool = False

    def to_dict(self) -> dict:
        d = asdict(self)
        d["handle"] = self.handle.hex()
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "PoolDescriptor":
        d = dict(d)
        d["handle"] = bytes.fromhex(d["handle"]) if isinstance(d["handle"], str) else d["handle"]
        d["buffers"] = tuple(BufferDesc(b["name"], b["offset"], tuple(b["shape"]), b.get("dtype", ""))
                             for b in d["buffers"])
        return cls(**d)
