"""The server process's heap. Every RPC allocates and frees buffers sized by its request (a match's slot array, the
messages, a new edge's key); glibc returns each large freed one to the kernel, so the next page-faults its way
back (about 2 us per 4 KiB page: 270 us for a 134k-token prompt's key). Kept, they are reused at memcpy speed.
Faulted in at start (`--prefault`), the kept heap also spares the first fill of an empty tree those faults."""
from __future__ import annotations

import ctypes
import ctypes.util
from typing import Optional

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_MAX = 32 << 20  # glibc refuses a larger mmap threshold on 64-bit
_BLOCK = 16 << 20  # prefault in blocks the heap serves (under the mmap threshold), so freeing them keeps them


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def _libc() -> Optional[ctypes.CDLL]:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def retain_freed_memory(keep_bytes: int, prefault: bool = False) -> bool:
    """Keep up to keep_bytes of freed heap for reuse and serve allocations up to 32 MiB from the heap (glibc's
    mallopt); with prefault, also touch that much heap now (less one block, so the kept top is never trimmed).
    False where keep_bytes is 0 or the C library has no mallopt (musl, macOS): its defaults stay."""
    libc = _libc() if keep_bytes > 0 else None
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None:
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    keep = min(keep_bytes, (1 << 31) - 1)
    if not (mallopt(_M_MMAP_THRESHOLD, min(keep, _MMAP_MAX)) and mallopt(_M_TRIM_THRESHOLD, keep)):
        return False
    if prefault:
        _touch_heap(libc, keep - _BLOCK)
    return True


def _touch_heap(libc: ctypes.CDLL, nbytes: int) -> None:
    """Allocate nbytes of heap in blocks, write every page, free them: the pages stay mapped for later buffers."""
    malloc, free = libc.malloc, libc.free
    malloc.argtypes, malloc.restype = (ctypes.c_size_t,), ctypes.c_void_p
    free.argtypes, free.restype = (ctypes.c_void_p,), None
    blocks = []
    try:
        for _ in range(max(nbytes, 0) // _BLOCK):
            p = malloc(_BLOCK)
            if not p:
                break
            blocks.append(p)
            ctypes.memset(p, 0, _BLOCK)
    finally:
        for p in reversed(blocks):
            free(p)


def heap_free_bytes() -> Optional[int]:
    """Bytes the C heap holds free for reuse (glibc's mallinfo2): resident memory that no object uses; None
    where the C library has no mallinfo2 (glibc before 2.33, musl, macOS)."""
    fn = getattr(_libc(), "mallinfo2", None)
    if fn is None:
        return None
    fn.restype = _MallInfo2
    return int(fn().fordblks)
