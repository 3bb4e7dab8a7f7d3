"""Two-tier edge cases, one per numbered case of SPEC-tiers section 11 that applies to device + host."""
import numpy as np
import pytest

from radixd.server.tree import (InFlight, InvalidInput, LocksHeld, RadixTree, StaleHandle, StateConflict,
                                UnknownReceipt)

HOST = 1000


def ok(t: RadixTree) -> None:
    assert t.check() == []


class Host:
    """Hands out host slots the way an engine would (never reused within a test)."""

    def __init__(self):
        self.next = HOST

    def take(self, n: int) -> np.ndarray:
        out = np.arange(self.next, self.next + n, dtype=np.int32)
        self.next += n
        return out


def backed(t: RadixTree, h: Host, actions, finish: bool = True) -> None:
    """Execute backup actions the way the engine does: commit in order, then finish."""
    for a in actions:
        t.commit_backup(a.ack, h.take(a.tokens))
        ok(t)
    if finish:
        for a in actions:
            t.finish_backup(a.ack)
            ok(t)


def node(t: RadixTree, nid: int):
    return t._nodes[nid]


# ---------------------------------------------------------------- 11.1 demote vs delete
def test_backed_up_leaf_is_demoted_and_its_parent_becomes_a_leaf():
    t, h = RadixTree(write_policy="write_through"), Host()
    backed(t, h, t.insert([1, 2], [10, 11]).backups)
    backed(t, h, t.insert([1, 2, 3, 4], [10, 11, 12, 13]).backups)
    leaf = t.match_prefix([1, 2, 3, 4]).node_id
    parent = node(t, leaf).parent
    r = t.evict(2)
    assert r.freed.tolist() == [12, 13] and r.demoted_tokens == 2
    assert node(t, leaf).tier == "host" and parent in t._leaves and node(t, leaf) in t._hleaves
    m = t.match_prefix([1, 2, 3, 4])
    assert (m.matched_len, m.host_hit_len, m.best_node_id) == (2, 2, leaf)
    ok(t)


def test_host_hits_on_a_demoted_leaf_do_not_grow_the_host_heap():
    t, h = RadixTree(write_policy="write_through"), Host()
    backed(t, h, t.insert([1, 2], [10, 11]).backups)
    backed(t, h, t.insert([1, 2, 3, 4], [10, 11, 12, 13]).backups)
    assert t.evict(2).demoted_tokens == 2
    for i in range(3000):
        assert t.match_prefix([1, 2, 3, 4]).host_hit_len == 2
        if i % 997 == 0:
            ok(t)  # the checker bounds each heap by the live leaves
    assert len(t._hheap) <= 2 * len(t._hleaves) + 1024
    assert t.evict_host(2).evicted_tokens == 2
    ok(t)


def test_unbacked_leaf_is_deleted_under_write_through_and_empty_parents_go():
    t = RadixTree(write_policy="write_through_selective", write_through_threshold=5)
    t.insert([1, 2], [10, 11], namespace=("ns", ""))
    r = t.evict(2)
    assert r.freed.tolist() == [10, 11] and r.demoted_tokens == 0 and not r.write_backs
    assert t.num_nodes == 0 and ("ns", "") not in t._roots  # tombstone walk removed the empty root
    ok(t)


def test_unbacked_leaf_is_written_back_then_demoted_under_write_back():
    t, h = RadixTree(write_policy="write_back"), Host()
    r = t.insert([1, 2, 3], [10, 11, 12])
    assert not r.backups  # write-back copies only when evicting
    e = t.evict(3)
    assert e.evicted_tokens == 0 and [a.device_slots.tolist() for a in e.write_backs] == [[10, 11, 12]]
    assert t.evict(3).evicted_tokens == 0  # pending: protected, not evicted twice
    a = e.write_backs[0]
    t.commit_backup(a.ack, h.take(3))
    ok(t)
    done = t.finish_backup(a.ack)
    assert done.device.tolist() == [10, 11, 12]
    assert node(t, a.node_ids[0]).tier == "host"
    assert t.match_prefix([1, 2, 3]).host_hit_len == 3
    ok(t)


def test_failed_write_back_drops_the_unbacked_subtree():
    t = RadixTree(write_policy="write_back")
    t.insert([1, 2, 3], [10, 11, 12])
    e = t.evict(3)
    r = t.abort_backup(e.write_backs[0].ack)
    assert r.device.tolist() == [10, 11, 12] and t.num_nodes == 0
    ok(t)


# --------------------------------------------------------- 11.2 insert onto a host-only node
def test_insert_onto_host_only_node_adopts_fresh_slots():
    t, h = RadixTree(write_policy="write_through"), Host()
    backed(t, h, t.insert([1, 2, 3, 4], [10, 11, 12, 13]).backups)
    t.evict(4)
    r = t.insert([1, 2, 3, 4, 5], [20, 21, 22, 23, 24])
    assert (r.prefix_len, r.adopted_len, r.unevicted_len) == (0, 5, 4) and r.duplicates.size == 0
    assert t.match_prefix([1, 2, 3, 4]).indices.tolist() == [20, 21, 22, 23]
    n = node(t, t.match_prefix([1, 2, 3, 4]).node_id)
    assert n.tier == "both" and n.host_value is not None
    ok(t)


def test_overlap_of_both_state_node_frees_exactly_the_duplicates():
    t, h = RadixTree(write_policy="write_through"), Host()
    backed(t, h, t.insert([1, 2, 3, 4], [10, 11, 12, 13]).backups)
    r = t.insert([1, 2, 3, 4], [10, 11, 32, 33], prev_prefix_len=2)
    assert r.duplicates.tolist() == [32, 33] and r.adopted_len == 0 and not r.backups
    ok(t)


# ------------------------------------------------------ 11.3 splits with transfers in flight
def test_split_of_pending_backup_publishes_both_fragments():
    t, h = RadixTree(write_policy="write_through"), Host()
    r = t.insert([1, 2, 3, 4], [10, 11, 12, 13])
    (a,) = r.backups
    t.commit_backup(a.ack, h.take(4))
    m = t.match_prefix([1, 2])  # splits the pending node
    upper, lower = node(t, m.node_id), node(t, a.node_ids[0])
    assert lower.parent is upper and upper.pending == lower.pending == a.ack
    assert upper.lock_ref == lower.lock_ref == 1 and upper.host_value is not None
    ok(t)
    t.finish_backup(a.ack)
    assert upper.pending == lower.pending == 0 and upper.host_lock_ref == lower.host_lock_ref == 0
    assert lower in t._leaves
    ok(t)


def test_split_before_commit_spreads_host_slots_over_both_fragments():
    t = RadixTree(write_policy="write_through")
    (a,) = t.insert([1, 2, 3, 4], [10, 11, 12, 13]).backups
    up = t.match_prefix([1, 2]).node_id
    t.commit_backup(a.ack, [100, 101, 102, 103])
    assert node(t, up).host_value == np.array([100, 101], "<i4").tobytes()
    t.finish_backup(a.ack)
    ok(t)


def test_split_inside_a_load_back_segment_keeps_the_pin_and_loads_both():
    t, h = RadixTree(write_policy="write_through", load_back_threshold=1), Host()
    backed(t, h, t.insert([1, 2, 3, 4], [10, 11, 12, 13]).backups)
    t.evict(4)
    p = t.load_back(t.match_prefix([1, 2, 3, 4]).best_node_id)
    t.match_prefix([1, 2])  # splits the pinned, host-only node
    ok(t)
    assert t.commit_load_back(p.op, [40, 41, 42, 43]).tolist() == [40, 41, 42, 43]
    t.finish_load_back(p.op)
    assert t.match_prefix([1, 2, 3, 4]).indices.tolist() == [40, 41, 42, 43]
    t.unlock(p.op)
    ok(t)


def test_split_during_match_of_host_only_node():
    t, h = RadixTree(write_policy="write_through"), Host()
    backed(t, h, t.insert([1, 2, 3, 4], [10, 11, 12, 13]).backups)
    t.evict(4)
    m = t.match_prefix([1, 2, 9])
    assert (m.matched_len, m.host_hit_len) == (0, 2)
    assert node(t, m.best_node_id).host_value == np.array([HOST, HOST + 1], "<i4").tobytes()
    ok(t)


# ------------------------------------------------------------- 11.4 load-back all-or-nothing
def _demoted(t, h, tokens, slots):
    backed(t, h, t.insert(tokens, slots).backups)
    t.evict(len(tokens))
    return t.match_prefix(tokens)


def test_load_back_below_threshold_or_over_quota_changes_nothing():
    t, h = RadixTree(write_policy="write_through", load_back_threshold=10), Host()
    m = _demoted(t, h, [1, 2, 3], [10, 11, 12])
    assert t.load_back(m.best_node_id).reason == "threshold"
    t.load_back_threshold = 1
    before = (t.evictable_size, t.protected_size, t.host_evictable_size, t.host_protected_size)
    assert t.load_back(m.best_node_id, mem_quota=2).reason == "quota"
    assert t.load_back(m.best_node_id, device_free=0).reason == "no_room"
    assert (t.evictable_size, t.protected_size, t.host_evictable_size, t.host_protected_size) == before
    with pytest.raises(InvalidInput):
        t.load_back(m.best_node_id, mem_quota=-1)
    ok(t)


def test_quota_counts_newly_protected_tokens():
    """R2.7: reject when kv_tokens > mem_quota - newly_protected."""
    t, h = RadixTree(write_policy="write_through", load_back_threshold=1), Host()
    backed(t, h, t.insert([1, 2], [10, 11]).backups)
    backed(t, h, t.insert([1, 2, 3, 4, 5], [10, 11, 12, 13, 14]).backups)
    t.evict(3)
    m = t.match_prefix([1, 2, 3, 4, 5])
    assert (m.matched_len, m.host_hit_len) == (2, 3)
    assert t.load_back(m.best_node_id, mem_quota=4).reason == "quota"  # 3 > 4 - 2
    p = t.load_back(m.best_node_id, mem_quota=5)
    assert p.op and p.tokens == 3
    t.abort_load_back(p.op)
    ok(t)


def test_load_back_evicts_elsewhere_never_the_path_and_returns_whole_path():
    t, h = RadixTree(write_policy="write_through", load_back_threshold=1), Host()
    backed(t, h, t.insert([1, 2], [10, 11]).backups)
    backed(t, h, t.insert([1, 2, 3, 4], [10, 11, 12, 13]).backups)
    backed(t, h, t.insert([7, 8], [20, 21]).backups)
    t.evict(2)  # LRU: [3, 4] leaves the device first
    m = t.match_prefix([1, 2, 3, 4])
    p = t.load_back(m.best_node_id, device_free=0)
    assert p.evict_tokens == 2
    e = t.evict(p.evict_tokens)
    assert e.freed.tolist() == [20, 21]  # the locked path [1, 2] is safe
    assert t.commit_load_back(p.op, e.freed).tolist() == [10, 11, 20, 21]
    with pytest.raises(InFlight):
        t.unlock(p.op)
    assert t.match_prefix([1, 2, 3, 4]).matched_len == 2  # not visible before the copy finishes
    assert t.finish_load_back(p.op) == p.op
    assert t.match_prefix([1, 2, 3, 4]).indices.tolist() == [10, 11, 20, 21]
    assert t.evict(100).evicted_tokens == 0  # op is now a receipt over the whole path
    t.unlock(p.op)
    ok(t)


def test_failed_load_back_releases_everything():
    t, h = RadixTree(write_policy="write_through", load_back_threshold=1), Host()
    m = _demoted(t, h, [1, 2, 3], [10, 11, 12])
    snap = t.check(), t.evictable_size, t.host_protected_size
    p = t.load_back(m.best_node_id)
    t.commit_load_back(p.op, [5, 6, 7])
    assert t.abort_load_back(p.op).tolist() == [5, 6, 7]
    assert (t.check(), t.evictable_size, t.host_protected_size) == snap
    with pytest.raises(UnknownReceipt):
        t.finish_load_back(p.op)


def test_a_segment_is_not_loaded_twice_and_insert_stops_at_it():
    t, h = RadixTree(write_policy="write_through", load_back_threshold=1), Host()
    m = _demoted(t, h, [1, 2, 3], [10, 11, 12])
    p = t.load_back(m.best_node_id)
    assert t.load_back(m.best_node_id).reason == "pinned"
    r = t.insert([1, 2, 3, 4], [20, 21, 22, 23])  # another client computed it meanwhile
    assert (r.prefix_len, r.adopted_len, r.tail.tolist()) == (0, 0, [20, 21, 22, 23])
    ok(t)
    t.abort_load_back(p.op)
    ok(t)


def test_load_back_of_resident_node_loads_nothing():
    t = RadixTree(write_policy="write_through")
    t.insert([1, 2], [1, 2])
    assert t.load_back(t.match_prefix([1, 2]).node_id).reason == "resident"


# ------------------------------------------------------------------- 11.5 leaf-set boundaries
def test_d_leaf_may_have_host_only_children_h_leaf_must_be_childless():
    t, h = RadixTree(write_policy="write_through"), Host()
    backed(t, h, t.insert([1, 2], [10, 11]).backups)
    backed(t, h, t.insert([1, 2, 3], [10, 11, 12]).backups)
    t.evict(1)
    parent = node(t, t.match_prefix([1, 2]).node_id)
    child = node(t, t.match_prefix([1, 2, 3]).best_node_id)
    assert parent in t._leaves and child in t._hleaves and child.parent is parent
    t.evict(2)  # the parent is demoted too; it has a child, so it is no H-leaf
    assert parent.tier == "host" and parent not in t._hleaves and parent not in t._leaves
    assert t.evict_host(1).freed.tolist() == [HOST + 2]  # the child goes first, then its parent is a leaf
    assert parent in t._hleaves
    assert t.evict_host(5).freed.tolist() == [HOST, HOST + 1] and t.num_nodes == 0
    ok(t)


def test_host_locked_node_is_not_host_evicted():
    t, h = RadixTree(write_policy="write_through"), Host()
    m = _demoted(t, h, [1, 2], [10, 11])
    r = t.lock(m.best_node_id)
    assert t.evict_host(5).evicted_tokens == 0 and t.host_protected_size == 2
    t.unlock(r)
    assert t.evict_host(5).evicted_tokens == 2
    ok(t)


def test_host_counters_say_what_an_unbounded_evict_host_frees():
    """A host lock pins the host-only path above it: a locked 300-token path sharing 200 tokens with an
    unlocked one leaves 100 evictable and 300 protected; device-resident copies are not host-evictable
    under write-through."""
    t, h = RadixTree(write_policy="write_through"), Host()
    shared = list(range(1, 201))
    a, b = shared + list(range(1000, 1100)), shared + list(range(2000, 2100))
    backed(t, h, t.insert(a, list(range(300))).backups)
    backed(t, h, t.insert(b, list(range(200)) + list(range(300, 400))).backups)
    assert (t.host_evictable_size, t.host_protected_size) == (0, 400)  # all on device too: nothing to free
    t.evict(400)
    assert (t.host_evictable_size, t.host_protected_size) == (400, 0)
    r = t.lock(t.match_prefix(a).best_node_id)
    assert (t.host_evictable_size, t.host_protected_size) == (100, 300)
    ok(t)
    assert t.evict_host(10_000).evicted_tokens == 100
    assert (t.host_evictable_size, t.host_protected_size) == (0, 300)
    t.unlock(r)
    assert (t.host_evictable_size, t.host_protected_size) == (300, 0)
    assert t.evict_host(10_000).evicted_tokens == 300
    ok(t)


def test_write_back_reclaims_host_copies_of_device_nodes_first():
    t, h = RadixTree(write_policy="write_back", load_back_threshold=1), Host()
    t.insert([1, 2], [10, 11])
    t.insert([5, 6], [20, 21])
    backed(t, h, t.evict(4).write_backs)
    p = t.load_back(t.match_prefix([1, 2]).best_node_id)
    t.commit_load_back(p.op, [30, 31])
    t.finish_load_back(p.op)
    t.unlock(p.op)
    r = t.evict_host(2)  # [1, 2] is on both tiers: its host copy goes before the host-only [5, 6]
    assert r.freed.tolist() == [HOST, HOST + 1] and t.counters.reclaimed_host_tokens == 2
    assert t.match_prefix([5, 6]).host_hit_len == 2 and t.match_prefix([1, 2]).matched_len == 2
    ok(t)


# ------------------------------------------------------------- 11.7 write-through parent-first
def test_write_through_backs_up_ancestors_first():
    t = RadixTree(write_policy="write_through_selective", write_through_threshold=2)
    t.insert([1, 2], [10, 11])
    t.insert([1, 2, 3, 4], [10, 11, 12, 13])  # [1, 2] now has 2 hits: backed up alone
    r = t.insert([1, 2, 3, 4, 5], [10, 11, 12, 13, 14])
    assert [a.device_slots.tolist() for a in r.backups] == [[12, 13]]
    t2 = RadixTree(write_policy="write_through_selective", write_through_threshold=2)
    t2.insert([1, 2, 3], [10, 11, 12], chunked=True)
    t2.insert([1, 2, 3, 4, 5], [10, 11, 12, 13, 14], chunked=True)
    assert not t2.insert([1, 2, 3, 4, 5], [10, 11, 12, 13, 14]).backups  # one hit each
    r = t2.insert([1, 2, 3, 4, 5], [10, 11, 12, 13, 14])  # both cross: one action each, ancestors first
    assert [a.device_slots.tolist() for a in r.backups] == [[10, 11, 12], [13, 14]]
    assert len({a.ack for a in r.backups}) == 2


def test_child_commit_refused_without_backed_up_parent_and_abort_cascades():
    t = RadixTree(write_policy="write_through")
    t.insert([1, 2], [10, 11], chunked=True)  # chunked: no hits, no backup
    r = t.insert([1, 2, 3], [10, 11, 12])
    pa, ch = r.backups
    assert pa.device_slots.tolist() == [10, 11] and ch.device_slots.tolist() == [12]
    with pytest.raises(StateConflict):
        t.commit_backup(ch.ack, [HOST + 2])  # parent-first
    t.commit_backup(pa.ack, [HOST, HOST + 1])
    t.commit_backup(ch.ack, [HOST + 2])
    ok(t)
    freed = t.abort_backup(pa.ack)  # the parent's copy failed: the child's backup goes with it
    assert sorted(freed.host.tolist()) == [HOST, HOST + 1, HOST + 2]
    assert t.host_cached_tokens == 0 and t.num_transfers == 0
    ok(t)


def test_chunked_insert_counts_no_hits():
    t = RadixTree(write_policy="write_through")
    assert not t.insert([1, 2], [1, 2], chunked=True).backups
    assert node(t, t.match_prefix([1, 2]).node_id).hit_count == 0


# ------------------------------------------------------------- 11.9 receipts and handles
def test_receipts_and_handles_across_tiers():
    t, h = RadixTree(write_policy="write_through", instance_tag=3), Host()
    m = _demoted(t, h, [1, 2, 3], [10, 11, 12])
    r = t.lock(m.best_node_id)
    with pytest.raises(UnknownReceipt):
        t.unlock(r + 1000)
    t.unlock(r)
    with pytest.raises(UnknownReceipt):
        t.unlock(r)
    with pytest.raises(UnknownReceipt):
        t.commit_backup(12345 | (3 << 48), [1])
    t.evict_host(3)
    with pytest.raises(StaleHandle):
        t.load_back(m.best_node_id)
    ok(t)


def test_reset_refuses_with_transfers_and_returns_both_tiers():
    t, h = RadixTree(write_policy="write_through"), Host()
    (a,) = t.insert([1, 2], [10, 11]).backups
    t.commit_backup(a.ack, h.take(2))
    with pytest.raises(LocksHeld):
        t.reset()
    t.finish_backup(a.ack)
    f = t.reset()
    assert f.device.tolist() == [10, 11] and f.host.tolist() == [HOST, HOST + 1]
    ok(t)


# ---------------------------------------------------------------- fixes vs SGLang 0.5.23
def test_misses_in_new_namespaces_allocate_nothing():
    t = RadixTree()
    for i in range(1000):
        t.match_prefix([1, 2, 3], (f"s{i}", ""))
    assert len(t._roots) == 1 and len(t._nodes) == 1
    t.insert([1, 2], [1, 2], namespace=("a", ""))
    r = t.lock(t.match_prefix([9], ("a", "")).node_id)  # an empty match locks the namespace root
    t.evict(10**9)
    assert ("a", "") in t._roots
    t.unlock(r)
    assert len(t._roots) == 1
    ok(t)


def test_match_stamps_the_path_leaf_newest_and_split_tail_fresh():
    t = RadixTree()
    t.insert([1, 2, 3, 4], [1, 2, 3, 4])
    t.insert([9], [9])
    m = t.match_prefix([1, 2])
    upper = node(t, m.node_id)
    tail = next(iter(upper.children.values()))
    other = node(t, t.match_prefix([9]).node_id)
    assert upper.last_access > tail.last_access  # the path is newer than the split-off tail
    assert other.last_access > upper.last_access
    t.insert([1, 2, 7], [1, 2, 7])
    leaf = node(t, t.match_prefix([1, 2, 7]).node_id)
    assert leaf.last_access > leaf.parent.last_access
    ok(t)
