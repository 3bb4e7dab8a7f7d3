"""The hybrid tree (FULL + SWA + MAMBA): op-for-op against SGLang's own UnifiedRadixCache, property tests
against a slot-level reference with the checker after every step, and bad input."""
from __future__ import annotations

import subprocess
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from radixd.server.tree import InvalidInput, UnknownReceipt
from radixd.server.tree.events import BlockStored
from radixd.server.tree.hashes import token_block_hashes
from radixd.server.tree.hybrid import HybridTree
from radixd.server.tree.hybrid_check import check_hybrid

from .conftest import venv_python

SGL_PY = venv_python("RADIXD_SGLANG_PYTHON", ".venv-sglang")
DIFF = Path(__file__).resolve().parent / "hybrid_differential.py"


@pytest.mark.skipif(SGL_PY is None, reason="no SGLang venv (.ci/run builds .venv-sglang with sglang 0.5.23)")
@pytest.mark.parametrize("core", ["python", "rust"])
@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("config", ["swa", "mamba", "tri"])
def test_hybrid_tree_agrees_with_sglangs_unified_cache_op_by_op(config, page, core):
    """tests/hybrid_differential.py: 10,000 seeded scheduler operations on SGLang 0.5.23's UnifiedRadixCache
    (its own tree core) and on radixd's hybrid tree; any difference in matches, frees per component, evict
    counts or sizes fails with the step that diverged."""
    seed = {"swa": 101, "mamba": 202, "tri": 303}[config] + page + (7 if core == "rust" else 0)
    r = subprocess.run([SGL_PY, "-W", "ignore", str(DIFF), config, str(page), core, str(seed), "10000"],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    line = r.stdout.strip().splitlines()[-1]
    assert line.startswith(f"ok {config} page={page} core={core}"), line
    counts = eval(line.split("steps=10000 ")[1].split("}")[0] + "}")  # noqa: S307 (our own printed dict)
    assert counts["insert"] > 5000 and counts["evict"] > 1000 and counts["blind"] > 200, counts
    if config != "swa":
        assert counts["exist"] > 5, counts  # donated states refused because the end node had one
    if config != "mamba":
        assert counts["release_swa"] > 1000, counts


@pytest.mark.skipif(SGL_PY is None, reason="no SGLang venv (.ci/run builds .venv-sglang with sglang 0.5.23)")
@pytest.mark.parametrize("core", ["python", "rust"])
@pytest.mark.parametrize("page", [1, 16])
def test_the_mamba_states_per_path_cap_agrees_with_sglang(page, core):
    """SGLang's mamba_max_states_per_path (the Rust seed's cap, R5.14) at 2: the same shallow states dropped."""
    r = subprocess.run([SGL_PY, "-W", "ignore", str(DIFF), "tri", str(page), core, str(400 + page), "10000", "2"],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    line = r.stdout.strip().splitlines()[-1]
    assert line.startswith(f"ok tri page={page} core={core}") and " cap=2 " in line, line
    assert int(line.split("trimmed=")[1].split()[0]) > 10, line  # the cap did drop states


def tree_pages(t: HybridTree, page: int) -> dict[int, Counter]:
    """Per event group (the tree's `groups`), the page hashes the tree holds (a multiset), recomputed from its
    keys and namespaces: the cache_salt seeds the hashes; the extra_key is not hashed (as in the plain tree and
    SGLang), so one prefix cached under two adapters names the same pages twice."""
    want = {0: Counter(), 1: Counter(), 2: Counter()}
    g = t.groups  # (FULL 0, SWA and MAMBA after it; without FULL KV, FULL is not announced and the rest start at 0)
    for node in list(t._nodes.values()):
        if node.parent is None:
            continue
        path, walker = [], node
        while walker.parent is not None:
            path.append(walker.key)
            walker = walker.parent
        tokens = np.frombuffer(b"".join(reversed(path)), "<i4").tolist()
        pages = token_block_hashes(tokens, page, node.ns[1], node.ns[0])[-(node.n // page):]
        if t.full_kv:
            want[g["full"]].update(pages)
        if node.swa:
            want[g["swa"]].update(pages)
        if node.mamba >= 0:
            want[g["mamba"]][pages[-1]] += 1
    return want


class HybridMachine(RuleBasedStateMachine):
    """Random requests in three namespaces, unlocks and evictions; a reference of which FULL slot holds each
    cached position of which namespace."""

    PAGE, WINDOW, CHUNK = 2, 6, 4
    NAMESPACES = [("", ""), ("", "salt"), ("lora", "")]

    def __init__(self):
        super().__init__()
        self.tree = HybridTree(self.PAGE, window=self.WINDOW, mamba_chunk=self.CHUNK, events=True,
                               mamba_max_states_per_path=3, victims=True)
        self.blocks: dict[int, Counter] = {0: Counter(), 1: Counter(), 2: Counter()}  # what an event follower knows
        self.cap = 200
        self.free = list(range(self.cap))
        self.mfree = list(range(1000, 1020))
        self.at: dict[int, tuple] = {}  # FULL slot -> the token prefix (through its position) it caches
        self.held: list[tuple[int, bool]] = []

    def _victims(self, r) -> None:
        """What a host tier would copy of each deleted leaf: its whole prefix's FULL slots, in order; the SWA run
        it ends with (at most one page-rounded window); its state, freed with it."""
        tail = self.tree.swa.tail_len
        for v in r.victims:
            tokens = tuple(np.frombuffer(v.key, "<i4").tolist())
            assert len(v.full) == len(tokens) and len(tokens) % self.PAGE == 0
            for i, s in enumerate(v.full.tolist()):
                assert self.at.get(s) == (v.ns, tokens[:i + 1])
            assert len(tokens) - tail <= v.swa_floor <= len(tokens) and v.swa_floor % self.PAGE == 0
            assert v.mamba == -1 or v.mamba in r.frees.mamba  # a locked leaf may have lost its state
            assert set(v.full[-1:].tolist()) <= set(r.frees.full_slots().tolist())  # the leaf itself goes

    def _freed(self, frees) -> None:
        full = frees.full_slots().tolist()
        assert len(set(full)) == len(full), "a slot freed twice in one operation"
        for s in full:
            assert s not in self.free, f"slot {s} freed but already free"
            self.at.pop(s, None)
            self.free.append(s)
        for s in frees.mamba:
            assert s not in self.mfree
            self.mfree.append(s)

    @rule(tokens=st.lists(st.integers(1, 3), min_size=0, max_size=24), floor_pages=st.integers(0, 12),
          early=st.booleans(), keep=st.booleans(), ns=st.sampled_from(NAMESPACES))
    def request(self, tokens, floor_pages, early, keep, ns):
        t = self.tree
        m = t.match_prefix(tokens, ns)
        for i, s in enumerate(m.indices.tolist()):  # every matched slot caches exactly this position
            assert self.at.get(s) == (ns, tuple(tokens[:i + 1])), (s, self.at.get(s), ns, tokens[:i + 1])
        held = t.held()
        if m.matched_len:
            assert m.mamba_src in held["mamba"].tolist()  # a hit ends where a state is
            tail = m.indices[-min(self.WINDOW, m.matched_len):]
            assert set(tail.tolist()) <= set(held["swa"].tolist())  # ...and the window before it has SWA KV
        rid = t.lock(m.node_id, skip_mamba=early and keep)
        total = len(tokens) - len(tokens) % self.PAGE
        need = total - m.matched_len
        if need > len(self.free):
            ev = t.evict(full=need - len(self.free))
            self._victims(ev)
            self._freed(ev.frees)
        if need > len(self.free) or not self.mfree:
            t.unlock(rid)
            return
        new = [self.free.pop() for _ in range(need)]
        mv = self.mfree.pop()
        floor = min(floor_pages * self.PAGE, total)  # the request freed its SWA KV below this
        slots = np.array(m.indices.tolist() + new, dtype=np.int64)
        r = t.insert(tokens[:total], slots, prev_prefix_len=m.matched_len, swa_evicted_seqlen=floor, mamba_value=mv,
                     namespace=ns)
        freed = set(r.frees.full_slots().tolist())
        for i in range(m.matched_len, total):
            if int(slots[i]) not in freed:
                self.at[int(slots[i])] = (ns, tuple(tokens[:i + 1]))
        self._freed(r.frees)  # a tree slot replaced by an SWA recovery caches nothing now
        if r.mamba_exist:
            self.mfree.append(mv)
        if early:
            self._freed(t.release_swa(rid))
        self.held.append((rid, early))
        if not keep or len(self.held) > 3:
            rid, _ = self.held.pop(0)
            t.unlock(rid)

    @precondition(lambda self: self.held)
    @rule()
    def unlock(self):
        rid, _ = self.held.pop()
        self.tree.unlock(rid)
        with pytest.raises(UnknownReceipt):
            self.tree.unlock(rid)

    @rule(full=st.integers(0, 8), swa=st.integers(0, 8), mamba=st.integers(0, 2))
    def evict(self, full, swa, mamba):
        before = self.tree.sizes()
        r = self.tree.evict(full, swa, mamba)
        self._victims(r)
        self._freed(r.frees)
        assert r.full >= min(full, before["full"][0]) or not self.tree._leaves
        assert len(r.frees.mamba) == r.mamba

    def _follow(self) -> None:
        for ev in self.tree.take_events():
            known = self.blocks[ev.group_idx]
            if isinstance(ev, BlockStored):
                assert ev.kv_cache_spec_kind == ("full_attention", "sliding_window", "mamba")[ev.group_idx]
                assert (ev.lora_name or "", ev.cache_salt or "") in self.NAMESPACES
                known.update(ev.block_hashes)
            else:
                for h in ev.block_hashes:
                    assert known[h] > 0, "a page removed that was never stored"
                    known[h] -= 1

    @invariant()
    def events_rebuild_every_component(self):
        """A follower of the events holds, per component, exactly the pages the tree holds."""
        self._follow()
        want = tree_pages(self.tree, self.PAGE)
        assert want == {g: +c for g, c in self.blocks.items()}
        snap = {0: Counter(), 1: Counter(), 2: Counter()}  # a consumer starting now: the snapshot says the same
        for ev in self.tree.snapshot_records():
            assert isinstance(ev, BlockStored) and (ev.lora_name or "", ev.cache_salt or "") in self.NAMESPACES
            snap[ev.group_idx].update(ev.block_hashes)
        assert want == {g: +c for g, c in snap.items()}

    @invariant()
    def consistent(self):
        assert check_hybrid(self.tree) == []
        held = self.tree.held()
        assert len(held["full"]) + len(self.free) == self.cap  # slot conservation
        assert set(held["full"].tolist()) == set(self.at)
        assert set(held["swa"].tolist()) <= set(held["full"].tolist())
        assert len(held["mamba"]) + len(self.mfree) == 20


TestHybridMachine = HybridMachine.TestCase
TestHybridMachine.settings = settings(max_examples=200, stateful_step_count=50, deadline=None,
                                      suppress_health_check=[HealthCheck.too_slow])


def test_bad_input_is_refused_and_changes_nothing():
    t = HybridTree(4, window=8, mamba_chunk=4)
    t.insert(list(range(1, 17)), np.arange(16), mamba_value=1)
    before = (t.sizes(), t.node_count())
    with pytest.raises(InvalidInput, match="multiple of the page size"):
        t.insert(list(range(1, 25)), np.arange(100, 124), swa_evicted_seqlen=6, mamba_value=2)
    with pytest.raises(InvalidInput, match="mamba_value"):
        t.insert(list(range(1, 25)), np.arange(100, 124))
    with pytest.raises(InvalidInput, match="slots for"):
        t.insert(list(range(1, 25)), np.arange(100, 110), mamba_value=2)
    assert (t.sizes(), t.node_count()) == before and check_hybrid(t) == []
    rid = t.lock(t.match_prefix(list(range(1, 17))).node_id)
    t.release_swa(rid)
    with pytest.raises(InvalidInput, match="already released"):
        t.release_swa(rid)
    t.unlock(rid)
    assert t.sizes()["full"] == (16, 0) and check_hybrid(t) == []


def test_an_insert_that_ends_or_turns_inside_an_edge_continues_on_the_prefix():
    """No match split the edge first (another request cached the longer path meanwhile): the donated state
    sums up the inserted prefix, so it sits where that prefix ends, and a turn hangs off the split point."""
    t = HybridTree(4, window=8, mamba_chunk=4)
    long = list(range(1, 17))
    t.insert(long, np.arange(16), mamba_value=1)
    r = t.insert(long[:8], np.arange(100, 108), mamba_value=2)
    assert r.prefix_len == 8 and not r.mamba_exist
    m = t.match_prefix(long[:8])
    assert (m.matched_len, m.mamba_src) == (8, 2) and m.indices.tolist() == list(range(8))
    assert t.match_prefix(long).mamba_src == 1
    turn = long[:4] + [99, 98, 97, 96]
    r = t.insert(turn, np.arange(200, 208), mamba_value=3)
    assert r.prefix_len == 4
    m = t.match_prefix(turn)
    assert (m.matched_len, m.mamba_src) == (8, 3) and m.indices.tolist() == [0, 1, 2, 3, 204, 205, 206, 207]
    assert check_hybrid(t) == []


@pytest.mark.parametrize("threshold", [1, 2, 3])
def test_the_write_through_count_names_the_deepest_prefix_walked_often_enough(threshold):
    """SPEC R1.3 on the hybrid tree: every non-chunked insert counts once on each edge it walks (a new leaf starts
    at 1, a split's prefix inherits the count), and the insert names the deepest prefix whose count reached the
    threshold: the whole prompt on write_through, a shared prefix once it is shared on write_through_selective."""
    t = HybridTree(4, window=8, mamba_chunk=4, write_through_threshold=threshold)
    system, a, b, c = list(range(1, 9)), [50, 51, 52, 53], [60, 61, 62, 63], [70, 71, 72, 73]
    got = [t.insert(system + a, np.arange(12), mamba_value=1).backup_len]
    got.append(t.insert(system + b, np.arange(100, 112), prev_prefix_len=8, mamba_value=2).backup_len)  # splits
    got.append(t.insert(system + c, np.arange(200, 212), prev_prefix_len=8, mamba_value=3).backup_len)
    # the system prompt's edge is walked 1, 2, 3 times; each turn's own leaf once
    assert got == {1: [12, 12, 12], 2: [0, 8, 8], 3: [0, 0, 8]}[threshold]
    assert t.insert(system + a, np.arange(12), mamba_value=4, count_hit=False).backup_len == 0  # (a load-back)
    assert check_hybrid(t) == []
    plain = HybridTree(4, window=8, mamba_chunk=4)  # no host tier: nothing counted, nothing named
    assert [plain.insert(system + a, np.arange(12), mamba_value=i).backup_len for i in range(3)] == [0, 0, 0]
