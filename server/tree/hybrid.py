"""A pure hybrid radix tree: FULL attention is the backbone, SWA and MAMBA plug in as components.

The FULL-only `RadixTree` stays as it is (no component costs it anything); a model with sliding-window or
state-space layers gets this tree, which mirrors SGLang 0.5.23's `UnifiedRadixCache` operation for operation
(SPEC-tiers section 5), checked side by side with SGLang's own cache (Python and Rust tree cores) in
`tests/hybrid_differential.py`. Like `RadixTree` it frees nothing: every operation returns, per component,
the slots the caller must free.

The backbone decides existence and leaf status (a D-leaf: no child, no lock of any component); each
component (`components/`) adds its match rule, split rule, insert rules, lock walk, LRU and eviction walk.

KV events (events=True) carry the component the way vLLM names KV cache groups: `group_idx` is the
component's place in `components` (FULL 0, then SWA and MAMBA in that order, as configured),
`kv_cache_spec_kind` is "full_attention", "sliding_window" or "mamba", and SWA stores carry the window.
Page hashes are radixd's frozen chain (hashes.py), so FULL events of a hybrid tree name pages exactly as a
plain tree's do. A MAMBA store or removal names one page, the last page of the prefix its state sums up.

Where radixd differs from SGLang 0.5.23, on purpose:
  * the tree keeps whether a node's SWA half exists, not SWA slot numbers: the SWA slots are the FULL slots'
    window twins, a translation the pool layer owns (`swa` frees name FULL slots whose twins go, as SGLang's
    own tree-side frees do); recovering a tombstone under a locked FULL returns a `swa_moves` pair instead of
    rewriting the allocator's mapping;
  * the host tier is not a second state of each node (SGLang's HiCache: host values beside device values, host
    locks, backups while the node stays on the device) but a second HybridTree below this one, used as a victim
    cache (server/hybrid_tiers.py): with `victims=True` an eviction reports every D-leaf it deletes (`Victim`:
    its whole prefix, FULL slots, the start of the SWA run it ends with, its state) so the caller copies it
    down before freeing; a load-back is an insert into this tree. Both trees keep every rule of this one, so a
    host match ends only where a window of SWA KV and a state were copied. SGLang's hybrid HiCache cannot run
    on CPU (its copies need CUDA kernels), so the host tier is proven against ground truth (the values and the
    model's true K/V and states) instead of side by side; R5.10's `swa_reprefill_tail_tokens` is always 0
    here, as the host keeps the window;
  * no EAGLE bigram keys.

The match and the FULL lock walks run in C where setup.py could build `_hwalk.c` (the same steps on the same
objects: `_match_path` and the Python loops in lock/unlock are its reference, and tests/test_hybrid_native.py
runs both side by side on random operations); `native=False` asks for the Python path.

Namespaces (extra_key, cache_salt) are separate roots, as in the plain tree: a prefix cached under one is
never matched under another, a namespace's root goes when its last node does, and its page hashes are seeded
from the cache_salt (events carry cache_salt and, as lora_name, the extra_key; both namespace the published
block hashes), exactly as the plain tree's.
"""
from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from . import hashes as _hashes
from .components import FULL, MAMBA, SWA, MambaComponent, SwaComponent
from .errors import InvalidInput, LocksHeld, StaleHandle, UnknownReceipt
from .events import (CLEARED, GPU, REMOVED, STORED, AllBlocksCleared, BlockRemoved, BlockStored, Coalescer, Event,
                     ReadyEvents)
from .results import TreeCounters
from .tree import DEFAULT_NS, Namespace, TokenInput, as_int32

try:  # the match loops in C (setup.py builds them where a C compiler is); the Python path below is the reference
    from . import _hwalk
except ImportError:  # pragma: no cover - depends on the build machine
    _hwalk = None

NATIVE = _hwalk is not None

_EMPTY64 = np.zeros(0, dtype=np.int64)
_I32 = np.dtype("<i4")


class HNode:
    """One edge of the hybrid tree: packed int32 key, FULL slots, SWA presence, MAMBA state slot, locks."""

    __slots__ = ("id", "parent", "children", "key", "full", "swa", "mamba", "lock", "slock", "mlock", "suuid",
                 "atime", "created", "dig", "n", "ns", "sprev", "snext", "mprev", "mnext")

    def __init__(self, node_id: int, parent: Optional["HNode"], key: bytes, full: np.ndarray, tick: float,
                 ns: Namespace = DEFAULT_NS):
        self.id = node_id
        self.ns = ns
        self.parent = parent
        self.children: dict[bytes, HNode] = {}
        self.key = key
        self.n = len(key) >> 2  # tokens on this edge
        self.full = full
        self.swa = False
        self.mamba = -1  # MAMBA state slot (-1: none)
        self.lock = self.slock = self.mlock = 0  # FULL, SWA and MAMBA lock references
        self.suuid = 0  # SWA window boundary mark (0: none)
        self.atime = tick
        self.created = tick + 1
        self.dig: Optional[bytes] = None  # page digests (events on), 32 bytes per page
        self.sprev = self.snext = self.mprev = self.mnext = None  # links of the SWA and MAMBA LRU lists

    def __repr__(self) -> str:
        return (f"HNode(id={self.id}, tokens={len(self.key) >> 2}, swa={self.swa}, mamba={self.mamba}, "
                f"locks={self.lock}/{self.slock}/{self.mlock})")


@dataclass(slots=True)
class HybridFrees:
    """Slots the caller must free, per component. `full`: FULL only; `both`: FULL and its SWA twins;
    `swa`: the SWA twins of these FULL slots only; `mamba`: state slots; `swa_moves`: (kept FULL, incoming FULL)
    pairs whose window twins move from incoming to kept (the incoming FULL is in `full`)."""

    full: list = field(default_factory=list)
    both: list = field(default_factory=list)
    swa: list = field(default_factory=list)
    mamba: list = field(default_factory=list)
    swa_moves: list = field(default_factory=list)

    @staticmethod
    def _cat(parts: list) -> np.ndarray:
        return np.concatenate(parts).astype(np.int64, copy=False) if parts else _EMPTY64

    def full_slots(self) -> np.ndarray:
        """Every FULL slot to free."""
        return self._cat(self.full + self.both)

    def swa_slots(self) -> np.ndarray:
        """FULL slots whose SWA twins are to be freed."""
        return self._cat(self.swa + self.both)


@dataclass(slots=True)
class HybridMatch:
    """A match: FULL slots of the usable prefix and where each component says the next checkpoint goes."""

    indices: np.ndarray
    matched_len: int
    node_id: int
    full_hit_len: int  # every matched token, whatever the components accept
    swa_branching_seqlen: Optional[int] = None
    mamba_branching_seqlen: Optional[int] = None
    mamba_src: int = -1  # the matched node's state: copy it into the request's own slot (never write it)


@dataclass(slots=True)
class HybridInsert:
    prefix_len: int
    node_id: int
    frees: HybridFrees
    mamba_exist: bool = False  # the end node kept its own state: free the donated one
    swa_branch_inserted: bool = False
    backup_len: int = 0  # with a write-through threshold: the prefix a host tier should copy now (0: none)


@dataclass(slots=True)
class Victim:
    """A D-leaf an eviction deleted, as a lower tier needs it to keep a copy: the whole prefix it ended (key,
    namespace), the FULL slots of that prefix (still holding their KV until the caller applies the frees), where
    the SWA run that ends at the leaf starts (`swa_floor`: the prefix end minus one page-rounded window at most,
    all the window a load-back restores) and the leaf's state slot (-1: none)."""

    ns: Namespace
    key: bytes
    full: np.ndarray
    swa_floor: int
    mamba: int
    own: int = 0  # tokens on the leaf's own edge (what its parent, still in the tree, does not hold)


@dataclass(slots=True)
class HybridEvicted:
    full: int
    swa: int
    mamba: int
    frees: HybridFrees
    victims: list = field(default_factory=list)


@dataclass(slots=True)
class _Params:
    key_len: int
    prev_prefix_len: int
    swa_evicted_seqlen: int
    mamba_value: int
    swa_branching_seqlen: Optional[int]


@dataclass(slots=True)
class _Receipt:
    node: HNode
    swa_uuid: int = 0
    swa_released: bool = False
    skip_mamba: bool = False  # a decode hold that opted out of pinning the state (R5.13)


class HybridTree:
    """FULL + optional SWA (`window`) + optional MAMBA (`mamba_chunk`) radix tree; pure, device tier."""

    FULL = FULL

    def __init__(self, page_size: int = 1, window: Optional[int] = None, mamba_chunk: Optional[int] = None,
                 events: bool = False, mamba_max_states_per_path: int = -1, victims: bool = False,
                 medium: str = GPU, native: bool = True, full_kv: bool = True,
                 write_through_threshold: Optional[int] = None):
        if page_size < 1:
            raise ValueError("page_size must be >= 1")
        if write_through_threshold is not None and write_through_threshold < 1:
            raise ValueError("write_through_threshold must be >= 1")
        # inserts that walk a prefix before a host tier copies it down (1: write_through, 2: the selective policy's
        # default); None counts nothing (write_back, or no host tier)
        self.write_through_threshold = write_through_threshold
        # inserts that walked each edge (SPEC R1.3), kept only with a threshold: no cost to a tree without one
        self._hits: Optional[dict] = {} if write_through_threshold is not None else None
        self.page_size = page_size
        self._pb = page_size * 4
        self._params = (page_size, window, mamba_chunk, events, mamba_max_states_per_path, victims, medium, native,
                        full_kv, write_through_threshold)
        # False: the model has no full-attention layer; FULL slots are the tree's keys with no KV behind them, so
        # FULL pages are not announced (a router would count them as hits) and the other components number the
        # event groups from 0, as vLLM numbers such a model's KV cache groups
        self.full_kv = full_kv
        self.medium = medium  # what events say the pages sit in (a host tier's tree: CPU)
        self._victims: Optional[list] = [] if victims else None  # deleted D-leaves, for a host tier below
        self.counters = TreeCounters()
        self._clock = 0.0
        self._ids = itertools.count(1)
        self._rids = itertools.count(1)
        self.root = HNode(0, None, b"", _EMPTY64, self._tick2())
        self.root.lock = 1  # the root is never evicted
        self._nodes: dict[int, HNode] = {0: self.root}
        self._roots: dict[Namespace, HNode] = {DEFAULT_NS: self.root}
        self._leaves: set[HNode] = set()
        self._receipts: dict[int, _Receipt] = {}
        self.swa = SwaComponent(self, window) if window else None
        self.mamba = MambaComponent(self, mamba_chunk, mamba_max_states_per_path) if mamba_chunk else None
        self.aux = tuple(c for c in (self.swa, self.mamba) if c is not None)  # registration order
        self.components = (FULL,) + tuple(c.name for c in self.aux)
        self.evictable = {c: 0 for c in (FULL, SWA, MAMBA)}
        self.protected = {c: 0 for c in (FULL, SWA, MAMBA)}
        self.groups = {c: i for i, c in enumerate(c for c in self.components if c != FULL or full_kv)}  # event
        # group_idx of each component
        self._ev: Optional[list] = [] if events else None
        rules = tuple(c.native_rule() for c in self.aux)
        # the C match (server/tree/_hwalk.c) and each component's rule for it; None: the Python path
        self._rules = None
        if native and _hwalk is not None and None not in rules:  # what the C match needs to build a HybridMatch
            ctx = (HybridMatch, np.empty, np.dtype(np.int64), page_size, self.swa is not None,
                   self.mamba.grid if self.mamba is not None else 0, _EMPTY64)
            self._rules = (_hwalk, rules, ctx)

    # ------------------------------------------------------------- helpers
    @staticmethod
    def _sentinel() -> HNode:
        """An end of a component's LRU list: an HNode outside the tree (id -1), never locked."""
        return HNode(-1, None, b"", _EMPTY64, 0.0)

    def _clock_tick(self) -> float:
        t = self._clock
        self._clock += 1.0
        return t

    def _tick2(self) -> float:
        t = self._clock
        self._clock += 2.0  # a new node takes an access and a creation time
        return t

    def _new_node(self, parent: HNode, key: bytes, full: np.ndarray) -> HNode:
        node = HNode(next(self._ids), parent, key, full, self._tick2(), parent.ns)
        self._nodes[node.id] = node
        return node

    def _root(self, ns: Namespace, create: bool) -> Optional[HNode]:
        root = self._roots.get(ns)
        if root is None and create:
            root = HNode(next(self._ids), None, b"", _EMPTY64, self._tick2(), ns)
            root.lock = 1
            self._roots[ns] = root
            self._nodes[root.id] = root
        return root

    def _prune_root(self, root: HNode) -> None:
        """A namespace root with nothing below it goes: misses and evictions must not leave memory behind."""
        if not root.children and root.ns != DEFAULT_NS and self._roots.get(root.ns) is root:
            del self._roots[root.ns]
            del self._nodes[root.id]

    def _is_leaf(self, node: HNode) -> bool:
        return (node.parent is not None and node.full is not None and not node.children
                and not (node.lock or node.slock or node.mlock))

    def _update_leaf(self, node: HNode) -> None:
        if self._is_leaf(node):
            self._leaves.add(node)
        else:
            self._leaves.discard(node)

    def _node(self, node_id: int) -> HNode:
        node = self._nodes.get(node_id)
        if node is None:
            raise StaleHandle(f"node handle {node_id} is stale: the node was evicted or never existed")
        return node

    @staticmethod
    def _tokens(tokens: TokenInput) -> np.ndarray:
        """tokens as a C-contiguous little-endian int32 array (itself when it is one)."""
        if type(tokens) is np.ndarray and tokens.dtype == _I32 and tokens.ndim == 1 and tokens.flags.c_contiguous:
            return tokens
        return np.ascontiguousarray(as_int32(tokens))

    def _key(self, tokens: TokenInput) -> bytes:
        arr = self._tokens(tokens)
        cut = len(arr) - len(arr) % self.page_size
        return (arr[:cut] if cut < len(arr) else arr).tobytes()

    def _common(self, a: bytes, b: bytes, off: int) -> int:
        """Page-aligned common prefix, in tokens, of a and b[off:]."""
        n = min(len(a), len(b) - off) >> 2
        x = np.frombuffer(a, "<i4", n)
        y = np.frombuffer(b, "<i4", n, off)
        ne = np.flatnonzero(x != y)
        i = int(ne[0]) if ne.size else n
        return i - i % self.page_size

    def _split(self, child: HNode, k: int) -> HNode:
        """Cut child after k tokens; child keeps its id and becomes the suffix."""
        parent = child.parent
        upper = self._new_node(parent, child.key[:k * 4], child.full[:k])
        upper.lock = child.lock
        if self._hits is not None and child in self._hits:
            self._hits[upper] = self._hits[child]
        if child.dig is not None:
            cut = k // self.page_size * 32
            upper.dig, child.dig = child.dig[:cut], child.dig[cut:]
        child.full = child.full[k:]
        child.key = child.key[k * 4:]
        child.n -= k
        child.parent = upper
        upper.children[child.key[:self._pb]] = child
        parent.children[upper.key[:self._pb]] = upper
        for comp in self.aux:
            comp.on_split(upper, child)
        for comp in self.aux:  # the prefix keeps the suffix's recency, just behind it
            if comp.has(upper) and upper not in comp.lru:
                comp.lru.insert_after(child, upper)
        child.atime = self._clock_tick()
        self._update_leaf(upper)
        self._update_leaf(child)
        return upper

    # ------------------------------------------------------------- match
    def _walk(self, root: HNode, kb: bytes) -> tuple[list, int]:
        """Whole edges of kb from root, then the edge it ends inside, split there; and every matched token."""
        node, off, full_hit = root, 0, 0
        path: list[HNode] = []
        pb = self._pb
        while off < len(kb):
            child = node.children.get(kb[off:off + pb])
            if child is None:
                break
            if kb.startswith(child.key, off):
                plen = len(child.key) >> 2
                full_hit += plen
                path.append(child)
                node = child
                off += plen * 4
                continue
            plen = self._common(child.key, kb, off)
            full_hit += plen
            if plen * 4 < len(child.key):
                child = self._split(child, plen)
            path.append(child)
            break
        return path, full_hit

    def _match_path(self, root: HNode, kb: bytes) -> tuple[np.ndarray, HNode, int, int]:
        """The reference of _hwalk.match: the walk, the deepest node every component accepts as a match end, its
        refresh and access times; returns (FULL slots, that node, its depth, every matched token)."""
        path, full_hit = self._walk(root, kb)
        best_n, settled = len(path), False
        while not settled and best_n:
            settled = True
            for comp in self.aux:
                n = comp.deepest(path, best_n)
                if n != best_n:
                    best_n, settled = n, False
        best = path[best_n - 1] if best_n else root
        for comp in self.aux:
            comp.refresh_match(best)
        t = self._clock_tick()
        walker = best
        while walker is not None:  # the path gets one time, a parent just older than its child
            walker.atime = t
            t -= 1e-5
            walker = walker.parent
        if best_n == 1:
            indices = best.full
        else:
            indices = np.concatenate([nd.full for nd in path[:best_n]]) if best_n else _EMPTY64
        return indices, best, best_n, full_hit

    def match_prefix(self, tokens: TokenInput, namespace: Namespace = DEFAULT_NS) -> HybridMatch:
        """Longest prefix every component can serve in this namespace; splits the edge it ends inside (as SGLang
        does)."""
        rules = self._rules
        if rules is not None and type(tokens) is np.ndarray and len(tokens) >= self.page_size:
            root = self._roots.get(namespace)  # the C match reads an int32 vector in place, builds the result
            if root is not None:
                out = rules[0].match(self, root, tokens, self._pb, rules[1], rules[2])
                if out is not NotImplemented:
                    return out
        arr = self._tokens(tokens)
        n = len(arr) - len(arr) % self.page_size
        root = self._roots.get(namespace)
        if root is None:  # a namespace never seen: nothing to match, nothing allocated
            self.counters.queried_tokens += n
            return HybridMatch(_EMPTY64, 0, self.root.id, 0)
        if not n:
            return HybridMatch(_EMPTY64, 0, root.id, 0)
        if rules is not None:
            return rules[0].match(self, root, arr, self._pb, rules[1], rules[2])
        indices, best, best_n, full_hit = self._match_path(root, (arr[:n] if n < len(arr) else arr).tobytes())
        matched = len(indices)
        self.counters.queried_tokens += n
        self.counters.hit_tokens += matched
        out = HybridMatch(indices, matched, best.id, full_hit)
        if self.swa is not None:
            aligned = full_hit - full_hit % self.page_size
            out.swa_branching_seqlen = aligned if aligned > matched else None
        if self.mamba is not None:
            aligned = full_hit - full_hit % self.mamba.grid
            out.mamba_branching_seqlen = aligned if aligned > matched else None
            out.mamba_src = best.mamba
        return out

    # ------------------------------------------------------------- insert
    def insert(self, tokens: TokenInput, slots, *, prev_prefix_len: int = 0, swa_evicted_seqlen: int = 0,
               mamba_value: int = -1, swa_branching_seqlen: Optional[int] = None,
               namespace: Namespace = DEFAULT_NS, count_hit: bool = True) -> HybridInsert:
        """Cache a request's prefix. Positions below prev_prefix_len are the tree's already; below
        swa_evicted_seqlen the request freed its SWA twins itself; mamba_value is the state it donates.
        count_hit=False (a chunk of an unfinished request, a load-back) leaves the write-through counts alone."""
        kb = self._key(tokens)
        n = len(kb) >> 2
        values = np.asarray(slots, dtype=np.int64)
        if len(values) < n:
            raise InvalidInput(f"{len(values)} slots for {n} page-aligned tokens")
        values = values[:n]
        if swa_evicted_seqlen % self.page_size:
            raise InvalidInput(f"swa_evicted_seqlen {swa_evicted_seqlen} is not a multiple of the page size "
                               f"{self.page_size}")
        if self.mamba is not None and mamba_value < 0:
            raise InvalidInput("this tree has a MAMBA component: every insert donates a state (mamba_value)")
        frees = HybridFrees()
        root = self._root(namespace, create=n > 0)
        if root is None:
            return HybridInsert(0, self.root.id, frees, mamba_exist=True)
        root.atime = self._clock_tick()
        if n == 0:
            return HybridInsert(0, root.id, frees, mamba_exist=True)
        params = _Params(n, prev_prefix_len, swa_evicted_seqlen if self.swa else 0, mamba_value,
                         swa_branching_seqlen)
        both = frees.both if self.swa is not None else frees.full
        node, off, total, pb = root, 0, 0, self._pb
        thr = self.write_through_threshold if count_hit else None
        backup_len = 0
        while off < len(kb):
            child = node.children.get(kb[off:off + pb])
            if child is None:
                break
            child.atime = self._clock_tick()
            plen = len(child.key) >> 2 if kb.startswith(child.key, off) else self._common(child.key, kb, off)
            if plen * 4 < len(child.key):
                child = self._split(child, plen)  # continue on the prefix: the suffix keeps the old id
            vslice = values[total:total + plen]
            consumed = plen
            for comp in self.aux:
                consumed = min(consumed, comp.overlap(child, plen, total, vslice, params, frees))
            dup_start = max(0, prev_prefix_len - total)
            if dup_start < consumed:
                dup = vslice[dup_start:consumed]
                gone = min(max(params.swa_evicted_seqlen - total - dup_start, 0), len(dup))
                if gone:
                    frees.full.append(dup[:gone])  # their SWA twins are already free
                if gone < len(dup):
                    both.append(dup[gone:])
            node = child
            total += plen
            off += plen * 4
            if thr is not None:
                h = self._hits[child] = self._hits.get(child, 0) + 1
                if h >= thr:
                    backup_len = total
        new_leaf = off < len(kb)
        if new_leaf:
            target = self._new_node(node, kb[off:], values[total:].copy())
            node.children[kb[off:off + pb]] = target
            if thr is not None:
                self._hits[target] = 1
                if thr <= 1:
                    backup_len = n
            self.evictable[FULL] += n - total
            self.counters.inserted_tokens += n - total
            if self._ev is not None:
                self._record(STORED, FULL, target)
            self._update_leaf(target)
            self._update_leaf(node)
        else:
            target = node
        result = HybridInsert(total, target.id, frees, backup_len=backup_len)
        for comp in self.aux:
            comp.commit(target, new_leaf, params, result)
        if target is not root:
            for comp in self.aux:
                comp.refresh_insert(target)
        return result

    # ------------------------------------------------------------- locks
    def lock(self, node_id: int, skip_mamba: bool = False) -> int:
        """Protect node's path (FULL), its window (SWA) and its state (MAMBA, unless skip_mamba); returns a
        receipt."""
        node = self._node(node_id)
        r = _Receipt(node, skip_mamba=skip_mamba)
        if self._rules is not None:
            newly = self._rules[0].lock_path(node, 1)
        else:
            cur, newly = node, 0
            while cur.parent is not None:
                if cur.lock == 0:
                    newly += cur.n
                cur.lock += 1
                cur = cur.parent  # only the anchor can be a leaf: every node above it has a child
        if newly:
            self.evictable[FULL] -= newly
            self.protected[FULL] += newly
        for comp in self.aux:
            comp.acquire(node, r)
        self._update_leaf(node)
        rid = next(self._rids)
        self._receipts[rid] = r
        return rid

    def _receipt(self, rid: int) -> _Receipt:
        r = self._receipts.get(rid)
        if r is None:
            raise UnknownReceipt(f"unknown or already released receipt {rid}")
        return r

    def release_swa(self, rid: int) -> HybridFrees:
        """Decode has passed the window: release the window lock and the MAMBA lock now, keep FULL's."""
        r = self._receipt(rid)
        frees = HybridFrees()
        if self.swa is None or r.swa_released:
            raise InvalidInput(f"receipt {rid} holds no SWA window lock" if self.swa is None
                               else f"receipt {rid} already released its SWA window")
        r.swa_released = True
        if r.node.parent is None:
            return frees
        self.swa.release_window(r.node, r, frees)
        for comp in reversed(self.aux):
            if comp.internal_priority < self.swa.internal_priority:
                comp.release(r.node, r)
        return frees

    def unlock(self, rid: int) -> None:
        """Release what the receipt still holds: components first, FULL last."""
        r = self._receipts.pop(rid, None)
        if r is None:
            raise UnknownReceipt(f"unknown or already released receipt {rid}")
        node = r.node
        for comp in reversed(self.aux):
            if r.swa_released and comp.internal_priority <= self.swa.internal_priority:
                continue
            comp.release(node, r)
        if self._rules is not None:
            freed = self._rules[0].lock_path(node, -1)
        else:
            cur, freed = node, 0
            while cur.parent is not None:
                if cur.lock == 1:
                    freed += cur.n
                cur.lock -= 1
                cur = cur.parent
        if freed:
            self.evictable[FULL] += freed
            self.protected[FULL] -= freed
        self._update_leaf(node)  # the only node of the path that can be a leaf

    # ------------------------------------------------------------- eviction
    def _victim(self, node: HNode) -> Victim:
        """What a host tier needs to keep a copy of the prefix ending at this leaf."""
        path = []
        while node.parent is not None:
            path.append(node)
            node = node.parent
        end = sum(nd.n for nd in path)
        floor, mamba = end, path[0].mamba
        if self.swa is not None:
            for nd in path:  # the SWA run that ends at the leaf, leaf upwards
                if not nd.swa:
                    break
                floor -= nd.n
            floor = max(floor, end - self.swa.tail_len)
        full = np.concatenate([nd.full for nd in reversed(path)]) if len(path) > 1 else path[0].full
        return Victim(path[0].ns, b"".join(nd.key for nd in reversed(path)), full, floor, mamba, path[0].n)

    def _delete_leaf(self, node: HNode, frees: HybridFrees, tracker: dict) -> None:
        if self._victims is not None:
            self._victims.append(self._victim(node))
        if self._hits is not None:
            self._hits.pop(node, None)
        if self._ev is not None:
            self._record(REMOVED, FULL, node)
        n = len(node.full)
        frees.full.append(node.full)
        self.evictable[FULL] -= n
        tracker[FULL] += n
        for comp in self.aux:
            if comp.has(node):
                comp.drop(node, frees, tracker)
        self._leaves.discard(node)
        parent = node.parent
        del parent.children[node.key[:self._pb]]
        del self._nodes[node.id]
        self._update_leaf(parent)
        if parent.parent is None:
            self._prune_root(parent)

    def evict(self, full: int = 0, swa: int = 0, mamba: int = 0) -> HybridEvicted:
        """Free at least this much of each component (whole nodes, so it may overshoot); FULL goes leaf by
        leaf, oldest first, each with all its components; then SWA, then MAMBA, on their own LRUs."""
        frees = HybridFrees()
        tracker = {FULL: 0, SWA: 0, MAMBA: 0}
        if full > 0:
            heap = [(n.atime, n.id, n) for n in self._leaves]
            heapq.heapify(heap)
            last = None
            while True:
                if last is not None and last.parent in self._leaves:
                    p = last.parent
                    heapq.heappush(heap, (p.atime, p.id, p))
                last = None
                while tracker[FULL] < full and heap:
                    x = heapq.heappop(heap)[2]
                    if x in self._leaves:
                        last = x
                        break
                if last is None:
                    break
                self._delete_leaf(last, frees, tracker)
        for comp, want in ((self.swa, swa), (self.mamba, mamba)):
            if comp is not None and want > tracker[comp.name]:
                comp.evict_walk(want, tracker, frees)
        self.counters.evicted_tokens_device += tracker[FULL]
        out = HybridEvicted(tracker[FULL], tracker[SWA], tracker[MAMBA], frees)
        if self._victims:
            out.victims, self._victims = self._victims, []
        return out

    # ------------------------------------------------------------- events
    def _digests(self, node: HNode) -> bytes:
        """A node's page digests (the frozen chain of hashes.py), computed top-down where missing."""
        if node.dig is None:
            todo = []
            walker = node
            while walker.parent is not None and walker.dig is None:
                todo.append(walker)
                walker = walker.parent
            prior = walker.dig[-32:] if walker.parent is not None else _hashes.salt_seed(walker.ns[1])
            for nd in reversed(todo):
                nd.dig = _hashes.chain(nd.key, self._pb, prior)
                prior = nd.dig[-32:]
        return node.dig

    def _record(self, kind: int, component: str, node: HNode) -> None:
        """Queue one component's store or removal of a node (hashed now: the node may split or go later).
        FULL and SWA name every page of the node; MAMBA names its last page, the prefix its state sums up."""
        if self._ev is None or (component == FULL and not self.full_kv):
            return
        self._ev.append(self._rec(kind, component, node))

    def _rec(self, kind: int, component: str, node: HNode) -> tuple:
        dig = self._digests(node)
        if component == MAMBA:
            if len(dig) > 32:
                parent = dig[-64:-32]
            else:
                parent = self._digests(node.parent)[-32:] if node.parent.parent is not None else None
            dig, key = dig[-32:], node.key[-self._pb:]
        else:
            parent = self._digests(node.parent)[-32:] if node.parent.parent is not None else None
            key = node.key
        return kind, component, dig, parent, key, node.ns

    def take_events(self) -> list[Event]:
        """Events since the last call, coalesced. Each carries its component as vLLM's KV cache group:
        group_idx is the component's place in `components` (FULL 0, then SWA and MAMBA as configured),
        kv_cache_spec_kind is "full_attention", "sliding_window" or "mamba", and an SWA store carries the
        window. MAMBA events name one page: the last page of the prefix whose state is cached."""
        if not self._ev:
            return []
        recs, self._ev = self._ev, []
        return self._events_of(recs)

    def snapshot_records(self) -> list[Event]:
        """A BlockStored for every page of every component held now, parents first (what the events so far add up
        to), for a consumer that starts from the current state."""
        recs = []
        for root in self._roots.values():
            stack = list(root.children.values())
            while stack:
                node = stack.pop()
                if self.full_kv:
                    recs.append(self._rec(STORED, FULL, node))
                recs.extend(self._rec(STORED, c.name, node) for c in self.aux if c.has(node))
                stack.extend(node.children.values())
        return self._events_of(recs)

    def _events_of(self, recs: list) -> list[Event]:
        out = Coalescer()
        kinds = {FULL: "full_attention", SWA: "sliding_window", MAMBA: "mamba"}
        window = self.swa.window if self.swa is not None else None
        for kind, comp, dig, parent, key, (lora, salt) in recs:
            if kind == CLEARED:
                out.push(AllBlocksCleared())
                continue
            seed = _hashes.event_seed(lora, salt) if lora or salt else None  # the namespace's own hashes
            hashes = _hashes.namespaced(_hashes.block_hashes(dig), seed)
            group = self.groups[comp]
            if kind == STORED:
                prev = None if parent is None else _hashes.namespaced([_hashes.block_hash(parent)], seed)[0]
                out.push(BlockStored(hashes, prev,
                                     np.frombuffer(key, "<i4").tolist(), self.page_size, self.medium,
                                     cache_salt=salt or None, lora_name=lora or None, group_idx=group, kv_cache_spec_kind=kinds[comp],
                                     kv_cache_spec_sliding_window=window if comp == SWA else None))
            else:
                out.push(BlockRemoved(hashes, self.medium, group_idx=group))
        return out.events

    # ------------------------------------------------------------- views
    def sizes(self) -> dict[str, tuple[int, int]]:
        """(evictable, protected) per component of this tree."""
        return {c: (self.evictable[c], self.protected[c]) for c in self.components}

    def node_count(self) -> int:
        return len(self._nodes) - len(self._roots)

    def held(self) -> dict[str, np.ndarray]:
        """Every slot the tree holds, per component (SWA by FULL slot): for conservation checks."""
        full, swa, mamba = [], [], []
        for node in self._nodes.values():
            if node.parent is None:
                continue
            full.append(node.full)
            if node.swa:
                swa.append(node.full)
            if node.mamba >= 0:
                mamba.append(node.mamba)
        cat = HybridFrees._cat
        return {FULL: cat(full), SWA: cat(swa), MAMBA: np.array(mamba, dtype=np.int64)}

    # ------------------------------------------------------------- service views
    @property
    def events_enabled(self) -> bool:
        return self._ev is not None

    def take_records(self) -> tuple[list, int]:
        """The event hub's feed: events since the last call (hashed here), none lost."""
        return self.take_events(), 0

    raw_events = staticmethod(ReadyEvents)

    def cached_prefix_len(self, tokens: TokenInput, ns: Namespace = DEFAULT_NS) -> int:
        """Tokens of this key the tree holds FULL KV for (page-aligned); touches nothing, splits nothing."""
        kb = self._key(tokens)
        node, off = self._roots.get(ns), 0
        if node is None:
            return 0
        while off < len(kb):
            child = node.children.get(kb[off:off + self._pb])
            if child is None:
                break
            if not kb.startswith(child.key, off):
                return (off >> 2) + self._common(child.key, kb, off)
            node, off = child, off + len(child.key)
        return off >> 2

    def has_receipt(self, rid: int) -> bool:
        return rid in self._receipts

    def receipt_node(self, rid: int) -> int:
        """The node a receipt protects."""
        return self._receipt(rid).node.id

    def swa_released(self, rid: int) -> bool:
        return self._receipt(rid).swa_released

    def reset(self) -> dict[str, np.ndarray]:
        """Drop every cached prefix (refused while a receipt is live); returns what the tree held, per
        component. Node and receipt ids keep counting, so a stale handle stays stale."""
        if self._receipts:
            raise LocksHeld(f"{len(self._receipts)} lock receipts are outstanding")
        held = self.held()
        ids, rids, counters, ev = self._ids, self._rids, self.counters, self._ev
        self.__init__(*self._params)
        self._ids, self._rids, self.counters = ids, rids, counters
        if ev is not None:
            ev.append((CLEARED, FULL, b"", None, b"", DEFAULT_NS))
            self._ev = ev
        return held

    @property
    def num_receipts(self) -> int:
        return len(self._receipts)

    @property
    def num_nodes(self) -> int:
        return len(self._nodes) - len(self._roots)

    @property
    def evictable_size(self) -> int:
        return self.evictable[FULL]

    @property
    def protected_size(self) -> int:
        return self.protected[FULL]

    @property
    def cached_tokens(self) -> int:
        return self.evictable[FULL] + self.protected[FULL]

    # a hybrid tree has no host half (its host tier is a tree of its own): these read as a plain tree's without one
    write_policy = None
    bigram = False
    host_evictable_size = host_protected_size = host_cached_tokens = 0
