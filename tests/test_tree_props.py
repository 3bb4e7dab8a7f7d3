"""Property-based tests: random operation sequences against a reference model, check() after every step."""
import random

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from radixd.server.tree import POLICIES, RadixTree, UnknownReceipt


class Reference:
    """The simplest correct cache: position i, named by its whole-page prefix, maps to its slot."""

    def __init__(self, page_size: int):
        self.page = page_size
        self.slot: dict[tuple, int] = {}
        self.next_slot = 0
        self.locked: dict[int, set[int]] = {}

    def fresh(self, n: int) -> np.ndarray:
        out = np.arange(self.next_slot, self.next_slot + n, dtype=np.int32)
        self.next_slot += n
        return out

    def key(self, ns, tokens, i) -> tuple:
        return ns, tuple(tokens[:(i // self.page + 1) * self.page]), i

    def match(self, ns, tokens) -> list[int]:
        out = []
        n = len(tokens) - len(tokens) % self.page
        for i in range(n):
            s = self.slot.get(self.key(ns, tokens, i))
            if s is None:
                break
            out.append(s)
        return out[:len(out) - len(out) % self.page]

    def insert(self, ns, tokens, values, prev) -> tuple[list[int], int]:
        n = len(tokens) - len(tokens) % self.page
        dups, adopted = [], 0
        for i in range(n):
            k = self.key(ns, tokens, i)
            if k in self.slot:
                if i >= prev:
                    dups.append(int(values[i]))
            else:
                self.slot[k] = int(values[i])
                adopted += 1
        return dups, adopted

    def forget(self, freed) -> None:
        gone = set(int(x) for x in freed)
        self.slot = {k: v for k, v in self.slot.items() if v not in gone}

    def locked_slots(self) -> set[int]:
        return set().union(*self.locked.values()) if self.locked else set()


NAMESPACES = [("", ""), ("lora", ""), ("", "salt")]


def run_step(tree: RadixTree, ref: Reference, rng: random.Random, op: str, tokens, ns) -> None:
    """Apply one operation to tree and model, asserting they agree."""
    if op == "insert":
        m = ref.match(ns, tokens)
        prev = len(m) if m and rng.random() < 0.5 else 0
        values = np.concatenate([np.array(m[:prev], dtype=np.int32), ref.fresh(len(tokens) - prev)])
        dups, adopted = ref.insert(ns, tokens, values, prev)
        r = tree.insert(tokens, values, ns, prev_prefix_len=prev, priority=rng.randrange(3))
        assert sorted(r.duplicates.tolist()) == sorted(dups)
        assert r.adopted_len == adopted
    elif op == "match":
        expect = ref.match(ns, tokens)
        m = tree.match_prefix(tokens, ns)
        assert m.indices.tolist() == expect and m.matched_len == len(expect)
        if rng.random() < 0.4:
            ref.locked[tree.lock(m.node_id)] = set(expect)
    elif op == "unlock" and ref.locked:
        receipt = rng.choice(sorted(ref.locked))
        tree.unlock(receipt)
        del ref.locked[receipt]
        with pytest.raises(UnknownReceipt):
            tree.unlock(receipt)
    elif op == "evict":
        want = rng.randrange(1, 40)
        before = tree.evictable_size
        r = tree.evict(want)
        assert r.evicted_tokens == len(r.freed) and r.evicted_tokens >= min(want, before)
        assert not (set(r.freed.tolist()) & ref.locked_slots()), "evicted a locked slot"
        assert tree.evictable_size == before - r.evicted_tokens
        ref.forget(r.freed)
    owned = tree.all_device_values()
    assert sorted(owned.tolist()) == sorted(ref.slot.values())
    assert tree.check() == []


class TreeMachine(RuleBasedStateMachine):
    """Hypothesis drives the operation choices; the model decides the expected outcome."""

    @initialize(page=st.sampled_from([1, 2, 4]), policy=st.sampled_from(sorted(POLICIES)),
                seed=st.integers(0, 2**32 - 1))
    def setup(self, page, policy, seed):
        self.tree = RadixTree(page_size=page, policy=policy, instance_tag=3)
        self.ref = Reference(page)
        self.rng = random.Random(seed)

    @rule(tokens=st.lists(st.integers(0, 3), min_size=0, max_size=14), ns=st.sampled_from(NAMESPACES))
    def insert(self, tokens, ns):
        run_step(self.tree, self.ref, self.rng, "insert", tokens, ns)

    @rule(tokens=st.lists(st.integers(0, 3), min_size=0, max_size=14), ns=st.sampled_from(NAMESPACES))
    def match(self, tokens, ns):
        run_step(self.tree, self.ref, self.rng, "match", tokens, ns)

    @precondition(lambda self: bool(self.ref.locked))
    @rule()
    def unlock(self):
        run_step(self.tree, self.ref, self.rng, "unlock", [], NAMESPACES[0])

    @rule()
    def evict(self):
        run_step(self.tree, self.ref, self.rng, "evict", [], NAMESPACES[0])

    @invariant()
    def sizes_nonnegative(self):
        if hasattr(self, "tree"):
            assert self.tree.evictable_size >= 0 and self.tree.protected_size >= 0


TestTreeMachine = TreeMachine.TestCase
TestTreeMachine.settings = settings(max_examples=60, stateful_step_count=50, deadline=None,
                                    suppress_health_check=[HealthCheck.too_slow])


def _sample_tokens(rng: random.Random, prompts: list[list[int]]) -> list[int]:
    base = list(rng.choice(prompts))
    return base[:rng.randrange(len(base) + 1)] + [rng.randrange(6) for _ in range(rng.randrange(8))]


@pytest.mark.parametrize("policy,page", [("lru", 1), ("priority", 2), ("slru", 4), ("lfu", 1)])
def test_seeded_long_fuzz(policy, page):
    """>= 10^4 operations per configuration, checked after every step."""
    rng = random.Random(1234 + page)
    tree = RadixTree(page_size=page, policy=policy)
    ref = Reference(page)
    prompts = [[rng.randrange(6) for _ in range(rng.randrange(4, 24))] for _ in range(12)]
    ops = ["insert"] * 4 + ["match"] * 4 + ["unlock"] * 2 + ["evict"]
    for step in range(10_000):
        op = rng.choice(ops)
        run_step(tree, ref, rng, op, _sample_tokens(rng, prompts), rng.choice(NAMESPACES))
        if step % 500 == 0:  # bound the model's lock set so eviction has work to do
            for receipt in list(ref.locked):
                tree.unlock(receipt)
                del ref.locked[receipt]
    assert tree.counters.evicted_tokens_device > 0 and tree.counters.hit_tokens > 0
