"""What the L3 tier needs from the tree: page digests to name pages by, and host-only inserts of fetched pages.

Mixed into RadixTree; pure like the rest of the tree (the engine talks to the store and copies bytes).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from . import hashes as _hashes
from .errors import InvalidInput, StateConflict
from .events import CPU
from .node import Node
from .results import _EMPTY, HostInsertResult

if TYPE_CHECKING:
    from .tree import Namespace, TokenInput


class StorageMixin:
    """Digests for storage keys (hashes.py, frozen) and `insert_host` (SPEC-tiers R1.21, R4.7)."""

    def root_id(self, namespace: "Namespace") -> int:
        """The root of a namespace, created if new (lock it at once: an empty unlocked root is pruned)."""
        return self._root(namespace).id

    def chain_prior(self, node_id: int) -> tuple["Namespace", Optional[bytes]]:
        """The namespace of a node and the digest its children's pages chain from (the seed at a root)."""
        node = self._node(node_id)
        if node.parent is None:
            return node.ns, self._seed(node.ns)
        return node.ns, self._digests(node)[-32:]

    def _seed(self, ns: "Namespace") -> Optional[bytes]:
        prior = self._seeds.get(ns, b"")
        if prior == b"":
            prior = self._seeds[ns] = _hashes.salt_seed(ns[1])
        return prior

    def backup_pages(self, ack: int) -> tuple["Namespace", bytes]:
        """Namespace and page digests of a committed backup, in the order of its host slots."""
        op = self._backup_op(ack)
        if not op.committed:
            raise StateConflict(f"backup ack {ack:#x} was never committed")
        return op.nodes[0].ns, b"".join(self._digests(nd) for nd in op.nodes)

    def insert_host(self, anchor_id: int, tokens: "TokenInput", host_slots: "TokenInput",
                    digests: bytes) -> HostInsertResult:
        """Cache fetched pages host-only below a (locked) anchor: the key continues the anchor's path.

        The part already cached (any tier) is a duplicate; the rest becomes one new host-only leaf, unless
        write-through host closure forbids it (the attach point is neither a root nor backed up for good),
        when it is dropped. Digests are trusted to continue the anchor's chain (the checker verifies them).
        """
        anchor = self._node(anchor_id)
        if not self.host:
            raise StateConflict("insert_host needs the host tier")
        kb = self._encode_key(tokens)
        hs = self._as_int32(host_slots)
        npos = len(kb) // self._isz
        if hs.size != npos or npos % self.page_size:
            raise InvalidInput(f"{hs.size} host slots for {npos} key positions (whole pages of {self.page_size})")
        if len(digests) != (npos // self.page_size) * 32:
            raise InvalidInput(f"{len(digests) // 32} digests for {npos // self.page_size} pages")
        node, off, n, pb, isz = anchor, 0, len(kb), self._page_b, self._isz
        while off < n:
            child = node.children.get(kb[off:off + pb])
            if child is None:
                break
            ck = child.key
            if off + len(ck) > n or not kb.startswith(ck, off):
                child = self._split(child, self._common_bytes(ck, kb, off, n))
            self._tick += 1
            child.last_access = self._tick
            self._refresh(child)
            off += len(child.key)
            node = child
        pos = off // isz
        vb = hs.tobytes()
        dup = hs[:pos]
        if off == n:
            return HostInsertResult(pos, node.id, dup, _EMPTY, _EMPTY)
        if self._through and node.parent is not None and (node.host_value is None or node.pending):
            # host closure: the attach point must be on host for good (a pending backup may still abort)
            return HostInsertResult(pos, node.id, dup, _EMPTY, hs[pos:])
        leaf = Node(self._mint(), node, kb[off:], None, self._next_tick(), node.priority, node.ns)
        node.children[leaf.key[:pb]] = leaf
        self._nodes[leaf.id] = leaf
        first = pos // self.page_size
        leaf.hashes = _hashes.known_span(bytes(digests[first * 32:]), self._fmt(node.ns))
        self._set_host(leaf, vb[pos * 4:])
        self._add_hleaf(leaf)
        self._sync(node)
        self.counters.storage_inserted_tokens += npos - pos
        if self._ev is not None:
            self._stored(leaf, CPU)
        return HostInsertResult(pos, leaf.id, dup, hs[pos:], _EMPTY)

    def host_spill(self, node: Node) -> tuple["Namespace", bytes]:
        """Namespace and digests of a host node about to be evicted (write-back to storage)."""
        return node.ns, self._digests(node)
