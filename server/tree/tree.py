"""A pure radix tree of token prefixes: it decides what to free, the caller frees it."""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Iterable, Optional, Union

import numpy as np

from .errors import ForeignHandle, InvalidInput, LocksHeld, StaleHandle, UnknownReceipt
from .node import Node
from .policies import policy_key

Namespace = tuple[str, str]
TokenInput = Union[bytes, bytearray, memoryview, np.ndarray, Iterable[int]]
DEFAULT_NS: Namespace = ("", "")
_SERIAL_BITS = 48
_SERIAL_MASK = (1 << _SERIAL_BITS) - 1
_EMPTY = np.zeros(0, dtype=np.int32)


@dataclass(frozen=True)
class MatchResult:
    """Longest cached page-aligned prefix: its device slots, length and the node it ends at."""

    indices: np.ndarray
    matched_len: int
    host_hit_len: int
    node_id: int


@dataclass(frozen=True)
class InsertResult:
    """What insert did: how much was cached already and which incoming slots the caller must free."""

    prefix_len: int
    node_id: int
    duplicates: np.ndarray
    adopted_len: int
    tail: np.ndarray = field(default_factory=lambda: _EMPTY)


@dataclass(frozen=True)
class EvictResult:
    """Slots released by eviction; the caller returns them to the allocator."""

    freed: np.ndarray
    evicted_tokens: int


@dataclass
class TreeCounters:
    """Monotonic counters for observability."""

    hit_tokens: int = 0
    queried_tokens: int = 0
    evicted_tokens_device: int = 0
    evicted_tokens_host: int = 0
    inserted_tokens: int = 0


def as_int32(data: TokenInput) -> np.ndarray:
    """Accept packed little-endian int32 bytes, numpy arrays or lists; return a 1-D int32 array."""
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


class RadixTree:
    """SGLang-style radix cache over packed numpy buffers; pure: no I/O, no frees, no copies."""

    def __init__(self, page_size: int = 1, policy: str = "lru", bigram: bool = False, instance_tag: int = 0):
        if page_size < 1:
            raise ValueError("page_size must be >= 1")
        if not 0 <= instance_tag < (1 << 16):
            raise ValueError("instance_tag must fit in 16 bits")
        self.page_size = page_size
        self.policy = policy
        self.bigram = bigram
        self._key_of = policy_key(policy)
        self._tag = instance_tag << _SERIAL_BITS
        self._isz = 8 if bigram else 4
        self._kdt = np.dtype("<i8" if bigram else "<i4")
        self._page_b = page_size * self._isz
        self._serial = 0
        self._tick = 0
        self._heap_seq = 0
        self._nodes: dict[int, Node] = {}
        self._roots: dict[Namespace, Node] = {}
        self._receipts: dict[int, Node] = {}
        self._leaves: set[Node] = set()
        self._heap: list[tuple] = []
        self.evictable_size = 0
        self.protected_size = 0
        self.counters = TreeCounters()
        self._root(DEFAULT_NS)

    # ---------------------------------------------------------------- helpers
    def _mint(self) -> int:
        self._serial += 1
        return self._tag | self._serial

    def _root(self, ns: Namespace, create: bool = True) -> Optional[Node]:
        root = self._roots.get(ns)
        if root is None and create:
            root = Node(self._mint(), None, b"", b"", self._tick, 0, ns)
            self._roots[ns] = root
            self._nodes[root.id] = root
        return root

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

    def _is_leaf(self, node: Node) -> bool:
        return node.parent is not None and node.lock_ref == 0 and node.value is not None and not node.children

    def _add_leaf(self, node: Node) -> None:
        node.hver += 1
        self._leaves.add(node)
        self._heap_seq += 1
        heapq.heappush(self._heap, (self._key_of(node), self._heap_seq, node.hver, node))

    def _drop_leaf(self, node: Node) -> None:
        if node in self._leaves:
            self._leaves.discard(node)
            node.hver += 1

    def _refresh(self, node: Node) -> None:
        """Re-sort a leaf whose policy key changed (touch, hit, priority)."""
        if node in self._leaves:
            self._add_leaf(node)

    def _node(self, node_id: int) -> Node:
        if node_id & ~_SERIAL_MASK != self._tag:
            raise ForeignHandle(f"node handle {node_id:#x} belongs to another server instance")
        node = self._nodes.get(node_id)
        if node is None:
            raise StaleHandle(f"node handle {node_id:#x} is stale: the node was evicted or never existed")
        return node

    def _walk(self, kb: bytes, n: int, root: Node, split: bool) -> tuple[Node, int, list[bytes]]:
        """Follow kb[:n] from root: deepest matched node, matched bytes, device values (split=False: no
        mutation, a partially matched edge counts in the length only). Compares in place: no big copies."""
        node, off, vals, pb = root, 0, [], self._page_b
        while off < n:
            child = node.children.get(kb[off:off + pb])
            if child is None or child.value is None:
                break
            ck = child.key
            if off + len(ck) <= n and kb.startswith(ck, off):
                vals.append(child.value)
                off += len(ck)
                node = child
                continue
            m = self._common_bytes(ck, kb, off, n)
            if m and split:
                node = self._split(child, m)
                vals.append(node.value)
            off += m
            break
        return node, off, vals

    def _split(self, child: Node, m: int) -> Node:
        """Cut child's edge after m key bytes; the new upper node inherits locks, hits and priority."""
        parent = child.parent
        pos = m // self._isz
        upper = Node(self._mint(), parent, child.key[:m], child.value[:pos * 4], child.last_access,
                     child.priority, child.ns)
        upper.created = child.created
        upper.hit_count = child.hit_count
        upper.lock_ref = child.lock_ref
        parent.children[child.key[:self._page_b]] = upper
        child.key = child.key[m:]
        child.value = child.value[pos * 4:]
        child.parent = upper
        upper.children[child.key[:self._page_b]] = child
        self._nodes[upper.id] = upper
        return upper

    # ------------------------------------------------------------- public API
    def match_prefix(self, tokens: TokenInput, namespace: Namespace = DEFAULT_NS) -> MatchResult:
        """Longest cached page-aligned prefix; a match ending inside an edge splits it."""
        kb = self._encode_key(tokens)
        end = self._align(len(kb))
        root = self._root(namespace)
        node, off, vals = self._walk(kb, end, root, split=True)
        queried = end // self._isz
        matched = off // self._isz
        self.counters.queried_tokens += queried
        self.counters.hit_tokens += matched
        if node is not root:
            tick = self._next_tick()
            walker = node
            while walker is not root:
                walker.last_access = tick
                walker.hit_count += 1
                walker = walker.parent
            self._refresh(node)
        indices = np.frombuffer(b"".join(vals), dtype="<i4") if vals else _EMPTY
        return MatchResult(indices, matched, 0, node.id)

    def cached_prefix_len(self, tokens: TokenInput, namespace: Namespace = DEFAULT_NS) -> int:
        """Length match_prefix would return, without splitting or touching anything."""
        return self._cached_len(self._encode_key(tokens), namespace)

    def _cached_len(self, kb: bytes, namespace: Namespace) -> int:
        root = self._root(namespace, create=False)
        if root is None:
            return 0
        return self._walk(kb, self._align(len(kb)), root, split=False)[1] // self._isz

    def insert(self, tokens: TokenInput, values: TokenInput, namespace: Namespace = DEFAULT_NS,
               prev_prefix_len: int = 0, priority: int = 0) -> InsertResult:
        """Cache tokens -> slots; returns duplicates the caller must free and the unaligned tail it keeps."""
        kb = self._encode_key(tokens)
        vals = as_int32(values)
        npos = len(kb) // self._isz
        if len(vals) != npos + (1 if self.bigram and npos else 0) and len(vals) != npos:
            raise InvalidInput(f"{len(vals)} slot indices for {npos} key positions")
        aligned = npos - npos % self.page_size
        if prev_prefix_len < 0 or prev_prefix_len > aligned:
            raise InvalidInput(f"prev_prefix_len {prev_prefix_len} outside [0, {aligned}]")
        if prev_prefix_len and self._cached_len(kb, namespace) < prev_prefix_len:
            raise InvalidInput(f"prev_prefix_len {prev_prefix_len} exceeds the cached prefix")
        tail = vals[aligned:]
        vb = vals[:aligned].tobytes()
        root = self._root(namespace)
        tick = self._next_tick()
        node, off, pb, isz, n = root, 0, self._page_b, self._isz, aligned * self._isz
        dups: list[bytes] = []
        while off < n:
            child = node.children.get(kb[off:off + pb])
            if child is None:
                break
            ck = child.key
            if off + len(ck) > n or not kb.startswith(ck, off):
                child = self._split(child, self._common_bytes(ck, kb, off, n))
            length = len(child.key) // isz
            pos = off // isz
            child.last_access = tick
            child.hit_count += 1
            if priority > child.priority:
                child.priority = priority
            dup_from = max(pos, prev_prefix_len)
            if dup_from < pos + length:
                dups.append(vb[dup_from * 4:(pos + length) * 4])
            self._refresh(child)
            off += len(child.key)
            node = child
        adopted = 0
        if off < n:
            pos = off // isz
            leaf = Node(self._mint(), node, kb[off:n], vb[pos * 4:], tick, priority, namespace)
            node.children[leaf.key[:pb]] = leaf
            self._nodes[leaf.id] = leaf
            adopted = aligned - pos
            self.evictable_size += adopted  # a new leaf is unlocked even under a locked parent
            self._drop_leaf(node)
            self._add_leaf(leaf)
            node = leaf
            self.counters.inserted_tokens += adopted
        dup = np.frombuffer(b"".join(dups), dtype="<i4") if dups else _EMPTY
        return InsertResult(aligned - adopted, node.id, dup, adopted, tail)

    def lock(self, node_id: int) -> int:
        """Protect a node and all its ancestors from eviction; returns the receipt that unlock replays."""
        node = self._node(node_id)
        walker = node
        while walker.parent is not None:
            if walker.lock_ref == 0:
                size = len(walker.value) // 4
                self.evictable_size -= size
                self.protected_size += size
                self._drop_leaf(walker)
            walker.lock_ref += 1
            walker = walker.parent
        walker.lock_ref += 1  # the namespace root counts receipts too, so it is never pruned under one
        receipt = self._mint()
        self._receipts[receipt] = node
        return receipt

    def unlock(self, receipt: int) -> None:
        """Release exactly what lock(receipt) took; a second release raises UnknownReceipt."""
        if receipt & ~_SERIAL_MASK != self._tag:
            raise ForeignHandle(f"receipt {receipt:#x} belongs to another server instance")
        node = self._receipts.pop(receipt, None)
        if node is None:
            raise UnknownReceipt(f"receipt {receipt:#x} is unknown or already released")
        walker = node
        while walker.parent is not None:
            walker.lock_ref -= 1
            if walker.lock_ref == 0:
                size = len(walker.value) // 4
                self.protected_size -= size
                self.evictable_size += size
                if self._is_leaf(walker):
                    self._add_leaf(walker)
            walker = walker.parent
        walker.lock_ref -= 1

    def has_receipt(self, receipt: int) -> bool:
        """Whether a receipt is live (issued by this tree and not yet released)."""
        return receipt in self._receipts

    def evict(self, num_tokens: int) -> EvictResult:
        """Delete unlocked leaves in policy order until num_tokens are freed or none is left."""
        freed: list[bytes] = []
        count = 0
        heap, leaves, nodes, pb = self._heap, self._leaves, self._nodes, self._page_b
        pop = heapq.heappop
        while count < num_tokens and heap:
            _, _, ver, node = pop(heap)
            if ver != node.hver or node not in leaves:
                continue
            leaves.discard(node)
            parent = node.parent
            del parent.children[node.key[:pb]]
            del nodes[node.id]
            node.hver += 1
            value = node.value
            freed.append(value)
            count += len(value) >> 2
            if not parent.children and parent.lock_ref == 0:
                if parent.parent is not None:
                    if parent.value is not None:
                        self._add_leaf(parent)
                elif parent.ns != DEFAULT_NS:
                    del self._roots[parent.ns]
                    del nodes[parent.id]
        self.evictable_size -= count
        if len(heap) > 2 * len(leaves) + 1024:
            self._rebuild_heap()
        self.counters.evicted_tokens_device += count
        return EvictResult(np.frombuffer(b"".join(freed), dtype="<i4") if freed else _EMPTY, count)

    def _rebuild_heap(self) -> None:
        self._heap = []
        for node in self._leaves:
            node.hver += 1
            self._heap_seq += 1
            self._heap.append((self._key_of(node), self._heap_seq, node.hver, node))
        heapq.heapify(self._heap)

    def reset(self) -> np.ndarray:
        """Drop every cached prefix; refuses while any lock is held. Returns the slots to free."""
        if self._receipts:
            raise LocksHeld(f"{len(self._receipts)} lock receipts are outstanding")
        freed = self.all_device_values()
        for node in self._leaves:
            node.hver += 1
        self._nodes.clear()
        self._roots.clear()
        self._leaves.clear()
        self._heap = []
        self.evictable_size = 0
        self.protected_size = 0
        self._root(DEFAULT_NS)
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

    def all_device_values(self) -> np.ndarray:
        """All device slots the tree owns, in no particular order."""
        parts = [n.value for n in self.iter_nodes() if n.parent is not None and n.value]
        return np.frombuffer(b"".join(parts), dtype="<i4").copy() if parts else _EMPTY.copy()

    @property
    def cached_tokens(self) -> int:
        """Tokens whose KV sits in device slots owned by the tree."""
        return self.evictable_size + self.protected_size

    @property
    def num_nodes(self) -> int:
        """Non-root nodes."""
        return len(self._nodes) - len(self._roots)

    @property
    def num_receipts(self) -> int:
        """Lock receipts not yet released."""
        return len(self._receipts)

    def check(self) -> list[str]:
        """Recompute every counter, set and link from scratch; return every violation found."""
        from .check import check_tree
        return check_tree(self)
