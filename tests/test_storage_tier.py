"""The L3 tier's races, in process on real pools and a real store, where the interleaving can be forced:
host pages freed while an L3 write still reads them, a prefetch that lands on pages inserted meanwhile."""
from __future__ import annotations

import asyncio
import uuid

import numpy as np
import pytest

from radixd.server.app import build_core
from radixd.server.config import Config
from radixd.server.core import Item
from radixd.server.pools.allocator import FREE

from .stores import FileDir

PAGE = 16
NS = ("", "")


@pytest.fixture
def core():
    d = FileDir()
    cfg = Config(device="cpu", num_slots=1024, page_size=PAGE, layers=2, kv_heads=2, head_dim=8, host_slots=2048,
                 storage=d.url, prefetch_threshold=PAGE)
    c = build_core(cfg, uuid.uuid4().hex)
    yield c
    c.storage.close()
    c.host.engine.close()
    for p in c.device_pools + [c.host_pool]:
        p.close()
    d.stop()


async def _cache(core, tokens: np.ndarray) -> None:
    s = core.attach("scheduler")
    slots = (await core.alloc_slots(s, [len(tokens)]))[0][0]
    core.device_pools[0].views["k.0"][slots] = (tokens % 251).astype(np.float16)[:, None, None]
    core.cache_finished(s, [Item(tokens, slots, NS)])
    await core.host.engine.drain()
    core.end_session(s)


def test_host_pages_freed_during_an_l3_write_stay_allocated_until_it_ends(core):
    async def run():
        tokens = np.arange(1, 1 + 4 * PAGE, dtype=np.int32)
        await _cache(core, tokens)  # the backup landed; its L3 write is queued, not yet run
        assert core.storage.busy and core.host.deferred_frees == 0
        assert await core.evict(len(tokens), len(tokens)) == (len(tokens), len(tokens))
        assert core.host.deferred_frees == len(tokens)  # the tree let go; the slots wait for the write
        assert core.host_alloc.counts[FREE] == core.host_alloc.capacity - len(tokens)
        assert core.check() == []
        assert await core.storage.idle(10)
        assert core.host.deferred_frees == 0 and core.host_alloc.counts[FREE] == core.host_alloc.capacity
        assert core.storage.pages["put"] == 4 and core.check() == []
        op = core.storage.maybe_prefetch(NS, tokens, 0, 0, 0)  # and the pages read back are the ones written
        await op.done.wait()
        assert (op.outcome, op.loaded) == ("completed", len(tokens))
        m = core.tree.match_prefix(tokens)
        assert m.host_hit_len == len(tokens)
        host = core.host_pool.layer(0, "k")
        slots = np.frombuffer(b"".join(n.host_value for n in core.tree.iter_nodes() if n.host_value), "<i4")
        got = host.reshape(-1, *host.shape[-2:])[np.sort(slots)][:, 0, 0]
        assert np.array_equal(np.sort(got.astype(np.int64)), np.sort(tokens % 251))
        assert core.check() == []
    asyncio.run(run())


def test_a_prefetch_that_lands_on_pages_inserted_meanwhile_frees_its_copies(core):
    async def run():
        tokens = np.arange(500, 500 + 4 * PAGE, dtype=np.int32)
        await _cache(core, tokens)
        assert await core.storage.idle(10)
        await core.evict(len(tokens), len(tokens))
        assert core.tree.cached_tokens == core.tree.host_cached_tokens == 0
        op = core.storage.maybe_prefetch(NS, tokens, 0, 0, 0)
        assert op is not None and op.length == len(tokens)
        joined = core.storage.maybe_prefetch(NS, tokens, 0, 0, 0)  # a second match joins the first fetch
        assert joined.op is op and joined.length == len(tokens) and not core.storage.prefetches.keys() - {op.key}
        await _cache(core, tokens)  # an engine prefilled it again while the fetch ran
        await op.done.wait()
        assert (op.outcome, op.loaded) == ("completed", 0)  # every fetched page was a duplicate: freed
        assert core.check() == []
        assert await core.storage.idle(10)
        assert core.check() == [] and not core.storage.prefetches
    asyncio.run(run())


def test_a_miss_or_a_short_run_costs_no_host_slots(core):
    async def run():
        tokens = np.arange(900, 900 + 3 * PAGE, dtype=np.int32)
        op = core.storage.maybe_prefetch(NS, tokens, 0, 0, 0)
        await op.done.wait()
        assert op.outcome == "miss" and core.host_alloc.counts[FREE] == core.host_alloc.capacity
        assert core.storage.maybe_prefetch(NS, tokens[:PAGE - 1], 0, 0, 0) is None  # not one whole page
        assert core.check() == []
    asyncio.run(run())
