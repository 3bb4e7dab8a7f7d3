"""Two-tier property tests: random operation sequences against the reference model, checker after every step."""
import random
import zlib

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

from radixd.server.tree import WRITE_POLICIES

from .tier_model import NAMESPACES, Driver

TOKENS = st.lists(st.integers(0, 3), min_size=0, max_size=14)


class TieredMachine(RuleBasedStateMachine):
    """Hypothesis picks the operations; the driver compares tree and model after each."""

    @initialize(page=st.sampled_from([1, 16, 2]), policy=st.sampled_from(WRITE_POLICIES),
                seed=st.integers(0, 2**32 - 1), host_capacity=st.sampled_from([8, 32, 200]))
    def setup(self, page, policy, seed, host_capacity):
        self.d = Driver(page, policy, seed, host_capacity=host_capacity)
        self.page = page

    def _tokens(self, tokens):
        return [t for t in tokens for _ in range(self.page if self.page > 2 else 1)]  # whole pages often

    @rule(tokens=TOKENS, ns=st.sampled_from(NAMESPACES), chunked=st.booleans())
    def insert(self, tokens, ns, chunked):
        self.d.insert(self._tokens(tokens), ns, chunked)
        self.d.m.invariants(self.d.tree)

    @rule(tokens=TOKENS, ns=st.sampled_from(NAMESPACES))
    def match(self, tokens, ns):
        self.d.match(self._tokens(tokens), ns)
        self.d.m.invariants(self.d.tree)

    @rule(n=st.integers(1, 40))
    def evict(self, n):
        self.d.evict(n * (self.page if self.page > 2 else 1))
        self.d.m.invariants(self.d.tree)

    @rule(tokens=TOKENS, ns=st.sampled_from(NAMESPACES), meanwhile=st.booleans())
    def host_insert(self, tokens, ns, meanwhile):
        toks = self._tokens(tokens)
        self.d.host_insert(toks, ns, (lambda: self.d.insert(toks + [3] * self.page, ns)) if meanwhile else None)
        self.d.m.invariants(self.d.tree)

    @rule(n=st.integers(1, 40))
    def evict_host(self, n):
        self.d.evict_host(n * (self.page if self.page > 2 else 1))
        self.d.m.invariants(self.d.tree)

    @rule()
    def evict_host_all(self):
        self.d.evict_host(1 << 30)  # frees exactly host_evictable_size (checked in the driver)
        self.d.m.invariants(self.d.tree)

    @precondition(lambda self: bool(self.d.m.receipts))
    @rule(data=st.data())
    def unlock(self, data):
        self.d.unlock(data.draw(st.sampled_from(sorted(self.d.m.receipts))))
        self.d.m.invariants(self.d.tree)

    @precondition(lambda self: bool(self.d.m.backups))
    @rule()
    def finish_backup(self):
        self.d.finish_backup(min(self.d.m.backups))
        self.d.m.invariants(self.d.tree)

    @precondition(lambda self: bool(self.d.m.backups))
    @rule()
    def abort_backup(self):
        self.d.abort_backup(max(self.d.m.backups))
        self.d.m.invariants(self.d.tree)

    @precondition(lambda self: bool(self.d.m.loads))
    @rule(data=st.data(), commit=st.booleans())
    def finish_load(self, data, commit):
        op = data.draw(st.sampled_from(sorted(self.d.m.loads)))
        if commit and self.d.m.loads[op]["slots"] is None:
            self.d.commit_load(op)
        self.d.finish_load(op)
        self.d.m.invariants(self.d.tree)

    @precondition(lambda self: bool(self.d.m.loads))
    @rule(data=st.data())
    def abort_load(self, data):
        self.d.abort_load(data.draw(st.sampled_from(sorted(self.d.m.loads))))
        self.d.m.invariants(self.d.tree)

    def teardown(self):
        if hasattr(self, "d"):
            self.d.drain()


TestTieredMachine = TieredMachine.TestCase
TestTieredMachine.settings = settings(max_examples=80, stateful_step_count=60, deadline=None,
                                      suppress_health_check=[HealthCheck.too_slow])


def _sample(rng: random.Random, prompts: list[list[int]], page: int) -> list[int]:
    base = list(rng.choice(prompts))
    tail = [rng.randrange(4) for _ in range(rng.randrange(3)) for _ in range(page)]
    return base[:rng.randrange(len(base) + 1)] + tail


@pytest.mark.parametrize("policy", WRITE_POLICIES)
@pytest.mark.parametrize("page", [1, 16])
def test_seeded_long_fuzz(policy, page):
    """17,000 operations per configuration (>10^5 in all), the model compared after every step."""
    rng = random.Random(zlib.crc32(f"{policy}/{page}".encode()))
    d = Driver(page, policy, seed=rng.randrange(2**32), host_capacity=24 * page,
               load_back_threshold=rng.choice([0, page]))
    prompts = [[rng.randrange(5) for _ in range(rng.randrange(2, 8) * page)] for _ in range(10)]
    for step in range(17_000):
        d.step(_sample(rng, prompts, page), rng.choice(NAMESPACES))
        if step % 400 == 399:  # bound locks and transfers so eviction keeps having work
            d.drain()
    c = d.tree.counters
    assert c.demoted_tokens and c.load_back_tokens and c.backup_tokens and c.evicted_tokens_host
    assert c.host_hit_tokens and c.hit_tokens and c.storage_inserted_tokens


@pytest.mark.parametrize("policy", WRITE_POLICIES)
@pytest.mark.parametrize("page", [1, 4])
def test_events_rebuild_exactly_what_the_tree_caches(policy, page):
    """KV events, applied by a follower, give the tree's pages per medium after every step."""
    rng = random.Random(zlib.crc32(f"events/{policy}/{page}".encode()))
    d = Driver(page, policy, seed=rng.randrange(2**32), host_capacity=24 * page, events=True)
    prompts = [[rng.randrange(5) for _ in range(rng.randrange(2, 8) * page)] for _ in range(10)]
    for step in range(3000):
        d.step(_sample(rng, prompts, page), rng.choice(NAMESPACES))
        if step % 400 == 399:
            d.follower.check(d.tree)  # backups and loads still in flight
            d.drain()
            d.follower.check(d.tree)
    assert sum(d.follower.media["GPU"].values()) > 0 and d.tree.counters.demoted_tokens > 0
