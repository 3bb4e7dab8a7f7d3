"""Map a radixd pool into this process as torch tensors, without copying (shm or CUDA IPC)."""
from __future__ import annotations

import logging
import threading
import weakref
from typing import Any, Callable, Optional, Sequence

from radixd.server.pools.descriptor import PoolDescriptor
from radixd.server.pools.spec import DTYPES


log = logging.getLogger("radixd.client")
MADV_POPULATE_WRITE = 23  # Linux 5.14+: fault every page in, writable (mmap does not name it before 3.13)


class PoolMappingError(RuntimeError):
    """A pool cannot be mapped (wrong instance, segment gone, GPU not visible)."""


class MappedPool:
    """Torch views of one pool, named as SGLang's KV pools: k_buffer[layer], v_buffer[layer] (or kv_buffer)."""

    def __init__(self, desc: PoolDescriptor, expected_instance: Optional[str] = None, pin: bool = True):
        import torch
        if expected_instance is not None and desc.instance_id != expected_instance:
            raise PoolMappingError(f"pool belongs to server instance {desc.instance_id}, "
                                   f"the server is now {expected_instance}")
        self.descriptor = desc
        self._shm = self._ipc = None
        self._pinned_at = 0
        if desc.backend == "shm":
            from radixd.server.pools.shm import ShmRegion
            try:
                self._shm = ShmRegion(desc.handle.decode())
            except FileNotFoundError as e:
                raise PoolMappingError(str(e)) from None
            raw = torch.frombuffer(self._shm.mm, dtype=torch.uint8)
            if desc.pinned and pin:
                from radixd.server.pools.cuda import pin_host
                try:
                    pin_host(raw.data_ptr(), raw.numel())
                except Exception as e:
                    self._shm.close()
                    raise PoolMappingError(f"cannot pin radixd's host pool here: {e}") from None
                self._pinned_at = raw.data_ptr()
        elif desc.backend == "cuda":
            from radixd.server.pools.cuda import IpcMapping
            try:
                ipc = IpcMapping(desc.handle, desc.gpu_uuid, desc.size_bytes)
            except (RuntimeError, LookupError) as e:
                raise PoolMappingError(str(e)) from None
            # the views own the mapping: it is unmapped when the last tensor made from it is gone, never under one
            raw = torch.from_dlpack(ipc.as_uint8())
        else:
            raise PoolMappingError(f"unknown backend {desc.backend!r}")
        self.device = raw.device
        self.buffers: dict[str, Any] = {}
        for b in desc.buffers:
            name = b.dtype or desc.dtype
            dtype = getattr(torch, DTYPES[name][2])
            n = 1
            for x in b.shape:
                n *= x
            nbytes = n * DTYPES[name][0]
            self.buffers[b.name] = raw[b.offset:b.offset + nbytes].view(dtype).view(b.shape)
        if desc.layout == "state":  # a state pool: conv_buffer[layer], temporal_buffer[layer], [slots, ...]
            self.conv_buffer = [self.buffers[f"conv.{i}"] for i in range(desc.num_layers)]
            self.temporal_buffer = [self.buffers[f"temporal.{i}"] for i in range(desc.num_layers)]
            kinds: tuple[str, ...] = ()
        else:
            kinds = ("kv",) if desc.mla else ("k", "v")
        per = {k: [self._layer(layer, k, kinds) for layer in range(desc.num_layers)] for k in kinds}
        self.k_buffer = per.get("k", [])
        self.v_buffer = per.get("v", [])
        self.kv_buffer = per.get("kv", [])
        self._closed = False
        self._finalizer = weakref.finalize(self, MappedPool._release, self._shm, self._pinned_at)

    def populate(self, chunk: int = 2 << 20) -> bool:
        """Map every page of a shared-memory pool into this process now, a chunk per call: a worker's first
        copy into a slot otherwise takes a page fault per 4 KiB (half of a 1k-token store's copy on CPU).
        False where the kernel cannot (before 5.14) or the pool is not shared memory or was closed."""
        if self._shm is None:
            return False
        mm = self._shm.mm
        try:
            for at in range(0, self._shm.size, chunk):
                mm.madvise(MADV_POPULATE_WRITE, at, min(chunk, self._shm.size - at))
        except (OSError, ValueError) as e:  # an old kernel, or closed meanwhile
            log.debug("radixd pool not populated: %s", e)
            return False
        return True

    def _layer(self, layer: int, kind: str, kinds: tuple[str, ...]) -> Any:
        if "pages" in self.buffers:
            return self.buffers["pages"][:, layer, kinds.index(kind)]
        return self.buffers[f"{kind}.{layer}"]

    @staticmethod
    def _release(shm, pinned_at: int) -> None:
        if pinned_at:
            from radixd.server.pools.cuda import unpin_host
            unpin_host(pinned_at)
        if shm is not None:
            shm.close()

    def close(self) -> None:
        """Drop the views and unmap; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        self.buffers.clear()
        self.k_buffer = self.v_buffer = self.kv_buffer = []
        self._finalizer()


def map_pool(desc: PoolDescriptor, expected_instance: Optional[str] = None, pin: bool = True) -> MappedPool:
    """Map one pool described by the server (pin=False: a host pool this process never DMAs from stays unpinned)."""
    return MappedPool(desc, expected_instance, pin)


def select_device_pools(pools: Sequence[PoolDescriptor], want_uuid: Optional[str],
                        visible: Callable[[], list[str]], elsewhere: bool = False) -> list[PoolDescriptor]:
    """The device pools a process maps: the one on its own GPU (by UUID, never by ordinal), or every pool on a GPU
    it can see; refused in one line when there is none. `elsewhere`: with no pool on its own GPU, the first pool
    on a GPU it sees (an engine rank that copies across GPUs). Shared-memory pools (no GPU) are all taken."""
    if not pools or all(p.backend != "cuda" for p in pools):
        return list(pools)
    on = ", ".join(p.gpu_uuid for p in pools)
    if want_uuid is not None:
        mine = [p for p in pools if p.gpu_uuid == want_uuid]
        if mine or not elsewhere:
            if not mine:
                raise PoolMappingError(f"radixd has no device pool on this process's GPU {want_uuid} (its pools are "
                                       f"on {on}): start radixd with --gpus covering it")
            return mine
    seen = set(visible())
    mine = [p for p in pools if p.gpu_uuid in seen]
    if not mine:
        raise PoolMappingError(f"none of radixd's GPUs ({on}) is visible to this process "
                               f"(check CUDA_VISIBLE_DEVICES or the container's GPUs)")
    return mine[:1] if want_uuid is not None else mine


def populate_in_background(pools: Sequence[MappedPool]) -> threading.Thread:
    """Populate shared-memory pools on a thread of their own (MappedPool.populate), so mapping returns at once."""
    t = threading.Thread(target=lambda: [p.populate() for p in pools], name="radixd-populate", daemon=True)
    t.start()
    return t


def wait_ipc_event(handle: bytes, device: Any, stream: Any = None) -> Any:
    """Make `stream` (default: the current one) wait for a load-back's copy without a CPU round trip.

    `handle` is `Loaded.ipc_event_handle`; work queued on the stream afterwards sees the loaded KV. Returns
    the opened event (keep it until the stream passed it)."""
    import torch
    event = torch.cuda.Event.from_ipc_handle(device, handle)
    (stream or torch.cuda.current_stream(device)).wait_event(event)
    return event
