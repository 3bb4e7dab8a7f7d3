"""A KV pool: one allocation (shm or cudaMalloc), per-layer buffer views, and its descriptor."""
from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from .descriptor import BufferDesc, PoolDescriptor
from .shm import ShmRegion, segment_name
from .spec import DTYPES, PoolSpec, buffer_table, total_bytes


class KVPool:
    """Owns the memory of one pool for the server's lifetime; `views` are numpy (cpu) or cupy (cuda)."""

    def __init__(self, spec: PoolSpec, tier: str, instance_id: str, backend: str = "shm", device_index: int = 0,
                 index: int = 0, pin: bool = False):
        self.spec, self.tier, self.backend = spec, tier, backend
        self.instance_id = instance_id
        table = buffer_table(spec)
        size = total_bytes(spec)
        storage = np.dtype(DTYPES[spec.dtype][1])
        self._region: ShmRegion | None = None
        self._device: Any = None
        self._pinned_at = 0
        self._pin_device = device_index
        uuid, handle = "", b""
        if backend == "shm":
            self._region = ShmRegion(segment_name(instance_id, tier, index), size, create=True)
            raw = np.frombuffer(self._region.mm, dtype=np.uint8)
            handle = self._region.name.encode()
            if pin:
                from .cuda import pin_host
                at = ctypes.addressof(ctypes.c_char.from_buffer(self._region.mm))
                try:
                    pin_host(at, self._region.size, device_index)
                except BaseException:  # (a SIGTERM's exception too) the segment is ours alone: leave none behind
                    del raw
                    self._region.close()
                    self._region = None
                    raise
                self._pinned_at = at
        elif backend == "cuda":
            from .cuda import DeviceAllocation
            self._device = DeviceAllocation(size, device_index)
            raw = self._device.as_uint8()
            handle, uuid = self._device.ipc_handle, self._device.uuid
        else:
            raise ValueError(f"unknown pool backend {backend!r}")
        self.views: dict[str, Any] = {}
        for name, off, shape in table:
            n = int(np.prod(shape)) * storage.itemsize
            self.views[name] = raw[off:off + n].view(storage).reshape(shape)
        self.descriptor = PoolDescriptor(
            instance_id=instance_id, tier=tier, backend=backend, handle=handle,
            size_bytes=int(raw.size), dtype=spec.dtype, num_layers=spec.num_layers, kv_heads=spec.kv_heads,
            head_dim=spec.head_dim, page_size=spec.page_size, num_slots=spec.num_slots, mla=spec.mla,
            layout=spec.layout, buffers=tuple(BufferDesc(n, o, s) for n, o, s in table), gpu_uuid=uuid,
            device_index=device_index if backend == "cuda" else -1, pinned=bool(self._pinned_at))

    def prefault(self) -> None:
        """Touch every memory page now, so a shortage shows at start and not in a worker (SIGBUS)."""
        if self._region is not None:
            raw = np.frombuffer(self._region.mm, dtype=np.uint8)
            raw[::4096] = 0

    def layer(self, layer: int, kind: str = "k") -> Any:
        """Buffer of one layer: [slots, heads, dim] (layer_first) or [pages, page, heads, dim] (page_first)."""
        if self.spec.layout == "page_first":
            return self.views["pages"][:, layer, self.spec.kinds.index(kind)]
        return self.views[f"{kind}.{layer}"]

    def close(self) -> None:
        """Release the memory (server shutdown only: importers must be gone)."""
        self.views.clear()
        if self._pinned_at:
            from .cuda import unpin_host
            unpin_host(self._pinned_at, self._pin_device)
            self._pinned_at = 0
        if self._region is not None:
            self._region.close()
            self._region = None
        if self._device is not None:
            self._device.free()
            self._device = None
