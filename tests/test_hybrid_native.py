"""The hybrid tree's C match (server/tree/_hwalk.c) against its Python reference (HybridTree._match_path): two
trees, one native and one not, take the same random operations; every result and, after every step, every node,
counter, LRU order and clock are equal."""
from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import invariant

from radixd.server.tree import hybrid
from radixd.server.tree.hybrid import HybridTree

from .test_tree_hybrid import HybridMachine

pytestmark = pytest.mark.skipif(
    not hybrid.NATIVE and not os.environ.get("RADIXD_REQUIRE_NATIVE"),
    reason="the native hybrid match was not built (no C compiler at install)")


def test_the_native_match_is_built_where_ci_asks_for_it():
    assert hybrid.NATIVE, "server/tree/_hwalk.c was not built"
    assert HybridTree(4, window=8, mamba_chunk=4)._rules is not None
    assert HybridTree(4, window=8, mamba_chunk=4, native=False)._rules is None


def _plain(x):
    """A result as comparable data (arrays as lists)."""
    if isinstance(x, np.ndarray):
        return x.tolist()
    if dataclasses.is_dataclass(x):
        return {f.name: _plain(getattr(x, f.name)) for f in dataclasses.fields(x)}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    return x


def snapshot(t: HybridTree) -> dict:
    """Everything the match touches or decides with, by node id (SWA boundary marks as which node holds each
    receipt's mark: their values come from one counter shared by both trees)."""
    nodes = {}
    for nid, nd in t._nodes.items():
        nodes[nid] = (nd.key, nd.full.tolist(), nd.swa, nd.mamba, nd.lock, nd.slock, nd.mlock, bool(nd.suuid),
                      nd.atime, nd.created, nd.n, nd.parent.id if nd.parent is not None else None,
                      sorted(c.id for c in nd.children.values()), nd.ns)
    marks = {rid: next((n.id for n in t._nodes.values() if r.swa_uuid and n.suuid == r.swa_uuid), None)
             for rid, r in t._receipts.items()}
    return dict(nodes=nodes, marks=marks, clock=t._clock, leaves=sorted(n.id for n in t._leaves),
                lru={c.name: [n.id for n in c.lru.order()] for c in t.aux}, evictable=dict(t.evictable),
                protected=dict(t.protected), counters=dataclasses.asdict(t.counters),
                receipts=sorted(t._receipts), roots=sorted((ns, r.id) for ns, r in t._roots.items()))


class Twin:
    """Forwards every call to a native and a Python tree and holds their results equal; reads come from the
    native one."""

    def __init__(self, native: HybridTree, python: HybridTree):
        assert native._rules is not None and python._rules is None
        self._native, self._python = native, python

    def __getattr__(self, name):
        mine = getattr(self._native, name)
        if not callable(mine):
            return mine

        def both(*a, **kw):
            err = None
            try:
                got = mine(*a, **kw)
            except Exception as e:  # noqa: BLE001 - the reference must fail the same way
                err = e
            try:
                want = getattr(self._python, name)(*a, **kw)
            except Exception as e:  # noqa: BLE001
                assert err is not None and type(err) is type(e) and str(err) == str(e), (name, err, e)
                raise
            assert err is None, (name, err)
            assert _plain(got) == _plain(want), (name, a, kw)
            return got
        return both


class NativeTwinMachine(HybridMachine):
    def __init__(self):
        super().__init__()
        kw = dict(window=self.WINDOW, mamba_chunk=self.CHUNK, events=True, mamba_max_states_per_path=3,
                  victims=True)
        self.pair = (HybridTree(self.PAGE, **kw), HybridTree(self.PAGE, native=False, **kw))
        self.tree = Twin(*self.pair)

    @invariant()
    def consistent(self):
        super().consistent()
        assert snapshot(self.pair[0]) == snapshot(self.pair[1])


TestNativeTwin = NativeTwinMachine.TestCase
TestNativeTwin.settings = settings(max_examples=150, stateful_step_count=50, deadline=None,
                                   suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize("page", [1, 16])
def test_native_and_python_agree_on_long_shared_prefixes(page):
    """Deep paths, splits inside edges, windows longer than a node, states on a chunk grid: both trees stay equal
    over a seeded workload of matches and inserts."""
    rng = np.random.default_rng(page)
    pair = (HybridTree(page, window=48 * page, mamba_chunk=4 * page), HybridTree(page, window=48 * page,
                                                                                  mamba_chunk=4 * page, native=False))
    twin = Twin(*pair)
    systems = [rng.integers(0, 50, int(rng.integers(2, 30)) * page, dtype=np.int32) for _ in range(4)]
    slot, state = 0, 0
    for _ in range(300):
        toks = np.concatenate([systems[int(rng.integers(4))], rng.integers(0, 3, int(rng.integers(0, 40)) * page,
                                                                            dtype=np.int32)])
        cut = int(rng.integers(0, len(toks) + 1))
        m = twin.match_prefix(toks[:cut])
        assert m.indices.dtype == np.int64 and len(m.indices) == m.matched_len
        n = len(toks) - len(toks) % page
        vals = np.concatenate([m.indices, np.arange(slot, slot + n - m.matched_len, dtype=np.int64)])
        slot += n
        state += 1
        r = twin.insert(toks, vals, prev_prefix_len=m.matched_len, mamba_value=state)
        assert r.prefix_len >= 0
        assert snapshot(pair[0]) == snapshot(pair[1])


def test_the_native_match_refuses_bad_arguments_without_crashing():
    t = HybridTree(4, window=8, mamba_chunk=4)
    t.insert(np.arange(16, dtype=np.int32), np.arange(16), mamba_value=1)
    native, rules, ctx = t._rules
    assert native.match(t, t.root, "not bytes", 16, rules, ctx) is NotImplemented  # packed (and refused) by Python
    with pytest.raises(ValueError):
        native.match(t, t.root, b"\0" * 16, 6, rules, ctx)
    with pytest.raises(TypeError):
        native.match(t, t.root, b"\0" * 16, 16, (("what", 1),), ctx)
    with pytest.raises(TypeError):
        native.match(t, t.root, b"\0" * 16)
    with pytest.raises(TypeError):  # the result's context is a 7-tuple
        native.match(t, t.root, b"\0" * 16, 16, rules, ctx[:6])
    with pytest.raises(ValueError):  # a negative MAMBA grid
        native.match(t, t.root, b"\0" * 16, 16, rules, ctx[:5] + (-1,) + ctx[6:])
    # a key it cannot read in place (int64, strided) goes back to be packed, and matches the same
    assert native.match(t, t.root, np.arange(16, dtype=np.int64), 16, rules, ctx) is NotImplemented
    assert native.match(t, t.root, np.arange(32, dtype=np.int32)[::2], 16, rules, ctx) is NotImplemented
    assert t.match_prefix(np.arange(16, dtype=np.int64)).matched_len == 16
    strided = np.zeros(32, dtype=np.int32)
    strided[::2] = np.arange(16)
    assert t.match_prefix(strided[::2]).matched_len == 16
    before = snapshot(t)
    assert t.match_prefix(np.arange(16, dtype=np.int32)).matched_len == 16
    assert snapshot(t)["nodes"].keys() == before["nodes"].keys()


def test_the_native_match_reads_numpy_directly():
    """The C match reads the slot arrays' fields and makes its result with numpy's own constructor once each has
    proven itself on this numpy, and fills the result and the counters through their slots; the indices are an
    ordinary, owned, writeable int64 array either way."""
    t = HybridTree(4, window=8, mamba_chunk=4)
    t.insert(np.arange(8, dtype=np.int32), np.arange(100, 108), mamba_value=1)
    t.insert(np.arange(16, dtype=np.int32), np.arange(100, 116), mamba_value=2)
    for _ in range(2):
        m = t.match_prefix(np.arange(16, dtype=np.int32))
    assert m.indices.tolist() == list(range(100, 116))
    assert m.indices.dtype == np.int64 and m.indices.flags.owndata and m.indices.flags.writeable
    paths = hybrid._hwalk.fast_paths()
    assert all(paths[k] for k in ("numpy_fields", "numpy_new", "result_slots", "counter_slots", "hnode_slots")), paths
    assert t.counters.queried_tokens == 32 and t.counters.hit_tokens == 32
