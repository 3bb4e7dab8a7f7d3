"""A two-tier reference model of the cache and a driver that runs the tree and the model side by side.

The model knows nothing of nodes: each position is named by its whole-page prefix and holds a device slot,
a host slot or both. The tree's decisions (what to evict, back up, load) are applied to the model only after
checking that they are legal; every match is compared exactly, and the checker runs after every step.
"""
from __future__ import annotations

import random
from typing import Optional

import numpy as np
import pytest

from radixd.server.tree import InFlight, RadixTree, StateConflict, UnknownReceipt
from radixd.server.tree import hashes as _hashes

NAMESPACES = [("", ""), ("lora", ""), ("", "salt")]
HOST_BASE = 1_000_000  # host slots live in another range so a tier mix-up cannot go unnoticed


class TierModel:
    """Position -> (device slot, host slot), plus what every lock, backup and load-back protects."""

    def __init__(self, page: int, write_policy: Optional[str], host_capacity: int):
        self.page = page
        self.policy = write_policy
        self.host_capacity = host_capacity
        self.dev: dict[tuple, int] = {}
        self.host: dict[tuple, int] = {}
        self.next_dev = 0
        self.next_host = HOST_BASE
        self.dlocks: dict[int, set] = {}  # receipt / ack / op -> positions that must stay on device
        self.hlocks: dict[int, set] = {}  # receipt / op -> positions that must stay cached
        self.receipts: set[int] = set()
        self.backups: dict[int, dict] = {}  # ack -> {keys, committed, write_back}
        self.loads: dict[int, dict] = {}  # op -> {keys, slots}

    # -------------------------------------------------------------- naming
    def key(self, ns, tokens, i) -> tuple:
        if not isinstance(tokens, bytes):
            tokens = bytes(tokens)  # token ids stay below 256 in these tests: one byte each, fast slices
        return ns, tokens[:(i // self.page + 1) * self.page], i

    def path(self, k) -> list[tuple]:
        ns, pfx, i = k
        return [(ns, pfx[:(j // self.page + 1) * self.page], j) for j in range(i + 1)]

    @staticmethod
    def below(k2, k) -> bool:
        return k2[0] == k[0] and k2[2] > k[2] and k2[1][:len(k[1])] == k[1]

    def fresh(self, n: int) -> np.ndarray:
        out = np.arange(self.next_dev, self.next_dev + n, dtype=np.int32)
        self.next_dev += n
        return out

    def fresh_host(self, n: int) -> np.ndarray:
        out = np.arange(self.next_host, self.next_host + n, dtype=np.int32)
        self.next_host += n
        return out

    def by_dev(self) -> dict[int, tuple]:
        return {v: k for k, v in self.dev.items()}

    def by_host(self) -> dict[int, tuple]:
        return {v: k for k, v in self.host.items()}

    def locked_dev(self) -> set:
        return set().union(*self.dlocks.values()) if self.dlocks else set()

    def locked_cached(self) -> set:
        return set().union(*self.hlocks.values()) if self.hlocks else set()

    def pinned(self) -> set:
        return set().union(*(lo["keys"] for lo in self.loads.values())) if self.loads else set()

    def pending(self) -> set:
        return set().union(*(b["keys"] for b in self.backups.values())) if self.backups else set()

    # ------------------------------------------------------------- queries
    def match(self, ns, tokens) -> tuple[list[int], list[tuple], list[tuple]]:
        """(device slots, device keys, host-extension keys) of the longest cached prefix."""
        n = len(tokens) - len(tokens) % self.page
        slots, dkeys, hkeys = [], [], []
        tokens = bytes(tokens)
        for i in range(n):
            k = self.key(ns, tokens, i)
            if k in self.dev and not hkeys:
                slots.append(self.dev[k])
                dkeys.append(k)
            elif k in self.host:
                assert k not in self.dev, f"device position {k} below a host-only one"
                hkeys.append(k)
            else:
                break
        return slots, dkeys, hkeys

    def forget_dev(self, slots) -> list[tuple]:
        inv = self.by_dev()
        keys = []
        for s in slots.tolist():
            k = inv[s]
            del self.dev[k]
            keys.append(k)
        return keys

    def forget_host(self, slots) -> list[tuple]:
        inv = self.by_host()
        keys = []
        for s in slots.tolist():
            k = inv[s]
            del self.host[k]
            keys.append(k)
        return keys

    def invariants(self, tree: RadixTree) -> None:
        assert sorted(tree.all_device_values().tolist()) == sorted(self.dev.values())
        assert sorted(tree.all_host_values().tolist()) == sorted(self.host.values())
        locked = self.locked_dev()
        assert locked <= set(self.dev), "a device-locked position lost its device slot"
        assert self.locked_cached() <= set(self.dev) | set(self.host), "a locked position left the cache"
        assert tree.protected_size == len(locked & set(self.dev))
        assert tree.evictable_size == len(self.dev) - tree.protected_size
        for k in set(self.dev) | set(self.host):
            ns, pfx, i = k
            if i:
                up = (ns, pfx[:((i - 1) // self.page + 1) * self.page], i - 1)
                assert up in self.dev or up in self.host, f"cached position {k} has an uncached parent"
                if k in self.dev:
                    assert up in self.dev, f"device closure broken at {k}"
                if k in self.host and self.policy in ("write_through", "write_through_selective"):
                    assert up in self.host, f"write-through host closure broken at {k}"
        bad = tree.check()
        assert bad == [], bad


class EventFollower:
    """What a router knows from the events alone: a multiset of block hashes per medium."""

    def __init__(self):
        from collections import Counter
        self.media = {"GPU": Counter(), "CPU_PINNED": Counter()}
        self.batches = 0

    def apply(self, events) -> None:
        from radixd.server.tree.events import AllBlocksCleared, BlockRemoved, BlockStored
        for ev in events:
            if isinstance(ev, BlockStored):
                assert len(ev.token_ids) == len(ev.block_hashes) * ev.block_size
                self.media[ev.medium].update(ev.block_hashes)
            elif isinstance(ev, BlockRemoved):
                self.media[ev.medium].subtract(ev.block_hashes)
            else:
                assert isinstance(ev, AllBlocksCleared)
                for c in self.media.values():
                    c.clear()

    def check(self, tree: RadixTree) -> None:
        """The blocks rebuilt from events equal the tree's cached pages per medium, exactly."""
        from collections import Counter

        from radixd.server.tree.hashes import block_hashes, event_seed, namespaced
        events, lost = tree.take_events()
        assert lost == 0
        self.apply(events)
        want = {"GPU": Counter(), "CPU_PINNED": Counter()}
        for nd in tree.iter_nodes():
            if nd.parent is None:
                continue
            hs = namespaced(block_hashes(tree._digests(nd)), event_seed(*nd.ns))  # (hashes.py: namespaced hashes)
            if nd.value is not None:
                want["GPU"].update(hs)
            if nd.host_value is not None and not nd.pending:
                want["CPU_PINNED"].update(hs)
        for medium, got in self.media.items():
            assert +got == want[medium], f"{medium}: events say {sum((+got).values())} pages, tree has " \
                                         f"{sum(want[medium].values())}"
        snap = EventFollower()  # a consumer starting now: the snapshot says the same
        snap.apply(tree.raw_events(tree.snapshot_records()).materialize())
        for medium, got in snap.media.items():
            assert got == want[medium], f"{medium}: the snapshot has {sum(got.values())} pages, the tree " \
                                        f"{sum(want[medium].values())}"


class Driver:
    """Runs random operations on a tree and the model; every assertion compares the two."""

    def __init__(self, page: int, write_policy: Optional[str], seed: int, host_capacity: int = 48,
                 load_back_threshold: int = 0, policy: str = "lru", events: bool = False):
        self.tree = RadixTree(page_size=page, policy=policy, instance_tag=5, write_policy=write_policy,
                              load_back_threshold=load_back_threshold, events=events)
        self.follower = EventFollower() if events else None
        self.m = TierModel(page, write_policy, host_capacity)
        self.rng = random.Random(seed)
        self.page = page

    # ------------------------------------------------------------- backups
    def _host_room(self, need: int) -> bool:
        m, t = self.m, self.tree
        free = m.host_capacity - len(m.host)
        if free < need:
            r = t.evict_host(need - free)
            self._apply_host_evict(r, need - free)
            free = m.host_capacity - len(m.host)
        return free >= need

    def _apply_host_evict(self, r, want: int) -> None:
        m = self.m
        assert r.evicted_tokens == r.freed.size
        protected = m.locked_cached() | m.pinned() | m.pending()
        inv = m.by_host()
        for s in r.freed.tolist():
            k = inv[s]
            if k in m.dev:
                assert self.tree.write_back, "host copy of a device node dropped outside write-back"
            assert k not in protected or k in m.dev, f"host eviction took protected position {k}"
        m.forget_host(r.freed)

    def _register_backups(self, actions) -> None:
        m = self.m
        inv = m.by_dev()
        for a in actions:
            keys = [inv[s] for s in a.device_slots.tolist()]
            for k in keys:
                assert k not in m.host and k not in m.pending(), f"backup of {k} that is backed up or pending"
            m.backups[a.ack] = dict(keys=set(keys), committed=False, write_back=a.write_back)
            m.dlocks[a.ack] = set(m.path(max(keys, key=lambda k: k[2])))

    def _run_backups(self, actions) -> None:
        """Commit in order; stop at the first that finds no host room and abort it and the rest."""
        failed = False
        for a in actions:
            if a.ack not in self.m.backups:
                continue  # taken by an earlier abort's cascade
            if not failed and self._host_room(a.tokens):
                hs = self.m.fresh_host(a.tokens)
                self.tree.commit_backup(a.ack, hs)
                for k, s in zip(sorted(self.m.backups[a.ack]["keys"], key=lambda k: k[2]), hs.tolist()):
                    self.m.host[k] = s
                self.m.backups[a.ack]["committed"] = True
            else:
                failed = True
        if failed:
            for a in reversed(actions):
                if a.ack in self.m.backups and not self.m.backups[a.ack]["committed"]:
                    self.abort_backup(a.ack)

    def abort_backup(self, ack: int) -> None:
        m, t = self.m, self.tree
        b = m.backups[ack]
        deepest = max(b["keys"], key=lambda k: k[2])
        below = [k for k in m.host if m.below(k, deepest)]
        if t._through and any(k not in m.pending() for k in below):
            with pytest.raises(StateConflict):
                t.abort_backup(ack)
            return
        cascade = {a for a, o in m.backups.items() if t._through and any(m.below(k, deepest) for k in o["keys"])}
        expect_host = sorted(m.host[k] for a in cascade | {ack} for k in m.backups[a]["keys"] if k in m.host)
        r = t.abort_backup(ack)
        if not b["write_back"]:
            assert sorted(r.host.tolist()) == expect_host and r.device.size == 0
        for a in cascade | {ack}:
            m.backups.pop(a)
            m.dlocks.pop(a)
        m.forget_host(r.host)
        dropped = m.forget_dev(r.device)
        for k in dropped:
            assert k not in m.host
        for k in [k for k in m.host if k not in m.dev and any(k == d or m.below(k, d) for d in dropped)]:
            raise AssertionError(f"host-only position {k} left below a dropped node")

    def finish_backup(self, ack: int) -> None:
        m = self.m
        b = m.backups[ack]
        if not b["committed"]:
            with pytest.raises(StateConflict):
                self.tree.finish_backup(ack)
            return
        r = self.tree.finish_backup(ack)
        del m.backups[ack]
        del m.dlocks[ack]
        keys = m.forget_dev(r.device)
        assert set(keys) <= b["keys"] and all(k in m.host for k in keys)

    # ------------------------------------------------------------- operations
    def insert(self, tokens, ns, chunked: bool = False) -> None:
        m, t, rng = self.m, self.tree, self.rng
        slots, dkeys, _ = m.match(ns, tokens)
        prev = len(slots) if slots and rng.random() < 0.5 else 0
        values = np.concatenate([np.array(slots[:prev], dtype=np.int32), m.fresh(len(tokens) - prev)])
        n = len(tokens) - len(tokens) % self.page
        dups, adopted, unevicted, dev_end, stop = [], 0, 0, None, n
        pinned = m.pinned()
        expect_new: dict[tuple, int] = {}
        tb = bytes(tokens)
        for i in range(n):
            k = m.key(ns, tb, i)
            if k in m.dev:
                if i >= prev:
                    dups.append(int(values[i]))
                continue
            if dev_end is None:
                dev_end = i
            if k in m.host:
                if k in pinned:
                    stop = i
                    break
                unevicted += 1
            expect_new[k] = int(values[i])
            adopted += 1
        r = t.insert(tokens, values, ns, prev_prefix_len=prev, priority=rng.randrange(3), chunked=chunked)
        assert sorted(r.duplicates.tolist()) == sorted(dups)
        assert (r.adopted_len, r.unevicted_len) == (adopted, unevicted)
        assert r.prefix_len == (dev_end if dev_end is not None else n)
        assert r.tail.tolist() == values[stop:].tolist()
        m.dev.update(expect_new)
        if not t.host or t.write_back or chunked:
            assert not r.backups
        self._register_backups(r.backups)
        if t.write_policy == "write_through" and not chunked and stop == n:
            covered = set(m.host) | m.pending()
            assert all(m.key(ns, tb, i) in covered for i in range(n)), "write-through left a node unbacked"
        self._run_backups(list(r.backups))

    def match(self, tokens, ns) -> None:
        m, t, rng = self.m, self.tree, self.rng
        slots, dkeys, hkeys = m.match(ns, tokens)
        r = t.match_prefix(tokens, ns)
        assert r.indices.tolist() == slots and r.matched_len == len(slots)
        assert r.host_hit_len == len(hkeys)
        roll = rng.random()
        if roll < 0.25:
            rec = t.lock(r.best_node_id)
            m.receipts.add(rec)
            m.dlocks[rec] = set(dkeys)
            m.hlocks[rec] = set(hkeys)
        elif roll < 0.4:
            rec = t.lock(r.node_id)
            m.receipts.add(rec)
            m.dlocks[rec] = set(dkeys)
        elif hkeys and roll < 0.8:
            self.load_back(r, dkeys, hkeys)

    def load_back(self, r, dkeys, hkeys) -> None:
        m, t, rng = self.m, self.tree, self.rng
        quota = rng.choice([None, None, None, rng.randrange(0, 40)])
        free = rng.choice([None, None, rng.randrange(0, 60)])
        locked = m.locked_dev()
        newly = sum(1 for k in dkeys if k not in locked)
        kv = len(hkeys)
        evict = max(0, kv - free) if free is not None else 0
        if set(hkeys) & m.pinned():
            want = "pinned"
        elif kv < t.load_back_threshold:
            want = "threshold"
        elif quota is not None and kv > quota - newly:
            want = "quota"
        elif evict > t.evictable_size - newly:
            want = "no_room"
        else:
            want = ""
        plan = t.load_back(r.best_node_id, mem_quota=quota, device_free=free)
        assert plan.reason == want, (plan.reason, want)
        assert plan.host_slots.tolist() == [m.host[k] for k in hkeys]
        if want:
            assert plan.op == 0
            return
        assert plan.evict_tokens == evict
        m.loads[plan.op] = dict(keys=set(hkeys), order=list(hkeys), slots=None, dkeys=list(dkeys))
        m.dlocks[plan.op] = set(dkeys)
        m.hlocks[plan.op] = set(hkeys)
        with pytest.raises(InFlight):
            t.unlock(plan.op)
        if rng.random() < 0.8:
            self.commit_load(plan.op)

    def commit_load(self, op: int) -> None:
        m, t = self.m, self.tree
        lo = m.loads[op]
        slots = m.fresh(len(lo["order"]))
        path = t.commit_load_back(op, slots)
        assert path.tolist() == [m.dev[k] for k in lo["dkeys"]] + slots.tolist()
        lo["slots"] = slots

    def finish_load(self, op: int) -> None:
        m, t = self.m, self.tree
        lo = m.loads[op]
        if lo["slots"] is None:
            with pytest.raises(StateConflict):
                t.finish_load_back(op)
            return
        assert t.finish_load_back(op) == op
        del m.loads[op]
        for k, s in zip(lo["order"], lo["slots"].tolist()):
            assert k in m.host and k not in m.dev
            m.dev[k] = s
        m.receipts.add(op)
        m.dlocks[op] = set(lo["dkeys"]) | set(lo["order"])
        m.hlocks.pop(op)

    def abort_load(self, op: int) -> None:
        m = self.m
        lo = m.loads.pop(op)
        freed = self.tree.abort_load_back(op)
        assert freed.tolist() == ([] if lo["slots"] is None else lo["slots"].tolist())
        m.dlocks.pop(op)
        m.hlocks.pop(op)

    def unlock(self, rec: int) -> None:
        self.tree.unlock(rec)
        self.m.receipts.discard(rec)
        self.m.dlocks.pop(rec)
        self.m.hlocks.pop(rec, None)
        with pytest.raises(UnknownReceipt):
            self.tree.unlock(rec)

    def evict(self, want: int) -> None:
        m, t = self.m, self.tree
        before = t.evictable_size
        r = t.evict(want)
        assert r.evicted_tokens == r.freed.size
        if t.write_back:  # a leaf being written back shields its parent until the copy is done
            assert r.evicted_tokens + r.write_back_tokens >= want or not t._leaves
        else:
            assert r.evicted_tokens >= min(want, before)
        locked = m.locked_dev()
        inv = m.by_dev()
        demoted = 0
        for s in r.freed.tolist():
            k = inv[s]
            assert k not in locked, f"evicted locked position {k}"
            demoted += k in m.host
            assert k in m.host or not t.write_back, "write-back deleted an unbacked node instead of writing it back"
        assert demoted == r.demoted_tokens
        m.forget_dev(r.freed)
        self._register_backups(r.write_backs)
        if t.write_back:
            self._run_backups(list(r.write_backs))
        else:
            assert not r.write_backs

    def evict_host(self, want: int) -> None:
        t = self.tree
        evictable, cached = t.host_evictable_size, t.host_evictable_size + t.host_protected_size
        r = t.evict_host(want)
        if want >= cached:  # unbounded: frees exactly what the counter called evictable
            assert r.evicted_tokens == evictable, (r.evicted_tokens, evictable)
        self._apply_host_evict(r, want)

    def host_insert(self, tokens, ns, meanwhile=None) -> None:
        """A prefetch from L3 as the engine runs it: match, lock the anchor, make host room, (other work
        meanwhile), insert the fetched pages host-only below the anchor, unlock."""
        m, t = self.m, self.tree
        slots, dkeys, hkeys = m.match(ns, tokens)
        start = len(slots) + len(hkeys)
        n = len(tokens) - len(tokens) % self.page
        if n <= start:
            return
        r = t.match_prefix(tokens, ns)
        anchor = r.best_node_id if start else t.root_id(ns)
        rec = t.lock(anchor)
        m.receipts.add(rec)
        m.dlocks[rec] = set(dkeys)
        m.hlocks[rec] = set(hkeys)
        ns_, prior = t.chain_prior(anchor)
        assert ns_ == ns
        rest = np.asarray(tokens[start:n], dtype="<i4")
        digests = _hashes.chain(rest.tobytes(), self.page * 4, prior)
        if self._host_room(n - start):
            if meanwhile is not None:
                meanwhile()
            hs = m.fresh_host(n - start)
            tb = bytes(tokens)
            keys = [m.key(ns, tb, i) for i in range(start, n)]
            pre = 0
            while pre < len(keys) and (keys[pre] in m.dev or keys[pre] in m.host):
                pre += 1
            attach = m.key(ns, tb, start + pre - 1) if start + pre else None
            drop = (pre < len(keys) and t._through and attach is not None
                    and (attach not in m.host or attach in m.pending()))
            res = t.insert_host(anchor, rest, hs, digests)
            assert res.prefix_len == pre
            assert res.duplicates.tolist() == hs[:pre].tolist()
            if drop or pre == len(keys):
                assert res.adopted.size == 0 and res.dropped.tolist() == hs[pre:].tolist()[:res.dropped.size]
            else:
                assert res.adopted.tolist() == hs[pre:].tolist() and res.dropped.size == 0
                for k, s in zip(keys[pre:], hs[pre:].tolist()):
                    m.host[k] = s
            m.invariants(t)
        self.unlock(rec)

    def step(self, tokens, ns) -> None:
        """One random operation, then the full comparison."""
        m, rng = self.m, self.rng
        op = rng.choice(["insert"] * 4 + ["match"] * 4 + ["unlock", "evict", "evict", "evict_host", "finish_backup",
                                                         "finish_backup", "finish_load", "abort"]
                        + (["host_insert"] if self.tree.host else [])
                        + (["reset"] if rng.random() < 0.01 else []))
        if op == "host_insert":
            other = list(tokens) + [rng.randrange(4) for _ in range(self.page * rng.randrange(3))]
            self.host_insert(tokens, ns, (lambda: self.insert(other, ns)) if rng.random() < 0.3 else None)
        elif op == "insert":
            self.insert(tokens, ns, chunked=rng.random() < 0.15)
        elif op == "match":
            self.match(tokens, ns)
        elif op == "unlock" and m.receipts:
            self.unlock(rng.choice(sorted(m.receipts)))
        elif op == "evict":
            self.evict(rng.randrange(1, 24) * self.page)
        elif op == "evict_host":
            self.evict_host(rng.randrange(1, 24) * self.page)
        elif op == "finish_backup" and m.backups:
            self.finish_backup(min(m.backups))  # copies complete in submission order
        elif op == "finish_load" and m.loads:
            op_id = rng.choice(sorted(m.loads))
            if m.loads[op_id]["slots"] is None and rng.random() < 0.7:
                self.commit_load(op_id)
            self.finish_load(op_id)
        elif op == "abort":
            if m.loads and rng.random() < 0.5:
                self.abort_load(rng.choice(sorted(m.loads)))
            elif m.backups:
                self.abort_backup(max(m.backups))  # the newest copy is the one that can fail alone
        elif op == "reset" and not m.receipts and not m.backups and not m.loads:
            self.tree.reset()
            m.dev.clear()
            m.host.clear()
        m.invariants(self.tree)
        if self.follower is not None:
            self.follower.check(self.tree)

    def drain(self) -> None:
        """Finish every transfer and release every receipt, checking after each."""
        m = self.m
        while m.backups:
            ack = min(m.backups)
            if m.backups[ack]["committed"]:
                self.finish_backup(ack)
            else:
                self.abort_backup(ack)
            m.invariants(self.tree)
        for op in sorted(m.loads):
            if m.loads[op]["slots"] is None:
                self.commit_load(op)
            self.finish_load(op)
        for rec in sorted(m.receipts):
            self.unlock(rec)
        m.invariants(self.tree)
