"""The first-pages table in shared memory (`radixd.client.firsts`): against a plain set under random adds, removes and
resets (tombstones, rebuilds into the other half, the marker values), and read lock-free by a separate process while
another writes: a page that stays is never missed. The relay's event follower that writes it keeps the first pages
(and only those) of what a plain BlockIndex holds, batch by batch."""
from __future__ import annotations

import multiprocessing as mp
import random

from hypothesis import given, settings, strategies as st

from radixd.client.events import BlockIndex, event_dicts
from radixd.client.firsts import FirstPages, _key
from radixd.client.relay import _apply_first_pages
from radixd.proto import cache_pb2 as pb

HASHES = st.sampled_from([0, 1, 2, -1, 3, 1025, 2049, -(2 ** 63), 2 ** 63 - 1] + list(range(100, 140)))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["add", "remove", "reset"]), st.lists(HASHES, max_size=6)), max_size=60))
def test_the_table_holds_what_a_set_holds(ops):
    t = FirstPages.create(4)  # 1024 slots: adds and removes on few keys churn tombstones into rebuilds
    ref: dict[int, int] = {}  # key -> pages under it (0 and 1, the markers, are stored as 2 and 3: they share those)
    try:
        for op, hs in ops:
            for _ in range(30 if op != "reset" else 1):  # (many rounds: tombstones past half the table)
                if op == "add":
                    for h in hs:
                        t.add(h)
                        ref[_key(h)] = ref.get(_key(h), 0) + 1
                elif op == "remove":
                    for h in hs:
                        t.remove(h)
                        if ref.get(_key(h), 0) > 1:
                            ref[_key(h)] -= 1
                        else:
                            ref.pop(_key(h), None)
                else:
                    t.reset(hs)
                    ref = {}
                    for h in hs:
                        ref[_key(h)] = ref.get(_key(h), 0) + 1
            for h in [0, 1, 2, -1, 3, 1025, 2049, -(2 ** 63), 2 ** 63 - 1] + list(range(100, 140)):
                assert (h in t) == (_key(h) in ref), (h, op)
    finally:
        t.close()


def _reader(fd: int, stable: list[int], rounds: int, out) -> None:
    t = FirstPages(fd)
    missed = 0
    for _ in range(rounds):
        for h in stable:
            if h not in t:
                missed += 1
    out.put(missed)


def test_a_reader_in_another_process_never_misses_a_page_that_stays():
    """A writer churns pages in and out (tombstones, rebuilds) while a reader process probes the stable ones."""
    rng = random.Random(5)
    t = FirstPages.create(64)
    stable = [rng.getrandbits(63) for _ in range(64)]
    for h in stable:
        t.add(h)
    ctx = mp.get_context("fork")  # (the child inherits the memfd and maps it itself)
    out = ctx.Queue()
    p = ctx.Process(target=_reader, args=(t.fd, stable, 3000, out))
    p.start()
    churn = [rng.getrandbits(63) for _ in range(200)]
    resets = 0
    while p.is_alive():
        for h in churn:
            t.add(h)
        for h in churn:
            t.remove(h)
        if rng.random() < 0.1:
            t.reset(stable)
            resets += 1
    missed = out.get(timeout=30)
    p.join(10)
    t.close()
    assert p.exitcode == 0 and missed == 0 and resets > 0


def _batch(seq: int, events: list) -> pb.EventBatch:
    b = pb.EventBatch(seq=seq)
    for kind, medium, hashes, parent in events:
        ev = b.events.add()
        if kind == "stored":
            ev.stored.medium = medium
            ev.stored.block_hashes.extend(hashes)
            if parent is not None:
                ev.stored.parent_block_hash = parent
        elif kind == "removed":
            ev.removed.medium = medium
            ev.removed.block_hashes.extend(hashes)
        else:
            ev.cleared.SetInParent()
    return b


@settings(max_examples=150, deadline=None)
@given(st.lists(st.lists(st.tuples(st.sampled_from(["stored", "stored", "removed", "cleared"]),
                                   st.sampled_from(["GPU", "CPU_PINNED"]), st.integers(0, 5), st.booleans()),
                         max_size=5), max_size=25))
def test_the_follower_keeps_the_first_pages_a_block_index_holds(batches):
    """Random chains (a first page of 6 and deeper pages), stored on either medium and removed leaf-first: after
    every batch the table holds exactly the first pages a plain BlockIndex counts on the followed media."""
    roots = [[1000 * (r + 1) + i for i in range(4)] for r in range(6)]  # 6 chains of 4 pages; page 0 is a first page
    depth = {("GPU", r): 0 for r in range(6)} | {("CPU_PINNED", r): 0 for r in range(6)}
    ref = BlockIndex(16)
    t = FirstPages.create(64)
    counts: dict = {}
    held: dict = {}
    media = {"GPU", "CPU_PINNED"}
    for seq, spec in enumerate(batches):
        events = []
        for kind, medium, r, deeper in spec:
            d = depth[medium, r]
            if kind == "stored" and d < 4:
                n = 2 if deeper else 1
                chain = roots[r][d:d + n]
                events.append(("stored", medium, chain, roots[r][d - 1] if d else None))
                depth[medium, r] = d + len(chain)
            elif kind == "removed" and d:
                events.append(("removed", medium, [roots[r][d - 1]], None))  # leaf first, as eviction goes
                depth[medium, r] = d - 1
            elif kind == "cleared":
                events.append(("cleared", "", [], None))
                depth = {k: 0 for k in depth}
        b = _batch(seq, events)
        _apply_first_pages(b, counts, held, media, t)
        ref.apply("n", event_dicts(b))
        for r in range(6):
            h = roots[r][0]
            want = any(ref.blocks("n", m)[h] for m in media)
            assert (h in t) == want, (r, seq)
            for deep in roots[r][1:]:
                assert deep not in t
    t.close()


def test_only_the_followed_media_count():
    t = FirstPages.create(16)
    counts: dict = {}
    held: dict = {}
    _apply_first_pages(_batch(0, [("stored", "CPU_PINNED", [7, 8], None), ("stored", "GPU", [9], None)]),
                       counts, held, {"GPU"}, t)
    assert 9 in t and 7 not in t and 8 not in t
    _apply_first_pages(_batch(1, [("removed", "CPU_PINNED", [9], None)]), counts, held, {"GPU"}, t)
    assert 9 in t  # (removed from a medium that was never counted)
    _apply_first_pages(_batch(2, [("removed", "GPU", [9], None)]), counts, held, {"GPU"}, t)
    assert 9 not in t
    t.close()
