"""KV events of the tree: the frozen page-hash chain (known answers), emission points, coalescing."""
import hashlib
import os
import struct

import numpy as np
import pytest

from radixd.server.tree import RadixTree
from radixd.server.tree.events import AllBlocksCleared, BlockRemoved, BlockStored, Coalescer
from radixd.server.tree.hashes import token_block_hashes


def _ref_block_hashes(tokens, page, salt=""):
    """The scheme written out independently: hex digests, first 16 hex digits, two's complement."""
    prior = hashlib.sha256(b"sglang-cache-salt-v1\x00" + salt.encode()).digest() if salt else b""
    out = []
    for i in range(0, len(tokens) - len(tokens) % page, page):
        h = hashlib.sha256(prior + b"".join(struct.pack("<I", t) for t in tokens[i:i + page]))
        prior = h.digest()
        v = int(h.hexdigest()[:16], 16)
        out.append(v - (1 << 64) if v >= 1 << 63 else v)
    return out


def test_known_answers_for_the_page_hash_chain():
    toks = [1, 2, 3, 4, 70000, 5]
    assert token_block_hashes(toks, 2) == _ref_block_hashes(toks, 2)
    assert token_block_hashes(toks, 2, "s") == _ref_block_hashes(toks, 2, "s") != _ref_block_hashes(toks, 2)
    # pinned values: a change of scheme must fail here, not silently in a router
    assert token_block_hashes([1, 2, 3, 4], 2) == [3817746824117602890, -4216701448867210342]
    assert token_block_hashes([1, 2], 2, cache_salt="tenant-a") == [31502315585564397]


def _events(t):
    evs, lost = t.take_events()
    assert lost == 0
    return evs


def test_emission_points_media_and_coalescing():
    t = RadixTree(page_size=2, write_policy="write_through", events=True)
    r = t.insert([1, 2, 3, 4], [10, 11, 12, 13])
    (ev,) = _events(t)
    assert isinstance(ev, BlockStored) and ev.medium == "GPU" and ev.parent_block_hash is None
    assert ev.block_hashes == token_block_hashes([1, 2, 3, 4], 2) and ev.token_ids == [1, 2, 3, 4]
    t.match_prefix([1, 2])  # a split emits nothing
    assert _events(t) == []
    for a in r.backups:
        t.commit_backup(a.ack, np.arange(100, 100 + a.tokens))
    assert _events(t) == []  # not acknowledged yet
    for a in r.backups:
        t.finish_backup(a.ack)
    (ev,) = _events(t)  # the two fragments' stores coalesce: the chain continues
    assert ev.medium == "CPU_PINNED" and ev.block_hashes == token_block_hashes([1, 2, 3, 4], 2)
    t.evict(4)
    (ev,) = _events(t)  # two demotions, one merged remove
    assert isinstance(ev, BlockRemoved) and ev.medium == "GPU" and sorted(ev.block_hashes) == sorted(
        token_block_hashes([1, 2, 3, 4], 2))
    t.evict_host(4)
    (ev,) = _events(t)
    assert isinstance(ev, BlockRemoved) and ev.medium == "CPU_PINNED"
    for a in t.insert([5, 6], [1, 2]).backups:
        t.commit_backup(a.ack, [7, 8])
        t.finish_backup(a.ack)
    t.reset()
    assert isinstance(_events(t)[-1], AllBlocksCleared)


def test_namespaced_chain_uses_the_salt_and_ignores_extra_key():
    t = RadixTree(page_size=2, events=True)
    t.insert([1, 2, 3, 4], [1, 2, 3, 4], namespace=("lora-x", ""))
    t.insert([1, 2, 3, 4], [5, 6, 7, 8], namespace=("lora-x", "tenant-a"))
    a, b = _events(t)
    assert a.block_hashes == token_block_hashes([1, 2, 3, 4], 2) and a.cache_salt is None
    assert b.block_hashes == token_block_hashes([1, 2, 3, 4], 2, "tenant-a") and b.cache_salt == "tenant-a"


def test_child_events_chain_to_the_parent_block():
    t = RadixTree(page_size=1, events=True)
    t.insert([1, 2], [1, 2])
    (first,) = _events(t)
    t.insert([1, 2, 3], [1, 2, 3])
    (second,) = _events(t)
    assert second.parent_block_hash == first.block_hashes[-1]
    t.insert([1, 2, 4], [1, 2, 4])
    t.insert([1, 2, 4, 5], [1, 2, 4, 5])
    (both,) = _events(t)  # queued together, the second continues the first's chain: one event
    assert both.block_hashes == token_block_hashes([1, 2, 4, 5], 1)[2:]


def test_coalescing_merges_only_compatible_neighbours():
    c = Coalescer()
    c.push(BlockStored([1], None, [0], 1, "GPU"))
    c.push(BlockStored([2], 1, [0], 1, "GPU"))  # continues the chain: merged
    c.push(BlockStored([9], 5, [0], 1, "GPU"))  # does not: new event
    c.push(BlockStored([10], 9, [0], 1, "CPU_PINNED"))  # continues, but another medium: new event
    c.push(BlockRemoved([3], "GPU"))
    c.push(BlockRemoved([4], "GPU"))  # same medium: merged
    assert [e.block_hashes for e in c.events] == [[1, 2], [9], [10], [3, 4]]


def test_raw_queue_is_bounded_and_counts_what_it_dropped():
    t = RadixTree(page_size=1, events=True, events_limit=2)
    for i in range(4):
        t.insert([100 + i], [i])
    raw, lost = t.take_raw_events()
    assert len(raw) == 2 and lost == 2
    assert [e.token_ids for e in raw.materialize()] == [[100], [101]]
    assert t.take_raw_events()[1] == 0


def test_events_off_computes_nothing():
    t = RadixTree(page_size=1)
    t.insert([1, 2, 3], [1, 2, 3])
    assert t.take_events() == ([], 0)
    assert all(n.hashes is None for n in t.iter_nodes())


def test_native_chain_equals_the_python_reference():
    from radixd.server.tree import hashes
    if not hashes.NATIVE:
        assert not os.environ.get("RADIXD_REQUIRE_NATIVE"), "the native chain was not built (OpenSSL headers?)"
        pytest.skip("the native chain was not built (no OpenSSL headers at install): Python hashes alone")
    rng = np.random.default_rng(3)
    for step in (4, 8, 64, 256):
        data = rng.bytes(step * 37)
        for prior in (None, b"", rng.bytes(32)):
            assert hashes.chain(data, step, prior) == hashes.py_chain(data, step, prior)
    with pytest.raises(ValueError):
        hashes.chain(b"x" * 10, 4, None)  # not whole pages
    with pytest.raises(ValueError):
        hashes.chain(b"x" * 8, 4, b"short")


def test_first_page_hash_from_every_token_type_equals_the_reference():
    """The hash an engine takes of each arriving request (the native call reads its token ids where they lie:
    SGLang's array('q'), vLLM's lists, int32 buffers) against hashlib's chain, for every type and salt."""
    from array import array

    from radixd.server.tree import hashes
    if not hashes.NATIVE:
        assert not os.environ.get("RADIXD_REQUIRE_NATIVE"), "the native chain was not built (OpenSSL headers?)"
        pytest.skip("the native chain was not built (no OpenSSL headers at install): Python hashes alone")
    rng = np.random.default_rng(5)
    for page in (1, 2, 16, 300):  # (300: past the native call's stack buffer)
        toks = rng.integers(0, 1 << 32, page + 7, dtype=np.int64).tolist()
        toks[0] = (1 << 32) - 1  # the top of the range
        for salt in ("", "tenant-a"):
            want = _ref_block_hashes(toks[:page], page, salt)[0]
            assert hashes.first_block_hash(toks, page, salt) == want
            assert hashes.first_block_hash([np.int64(t) for t in toks], page, salt) == want  # (numpy's ints)
            assert hashes.first_block_hash(array("q", toks), page, salt) == want
            assert hashes.first_block_hash(array("Q", toks), page, salt) == want
            assert hashes.first_block_hash(array("L", toks), page, salt) == want
            assert hashes._native_first(np.asarray(toks, dtype=np.uint32), page,
                                        hashes.salt_seed(salt)) == want
            small = [t % 30000 for t in toks]
            want_small = _ref_block_hashes(small[:page], page, salt)[0]
            for code in "bhiq":
                if code in "bh" and max(small) >= 1 << (8 * array(code).itemsize - 1):
                    continue
                assert hashes.first_block_hash(array(code, small), page, salt) == want_small
            assert hashes._native_first(np.asarray(small, dtype=np.int32), page, None) == \
                _ref_block_hashes(small[:page], page)[0]
    for bad in ([1, -1], array("q", [1, -1]), [1, 1 << 32], array("q", [1 << 40, 1])):
        with pytest.raises(OverflowError):
            hashes.first_block_hash(bad, 2)
    with pytest.raises(ValueError):
        hashes._native_first([1], 2, None)  # no whole page
    with pytest.raises(ValueError):
        hashes._native_first([1, 2], 2, b"short")
    with pytest.raises(TypeError):
        hashes._native_first([1, "x"], 2, None)
    with pytest.raises(TypeError):
        hashes._native_first(np.zeros(4, np.float32), 2, None)

def test_lazy_digests_resolve_on_another_thread_while_the_tree_changes():
    """The server's split: the request path records, a publisher thread hashes; the result is exact."""
    import queue
    import threading

    from .tier_model import EventFollower
    t = RadixTree(page_size=2, write_policy="write_through", events=True)
    q: queue.SimpleQueue = queue.SimpleQueue()
    follower = EventFollower()

    def publisher():
        while (raw := q.get()) is not None:
            follower.apply(raw.materialize())

    th = threading.Thread(target=publisher)
    th.start()
    rng = np.random.default_rng(11)
    slot = 0
    for _ in range(3000):
        toks = rng.integers(0, 6, int(rng.integers(1, 12)) * 2)
        op = rng.integers(4)
        if op == 0:
            r = t.insert(toks, np.arange(slot, slot + toks.size))
            slot += toks.size
            for a in r.backups:
                t.commit_backup(a.ack, np.arange(slot, slot + a.tokens))
                slot += a.tokens
                t.finish_backup(a.ack)
        elif op == 1:
            t.match_prefix(toks)  # splits nodes whose digests may still be unhashed
        elif op == 2:
            t.evict(int(rng.integers(1, 30)))
        else:
            t.evict_host(int(rng.integers(1, 30)))
        raw, lost = t.take_raw_events()
        assert lost == 0
        if raw.records:
            q.put(raw)
    q.put(None)
    th.join()
    from collections import Counter

    from radixd.server.tree.hashes import block_hashes
    want = {"GPU": Counter(), "CPU_PINNED": Counter()}
    for nd in t.iter_nodes():
        if nd.parent is not None:
            hs = block_hashes(t._digests(nd))
            if nd.value is not None:
                want["GPU"].update(hs)
            if nd.host_value is not None and not nd.pending:
                want["CPU_PINNED"].update(hs)
    assert {m: +c for m, c in follower.media.items()} == want and sum(want["GPU"].values()) > 0
    assert t.check() == []
