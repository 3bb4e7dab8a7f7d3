"""A pure two-tier radix tree of token prefixes: it decides what to free, copy or load; the caller does it.

Tiers (SPEC-tiers sections 1-3). A node holds device slots (`value`), host slots (`host_value`) or both;
"neither" never exists at rest. Device residency is prefix-closed; host residency is prefix-closed under
the write-through policies. With `write_policy=None` the host tier is off and the tree is device-only.

Every transfer is a plan the engine executes and reports back:
  backup    insert (or eviction under write-back) returns `BackupAction`s; the engine evicts host space
            (`evict_host`), copies, `commit_backup(ack, host_slots)`, and `finish_backup(ack)` once the
            copy completed (or `abort_backup(ack)`). The node is device-locked from the action until then.
  load-back `load_back(node)` plans (all or nothing over the evicted segment), the engine evicts device
            space and copies, `commit_load_back(op, slots)`, then `finish_load_back(op)` makes the
            segment device-resident and turns the op id into a lock receipt over the whole path.
Locks: device locks cover device-resident nodes only, from the anchor to the root; host locks pin one
host-only node (its ancestors cannot be host leaves while it exists). `lock()` on a host-only node takes
both, and the receipt remembers exactly what it took.

Handles: a node handle is `instance_tag << 48 | serial`. After a split the old handle names the deeper
fragment (as in both seeds); the new upper node gets a new handle.

Access times and hits, where radixd differs from SGLang's in-process RadixCache:
  * Times are integer ticks, not `time.monotonic()`: ordering is deterministic and never tied.
  * A match re-stamps its path root to leaf with increasing ticks, so a child is always newer than its
    parent (SGLang stamps the whole path with one time). A split stamps both fragments fresh before that,
    so an unmatched tail counts as just used, as in SGLang and the seeds.
  * Hits (LFU, SLRU, write-through thresholds) are counted on insert, never on match, as in SGLang and
    the seeds; a chunked insert counts none. Unlike the seeds radixd also counts them under write-back,
    so LFU and SLRU keep working there (write-back never reads the count for backups).
"""
from __future__ import annotations

import heapq
from typing import Iterable, Optional, Union

import numpy as np

from .errors import ForeignHandle, InFlight, InvalidInput, LocksHeld, StaleHandle, UnknownReceipt
from .node import Node
from . import hashes as _hashes
from .events import CPU, GPU, REMOVED, STORED, CLEARED, Event, EventQueue, RawEvents
from .policies import DEFAULT_SLRU_THRESHOLD, POLICIES, policy_key
from .results import _EMPTY, BackupAction, EvictResult, FreedSlots, InsertResult, MatchResult, TreeCounters, _slots
from .storage import StorageMixin
from .transfers import BackupOp, LoadOp, TransferMixin

try:  # the match and lock walks in C (server/tree/_hwalk.c), optional like every native part
    from . import _hwalk
except ImportError:  # pragma: no cover - built by setup.py wherever a C compiler is
    _hwalk = None

Namespace = tuple[str, str]
TokenInput = Union[bytes, bytearray, memoryview, np.ndarray, Iterable[int]]
DEFAULT_NS: Namespace = ("", "")
WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
HEAP_SLACK, HEAP_FLOOR = 2, 1024  # a lazy heap holds at most SLACK x live entries + FLOOR
_I32 = np.dtype("<i4")
_SERIAL_BITS = 48
_SERIAL_MASK = (1 << _SERIAL_BITS) - 1


def as_int32(data: TokenInput) -> np.ndarray:
    """Accept packed little-endian int32 bytes, numpy arrays or lists; return a 1-D int32 array."""
    if type(data) is np.ndarray and data.dtype is _I32 and data.ndim == 1:  # already one: the hot case, as is
        return data
    if isinstance(data, (bytes, bytearray, memoryview)):
        if len(data) % 4:
            raise InvalidInput(f"packed int32 buffer has {len(data)} bytes, not a multiple of 4")
        return np.frombuffer(data, dtype="<i4")
    arr = np.asarray(data)
    if arr.ndim != 1:
        raise InvalidInput(f"expected a 1-D sequence, got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        raise InvalidInput(f"expected integers, got dtype {arr.dtype}")
    return arr.astype("<i4", copy=False)


def bigram_keys(tokens: np.ndarray) -> np.ndarray:
    """EAGLE bigram keys: position i holds the pair (t[i], t[i+1]) packed into one int64."""
    if len(tokens) < 2:
        return np.zeros(0, dtype="<i8")
    hi = tokens[:-1].astype(np.int64) << 32
    return (hi | (tokens[1:].astype(np.int64) & 0xFFFFFFFF)).astype("<i8", copy=False)


_NO_EVENTS = RawEvents([], 1, "<i4", False)  # what an empty take returns (never mutated)
_NO_RECORDS: tuple[list, int] = ([], 0)  # likewise


class RadixTree(TransferMixin, StorageMixin):
    """SGLang-style two-tier radix cache over packed numpy buffers; pure: no I/O, no frees, no copies."""

    def __init__(self, page_size: int = 1, policy: str = "lru", bigram: bool = False, instance_tag: int = 0,
                 write_policy: Optional[str] = None, write_through_threshold: Optional[int] = None,
                 load_back_threshold: int = 10, slru_threshold: int = DEFAULT_SLRU_THRESHOLD,
                 events: bool = False, events_limit: int = 1 << 20, native: bool = True):
        if page_size < 1:
            raise ValueError("page_size must be >= 1")
        if not 0 <= instance_tag < (1 << 16):
            raise ValueError("instance_tag must fit in 16 bits")
        if write_policy is not None and write_policy not in WRITE_POLICIES:
            raise ValueError(f"unknown write policy {write_policy!r}; choose one of {list(WRITE_POLICIES)}")
        if write_through_threshold is None:
            write_through_threshold = 1 if write_policy == "write_through" else 2
        if write_through_threshold < 1:
            raise ValueError("write_through_threshold must be >= 1")
        if load_back_threshold < 0:
            raise ValueError("load_back_threshold must be >= 0")
        self.page_size = page_size
        self.policy = policy
        self.bigram = bigram
        self.write_policy = write_policy
        self.host = write_policy is not None
        self.write_back = write_policy == "write_back"
        self._through = self.host and not self.write_back
        self.write_through_threshold = write_through_threshold
        self.load_back_threshold = load_back_threshold
        self._key_of = policy_key(policy, slru_threshold)
        # a match only raises an LRU key: its leaves keep their heap entries, and eviction re-sorts the ones it
        # pops out of date (the order is the same: every access tick is distinct)
        self._lazy = self._key_of is POLICIES["lru"]
        self._tag = instance_tag << _SERIAL_BITS
        self._isz = 8 if bigram else 4
        self._kdt = np.dtype("<i8" if bigram else "<i4")
        self._page_b = page_size * self._isz
        self._handle = self._tag  # the last handle minted: the tag | the last serial
        self._tick = 0
        self._heap_seq = 0
        self._nodes: dict[int, Node] = {}
        self._roots: dict[Namespace, Node] = {}
        self._receipts: dict[int, tuple[Node, Optional[Node]]] = {}  # receipt -> (device anchor, host anchor)
        self._backups: dict[int, BackupOp] = {}
        self._loads: dict[int, LoadOp] = {}
        self._leaves: set[Node] = set()  # D-leaves: device-evictable
        self._heap: list[tuple] = []
        self._hleaves: set[Node] = set()  # H-leaves: host-evictable
        self._hheap: list[tuple] = []
        self._coexist: set[Node] = set()  # write-back: candidates for host-copy reclaim (may hold stale entries)
        self.evictable_size = 0
        self.protected_size = 0
        self.host_evictable_size = 0
        self.host_protected_size = 0
        self.counters = TreeCounters()
        self._ev: Optional[EventQueue] = EventQueue(events_limit) if events else None
        self._walk = _hwalk if native else None  # match and lock walks in C; None: the Python loops (their reference)
        if self._walk is not None:  # lock and unlock go straight to C, no Python frame; the methods take the rare cases
            self.lock, self.unlock = _hwalk.bind_locks(self)
            if not self.host and not bigram and type(self).insert is RadixTree.insert:  # likewise insert's common call
                self.insert = _hwalk.bind_insert(self, DEFAULT_NS)
        # what the C match builds with, and the lazy heaps' bound it keeps when it re-pushes a leaf
        self._mctx = (MatchResult, np.empty, _I32, _EMPTY, page_size, POLICIES["lru"], HEAP_SLACK, HEAP_FLOOR)
        self._ictx = (InsertResult, Node, GPU, np.empty, _I32, _EMPTY, POLICIES["lru"], HEAP_SLACK, HEAP_FLOOR)
        self._ectx = (EvictResult, DEFAULT_NS, REMOVED, GPU, np.empty, _I32, _EMPTY, POLICIES["lru"], HEAP_SLACK,
                      HEAP_FLOOR)
        self._seeds: dict[Namespace, Optional[bytes]] = {}
        self._hfmt = (self._page_b, self.bigram)  # shared by every lazy digest run of the default namespace
        self._hfmts: dict[Namespace, tuple] = {DEFAULT_NS: self._hfmt}  # others add their event seed (hashes.py)
        self._root(DEFAULT_NS)

    # ---------------------------------------------------------------- events
    def _fmt(self, ns: Namespace) -> tuple:
        """The digest-run format of a namespace: page bytes, bigram, and its event seed unless the default."""
        fmt = self._hfmts.get(ns)
        if fmt is None:
            seed = _hashes.event_seed(ns[0], ns[1])
            fmt = self._hfmts[ns] = self._hfmt if seed is None else (self._page_b, self.bigram, seed)
        return fmt

    def _span(self, node: Node) -> _hashes.Span:
        """A node's page digests as a lazy span, created along its path where missing (nothing is hashed)."""
        span = node.hashes
        if span is not None:
            return span
        parent = node.parent
        if parent.parent is None:
            prior = self._seed(node.ns)
        else:
            ps = parent.hashes
            if ps is None:  # ancestors without spans too (events were off until storage asked): fill top-down
                path = []
                while parent.parent is not None and parent.hashes is None:
                    path.append(parent)
                    parent = parent.parent
                for nd in reversed(path):
                    self._span(nd)
                ps = node.parent.hashes
            prior = (ps[0], ps[2] - 1)
        node.hashes = span = _hashes.lazy_span(node.key, self._fmt(node.ns), prior)
        return span

    def _digests(self, node: Node) -> bytes:
        """Page digests of a node, 32 bytes each (hashes.py, frozen), hashed now if not yet."""
        return _hashes.span_digests(self._span(node))

    def _stored(self, node: Node, medium: str) -> None:
        q = self._ev
        if len(q.records) >= q.limit:
            q.dropped += 1
            return
        parent, span = node.parent, node.hashes
        if parent.parent is None:
            ps = None
            if span is None:
                span = self._span(node)
        else:
            ps = parent.hashes or self._span(parent)
            if span is None:  # a new leaf, the common case: its span continues its parent's (as _span would)
                node.hashes = span = _hashes.lazy_span(node.key, self._fmt(node.ns), (ps[0], ps[2] - 1))
        q.records.append((STORED, span, ps, node.key, medium, node.ns[1] or None, node.ns[0] or None))

    def _removed(self, node: Node, medium: str) -> None:
        recs = self._ev.records
        span = node.hashes or self._span(node)
        if recs and recs[-1][0] == REMOVED and recs[-1][2] == medium:
            recs[-1][1].append(span)  # removes of one medium merge anyway (R6.4): one record
        else:
            self._ev.push_raw((REMOVED, [span], medium))

    def snapshot_records(self) -> list:
        """STORED records of every page held now, per medium and parents first (what the events so far add up to:
        a host copy counts once its backup is acknowledged), for a consumer that starts from the current state."""
        out = []
        for root in self._roots.values():
            stack = list(root.children.values())
            while stack:
                node = stack.pop()
                span = node.hashes or self._span(node)
                ps = node.parent.hashes if node.parent.parent is not None else None
                salt, lora = node.ns[1] or None, node.ns[0] or None
                if node.value is not None:
                    out.append((STORED, span, ps, node.key, GPU, salt, lora))
                if node.host_value is not None and not node.pending:
                    out.append((STORED, span, ps, node.key, CPU, salt, lora))
                stack.extend(node.children.values())
        return out

    @property
    def events_enabled(self) -> bool:
        """Whether this tree records KV events."""
        return self._ev is not None

    def take_events(self) -> tuple[list[Event], int]:
        """Events since the last call, in order and coalesced, and how many the bound dropped (0 normally)."""
        if self._ev is None:
            return [], 0
        raw, lost = self.take_raw_events()
        return (raw.materialize() if raw.records else []), lost

    def take_raw_events(self) -> tuple[RawEvents, int]:
        """The same, still unhashed: cheap to take on the request path, `materialize()` it elsewhere."""
        records, lost = self.take_records()
        return (self.raw_events(records) if records else _NO_EVENTS), lost

    def take_records(self) -> tuple[list, int]:
        """The bare records since the last take and how many the bound dropped: the least a caller on the
        request path can do (wrap them with `raw_events` wherever they are published)."""
        q = self._ev
        if q is None or not (q.records or q.dropped):
            return _NO_RECORDS
        return q.take()

    def raw_events(self, records: list) -> RawEvents:
        """Records from `take_records` with what their hashing needs to know of this tree."""
        return RawEvents(records, self.page_size, self._kdt, self.bigram)

    # ---------------------------------------------------------------- helpers
    _as_int32 = staticmethod(as_int32)

    def _mint(self) -> int:
        self._handle += 1
        return self._handle

    def _root(self, ns: Namespace, create: bool = True) -> Optional[Node]:
        root = self._roots.get(ns)
        if root is None and create:
            root = Node(self._mint(), None, b"", b"", self._tick, 0, ns)
            self._roots[ns] = root
            self._nodes[root.id] = root
        return root

    def _prune_root(self, root: Node) -> None:
        """A namespace root with nothing below it and no lock goes: misses must not grow memory."""
        if not root.children and root.lock_ref == 0 and root.ns != DEFAULT_NS:
            del self._roots[root.ns]
            del self._nodes[root.id]

    def _next_tick(self) -> int:
        self._tick += 1
        return self._tick

    def _encode_key(self, tokens: TokenInput) -> bytes:
        if not self.bigram and isinstance(tokens, bytes):
            if len(tokens) % 4:
                raise InvalidInput(f"packed int32 buffer has {len(tokens)} bytes, not a multiple of 4")
            return tokens
        arr = as_int32(tokens)
        return (bigram_keys(arr) if self.bigram else arr).tobytes()

    def _align(self, nbytes: int) -> int:
        return nbytes - nbytes % self._page_b

    def _common_bytes(self, a: bytes, b: bytes, boff: int, bend: int) -> int:
        """Page-aligned length in bytes of the common prefix of a and b[boff:bend]."""
        n = min(len(a), bend - boff) // self._isz
        x = np.frombuffer(a, self._kdt, n)
        y = np.frombuffer(b, self._kdt, n, boff)
        ne = x != y
        i = int(ne.argmax()) if n else 0
        if n and not ne[i]:
            i = n
        return (i - i % self.page_size) * self._isz

    # ------------------------------------------------------------ leaf sets
    def _has_dev_child(self, node: Node) -> bool:
        if not self.host:
            return bool(node.children)
        for c in node.children.values():
            if c.value is not None:
                return True
        return False

    def _is_leaf(self, node: Node) -> bool:
        """D-leaf (R3.1): device-resident, unlocked, no device-resident child."""
        return (node.parent is not None and node.lock_ref == 0 and node.value is not None
                and not self._has_dev_child(node))

    @staticmethod
    def _is_hleaf(node: Node) -> bool:
        """H-leaf (R3.2): host-only, not host-locked, not being loaded, childless."""
        return (node.parent is not None and node.value is None and node.host_value is not None
                and node.host_lock_ref == 0 and not node.loading and not node.children)

    def _add_leaf(self, node: Node) -> None:
        node.dver += 1
        self._leaves.add(node)
        self._heap_seq += 1
        heap = self._heap
        heapq.heappush(heap, (self._key_of(node), self._heap_seq, node.dver, node))
        if len(heap) > HEAP_SLACK * len(self._leaves) + HEAP_FLOOR:
            self._compact(heap, self._leaves, "dver")

    def _drop_leaf(self, node: Node) -> None:
        if node in self._leaves:
            self._leaves.discard(node)
            node.dver += 1

    def _add_hleaf(self, node: Node) -> None:
        node.hver += 1
        self._hleaves.add(node)
        self._heap_seq += 1
        heap = self._hheap
        heapq.heappush(heap, (self._key_of(node), self._heap_seq, node.hver, node))
        if len(heap) > HEAP_SLACK * len(self._hleaves) + HEAP_FLOOR:
            self._compact(heap, self._hleaves, "hver")

    def _drop_hleaf(self, node: Node) -> None:
        if node in self._hleaves:
            self._hleaves.discard(node)
            node.hver += 1

    def _sync(self, node: Node) -> None:
        """Recompute both leaf predicates for one node and fix set membership (R3.3)."""
        if node.parent is None:
            return
        if self._is_leaf(node):
            if node not in self._leaves:
                self._add_leaf(node)
        else:
            self._drop_leaf(node)
        if self._is_hleaf(node):
            if node not in self._hleaves:
                self._add_hleaf(node)
        else:
            self._drop_hleaf(node)

    def _refresh(self, node: Node) -> None:
        """Re-sort a leaf whose policy key changed (touch, hit, priority)."""
        if node in self._leaves:
            self._add_leaf(node)
        elif node in self._hleaves:
            self._add_hleaf(node)

    # ---------------------------------------------------------------- locks
    def _dlock(self, node: Node) -> int:
        """Device-lock node..root (all device-resident); returns the tokens newly moved to protected."""
        if self._walk is not None:
            newly = self._walk.full_lock(node, self._leaves)
            self.evictable_size -= newly
            self.protected_size += newly
            return newly
        newly = 0
        walker = node
        while walker.parent is not None:
            if walker.lock_ref == 0:
                size = len(walker.value) >> 2
                newly += size
                self._drop_leaf(walker)
            walker.lock_ref += 1
            walker = walker.parent
        walker.lock_ref += 1  # the namespace root counts locks too, so it is never pruned under one
        self.evictable_size -= newly
        self.protected_size += newly
        return newly

    def _dunlock(self, node: Node) -> None:
        if self._walk is not None:
            freed, root = self._walk.full_unlock(node)
            self.protected_size -= freed
            self.evictable_size += freed
            if self._is_leaf(node):  # the only node of the path that can have become a D-leaf
                self._add_leaf(node)
            if root is not None:
                self._prune_root(root)
            return
        walker = node
        while walker.parent is not None:
            walker.lock_ref -= 1
            if walker.lock_ref == 0:
                size = len(walker.value) >> 2
                self.protected_size -= size
                self.evictable_size += size
                if self._is_leaf(walker):
                    self._add_leaf(walker)
            walker = walker.parent
        walker.lock_ref -= 1
        if walker.lock_ref == 0:
            self._prune_root(walker)

    def _hlock(self, node: Node) -> None:
        """Host-lock a node; every node above it is pinned (an unbounded evict_host cannot reach them)."""
        if node.host_lock_ref == 0:
            self._drop_hleaf(node)
        node.host_lock_ref += 1
        self._pin(node, 1)

    def _hunlock(self, node: Node) -> None:
        node.host_lock_ref -= 1
        self._pin(node, -1)
        if node.host_lock_ref == 0:
            self._sync(node)

    def _bunlock(self, node: Node) -> None:
        """Release a backup's own host lock (taken on the node only, while its host slots are written)."""
        node.host_lock_ref -= 1
        if node.host_lock_ref == 0:
            self._sync(node)
        self._hfix(node)

    def _pin(self, node: Node, step: int) -> None:
        walker = node
        while walker.parent is not None:
            walker.hpin += step
            self._hfix(walker)
            walker = walker.parent

    def _hfix(self, node: Node) -> None:
        """Recount a node's host tokens as evictable (an unbounded evict_host would free them) or protected."""
        if node.host_value is None:
            state = 0
        elif node.value is None:
            state = 2 if node.hpin or node.host_lock_ref or node.loading else 1
        else:
            state = 1 if self.write_back and self._reclaimable(node) else 2
        if state != node.hstate:
            size = len(node.host_value) >> 2  # not None: _set_host uncounts a node before changing it
            if node.hstate == 1:
                self.host_evictable_size -= size
            elif node.hstate == 2:
                self.host_protected_size -= size
            if state == 1:
                self.host_evictable_size += size
            elif state == 2:
                self.host_protected_size += size
            node.hstate = state

    def _set_host(self, node: Node, host: Optional[bytes]) -> None:
        """Replace a node's host value, keeping the host counters exact."""
        if node.hstate:
            if node.hstate == 1:
                self.host_evictable_size -= len(node.host_value) >> 2
            else:
                self.host_protected_size -= len(node.host_value) >> 2
            node.hstate = 0
        node.host_value = host
        self._hfix(node)

    def _node(self, node_id: int) -> Node:
        if node_id & ~_SERIAL_MASK != self._tag:
            raise ForeignHandle(f"node handle {node_id:#x} belongs to another server instance")
        node = self._nodes.get(node_id)
        if node is None:
            raise StaleHandle(f"node handle {node_id:#x} is stale: the node was evicted or never existed")
        return node

    def _own(self, handle: int, what: str) -> None:
        if handle & ~_SERIAL_MASK != self._tag:
            raise ForeignHandle(f"{what} {handle:#x} belongs to another server instance")

    # ---------------------------------------------------------------- split
    def _split(self, child: Node, m: int) -> Node:
        """Cut child's edge after m key bytes; the new upper node inherits locks, hits, priority, pins."""
        parent = child.parent
        pos4 = (m // self._isz) * 4
        upper = Node(self._mint(), parent, child.key[:m], None if child.value is None else child.value[:pos4],
                     0, child.priority, child.ns)
        upper.created = child.created
        upper.hit_count = child.hit_count
        upper.lock_ref = child.lock_ref
        upper.hpin = child.hpin  # every host lock below child is below upper too
        if child.value is not None:
            child.value = child.value[pos4:]
        if child.host_value is not None:
            host = child.host_value
            self._set_host(child, None)  # out with the whole, in with both fragments
            if child.pending and self._backups[child.pending].committed:
                upper.host_lock_ref = 1  # the backup op host-locks each of its nodes
            self._set_host(upper, host[:pos4])
            self._set_host(child, host[pos4:])
        if child.pending:
            upper.pending = child.pending
            nodes = self._backups[child.pending].nodes
            nodes.insert(nodes.index(child), upper)
        upper.loading = child.loading
        self._hfix(upper)
        if child.hashes is not None:
            upper.hashes, child.hashes = _hashes.span_split(child.hashes, m // self._page_b)
        if child in self._coexist:
            self._coexist.add(upper)
        parent.children[child.key[:self._page_b]] = upper
        child.key = child.key[m:]
        child.parent = upper
        upper.children[child.key[:self._page_b]] = child
        self._nodes[upper.id] = upper
        upper.last_access = self._next_tick()
        child.last_access = self._next_tick()
        self._refresh(child)
        return upper

    # ------------------------------------------------------------- public API
    def match_prefix(self, tokens: TokenInput, namespace: Namespace = DEFAULT_NS) -> MatchResult:
        """Longest cached page-aligned prefix over both tiers; a match ending inside an edge splits it."""
        walk = self._walk
        if walk is not None and not self.bigram:
            root = self._roots.get(namespace)
            if root is not None:  # the C walk reads packed or int32 tokens in place and builds the result
                out = walk.full_match(self, root, tokens, self._page_b, self._mctx)
                if out is NotImplemented:  # a list, or another dtype: packed first
                    out = walk.full_match(self, root, self._encode_key(tokens), self._page_b, self._mctx)
                return out
        kb = self._encode_key(tokens)
        n = self._align(len(kb))
        isz = self._isz
        self.counters.queried_tokens += len(kb) // isz  # every token asked for, as SGLang's hit rate counts
        root = self._roots.get(namespace)
        if root is None:  # a namespace never seen: allocate nothing
            root = self._roots[DEFAULT_NS]
            return MatchResult(_EMPTY, 0, 0, root.id, root.id)
        node, off, vals, pb = root, 0, [], self._page_b
        dev, dev_off = root, 0
        path = []
        while off < n:
            child = node.children.get(kb[off:off + pb])
            if child is None:
                break
            ck = child.key
            if off + len(ck) <= n and kb.startswith(ck, off):
                off += len(ck)
                full = True
            else:
                m = self._common_bytes(ck, kb, off, n)
                child = self._split(child, m)
                off += m
                full = False
            if child.value is not None:
                vals.append(child.value)
                dev, dev_off = child, off
            path.append(child)
            node = child
            if not full:
                break
        matched = dev_off // isz
        host_hit = (off - dev_off) // isz
        self.counters.hit_tokens += matched
        self.counters.host_hit_tokens += host_hit
        if path:
            tick = self._tick
            for nd in path:  # root to leaf: a child is always newer than its parent (R2.3)
                tick += 1
                nd.last_access = tick
            self._tick = tick
            if not self._lazy:
                self._refresh(node)
                if dev is not node and dev is not root:
                    self._refresh(dev)
        indices = np.frombuffer(b"".join(vals), dtype="<i4") if vals else _EMPTY
        return MatchResult(indices, matched, host_hit, dev.id, node.id)

    def cached_prefix_len(self, tokens: TokenInput, namespace: Namespace = DEFAULT_NS) -> int:
        """Device-resident length match_prefix would return, without splitting or touching anything."""
        return self._cached_len(self._encode_key(tokens), namespace)

    def _cached_len(self, kb: bytes, namespace: Namespace) -> int:
        node = self._roots.get(namespace)
        if node is None:
            return 0
        n, off, pb = self._align(len(kb)), 0, self._page_b
        while off < n:
            child = node.children.get(kb[off:off + pb])
            if child is None or child.value is None:
                break
            ck = child.key
            if off + len(ck) <= n and kb.startswith(ck, off):
                off += len(ck)
                node = child
                continue
            off += self._common_bytes(ck, kb, off, n)
            break
        return off // self._isz

    def insert(self, tokens: TokenInput, values: TokenInput, namespace: Namespace = DEFAULT_NS,
               prev_prefix_len: int = 0, priority: int = 0, chunked: bool = False) -> InsertResult:
        """Cache tokens -> slots; returns duplicates to free, the tail the caller keeps and backups to run."""
        walk = self._walk if not self.bigram else None
        kb, isz = tokens, self._isz
        npos = walk.key_tokens(tokens) if walk is not None else -1  # the C descent reads the key in place
        if npos < 0:
            kb = self._encode_key(tokens)
            npos = len(kb) // isz
        vals = as_int32(values)
        if len(vals) != npos + (1 if self.bigram and npos else 0) and len(vals) != npos:
            raise InvalidInput(f"{len(vals)} slot indices for {npos} key positions")
        aligned = npos - npos % self.page_size
        if prev_prefix_len < 0 or prev_prefix_len > aligned:
            raise InvalidInput(f"prev_prefix_len {prev_prefix_len} outside [0, {aligned}]")
        if prev_prefix_len and self._cached_len(self._encode_key(kb), namespace) < prev_prefix_len:
            raise InvalidInput(f"prev_prefix_len {prev_prefix_len} exceeds the cached prefix")
        root = self._root(namespace, create=aligned > 0)
        if root is None:  # nothing to cache in a namespace never seen: allocate nothing
            return InsertResult(0, self._roots[DEFAULT_NS].id, _EMPTY, 0, vals)
        pb, n = self._page_b, aligned * isz
        if walk is not None and not self.host:  # the whole insert in C; the lines below are its reference
            out = walk.full_insert(self, root, kb, vals, n, prev_prefix_len, priority, chunked, namespace, self._ictx)
            if out is not NotImplemented:
                return out
        path, tail = walk.full_descend(self, root, kb, n, pb) if walk is not None else self._descend(root, kb, n)
        node, off = root, 0
        dups: list[tuple[int, int]] = []  # [from, to) ranges of vals; consecutive device nodes extend one range
        dev_end = -1  # byte offset where the device-resident part of the path ended
        unevicted = 0
        want_backup: Optional[Node] = None
        thr, through, leaves = self.write_through_threshold, self._through, self._leaves
        for child in path:
            length = len(child.key) // isz
            pos = off // isz
            if child.value is None:
                if dev_end < 0:
                    dev_end = off
                self._unevict(child, vals[pos:pos + length].tobytes())
                unevicted += length
            else:
                dup_from = max(pos, prev_prefix_len)
                if dup_from < pos + length:
                    if dups and dups[-1][1] == dup_from:
                        dups[-1] = (dups[-1][0], pos + length)
                    else:
                        dups.append((dup_from, pos + length))
            self._tick += 1
            child.last_access = self._tick
            if priority > child.priority:
                child.priority = priority
            if not chunked:
                child.hit_count += 1
                if through and child.host_value is None and not child.pending and child.hit_count >= thr:
                    want_backup = child
            if child in leaves:  # its policy key moved: re-sort (walked nodes are all device-resident now)
                self._add_leaf(child)
            off += len(child.key)
            node = child
        if dev_end < 0:
            dev_end = off
        if tail is not None:
            pos = off // isz
            # only the slots the tree keeps are packed: a long prompt's cached part is never copied
            leaf = Node(self._mint(), node, tail, vals[pos:aligned].tobytes(), self._next_tick(), priority, namespace)
            node.children[leaf.key[:pb]] = leaf
            self._nodes[leaf.id] = leaf
            self.evictable_size += aligned - pos  # a new leaf is unlocked even under a locked parent
            self._drop_leaf(node)
            if not chunked:
                leaf.hit_count = 1
                if self._through and thr <= 1:
                    want_backup = leaf
            self._add_leaf(leaf)
            if self._ev is not None:
                self._stored(leaf, GPU)
            node = leaf
            off = n
        adopted = (off - dev_end) // isz
        self.counters.inserted_tokens += adopted
        backups = self._backup_chain(want_backup) if want_backup is not None else ()
        # a copy: never a view of the caller's array
        dup = _EMPTY if not dups else vals[dups[0][0]:dups[0][1]].copy() if len(dups) == 1 else \
            np.concatenate([vals[a:b] for a, b in dups])
        return InsertResult(dev_end // isz, node.id, dup, adopted, vals[off // isz:], unevicted, backups)

    def _descend(self, root: Node, kb: bytes, n: int) -> tuple[list[Node], Optional[bytes]]:
        """insert's walk along kb[:n] (_hwalk.full_descend's reference): the path and the key of a new leaf.

        An edge the key leaves inside is split and its upper part ends the path; a host-only node being loaded back
        ends it before that node (the load will fill it), and then no leaf is made.
        """
        node, off, pb, path = root, 0, self._page_b, []
        while off < n:
            child = node.children.get(kb[off:off + pb])
            if child is None:
                break
            ck = child.key
            whole = off + len(ck) <= n and kb.startswith(ck, off)
            if not whole:
                child = self._split(child, self._common_bytes(ck, kb, off, n))
            if child.value is None and child.loading:
                return path, None
            path.append(child)
            off += len(child.key)
            node = child
            if not whole:
                break
        return path, (kb[off:n] if off < n else None)

    def _unevict(self, node: Node, value: bytes) -> None:
        """A host-only node takes the request's fresh device slots (R1.20): it becomes 'both'."""
        node.value = value
        self.evictable_size += len(value) >> 2  # host-only nodes carry no device lock
        self._drop_hleaf(node)
        if node.parent.parent is not None:
            self._drop_leaf(node.parent)
        if self.write_back:
            self._coexist.add(node)
        self._hfix(node)
        self._add_leaf(node)  # no device child yet; a deeper unevict or leaf drops it again
        if self._ev is not None:
            self._stored(node, GPU)

    # ---------------------------------------------------------------- locks
    def lock(self, node_id: int) -> int:
        """Protect a node's path from eviction; returns the receipt that unlock replays.

        On a host-only node the device-resident ancestors are device-locked and the node is host-locked,
        so a later load-back finds the whole prefix still cached.
        """
        node = self._node(node_id)
        receipt = self._mint()
        if node.value is not None:  # the common case: the device walk alone
            self._dlock(node)
            self._receipts[receipt] = (node, None)
            return receipt
        dev = node
        while dev.value is None:
            dev = dev.parent
        self._dlock(dev)
        self._hlock(node)
        self._receipts[receipt] = (dev, node)
        return receipt

    def unlock(self, receipt: int) -> None:
        """Release exactly what lock(receipt) took; a second release raises UnknownReceipt."""
        r = self._receipts.pop(receipt, None)
        if r is None:
            self._own(receipt, "receipt")
            if receipt in self._loads:
                raise InFlight(f"receipt {receipt:#x} belongs to a load-back still in flight")
            raise UnknownReceipt(f"receipt {receipt:#x} is unknown or already released")
        dev, host = r
        if host is not None:
            self._hunlock(host)
        self._dunlock(dev)

    def has_receipt(self, receipt: int) -> bool:
        """Whether a receipt is live (issued by this tree and not yet released)."""
        return receipt in self._receipts

    # -------------------------------------------------------------- eviction
    def evict(self, num_tokens: int) -> EvictResult:
        """Free device slots from unlocked D-leaves in policy order until num_tokens are freed or pending.

        A backed-up leaf is demoted (kept host-only); an unbacked one is deleted, or under write-back
        handed back as a write-back action whose tokens count toward num_tokens.
        """
        if not self.host:  # the whole of it in C; _evict_device_only is its reference
            if self._walk is not None:
                return self._walk.full_evict(self, num_tokens, self._ectx)
            return self._evict_device_only(num_tokens)
        freed: list[bytes] = []
        count = demoted = wb_tokens = 0
        write_backs: list[BackupAction] = []
        heap, leaves, nodes, pb = self._heap, self._leaves, self._nodes, self._page_b
        pop = heapq.heappop
        lazy = self._lazy
        while count + wb_tokens < num_tokens and heap:
            key, _, ver, node = pop(heap)
            if ver != node.dver or node not in leaves:
                continue
            if lazy and key != node.last_access:  # touched since it was pushed: back in at its place
                self._add_leaf(node)
                continue
            size = len(node.value) >> 2
            if node.host_value is not None:
                freed.append(self._demote(node))
                count += size
                demoted += size
                continue
            if self.write_back:
                action = self._start_backup(node, True)
                write_backs.append(action)
                wb_tokens += size
                continue
            leaves.discard(node)
            node.dver += 1
            parent = node.parent
            del parent.children[node.key[:pb]]
            del nodes[node.id]
            freed.append(node.value)
            count += size
            self.evictable_size -= size
            self.counters.evicted_tokens_device += size
            self._coexist.discard(node)
            if self._ev is not None:
                self._removed(node, GPU)
            self._tombstone(parent)
        self._compact(heap, leaves, "dver")
        return EvictResult(_slots(freed), count, tuple(write_backs), demoted)

    def _evict_device_only(self, num_tokens: int) -> EvictResult:
        """The host tier is off: delete leaves, nothing else to decide (the hot loop kept minimal)."""
        freed: list[bytes] = []
        count = 0
        heap, leaves, nodes, pb = self._heap, self._leaves, self._nodes, self._page_b
        gone: Optional[list] = [] if self._ev is not None else None
        pop = heapq.heappop
        lazy = self._lazy
        while count < num_tokens and heap:
            key, _, ver, node = pop(heap)
            if ver != node.dver or node not in leaves:
                continue
            if lazy and key != node.last_access:  # touched since it was pushed: back in at its place
                self._add_leaf(node)
                continue
            if gone is not None:
                gone.append(node.hashes or self._span(node))
            leaves.discard(node)
            parent = node.parent
            del parent.children[node.key[:pb]]
            del nodes[node.id]
            node.dver += 1
            value = node.value
            freed.append(value)
            count += len(value) >> 2
            if not parent.children and parent.lock_ref == 0:
                if parent.parent is not None:
                    self._add_leaf(parent)
                elif parent.ns != DEFAULT_NS:
                    del self._roots[parent.ns]
                    del nodes[parent.id]
        if gone:
            self._ev.push_raw((REMOVED, gone, GPU))
        self.evictable_size -= count
        self.counters.evicted_tokens_device += count
        self._compact(heap, leaves, "dver")
        return EvictResult(_slots(freed), count)

    def evict_host(self, num_tokens: int, spill: bool = False) -> EvictResult:
        """Free host slots: under write-back reclaim copies of device-resident nodes first (R1.23), then
        delete host-only leaves in policy order; parents become leaves in turn, empty roots go. With
        `spill`, the deleted host-only pages are described (namespace, slots, digests) for L3 write-back."""
        freed: list[bytes] = []
        spilled: list[tuple] = []
        count = 0
        if self.write_back and self._coexist:
            self._coexist = {nd for nd in self._coexist if nd.value is not None and nd.host_value is not None
                             and self._nodes.get(nd.id) is nd}  # drop stale entries
            cands = [nd for nd in self._coexist if self._reclaimable(nd)]
            cands.sort(key=self._key_of)
            for nd in cands:
                if count >= num_tokens:
                    break
                freed.append(nd.host_value)
                count += len(nd.host_value) >> 2
                if self._ev is not None:
                    self._removed(nd, CPU)
                self._set_host(nd, None)
                self._coexist.discard(nd)
            self.counters.reclaimed_host_tokens += count
        heap, leaves = self._hheap, self._hleaves
        pop = heapq.heappop
        lazy = self._lazy
        while count < num_tokens and heap:
            key, _, ver, node = pop(heap)
            if ver != node.hver or node not in leaves:
                continue
            if lazy and key != node.last_access:  # touched since it was pushed: back in at its place
                self._add_hleaf(node)
                continue
            value = node.host_value
            freed.append(value)
            count += len(value) >> 2
            self.counters.evicted_tokens_host += len(value) >> 2
            if spill:
                spilled.append((node.ns, np.frombuffer(value, "<i4"), self._digests(node)))
            if self._ev is not None:
                self._removed(node, CPU)
            self._set_host(node, None)
            parent = node.parent
            self._unlink(node)
            self._tombstone(parent)
        self._compact(heap, leaves, "hver")
        return EvictResult(_slots(freed), count, spilled=tuple(spilled))

    @staticmethod
    def _reclaimable(nd: Node) -> bool:
        return (nd.parent is not None and nd.value is not None and nd.host_value is not None
                and not nd.pending and not nd.loading and nd.host_lock_ref == 0)

    def _compact(self, heap: list[tuple], leaves: set[Node], ver: str) -> None:
        """Drop a lazy heap's stale entries once they outnumber the live ones (every re-sort of a leaf pushes
        a new entry; under LRU a match re-sorts nothing). In place, so an eviction loop holding the list keeps a
        valid heap."""
        if len(heap) <= HEAP_SLACK * len(leaves) + HEAP_FLOOR:
            return
        heap.clear()
        for node in leaves:
            v = getattr(node, ver) + 1
            setattr(node, ver, v)
            self._heap_seq += 1
            heap.append((self._key_of(node), self._heap_seq, v, node))
        heapq.heapify(heap)

    # ----------------------------------------------------------- whole cache
    def reset(self) -> FreedSlots:
        """Drop every cached prefix; refuses while any lock or transfer is outstanding."""
        if self._receipts or self._backups or self._loads:
            raise LocksHeld(f"{len(self._receipts)} lock receipts, {len(self._backups)} backups and "
                            f"{len(self._loads)} load-backs are outstanding")
        freed = FreedSlots(self.all_device_values(), self.all_host_values())
        for node in self._leaves:
            node.dver += 1
        for node in self._hleaves:
            node.hver += 1
        self._nodes.clear()
        self._roots.clear()
        self._leaves.clear()
        self._hleaves.clear()
        self._coexist.clear()
        self._heap = []
        self._hheap = []
        self.evictable_size = self.protected_size = 0
        self.host_evictable_size = self.host_protected_size = 0
        self._root(DEFAULT_NS)
        if self._ev is not None:
            self._ev.push_raw((CLEARED,))
        return freed

    # --------------------------------------------------------------- queries
    def iter_nodes(self) -> Iterable[Node]:
        """Every node reachable from a namespace root, roots included (depth first)."""
        for root in list(self._roots.values()):
            stack = [root]
            while stack:
                node = stack.pop()
                yield node
                stack.extend(node.children.values())

    def path_values(self, node: Node) -> np.ndarray:
        """Device slots from the root down to a device-resident node."""
        parts = []
        while node.parent is not None:
            parts.append(node.value)
            node = node.parent
        parts.reverse()
        return _slots(parts)

    def all_device_values(self) -> np.ndarray:
        """All device slots the tree owns, in no particular order."""
        parts = [n.value for n in self.iter_nodes() if n.parent is not None and n.value]
        return np.frombuffer(b"".join(parts), dtype="<i4").copy() if parts else _EMPTY.copy()

    def all_host_values(self) -> np.ndarray:
        """All host slots the tree owns (committed backups included), in no particular order."""
        parts = [n.host_value for n in self.iter_nodes() if n.host_value]
        return np.frombuffer(b"".join(parts), dtype="<i4").copy() if parts else _EMPTY.copy()

    @property
    def cached_tokens(self) -> int:
        """Tokens whose KV sits in device slots owned by the tree."""
        return self.evictable_size + self.protected_size

    @property
    def host_cached_tokens(self) -> int:
        """Tokens whose KV sits (or is being written) in host slots owned by the tree."""
        return self.host_evictable_size + self.host_protected_size

    @property
    def num_nodes(self) -> int:
        """Non-root nodes."""
        return len(self._nodes) - len(self._roots)

    @property
    def num_receipts(self) -> int:
        """Lock receipts not yet released."""
        return len(self._receipts)

    def receipt_anchor(self, receipt: int) -> int:
        """The node a live receipt was taken on (its host anchor when it protects a host segment)."""
        r = self._receipts.get(receipt)
        if r is None:
            raise UnknownReceipt(f"receipt {receipt:#x} is unknown or already released")
        return (r[1] or r[0]).id

    def resident_prefix(self, node_id: int) -> np.ndarray:
        """Device slots of the deepest device-resident node on a node's path, root first."""
        node = self._node(node_id)
        while node.value is None:
            node = node.parent
        return self.path_values(node)

    def is_loading(self, op: int) -> bool:
        """Whether a load-back op (the receipt it will become) is still planned or in flight."""
        return op in self._loads

    def pending_backups(self) -> set[int]:
        """Acks of backups not yet finished or aborted."""
        return set(self._backups)

    @property
    def num_transfers(self) -> int:
        """Backups and load-backs planned or in flight."""
        return len(self._backups) + len(self._loads)

    def check(self) -> list[str]:
        """Recompute every counter, set and link from scratch; return every violation found."""
        from .check import check_tree
        return check_tree(self)
