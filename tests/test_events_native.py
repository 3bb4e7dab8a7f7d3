"""The native KV event encoder (server/_kvevents.c): byte for byte what the Python path publishes."""
from __future__ import annotations

import os

import msgspec
import numpy as np
import pytest

from radixd.server import events as hub
from radixd.server.tree import RadixTree
from radixd.server.tree.events import BlockRemoved, BlockStored


def _python_payload(ts: float, evs) -> bytes:
    return hub.python_payload(ts, evs)


@pytest.fixture(autouse=True)
def _native():
    if not hub.NATIVE:
        assert not os.environ.get("RADIXD_REQUIRE_NATIVE"), "the native event encoder was not built"
        pytest.skip("the native event encoder was not built (no OpenSSL headers at install)")


@pytest.mark.parametrize("page,bigram,policy", [(1, False, "write_through"), (4, False, "write_back"),
                                                (2, True, "write_through"), (16, False, None)])
def test_native_batches_equal_the_python_path_and_resolve_the_same_digests(page, bigram, policy):
    """Two trees, one operation sequence: one published through Python, one natively; every batch equal."""
    kw = dict(page_size=page, bigram=bigram, events=True, **({"write_policy": policy} if policy else {}))
    trees = RadixTree(**kw), RadixTree(**kw)
    host = {id(t): 0 for t in trees}
    rng = np.random.default_rng(page)
    slot = batches = 0

    def backup(t, actions):
        for a in actions:
            t.commit_backup(a.ack, np.arange(host[id(t)], host[id(t)] + a.tokens))
            host[id(t)] += a.tokens
            t.finish_backup(a.ack)

    for step in range(800):
        toks = rng.integers(0, 5, int(rng.integers(1, 10)) * page + bigram).astype(np.int32)
        ns = [("", ""), ("", "tenant"), ("lora", "")][int(rng.integers(3))]
        op, k = int(rng.integers(5)), int(rng.integers(1, 40))
        for t in trees:
            if op == 0:
                backup(t, getattr(t.insert(toks, np.arange(slot, slot + toks.size - bigram), namespace=ns),
                                  "backups", ()))
            elif op == 1:
                t.match_prefix(toks, ns)  # splits nodes whose digests are not hashed yet
            elif op == 2:
                backup(t, getattr(t.evict(k), "write_backs", ()))
            elif op == 3 and policy:
                t.evict_host(k)
            elif op == 4 and step % 200 == 199:
                t.reset()
        slot += toks.size
        (py, _), (nat, _) = (t.take_raw_events() for t in trees)
        assert len(py) == len(nat)
        if len(py):
            batches += 1
            got = hub.native_payload(nat, 1.5)
            assert got == _python_payload(1.5, py.materialize()), msgspec.msgpack.decode(got)
    assert batches > 100
    assert trees[1].check() == []  # the digests the encoder stored back continue every chain
    by_id = [sorted(t.iter_nodes(), key=lambda n: n.id) for t in trees]
    for a, b in zip(*by_id):
        if a.parent is not None:
            assert trees[0]._digests(a) == trees[1]._digests(b)


def test_bad_records_raise_and_change_nothing():
    with pytest.raises(TypeError):
        hub._native_encode([("not a record",)], 0.0, 1, 4, False)
    with pytest.raises(ValueError):
        hub._native_encode([], 0.0, 1, 3, False)
    assert msgspec.msgpack.decode(hub._native_encode([], 2.0, 1, 4, False)) == [2.0, [], None]
