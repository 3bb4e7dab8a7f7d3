"""The server keeps freed heap for reuse (server/memory.py): request-sized buffers that grow from request to request
cost page faults once, not on every request; with --prefault the kept heap is faulted in at start, so a tree that
grows from empty takes none. Counted with the kernel's own minor-fault counters."""
from __future__ import annotations

import subprocess
import sys
from typing import Callable

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


def _faults_while(num_slots: int, flags: tuple, warm: Callable, measured: Callable) -> int:
    """Minor faults of a real server while a client runs measured(client), after warm(client)."""
    from radixd.client import CacheClient
    s = ServerProc("--num-slots", str(num_slots), *flags)
    try:
        c = CacheClient(s.target, name="heap")
        warm(c)
        before = _minflt(s.proc.pid)
        measured(c)
        faults = _minflt(s.proc.pid) - before
        c.close()
        return faults
    finally:
        s.stop()


def _server_faults(*flags: str) -> int:
    """Minor faults of a real server answering matches whose slot arrays grow from 8k to 200k tokens."""
    toks = np.random.default_rng(1).integers(0, 32000, 200_000, dtype=np.int32)

    def warm(c) -> None:
        c.insert(toks, c.alloc(len(toks)))
        c.match_prefix(toks[:4096])

    def grow(c) -> None:
        for n in range(8_000, 200_001, 8_000):
            assert c.match_prefix(toks[:n]).matched_len == n

    return _faults_while(262144, flags, warm, grow)


def test_the_server_retains_freed_heap_by_default():
    default, off = _server_faults(), _server_faults("--heap-retain-mb", "0")
    assert off > 3 * default, (default, off)


FILL = """
import resource, sys
from radixd.server.memory import heap_free_bytes, retain_freed_memory
print(retain_freed_memory(64 << 20, prefault=sys.argv[1] == "1"))
free = heap_free_bytes()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
kept = [bytes(bytearray(500_000)) for _ in range(60)]  # a tree's new edges: held, never freed
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before, free)
"""


def _fill(prefault: bool) -> tuple[str, int, int]:
    out = subprocess.run([sys.executable, "-c", FILL, "1" if prefault else "0"], capture_output=True, text=True,
                         check=True)
    applied, faults, free = out.stdout.split()
    return applied, int(faults), int(free)


def test_a_prefaulted_heap_takes_no_faults_while_it_fills():
    (on, faults, free), (off, cold, _) = _fill(True), _fill(False)
    assert (on, off) == ("True", "True")
    touched = 60 * 500_000 // 4096  # the pages the kept buffers fill: each faults once on a cold heap
    assert cold > touched, (cold, touched)
    assert faults < touched // 10, (faults, touched)
    assert free >= (64 - 16 - 1) << 20, free  # faulted in and freed, yet kept (less one block, under the trim mark)


def _growth_faults(*flags: str) -> int:
    """Minor faults of a real server caching 12 distinct prompts of 24k tokens (its tree grows, nothing is freed)."""
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, 32000, 24_000, dtype=np.int32) for _ in range(13)]

    def fill(c) -> None:
        for toks in prompts[1:]:
            assert c.insert(toks, c.alloc(len(toks))).prefix_len == 0

    # the first insert sizes the messages' buffers, kept from then on either way
    return _faults_while(400000, flags, lambda c: c.insert(prompts[0], c.alloc(24_000)), fill)


def test_a_prefaulted_server_grows_its_tree_without_faults():
    cold, warm = _growth_faults(), _growth_faults("--prefault")
    edges = 12 * 24_000 * 8 // 4096  # each new edge's key and slots: pages a cold heap faults in
    assert cold > edges // 2, (cold, edges)
    assert warm < cold // 3, (warm, cold)
