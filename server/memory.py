"""The server process's heap. Every RPC allocates and frees buffers sized by its request (a match's slot array, the
messages, a new edge's key); glibc returns each large freed one to the kernel, so the next page-faults its way
back (about 2 us per 4 KiB page: 270 us for a 134k-token prompt's key). Kept, they are reused at memcpy speed."""
from __future__ import annotations

import ctypes
import ctypes.util

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_MAX = 32 << 20  # glibc refuses a larger mmap threshold on 64-bit


def retain_freed_memory(keep_bytes: int) -> bool:
    """Keep up to keep_bytes of freed heap for reuse and serve allocations up to 32 MiB from the heap (glibc's
    mallopt); False where keep_bytes is 0 or the C library has no mallopt (musl, macOS): its defaults stay."""
    if keep_bytes <= 0:
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    keep = min(keep_bytes, (1 << 31) - 1)
    return bool(mallopt(_M_MMAP_THRESHOLD, min(keep, _MMAP_MAX)) and mallopt(_M_TRIM_THRESHOLD, keep))
