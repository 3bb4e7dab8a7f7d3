"""A worker's mapping of a shared-memory pool, populated up front (`MappedPool.populate`): its first copy into a
page then takes no page fault (measured by the process's own minor-fault count), where without it every 4 KiB
page of the pool faults once."""
from __future__ import annotations

import resource

import pytest
import torch

from radixd.client import CacheClient
from radixd.client.pools import populate_in_background

from .conftest import ServerProc


def _faults_writing(buf: torch.Tensor) -> int:
    raw = buf.view(torch.uint8).view(-1)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    raw[::4096] = 1  # one byte per memory page
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def test_a_populated_pool_takes_no_page_fault_on_first_write():
    srv = ServerProc("--num-slots", "16384", "--page-size", "16", "--layers", "2", "--kv-heads", "2",
                     "--head-dim", "64", "--dtype", "float32")
    try:
        with CacheClient(srv.target, attach=False) as c:
            cold = c.map_pools(torch.device("cpu"))
            pages = cold.device[0].k_buffer[0].numel() * 4 // 4096
            assert pages >= 256
            assert _faults_writing(cold.device[0].k_buffer[0]) >= pages // 2  # every page faults once unpopulated
            cold.close()
            warm = c.map_pools(torch.device("cpu"))
            if not warm.device[0].populate():
                pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux 5.14+)")
            assert _faults_writing(warm.device[0].v_buffer[1]) <= pages // 16
            populate_in_background(warm.device).join(30)  # the same on its own thread, again: harmless
            assert _faults_writing(warm.device[0].k_buffer[1]) <= pages // 16
            warm.close()
            assert not warm.device[0].populate()  # closed: nothing to do, no error
    finally:
        srv.stop()
