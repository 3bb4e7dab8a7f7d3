"""BlockIndex keeps a multiset of block hashes per node and medium, whatever order stores and removes come in."""
from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from radixd.client.events import BlockIndex

hashes = st.lists(st.integers(-3, 3), max_size=6)
event = st.one_of(
    st.builds(lambda h, m: dict(type="BlockStored", block_hashes=h, parent_block_hash=None, token_ids=[],
                                block_size=1, medium=m), hashes, st.sampled_from(["GPU", "CPU_PINNED"])),
    st.builds(lambda h, m: dict(type="BlockRemoved", block_hashes=h, medium=m), hashes,
              st.sampled_from(["GPU", "CPU_PINNED"])),
    st.just(dict(type="AllBlocksCleared")))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(event, max_size=4), max_size=12))
def test_apply_matches_a_plain_multiset(batches):
    idx = BlockIndex(1)
    ref = {"GPU": Counter(), "CPU_PINNED": Counter()}
    for batch in batches:
        idx.apply("n", batch)
        for ev in batch:
            if ev["type"] == "BlockStored":
                ref[ev["medium"]].update(ev["block_hashes"])
            elif ev["type"] == "BlockRemoved":
                for h in ev["block_hashes"]:  # a remove of a block never stored is ignored
                    if ref[ev["medium"]][h] > 0:
                        ref[ev["medium"]][h] -= 1
                ref[ev["medium"]] = +ref[ev["medium"]]
            else:
                ref = {m: Counter() for m in ref}
        for m in ref:
            assert idx.blocks("n", m) == ref[m]
