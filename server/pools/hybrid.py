"""The pools a hybrid model adds beside FULL KV: SWA KV with radixd's FULL->SWA translation, and a state pool.

* SWA KV is a `KVPool` of its own geometry (the sliding-window layers) and slot count (a window per running
  request is enough, so it is far smaller than FULL). radixd owns the translation: a FULL page that has SWA KV
  maps to one SWA page (`SwaTranslation`), so a worker addresses both pools from the FULL slots the scheduler
  got, as SGLang's `translate_loc_from_full_to_swa` does. The hybrid tree's frees name FULL slots; the
  translation turns them into SWA frees.
* The state pool (`StatePool`) holds one recurrent state per slot for every Mamba / linear-attention layer:
  a conv buffer and a temporal buffer per layer, each with its own shape and dtype (per buffer in the
  descriptor), in one shared-memory (or CUDA) allocation like the KV pools.
"""
from __future__ import annotations

import contextlib
from typing import Any, ContextManager, Optional

import numpy as np

from ..layouts import StateSpec
from .allocator import OutOfSlots, SlotError
from .descriptor import BufferDesc, PoolDescriptor
from .shm import ShmRegion, segment_name
from .spec import ALIGN, DTYPES

_NONE = -1


class SwaTranslation:
    """FULL page -> SWA page, and the SWA pool's free pages: every SWA page has at most one FULL page."""

    def __init__(self, full_slots: int, swa_slots: int, page_size: int = 1):
        if page_size < 1 or full_slots % page_size or swa_slots % page_size or swa_slots < page_size:
            raise ValueError("slot counts must be positive multiples of the page size")
        self.page_size = page_size
        self.swa_capacity = swa_slots
        self.map = np.full(full_slots // page_size, _NONE, dtype=np.int64)  # FULL page -> SWA page
        self._free = np.arange(swa_slots // page_size - 1, -1, -1, dtype=np.int64)  # a stack; page 0 first
        self._top = len(self._free)
        self._offsets = np.arange(page_size, dtype=np.int64)

    @property
    def free_slots(self) -> int:
        return self._top * self.page_size

    def _pages(self, full_slots: np.ndarray, what: str) -> np.ndarray:
        """The distinct FULL pages, in the order the slots name them (a request's token order)."""
        full_slots = np.asarray(full_slots, dtype=np.int64)
        if full_slots.size and (int(full_slots.min()) < 0 or int(full_slots.max()) >= len(self.map) * self.page_size):
            raise SlotError(f"{what}: FULL slot outside [0, {len(self.map) * self.page_size})")
        p = self.page_size
        if p > 1 and full_slots.size % p == 0:  # whole pages (the tree's frees, an allocation): one slot each
            heads = full_slots[::p]
            if not (heads % p).any() and (full_slots.reshape(-1, p) - heads[:, None] == self._offsets).all():
                pages = heads // p
                if pages.size < 2 or np.unique(pages).size == pages.size:
                    return pages
        pages = full_slots // p
        _, first = np.unique(pages, return_index=True)
        return pages[np.sort(first)]

    def assign(self, full_slots: np.ndarray) -> np.ndarray:
        """Give these FULL slots' pages SWA pages (all or nothing), consecutive in the order given, so that a
        request's window is one run of the SWA pool while it is not fragmented; returns the SWA slots."""
        pages = self._pages(full_slots, "assign")
        if pages.size and (self.map[pages] != _NONE).any():
            raise SlotError("assign: a FULL page already has an SWA page")
        if pages.size > self._top:
            raise OutOfSlots(f"assign: {pages.size} SWA pages wanted, {self._top} free")
        self._top -= pages.size
        self.map[pages] = self._free[self._top:self._top + pages.size][::-1]  # the stack pops low pages first
        return self.translate(full_slots)

    def translate_pages(self, full_pages: np.ndarray) -> np.ndarray:
        """The SWA pages of these FULL pages (-1 where none): whole-page copies need no per-token index."""
        return self.map[np.asarray(full_pages, dtype=np.int64)]

    def translate(self, full_slots: np.ndarray) -> np.ndarray:
        """The SWA slots of these FULL slots (-1 where the page has none)."""
        full_slots = np.asarray(full_slots, dtype=np.int64)
        swa_page = self.map[full_slots // self.page_size]
        return np.where(swa_page == _NONE, _NONE, swa_page * self.page_size + full_slots % self.page_size)

    def release(self, full_slots: np.ndarray, whole_pages: bool = False) -> int:
        """Free the SWA pages of these FULL slots' pages (pages without one are skipped); returns slots freed.
        whole_pages: the caller knows they are distinct whole pages (the tree's frees), so one slot names each."""
        if whole_pages:
            pages = np.asarray(full_slots, dtype=np.int64)[::self.page_size] // self.page_size
        else:
            pages = self._pages(full_slots, "release")
        swa = self.map[pages]
        swa = swa[swa != _NONE]
        self.map[pages] = _NONE
        self._free[self._top:self._top + swa.size] = swa
        self._top += swa.size
        return int(swa.size) * self.page_size

    def move(self, kept: np.ndarray, incoming: np.ndarray) -> None:
        """kept's pages take incoming's SWA pages (a tombstone recovered under a locked FULL: `swa_moves`)."""
        kp, ip = self._pages(kept, "move"), self._pages(incoming, "move")
        if kp.size != ip.size:
            raise SlotError(f"move: {kp.size} kept pages but {ip.size} incoming")
        if (self.map[kp] != _NONE).any() or (self.map[ip] == _NONE).any():
            raise SlotError("move: a kept page already has SWA KV, or an incoming page has none")
        self.map[kp] = self.map[ip]
        self.map[ip] = _NONE

    def check(self) -> list[str]:
        """Conservation: every SWA page is free or mapped from exactly one FULL page."""
        mapped = self.map[self.map != _NONE]
        free = self._free[:self._top]
        bad = []
        if len(np.unique(mapped)) != mapped.size:
            bad.append("an SWA page is mapped from two FULL pages")
        both = np.intersect1d(mapped, free)
        if both.size:
            bad.append(f"{both.size} SWA pages are both free and mapped")
        if mapped.size + free.size != self.swa_capacity // self.page_size:
            bad.append(f"SWA pages: {mapped.size} mapped + {free.size} free != "
                       f"{self.swa_capacity // self.page_size}")
        return bad


def take_pages(paged: np.ndarray, pages: np.ndarray, out: np.ndarray) -> np.ndarray:
    """Gather whole pages (paged: [pages, page, ...]) into out. The indices are checked here, so numpy's take
    runs in clip mode: in its default mode, with `out`, it stages the result in a temporary (2-3x slower)."""
    pages = np.asarray(pages, dtype=np.int64)
    if pages.size and (int(pages.min()) < 0 or int(pages.max()) >= len(paged)):
        raise SlotError(f"page index outside [0, {len(paged)}) (an SWA page missing?)")
    return np.take(paged, pages, axis=0, out=out, mode="clip")


def state_buffer_table(num_layers: int, state: StateSpec, num_slots: int) -> list[tuple[str, int, tuple, str]]:
    """(name, byte offset, shape, dtype) of every buffer: conv.L and temporal.L per state layer."""
    out, off = [], 0
    for layer in range(num_layers):
        for kind, shape, dtype in (("conv", state.conv_shape, state.conv_dtype),
                                   ("temporal", state.temporal_shape, state.temporal_dtype)):
            full = (num_slots, *shape)
            out.append((f"{kind}.{layer}", off, full, dtype))
            n = DTYPES[dtype][0]
            for d in full:
                n *= d
            off += -(-n // ALIGN) * ALIGN
    return out


def state_pool_bytes(num_layers: int, state: StateSpec, num_slots: int) -> int:
    """Bytes of a state pool's one allocation (every buffer aligned)."""
    name, off, shape, dtype = state_buffer_table(num_layers, state, num_slots)[-1]
    return off + int(np.prod(shape)) * DTYPES[dtype][0]


class StatePool:
    """One recurrent state per slot for every state layer, in one allocation: shared memory (cpu) or cudaMalloc
    exported over CUDA IPC (cuda), like the KV pools; `views` are numpy or cupy arrays."""

    def __init__(self, num_slots: int, num_layers: int, state: StateSpec, instance_id: str, index: int = 0,
                 backend: str = "shm", device_index: int = 0):
        if num_slots < 1 or num_layers < 1:
            raise ValueError("a state pool needs at least one slot and one layer")
        self.state, self.num_slots, self.num_layers = state, num_slots, num_layers
        self.backend = backend
        table = state_buffer_table(num_layers, state, num_slots)
        self.size = state_pool_bytes(num_layers, state, num_slots)
        self._region: ShmRegion | None = None
        self._device: Any = None
        uuid = ""
        if backend == "shm":
            self._region = ShmRegion(segment_name(instance_id, "state", index), max(self.size, 1), create=True)
            raw = np.frombuffer(self._region.mm, dtype=np.uint8)
            handle = self._region.name.encode()
        elif backend == "cuda":
            from .cuda import DeviceAllocation
            self._device = DeviceAllocation(max(self.size, 1), device_index)
            raw = self._device.as_uint8()
            handle, uuid = self._device.ipc_handle, self._device.uuid
        else:
            raise ValueError(f"unknown pool backend {backend!r}")
        self.views: dict[str, Any] = {}
        for name, off, shape, dtype in table:
            storage = np.dtype(DTYPES[dtype][1])
            n = int(np.prod(shape)) * storage.itemsize
            self.views[name] = raw[off:off + n].view(storage).reshape(shape)
        self.descriptor = PoolDescriptor(
            instance_id=instance_id, tier="state", backend=backend, handle=handle,
            size_bytes=int(raw.size), dtype=state.temporal_dtype, num_layers=num_layers, kv_heads=1,
            head_dim=1, page_size=1, num_slots=num_slots, mla=False, layout="state",
            buffers=tuple(BufferDesc(n, o, s, d) for n, o, s, d in table), gpu_uuid=uuid,
            device_index=device_index if backend == "cuda" else -1)

    @property
    def slot_bytes(self) -> int:
        """Bytes one state slot holds across all layers."""
        return self.num_layers * self.state.nbytes

    def copy(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Copy states slot to slot (copy-on-write at a hit: the tree's state into the request's own slot)."""
        pairs = list(zip(np.asarray(src, dtype=np.int64).tolist(), np.asarray(dst, dtype=np.int64).tolist()))
        with on_device(self):  # the pool's GPU current (it need not be GPU 0)
            for view in self.views.values():
                for s, d in pairs:  # a slot is one contiguous block per buffer: straight copies (device to device
                    view[d] = view[s]  # on a GPU), no gather temp
            if self._device is not None:  # a worker reads the copy on its own stream as soon as the call returns
                import cupy
                cupy.cuda.get_current_stream().synchronize()

    @property
    def device_index(self) -> Optional[int]:
        """The GPU the pool is on (None: shared memory)."""
        return self._device.device_index if self._device is not None else None

    def close(self) -> None:
        self.views.clear()
        if self._region is not None:
            self._region.close()
            self._region = None
        if self._device is not None:
            self._device.free()
            self._device = None


def copy_states(src: StatePool, src_slots: np.ndarray, dst: StatePool, dst_slots: np.ndarray) -> None:
    """Copy states between two pools of one geometry (device <-> host tier), slot by slot, every buffer; a
    GPU side is synchronized before the call returns."""
    if src.views.keys() != dst.views.keys() or any(src.views[k].shape[1:] != dst.views[k].shape[1:] or
                                                   src.views[k].dtype != dst.views[k].dtype for k in src.views):
        raise ValueError("state pools differ in geometry or dtype")
    if src._device is None and dst._device is None and _copy_rows(src, src_slots, dst, dst_slots):
        return
    pairs = list(zip(np.asarray(src_slots, dtype=np.int64).tolist(), np.asarray(dst_slots, dtype=np.int64).tolist()))
    with on_device(src if src._device is not None else dst):
        for name, sv in src.views.items():
            dv = dst.views[name]
            for s, d in pairs:
                if (src._device is None) == (dst._device is None):
                    dv[d] = sv[s]
                elif src._device is not None:  # device -> host
                    sv[s].get(out=dv[d])
                else:  # host -> device
                    dv[d].set(sv[s])
        if src._device is not None or dst._device is not None:
            import cupy
            cupy.cuda.get_current_stream().synchronize()


def _copy_rows(src: StatePool, src_slots: np.ndarray, dst: StatePool, dst_slots: np.ndarray) -> bool:
    """Shared memory both sides: every buffer's slot rows in one native call (client/_pagecopy.c, split between
    threads: a state is megabytes); False where it is not built or a view is not one row per slot."""
    try:
        from radixd.client._pagecopy import copy_pages
    except ImportError:  # pragma: no cover - setup.py builds it where a C compiler is
        return False
    from ..transfer.pages import _PARALLEL_BYTES, _THREADS
    plan = []
    for name, sv in src.views.items():
        dv = dst.views[name]
        if not (sv.flags.c_contiguous and dv.flags.c_contiguous):
            return False
        row = sv[0].nbytes
        plan += [sv.ctypes.data, sv.shape[0], row, dv.ctypes.data, dv.shape[0], row, row]
    a = np.ascontiguousarray(src_slots, dtype=np.int64)
    b = np.ascontiguousarray(dst_slots, dtype=np.int64)
    if a.size != b.size:
        raise ValueError("source and destination state counts differ")
    nbytes = a.size * sum(v[0].nbytes for v in src.views.values())
    if a.size and not copy_pages(np.array(plan, dtype=np.int64), a, b, 1, nogil=True, strided=True,
                                 threads=_THREADS if nbytes >= _PARALLEL_BYTES else 1):
        raise ValueError("state slot out of range")
    return True


def on_device(pool: "StatePool") -> ContextManager:
    """The pool's GPU made current for CuPy work on it (nothing for a shared-memory pool)."""
    if pool._device is None:
        return contextlib.nullcontext()
    import cupy
    return cupy.cuda.Device(pool._device.device_index)

