"""The server keeps freed heap for reuse (server/memory.py): request-sized buffers that grow from request to request
cost page faults once, not on every request. Counted with the kernel's own minor-fault counters."""
from __future__ import annotations

import subprocess
import sys

import numpy as np

from .conftest import ServerProc

GROW = """
import resource, sys
from radixd.server.memory import retain_freed_memory
print(retain_freed_memory(int(sys.argv[1])))
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for k in range(1, 41):  # a buffer per request, each larger than the last (prompts that grow), freed at once
    b = bytearray(k * 100_000)
    b[-1] = 1
    del b
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _grow(keep: int) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", GROW, str(keep)], capture_output=True, text=True, check=True)
    applied, faults = out.stdout.split()
    return applied, int(faults)


def test_growing_buffers_fault_once_with_the_heap_retained():
    applied, kept = _grow(256 << 20)
    off, default = _grow(0)
    assert (applied, off) == ("True", "False")
    grown = 40 * 100_000 // 4096  # the largest buffer's pages: what growing to it must fault at least once
    assert default > 8 * grown, default  # glibc's default maps and unmaps each new largest buffer
    assert kept < 2 * grown, (kept, grown)


def _minflt(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[7])  # field 10: minor faults


def _server_faults(*flags: str) -> int:
    """Minor faults of a real server answering matches whose slot arrays grow from 8k to 200k tokens."""
    from radixd.client import CacheClient
    s = ServerProc("--num-slots", "262144", *flags)
    try:
        c = CacheClient(s.target, name="heap")
        toks = np.random.default_rng(1).integers(0, 32000, 200_000, dtype=np.int32)
        c.insert(toks, c.alloc(len(toks)))
        c.match_prefix(toks[:4096])
        before = _minflt(s.proc.pid)
        for n in range(8_000, 200_001, 8_000):
            assert c.match_prefix(toks[:n]).matched_len == n
        faults = _minflt(s.proc.pid) - before
        c.close()
        return faults
    finally:
        s.stop()


def test_the_server_retains_freed_heap_by_default():
    default, off = _server_faults(), _server_faults("--heap-retain-mb", "0")
    assert off > 3 * default, (default, off)
