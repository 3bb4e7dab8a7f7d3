"""KV events of the tree: the frozen page-hash chain (known answers), emission points, coalescing."""
import hashlib
import os
import struct

import numpy as np
import pytest

from radixd.server.tree import RadixTree
from radixd.server.tree.events import AllBlocksCleared, BlockRemoved, BlockStored, Coalescer
from radixd.server.tree.hashes import token_block_hashes


def _ref_block_hashes(tokens, page, salt="", lora=""):
    """The scheme written out independently: hex digests, first 16 hex digits, two's complement; a namespace's
    hashes then re-hashed with its seed (SGLang's Dynamo event format)."""
    prior = hashlib.sha256(b"sglang-cache-salt-v1\x00" + salt.encode()).digest() if salt else b""
    out = []
    for i in range(0, len(tokens) - len(tokens) % page, page):
        h = hashlib.sha256(prior + b"".join(struct.pack("<I", t) for t in tokens[i:i + page]))
        prior = h.digest()
        v = int(h.hexdigest()[:16], 16)
        out.append(v - (1 << 64) if v >= 1 << 63 else v)
    if not (salt or lora):
        return out
    seed = hashlib.sha256(b"sglang-kv-event-namespace-v1")
    for part in (lora, salt):
        seed.update(b"\x01" + struct.pack("<Q", len(part.encode())) + part.encode() if part else b"\x00")
    return [struct.unpack(">q", hashlib.sha256(seed.digest() + struct.pack(">q", v)).digest()[:8])[0] for v in out]


def test_known_answers_for_the_page_hash_chain():
    toks = [1, 2, 3, 4, 70000, 5]
    assert token_block_hashes(toks, 2) == _ref_block_hashes(toks, 2)
    assert token_block_hashes(toks, 2, "s") == _ref_block_hashes(toks, 2, "s") != _ref_block_hashes(toks, 2)
    assert token_block_hashes(toks, 2, extra_key="a") == _ref_block_hashes(toks, 2, lora="a") != \
        _ref_block_hashes(toks, 2)
    both = token_block_hashes(toks, 2, "s", "a")
    assert both == _ref_block_hashes(toks, 2, "s", "a") not in (_ref_block_hashes(toks, 2, "s"),
                                                                 _ref_block_hashes(toks, 2, lora="a"))
    # pinned values: a change of scheme must fail here, not silently in a router (the namespaced ones as
    # SGLang 0.5.23's kv_event_namespace_seed and namespaced_block_hash compute them)
    assert token_block_hashes([1, 2, 3, 4], 2) == [3817746824117602890, -4216701448867210342]
    assert token_block_hashes([1, 2], 2, extra_key="adapter-b") == [-7207481173606926673]
    assert token_block_hashes([1, 2], 2, cache_salt="tenant-a") == [552704225747113539]
    assert token_block_hashes([1, 2], 2, cache_salt="tenant-a", extra_key="adapter-b") == [-5559624396518388732]


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


def test_every_namespace_publishes_its_own_block_hashes():
    """The same tokens under no adapter, two adapters and a salt: four sets of hashes, stored and removed alike
    (a router that identifies pages by hash must never take one namespace's copy for another's)."""
    t = RadixTree(page_size=2, events=True)
    spaces = [("", ""), ("lora-x", ""), ("lora-y", ""), ("lora-x", "tenant-a")]
    for i, ns in enumerate(spaces):
        t.insert([1, 2, 3, 4, 5, 6], [10 * i + j for j in range(6)], namespace=ns)
    stores = _events(t)
    assert [(e.lora_name, e.cache_salt) for e in stores] == [(lora or None, salt or None) for lora, salt in spaces]
    for e, (lora, salt) in zip(stores, spaces):
        assert e.block_hashes == token_block_hashes([1, 2, 3, 4, 5, 6], 2, salt, lora)
    assert len({h for e in stores for h in e.block_hashes}) == 12
    t.insert([1, 2, 3, 4, 7, 8], [90, 91, 92, 93, 94, 95], namespace=("lora-x", ""))  # a split, then a child
    (child,) = _events(t)
    assert child.parent_block_hash == token_block_hashes([1, 2, 3, 4], 2, extra_key="lora-x")[-1]
    assert child.block_hashes == token_block_hashes([1, 2, 3, 4, 7, 8], 2, extra_key="lora-x")[2:]
    t.evict(100)
    removed = [h for e in _events(t) for h in e.block_hashes]
    assert sorted(removed) == sorted({h for e in stores + [child] for h in e.block_hashes})


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
        for salt, lora in (("", ""), ("tenant-a", ""), ("", "adapter"), ("tenant-a", "adapter")):
            want = _ref_block_hashes(toks[:page], page, salt, lora)[0]
            assert hashes.first_block_hash(toks, page, salt, lora) == want
            assert hashes.first_block_hash(array("q", toks), page, salt, lora) == want
        for salt in ("", "tenant-a"):
            want = _ref_block_hashes(toks[:page], page, salt)[0]
            assert hashes.first_block_hash(toks, page, salt) == want
            assert hashes.first_block_hash([np.int64(t) for t in toks], page, salt) == want  # (numpy's ints)
            assert hashes.first_block_hash(array("q", toks), page, salt) == want
            assert hashes.first_block_hash(array("Q", toks), page, salt) == want
            assert hashes.first_block_hash(array("L", toks), page, salt) == want
            chained = hashes._native_first(np.asarray(toks, dtype=np.uint32), page, hashes.salt_seed(salt))
            assert hashes.namespaced([chained], hashes.event_seed("", salt))[0] == want
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
