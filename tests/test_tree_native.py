"""The plain tree's walks in C (server/tree/_hwalk.c: full_match, full_descend, full_lock, full_unlock) against
their Python reference (RadixTree(native=False)): two trees, the same random operations, the whole state equal after
every step."""
from __future__ import annotations

import random

import numpy as np
import pytest

from radixd.server.tree import tree as tree_mod
from radixd.server.tree.tree import RadixTree

pytestmark = pytest.mark.skipif(tree_mod._hwalk is None, reason="server/tree/_hwalk.c was not built")


def snapshot(t: RadixTree) -> dict:
    """Everything a lock walk can touch: every node's locks, heap version and place, the leaf set, the heap, the
    sizes, the roots."""
    return dict(
        nodes={nid: (n.key, n.value, n.lock_ref, n.dver, n.parent.id if n.parent else None, n.last_access,
                     n.hit_count, n.priority) for nid, n in t._nodes.items()},
        leaves=sorted(n.id for n in t._leaves),
        heap=sorted((e[1], e[2], e[3].id) for e in t._heap),
        sizes=(t.evictable_size, t.protected_size),
        roots={ns: r.id for ns, r in t._roots.items()},
        receipts={r: (a.id, b.id if b else None) for r, (a, b) in t._receipts.items()},
    )


@pytest.mark.parametrize("page,policy,events", [(1, "lru", False), (4, "slru", True), (16, "lfu", False),
                                                (2, "priority", True)])
def test_native_and_python_walks_agree_step_by_step(page, policy, events):
    rng = random.Random(page)
    pair = [RadixTree(page_size=page, policy=policy, native=n, events=events) for n in (True, False)]
    assert pair[0]._walk is not None and pair[1]._walk is None
    assert pair[0].lock.__self__ is pair[0] and pair[0].unlock.__self__ is pair[0]  # C functions bound to the tree
    assert type(pair[0].lock) is type(len) and pair[0].unlock.__name__ == "unlock"
    prompts = [[rng.randrange(5) for _ in range(rng.randrange(2, 12) * page)] for _ in range(10)]
    held: list[int] = []
    slot = 1
    for step in range(3000):
        op = rng.choice(["insert", "insert", "match", "lock", "lock", "unlock", "unlock", "evict"])
        base = rng.choice(prompts)
        toks = base[:rng.randrange(len(base) + 1)] + [rng.randrange(5) for _ in range(rng.randrange(3) * page)]
        ns = rng.choice([("", ""), ("a", "")])
        form = rng.choice([list, lambda x: np.array(x, dtype=np.int32), lambda x: np.array(x, dtype=np.int32).tobytes(),
                           lambda x: np.array(x, dtype=np.int64)])  # every form a caller may hand over
        n, toks = len(toks), form(toks)
        if op == "insert":
            vals = np.arange(slot, slot + n, dtype=np.int32)
            slot += n
            kw = dict(priority=rng.randrange(3), chunked=rng.random() < 0.2)
            out = [t.insert(toks, vals, ns, **kw) for t in pair]
            assert out[0].duplicates.tolist() == out[1].duplicates.tolist()
            assert [(o.prefix_len, o.node_id, o.adopted_len, o.tail.tolist()) for o in out] == \
                [(o.prefix_len, o.node_id, o.adopted_len, o.tail.tolist()) for o in out[::-1]]
        elif op in ("match", "lock"):
            ms = [t.match_prefix(toks, ns) for t in pair]
            assert ms[0].indices.tolist() == ms[1].indices.tolist() and ms[0].node_id == ms[1].node_id
            if op == "lock":
                receipts = [t.lock(m.node_id) for t, m in zip(pair, ms)]
                assert receipts[0] == receipts[1]
                held.append(receipts[0])
        elif op == "unlock" and held:
            r = held.pop(rng.randrange(len(held)))
            for t in pair:
                t.unlock(r)
        elif op == "evict":
            want = rng.choice([rng.randrange(1, 30), 0, -5]) if step % 500 else 1 << 70  # a wire value: any size
            out = [t.evict(want) for t in pair]
            assert out[0].freed.tolist() == out[1].freed.tolist()
        assert snapshot(pair[0]) == snapshot(pair[1]), f"step {step}: {op}"
        if events:  # the C insert emits its new leaf's STORED event through the same method
            assert pair[0].take_events() == pair[1].take_events(), f"step {step}: {op}"
        if step % 100 == 0:
            assert pair[0].check() == [] and pair[1].check() == []
    assert pair[0].counters.evicted_tokens_device > 0 and pair[0].protected_size >= 0
    assert pair[0].counters == pair[1].counters
    paths = tree_mod._hwalk.fast_paths()
    assert paths["match_slots"] and paths["node_slots"] and paths["counter_slots"], paths


@pytest.mark.parametrize("page", [1, 16])
def test_native_long_leaves_keep_every_byte(page):
    """A new leaf of 4096 tokens or more is written with streaming stores: at every offset and length (the copy's
    unaligned head and tail), its key and slots equal the Python reference's and read back exactly."""
    rng = np.random.default_rng(page)
    pair = [RadixTree(page_size=page, native=n) for n in (True, False)]
    base = rng.integers(0, 1 << 31, 20000, dtype=np.int64).astype(np.int32)
    slot = 0
    for cut, extra in [(0, 4096), (4096, 4097), (4096 + 3 * page, 5000), (0, 16384 + 7 * page), (13, 4999)]:
        toks = np.concatenate([base[:cut], rng.integers(0, 1 << 31, extra, dtype=np.int64).astype(np.int32)])
        vals = np.arange(slot, slot + len(toks), dtype=np.int32) * 3 + 1
        slot += len(toks)
        out = [t.insert(toks, vals) for t in pair]
        assert [(o.prefix_len, o.adopted_len, o.duplicates.tolist()) for o in out] == \
            [(o.prefix_len, o.adopted_len, o.duplicates.tolist()) for o in out[::-1]]
        aligned = len(toks) - len(toks) % page
        got = [t.match_prefix(toks) for t in pair]
        kept = np.concatenate([o.duplicates for o in out[:1]] + [vals[out[0].prefix_len:aligned]])
        assert got[0].indices.tolist() == got[1].indices.tolist()
        assert got[0].indices[out[0].prefix_len:].tolist() == kept[len(out[0].duplicates):].tolist()
        assert snapshot(pair[0]) == snapshot(pair[1])
        assert pair[0].check() == []


def test_native_lock_walks_refuse_bad_arguments():
    t = RadixTree(page_size=1)
    t.insert([1, 2, 3], np.arange(3, dtype=np.int32))
    node = t._nodes[t.match_prefix([1, 2, 3]).node_id]
    with pytest.raises(TypeError):
        tree_mod._hwalk.full_lock(node, [])  # leaves must be a set
    with pytest.raises(TypeError):
        tree_mod._hwalk.full_unlock(node, 1)
    with pytest.raises(AttributeError):
        tree_mod._hwalk.full_lock(object(), set())
    root = t._roots[("", "")]
    with pytest.raises(ValueError):  # more bytes than the key holds
        tree_mod._hwalk.full_descend(t, root, np.arange(3, dtype=np.int32), 16, 4)
    with pytest.raises(ValueError):  # not whole pages
        tree_mod._hwalk.full_descend(t, root, np.arange(3, dtype=np.int32), 6, 4)
    assert tree_mod._hwalk.full_descend(t, root, [1, 2], 8, 4) is NotImplemented  # a list is packed first
    with pytest.raises(TypeError):  # the evict's context is the tree's own
        tree_mod._hwalk.full_evict(t, 5, ())
    assert tree_mod._hwalk.key_tokens(b"\0" * 12) == 3 and tree_mod._hwalk.key_tokens([1]) == -1
    assert tree_mod._hwalk.key_tokens(np.arange(3, dtype=np.int64)) == -1  # int64: packed (range-checked) first
    assert t.check() == []


def test_native_paths_honour_a_descriptor_on_the_tree_class():
    """The C paths read and write a tree's counters in its instance dict only for a class with no data descriptor
    under their names; a subclass with a property for one gets the generic protocol (its setter sees every write)."""
    seen: list[int] = []

    class Watched(RadixTree):
        @property
        def protected_size(self) -> int:
            return self.__dict__.get("_protected", 0)

        @protected_size.setter
        def protected_size(self, v: int) -> None:
            seen.append(v)
            self.__dict__["_protected"] = v

    for t in (Watched(page_size=1), RadixTree(page_size=1)):
        assert t._walk is not None
        t.insert([1, 2, 3], np.arange(3, dtype=np.int32))
        r = t.lock(t.match_prefix([1, 2, 3]).node_id)
        assert t.protected_size == 3 and t.evictable_size == 0 and t.check() == []
        t.unlock(r)
        assert t.protected_size == 0 and t.evictable_size == 3 and t.check() == []
    assert seen == [0, 3, 0]  # __init__, the C lock, the C unlock: each through the property


def _slots_of(node) -> dict:
    """Every slot of a Node, its links by id (children by their first pages), its lazy digests by presence."""
    from radixd.server.tree.node import Node
    out = {}
    for name in Node.__slots__:
        v = getattr(node, name)
        out[name] = (v.id if v is not None else None) if name == "parent" else \
            {k: c.id for k, c in v.items()} if name == "children" else (v is None) if name == "hashes" else v
    return out


@pytest.mark.parametrize("events", [False, True])
def test_native_insert_builds_the_nodes_the_method_builds(events):
    """tree.insert of a native tree is C bound to the tree (no Python frame): its new leaves carry every slot the
    Python method's Node(...) gives them, each leaf its own children dict, and its tail is a view of the caller's
    slots as numpy slices one."""
    pair = [RadixTree(page_size=4, native=n, events=events) for n in (True, False)]
    assert type(pair[0].insert) is type(len) and pair[0].insert.__self__ is pair[0]
    assert "insert" not in vars(pair[1])  # the reference keeps the method
    rng = np.random.default_rng(3)
    base = rng.integers(0, 1000, 64, dtype=np.int32)
    slot = 0
    for cut, extra, kw in [(0, 30, {}), (16, 13, {"priority": 2}), (16, 9, {"chunked": True}), (40, 3, {}),
                           (0, 64, {"priority": 1, "chunked": False})]:
        toks = np.concatenate([base[:cut], rng.integers(0, 1000, extra, dtype=np.int32)])
        vals = np.arange(slot, slot + len(toks), dtype=np.int32)
        slot += len(toks)
        out = [t.insert(toks, vals, **kw) for t in pair]
        assert [(o.prefix_len, o.node_id, o.adopted_len, o.duplicates.tolist(), o.tail.tolist()) for o in out] == \
            [(o.prefix_len, o.node_id, o.adopted_len, o.duplicates.tolist(), o.tail.tolist()) for o in out[::-1]]
        tail = out[0].tail
        assert tail.flags.writeable and tail.base is vals and tail.dtype == np.int32
        if len(tail):
            vals[-1] += 1000  # a view, as vals[aligned:] is
            assert tail[-1] == vals[-1]
    for nid, node in pair[0]._nodes.items():
        assert _slots_of(node) == _slots_of(pair[1]._nodes[nid]), nid
    kids = [n.children for n in pair[0]._nodes.values()]
    assert len({id(k) for k in kids}) == len(kids)
    ro = np.frombuffer(np.arange(1000, 1007, dtype=np.int32).tobytes(), dtype=np.int32)  # what the service decodes
    r = pair[0].insert(np.arange(500, 507, dtype=np.int32), ro)
    assert r.tail.tolist() == [1004, 1005, 1006] and not r.tail.flags.writeable
    paths = tree_mod._hwalk.fast_paths()
    assert paths["node_template"] and paths["numpy_view"], paths  # what ran above is the C path, not its fallback
    assert pair[0].check() == [] and pair[1].check() == []


def test_native_insert_leaves_every_other_call_to_the_method():
    """What the bound insert does not take (prev_prefix_len, a namespace not seen yet, slots as bytes or a list, a
    slot count that does not fit, a bad argument) goes to RadixTree.insert: the same result, the same error."""
    from radixd.server.tree.errors import InvalidInput
    pair = [RadixTree(page_size=2, native=n) for n in (True, False)]
    toks = np.arange(10, dtype=np.int32)
    calls = [((toks, np.arange(10, dtype=np.int32)), {}),
             ((toks, np.arange(10, dtype=np.int32), ("", ""), 4), {}),  # prev_prefix_len, positional
             ((toks, np.arange(10, dtype=np.int32)), {"prev_prefix_len": 6, "namespace": ("", "")}),
             ((toks[:6], np.arange(20, 26, dtype=np.int32)), {"namespace": ("m", "")}),  # a new namespace
             ((toks[:8], np.arange(30, 38, dtype=np.int32).tobytes()), {"namespace": ("m", "")}),
             ((list(range(100, 106)), list(range(40, 46))), {}),
             ((np.arange(200, 204, dtype=np.int64), np.arange(50, 54, dtype=np.int64)), {})]
    for args, kw in calls:
        out = [t.insert(*args, **kw) for t in pair]
        assert [(o.prefix_len, o.node_id, o.adopted_len, o.duplicates.tolist(), o.tail.tolist()) for o in out] == \
            [(o.prefix_len, o.node_id, o.adopted_len, o.duplicates.tolist(), o.tail.tolist()) for o in out[::-1]]
    bad = [((toks, np.arange(9, dtype=np.int32)), {}, InvalidInput),  # 9 slots for 10 tokens
           ((toks, np.arange(10, dtype=np.int32)), {"prev_prefix_len": 12}, InvalidInput),
           ((toks, np.arange(10, dtype=np.int32)), {"colour": 1}, TypeError),
           ((toks, np.arange(10, dtype=np.int32), ("", "")), {"namespace": ("", "")}, TypeError),
           ((toks,), {}, TypeError)]
    for args, kw, exc in bad:
        msgs = []
        for t in pair:
            with pytest.raises(exc) as e:
                t.insert(*args, **kw)
            msgs.append(str(e.value))
        assert msgs[0] == msgs[1]
    for nid, node in pair[0]._nodes.items():
        assert _slots_of(node) == _slots_of(pair[1]._nodes[nid]), nid
    assert pair[0].check() == [] and pair[1].check() == []


def test_node_template_refuses_a_node_class_it_cannot_copy():
    """The C insert builds a leaf from a template learned from two probe Node(...) calls only where every slot is an
    argument, a fresh children dict, or a constant int/bool/None; a class whose __init__ derives a slot from its
    arguments, gives a mutable default, leaves a slot unset or stores an argument twice keeps its __init__."""
    from radixd.server.tree.node import Node
    usable = tree_mod._hwalk.node_template_usable

    def variant(name, extra):
        def init(self, *args):
            Node.__init__(self, *args)
            extra(self)
        return type(name, (), {"__slots__": Node.__slots__, "__init__": init})

    assert usable(Node) and usable(type("Same", (), {"__slots__": Node.__slots__, "__init__": Node.__init__}))
    assert not usable(variant("Derived", lambda n: setattr(n, "hpin", len(n.key))))
    assert not usable(variant("Mutable", lambda n: setattr(n, "hashes", [])))
    assert not usable(variant("Unset", lambda n: delattr(n, "created")))
    assert not usable(variant("Twice", lambda n: setattr(n, "hpin", n.priority)))
    assert not usable(type("WithDict", (), {"__init__": Node.__init__}))  # instances with a __dict__
