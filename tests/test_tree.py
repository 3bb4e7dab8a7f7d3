"""Unit tests of the radix tree's behaviours (SGLang semantics)."""
import numpy as np
import pytest

from radixd.server.tree import (
    POLICIES, ForeignHandle, InvalidInput, LocksHeld, RadixTree, StaleHandle, UnknownReceipt,
)


def ok(tree):
    assert tree.check() == []
    return tree


def arr(*xs):
    return np.array(xs, dtype=np.int32)


def test_insert_then_match_returns_inserted_slots():
    t = RadixTree()
    r = t.insert([1, 2, 3, 4], [10, 11, 12, 13])
    assert (r.prefix_len, r.adopted_len, len(r.duplicates)) == (0, 4, 0)
    m = t.match_prefix([1, 2, 3, 4, 5])
    assert m.matched_len == 4 and m.indices.tolist() == [10, 11, 12, 13] and m.host_hit_len == 0
    assert t.match_prefix([9]).matched_len == 0
    ok(t)


def test_packed_bytes_and_numpy_inputs_are_equivalent():
    t = RadixTree()
    t.insert(arr(5, 6, 7).tobytes(), arr(1, 2, 3).tobytes())
    assert t.match_prefix(np.array([5, 6, 7], dtype=np.int64)).indices.tolist() == [1, 2, 3]
    with pytest.raises(InvalidInput):
        t.match_prefix(b"\x01\x02\x03")
    with pytest.raises(InvalidInput):
        t.insert([1, 2], [1])
    ok(t)


def test_match_inside_an_edge_splits_at_page_boundary():
    t = RadixTree(page_size=4)
    t.insert(list(range(12)), list(range(100, 112)))
    assert t.num_nodes == 1
    # mismatch at position 6: only the first whole page (4 tokens) matches
    m = t.match_prefix([0, 1, 2, 3, 4, 5, 99, 7, 8])
    assert m.matched_len == 4 and m.indices.tolist() == [100, 101, 102, 103]
    assert t.num_nodes == 2
    ok(t)
    # a query shorter than a page matches nothing and does not split
    assert t.match_prefix([0, 1, 2]).matched_len == 0
    assert t.num_nodes == 2


def test_insert_truncates_to_whole_pages_and_returns_tail():
    t = RadixTree(page_size=4)
    r = t.insert(list(range(10)), list(range(50, 60)))
    assert r.adopted_len == 8 and r.tail.tolist() == [58, 59]
    assert t.cached_tokens == 8
    ok(t)


def test_insert_split_and_branch():
    t = RadixTree(page_size=2)
    t.insert([1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6])
    r = t.insert([1, 2, 3, 4, 7, 8], [11, 12, 13, 14, 17, 18])
    assert r.prefix_len == 4 and r.adopted_len == 2 and r.duplicates.tolist() == [11, 12, 13, 14]
    assert t.num_nodes == 3
    assert t.match_prefix([1, 2, 3, 4, 7, 8]).indices.tolist() == [1, 2, 3, 4, 17, 18]
    ok(t)


def test_duplicates_respect_prev_prefix_len():
    t = RadixTree()
    t.insert([1, 2, 3, 4], [10, 11, 12, 13])
    m = t.match_prefix([1, 2, 3, 4, 5, 6])
    # request's own KV beyond its matched prefix: positions 4, 5 are new
    r = t.insert([1, 2, 3, 4, 5, 6], np.concatenate([m.indices, arr(20, 21)]), prev_prefix_len=4)
    assert r.duplicates.size == 0 and r.adopted_len == 2
    # another request recomputed positions 2..5 although 0..5 were cached meanwhile
    r = t.insert([1, 2, 3, 4, 5, 6], arr(10, 11, 32, 33, 34, 35), prev_prefix_len=2)
    assert r.duplicates.tolist() == [32, 33, 34, 35] and r.adopted_len == 0
    with pytest.raises(InvalidInput):
        t.insert([1, 2, 9, 9], [10, 11, 40, 41], prev_prefix_len=4)
    ok(t)


def test_namespaces_are_isolated():
    t = RadixTree()
    t.insert([1, 2, 3], [1, 2, 3], namespace=("lora-a", ""))
    t.insert([1, 2, 3], [4, 5, 6], namespace=("", "salt"))
    assert t.match_prefix([1, 2, 3]).matched_len == 0
    assert t.match_prefix([1, 2, 3], ("lora-a", "")).indices.tolist() == [1, 2, 3]
    assert t.match_prefix([1, 2, 3], ("", "salt")).indices.tolist() == [4, 5, 6]
    assert t.match_prefix([1, 2, 3], ("lora-a", "salt")).matched_len == 0
    ok(t)
    assert t.evict(100).evicted_tokens == 6
    ok(t)


def test_lock_protects_path_and_unlock_replays():
    t = RadixTree()
    t.insert([1, 2, 3, 4], [1, 2, 3, 4])
    t.insert([1, 2, 5, 6], [1, 2, 5, 6])
    leaf = t.match_prefix([1, 2, 3, 4]).node_id
    receipt = t.lock(leaf)
    assert t.protected_size == 4 and t.evictable_size == 2
    ok(t)
    assert sorted(t.evict(100).freed.tolist()) == [5, 6]
    assert t.cached_tokens == 4
    t.unlock(receipt)
    assert t.protected_size == 0 and t.evictable_size == 4
    ok(t)
    with pytest.raises(UnknownReceipt):
        t.unlock(receipt)
    assert t.evictable_size == 4
    ok(t)


def test_lock_survives_a_split_of_the_locked_edge():
    t = RadixTree()
    t.insert([1, 2, 3, 4], [1, 2, 3, 4])
    receipt = t.lock(t.match_prefix([1, 2, 3, 4]).node_id)
    t.match_prefix([1, 2, 9])  # splits the locked edge
    assert t.num_nodes == 2 and t.protected_size == 4
    ok(t)
    assert t.evict(100).evicted_tokens == 0
    t.unlock(receipt)
    ok(t)
    assert t.evict(100).evicted_tokens == 4


def test_parent_becomes_evictable_after_its_last_child_goes():
    t = RadixTree()
    t.insert([1, 2], [1, 2])
    t.insert([1, 2, 3, 4], [1, 2, 3, 4])
    assert t.num_nodes == 2
    r = t.evict(1)  # the leaf [3,4] goes first; then the parent is an evictable leaf
    assert r.freed.tolist() == [3, 4]
    ok(t)
    assert t._leaves == {t._nodes[t.match_prefix([1, 2]).node_id]}
    assert t.evict(1).freed.tolist() == [1, 2]
    assert t.num_nodes == 0
    ok(t)


def test_evict_cascades_within_one_call():
    t = RadixTree()
    t.insert([1, 2, 3, 4, 5, 6], list(range(6)))
    t.match_prefix([1, 2, 3, 9])
    t.match_prefix([1, 2, 9])  # three nodes in a chain
    assert t.num_nodes == 3
    assert t.evict(6).evicted_tokens == 6 and t.num_nodes == 0
    ok(t)


def test_a_read_only_workload_does_not_grow_the_eviction_heap():
    """Every hit re-files its leaf in a lazy heap; without eviction the stale entries must still be dropped."""
    t = RadixTree()
    t.insert([1, 2, 3, 4], [1, 2, 3, 4])
    t.insert([1, 2, 7, 8], [5, 6, 7, 8])
    for i in range(5000):
        t.match_prefix([1, 2, 3, 4] if i % 2 else [1, 2, 7, 8])
        if i % 997 == 0:
            ok(t)  # the checker bounds each heap by the live leaves
    assert len(t._heap) <= 2 * len(t._leaves) + 1024
    assert t.evict(2).freed.tolist() == [7, 8]  # the least recent leaf still goes first
    ok(t)


def test_stale_and_foreign_handles():
    t = RadixTree(instance_tag=7)
    t.insert([1, 2], [1, 2])
    node = t.match_prefix([1, 2]).node_id
    t.evict(10)
    with pytest.raises(StaleHandle):
        t.lock(node)
    other = RadixTree(instance_tag=8)
    other.insert([1, 2], [1, 2])
    foreign = other.match_prefix([1, 2]).node_id
    with pytest.raises(ForeignHandle):
        t.lock(foreign)
    r = other.lock(foreign)
    with pytest.raises(ForeignHandle):
        t.unlock(r)
    ok(t)
    ok(other)


def _order(policy, setup):
    t = RadixTree(policy=policy)
    setup(t)
    order = []
    while True:
        r = t.evict(1)
        if not r.evicted_tokens:
            break
        order.append(int(r.freed[0]))
        ok(t)
    return order


def _three_leaves(t):
    # created 1,2,3; then hits (inserts count, as in the seeds): leaf 1 twice more, leaf 2 once more
    # (LRU time: 3 < 1 < 2)
    for i in (1, 2, 3):
        t.insert([i], [i])
    t.insert([1], [1])
    t.insert([1], [1])
    t.insert([2], [2])


@pytest.mark.parametrize("policy,expected", [
    ("lru", [3, 1, 2]), ("mru", [2, 1, 3]), ("fifo", [1, 2, 3]), ("filo", [3, 2, 1]),
    ("lfu", [3, 2, 1]), ("slru", [3, 1, 2]),  # slru: 1 and 2 both reach 2 hits
])
def test_policy_order(policy, expected):
    assert _order(policy, _three_leaves) == expected


def test_priority_policy_lower_first_lru_tiebreak_and_split_inherits():
    def setup(t):
        t.insert([1], [1], priority=5)
        t.insert([2], [2], priority=1)
        t.insert([3], [3], priority=1)
        t.insert([4, 4], [40, 41], priority=9)
        t.match_prefix([2])  # 3 is now least recent among priority 1
    assert _order("priority", setup) == [3, 2, 1, 40]
    t = RadixTree(policy="priority")
    t.insert([7, 8, 9], [7, 8, 9], priority=3)
    t.insert([7, 8, 1], [7, 8, 1], priority=6)  # raises the shared prefix to 6; split keeps 3 below
    upper = t._nodes[t.match_prefix([7, 8]).node_id]
    assert upper.priority == 6
    assert t._nodes[t.match_prefix([7, 8, 9]).node_id].priority == 3
    ok(t)


def test_slru_hits_move_a_leaf_out_of_probation():
    def setup(t):
        t.insert([1], [1])
        t.insert([2], [2])
        t.insert([1], [1])  # 1 is protected (2+ hits); 2 evicted first even though more recent
        t.match_prefix([2])
    assert _order("slru", setup) == [2, 1]
    assert _order("lru", setup) == [1, 2]


def test_lookups_are_not_hits_and_slru_threshold_is_a_parameter():
    t = RadixTree(policy="lfu")
    t.insert([1], [1])
    t.insert([2], [2])
    t.insert([2], [2])
    for _ in range(5):
        t.match_prefix([1])  # lookups never count (R1.8, R1.9): 1 stays at one hit, 2 has two
    assert t.evict(1).freed.tolist() == [1]
    t = RadixTree(policy="slru", slru_threshold=3)
    t.insert([1], [1])
    t.insert([2], [2])
    t.insert([1], [1])  # two hits: still probationary with a threshold of 3
    t.match_prefix([2])
    assert t.evict(1).freed.tolist() == [1]
    with pytest.raises(ValueError):
        RadixTree(policy="slru", slru_threshold=0)


def test_all_policies_known():
    assert set(POLICIES) == {"lru", "lfu", "fifo", "mru", "filo", "priority", "slru"}
    with pytest.raises(ValueError):
        RadixTree(policy="random")


def test_bigram_keys():
    t = RadixTree(bigram=True)
    r = t.insert([1, 2, 3, 4], [10, 11, 12, 13])
    assert r.adopted_len == 3 and r.tail.tolist() == [13]
    m = t.match_prefix([1, 2, 3, 9])
    assert m.matched_len == 2 and m.indices.tolist() == [10, 11]
    assert t.match_prefix([1, 3]).matched_len == 0
    ok(t)


def test_reset_refuses_while_locked_and_returns_all_slots():
    t = RadixTree()
    t.insert([1, 2, 3], [7, 8, 9])
    t.insert([4], [6], namespace=("x", ""))
    r = t.lock(t.match_prefix([1, 2]).node_id)
    with pytest.raises(LocksHeld):
        t.reset()
    assert t.cached_tokens == 4
    t.unlock(r)
    assert sorted(t.reset().device.tolist()) == [6, 7, 8, 9]
    assert t.cached_tokens == 0 and t.num_nodes == 0
    ok(t)


def test_counters_move():
    t = RadixTree()
    t.insert([1, 2, 3, 4], [1, 2, 3, 4])
    t.match_prefix([1, 2, 3, 4, 5, 6])
    t.match_prefix([9, 9])
    c = t.counters
    assert (c.hit_tokens, c.queried_tokens, c.inserted_tokens) == (4, 8, 4)
    t.evict(4)
    assert c.evicted_tokens_device == 4


def test_checker_reports_corruption():
    t = RadixTree()
    t.insert([1, 2, 3], [1, 2, 3])
    t.evictable_size += 1
    assert any("evictable_size" in v for v in t.check())
    t.evictable_size -= 1
    node = t._nodes[t.match_prefix([1, 2, 3]).node_id]
    node.lock_ref = 2
    assert any("lock_ref" in v for v in t.check())
    node.lock_ref = 0
    node.last_access += 100  # LRU: a heap key behind its node's access is lazy, and legal (eviction re-sorts it)
    assert t.check() == []
    node.last_access -= 200  # ahead of it: an LRU key never falls
    assert any("stale" in v for v in t.check())
    lfu = RadixTree(policy="lfu")  # any other policy: every change re-sorts at once
    lfu.insert([1, 2, 3], [1, 2, 3])
    lfu._nodes[lfu.match_prefix([1, 2, 3]).node_id].last_access += 100
    assert any("stale" in v for v in lfu.check())


def test_lazy_lru_evicts_in_access_order():
    """Matches leave an LRU tree's heap entries behind; eviction still takes the least recently used leaf first,
    exactly as a policy that re-sorts on every access (priority, all equal) does."""
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 50, 24).tolist() for _ in range(40)]
    lazy, eager = RadixTree(page_size=4), RadixTree(page_size=4, policy="priority")
    assert lazy._lazy and not eager._lazy
    for t in (lazy, eager):
        for i, p in enumerate(prompts):
            t.insert(p, list(range(1000 * i, 1000 * i + len(p))))
    for i, n in zip(rng.integers(0, 40, 300), rng.integers(4, 25, 300)):  # ends inside edges split them
        for t in (lazy, eager):
            t.match_prefix(prompts[i][:n])
    pushed = len(lazy._heap)
    for i in rng.integers(0, 40, 300):  # whole prompts: every match ends at a leaf
        for t in (lazy, eager):
            t.match_prefix(prompts[i])
    assert len(lazy._heap) == pushed  # no entry per match
    while lazy.cached_tokens:
        n = int(rng.integers(1, 30))
        a, b = lazy.evict(n), eager.evict(n)
        assert a.freed.tolist() == b.freed.tolist()
        assert lazy.check() == [] and eager.check() == []
