"""The tree's sanity check: every derived structure recomputed from scratch and compared (SPEC 7.5)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from .tree import HEAP_FLOOR, HEAP_SLACK

if TYPE_CHECKING:
    from .node import Node
    from .tree import RadixTree


def _host_pins(tree: "RadixTree") -> dict[int, int]:
    """Host locks a receipt or a load-back anchors on each node (backups lock their own nodes only)."""
    pins: dict[int, int] = {}
    anchors = [h for _, h in tree._receipts.values() if h is not None] + [lo.node for lo in tree._loads.values()]
    for nd in anchors:
        pins[nd.id] = pins.get(nd.id, 0) + 1
    return pins


def _host_freeable(tree: "RadixTree", order: list) -> set:
    """The nodes whose host copy an unbounded evict_host would free: write-back copies it may reclaim, then
    host-only leaves repeatedly (a host-only node goes once nothing below it stays)."""
    out = set()
    for node in reversed(order):  # children before parents
        if node.parent is None or node.host_value is None:
            continue
        if node.value is not None:
            if tree.write_back and tree._reclaimable(node):
                out.add(node)
        elif node.host_lock_ref == 0 and not node.loading and all(c in out for c in node.children.values()):
            out.add(node)
    return out


def _expected_locks(tree: "RadixTree") -> tuple[dict[int, int], dict[int, int]]:
    """Device-lock anchors and host-lock counts implied by receipts and transfers."""
    dev: dict[int, int] = {}
    host: dict[int, int] = {}
    for d, h in tree._receipts.values():
        dev[d.id] = dev.get(d.id, 0) + 1
        if h is not None:
            host[h.id] = host.get(h.id, 0) + 1
    for op in tree._backups.values():
        anchor = op.nodes[-1]
        dev[anchor.id] = dev.get(anchor.id, 0) + 1
        if op.committed:
            for nd in op.nodes:
                host[nd.id] = host.get(nd.id, 0) + 1
    for lo in tree._loads.values():
        dev[lo.dev.id] = dev.get(lo.dev.id, 0) + 1
        host[lo.node.id] = host.get(lo.node.id, 0) + 1
    return dev, host


def _check_heap(tree: "RadixTree", heap: list, leaves: set, ver: str, name: str, bad: list[str]) -> None:
    if len(heap) > HEAP_SLACK * len(leaves) + HEAP_FLOOR:
        bad.append(f"{name} heap holds {len(heap)} entries for {len(leaves)} leaves (stale entries never dropped)")
    live = {}
    for key, _, v, node in heap:
        if v == getattr(node, ver) and node in leaves:
            live[node] = key
    for node in leaves:
        if node not in live:
            bad.append(f"{name} leaf {node.id:#x} has no live heap entry")
        elif live[node] != tree._key_of(node) and not (tree._lazy and live[node] < node.last_access):
            bad.append(f"{name} leaf {node.id:#x} heap key {live[node]} is stale, now {tree._key_of(node)}")


def _check_transfers(tree: "RadixTree", bad: list[str]) -> None:
    """I23-I25: every pending backup and load-back names live, protected nodes, and nothing else is pinned."""
    pend: dict[int, int] = {}
    for ack, op in tree._backups.items():
        for nd in op.nodes:
            pend[nd.id] = ack
            if tree._nodes.get(nd.id) is not nd:
                bad.append(f"backup {ack:#x} names node {nd.id:#x} that left the tree")
            if nd.pending != ack or nd.lock_ref <= 0 or nd.value is None:
                bad.append(f"backup {ack:#x}: node {nd.id:#x} pending={nd.pending:#x} lock_ref={nd.lock_ref} "
                           f"tier={nd.tier}")
            if op.committed != (nd.host_value is not None):
                bad.append(f"backup {ack:#x}: node {nd.id:#x} committed={op.committed} but tier={nd.tier}")
        for a, b in zip(op.nodes, op.nodes[1:]):
            if b.parent is not a:
                bad.append(f"backup {ack:#x}: its nodes are not one chain")
    pins: dict[int, int] = {}
    for opid, lo in tree._loads.items():
        nd = lo.node
        if nd is lo.dev or tree._nodes.get(nd.id) is not nd:
            bad.append(f"load-back {opid:#x} anchor {nd.id:#x} is resident or left the tree")
            continue
        while nd is not lo.dev and nd is not None:
            pins[nd.id] = opid
            if nd.value is not None or nd.host_value is None:
                bad.append(f"load-back {opid:#x}: node {nd.id:#x} in its segment has tier {nd.tier}")
            nd = nd.parent
        if nd is None or lo.dev.value is None or lo.dev.lock_ref <= 0 or lo.node.host_lock_ref <= 0:
            bad.append(f"load-back {opid:#x}: device anchor not an ancestor, not resident or not locked")
        if lo.slots is not None:
            total = sum(len(x.host_value) for x in tree._segment(opid, lo)) // 4
            if lo.slots.size != total:
                bad.append(f"load-back {opid:#x} holds {lo.slots.size} slots for {total} tokens")
    for node in tree._nodes.values():
        if node.pending and pend.get(node.id) != node.pending:
            bad.append(f"node {node.id:#x} marked pending on {node.pending:#x}, not in that backup")
        if node.loading and pins.get(node.id) != node.loading:
            bad.append(f"node {node.id:#x} pinned by load-back {node.loading:#x}, not in its segment")
    for nid, opid in pins.items():
        if tree._nodes[nid].loading != opid:
            bad.append(f"node {nid:#x} in the segment of load-back {opid:#x} is not pinned by it")


def check_tree(tree: "RadixTree") -> list[str]:
    """Return a list of human-readable violations (empty when the tree is consistent)."""
    bad: list[str] = []
    isz, pb = tree._isz, tree._page_b
    through = tree.host and not tree.write_back
    seen: dict[int, Node] = {}
    own_dev, own_host = _expected_locks(tree)
    own_pins = _host_pins(tree)
    evictable = protected = h_evictable = h_protected = 0
    leaves, hleaves = set(), set()
    values, hvalues = [], []
    for ns, root in tree._roots.items():
        if root.parent is not None or root.ns != ns or root.value != b"" or root.host_value is not None:
            bad.append(f"root of namespace {ns} has a parent, a wrong namespace or a value")
        if ns != ("", "") and not root.children and root.lock_ref == 0:
            bad.append(f"namespace {ns} keeps an empty, unlocked root")
        order = []
        stack = [root]
        while stack:
            node = stack.pop()
            order.append(node)
            if node.id in seen:
                bad.append(f"node {node.id:#x} reachable twice")
            seen[node.id] = node
            for first, child in node.children.items():
                if child.parent is not node:
                    bad.append(f"node {child.id:#x} parent link broken")
                if child.key[:pb] != first:
                    bad.append(f"node {child.id:#x} is filed under the wrong child key")
                if child.ns != ns:
                    bad.append(f"node {child.id:#x} has namespace {child.ns}, expected {ns}")
                stack.append(child)
        expect_ref: dict[int, int] = {}
        expect_pin: dict[int, int] = {}
        freeable = _host_freeable(tree, order)
        for node in reversed(order):  # children before parents
            ref = own_dev.get(node.id, 0) + sum(expect_ref[c.id] for c in node.children.values())
            expect_ref[node.id] = ref
            if node.lock_ref != ref:
                bad.append(f"node {node.id:#x} lock_ref {node.lock_ref}, recomputed {ref}")
            pin = own_pins.get(node.id, 0) + sum(expect_pin[c.id] for c in node.children.values())
            expect_pin[node.id] = pin
            if node.parent is not None and node.hpin != pin:
                bad.append(f"node {node.id:#x} hpin {node.hpin}, recomputed {pin}")
            if node.host_lock_ref != own_host.get(node.id, 0):
                bad.append(f"node {node.id:#x} host_lock_ref {node.host_lock_ref}, "
                           f"recomputed {own_host.get(node.id, 0)}")
            if node.parent is None:
                continue
            _check_node(tree, node, ref, through, bad)
            npos = len(node.key) // isz
            if node.value is not None:
                values.append(node.value)
                if ref:
                    protected += npos
                else:
                    evictable += npos
            if node.host_value is not None:
                hvalues.append(node.host_value)
                if node in freeable:
                    h_evictable += npos
                else:
                    h_protected += npos
            if tree._is_leaf(node):
                leaves.add(node)
            if tree._is_hleaf(node):
                hleaves.add(node)
            if (tree.write_back and node.value is not None and node.host_value is not None and not node.pending
                    and node not in tree._coexist):
                bad.append(f"write-back: both-tier node {node.id:#x} missing from the reclaim candidates")
    if set(seen) != set(tree._nodes):
        bad.append(f"node table has {len(tree._nodes)} entries, {len(seen)} reachable")
    for d, h in tree._receipts.values():
        for nd in (d, h):
            if nd is not None and tree._nodes.get(nd.id) is not nd:
                bad.append(f"receipt anchored on unreachable node {nd.id:#x}")
        if d.value is None or (h is not None and h.host_value is None):
            bad.append(f"receipt anchors {d.id:#x} / {h and h.id} lost the tier they lock")
    for name, got, want in (("evictable_size", tree.evictable_size, evictable),
                            ("protected_size", tree.protected_size, protected),
                            ("host_evictable_size", tree.host_evictable_size, h_evictable),
                            ("host_protected_size", tree.host_protected_size, h_protected)):
        if got != want:
            bad.append(f"{name} {got}, recomputed {want}")
    if leaves != tree._leaves:
        bad.append(f"D-leaf set has {len(tree._leaves)} nodes, recomputed {len(leaves)}")
    if hleaves != tree._hleaves:
        bad.append(f"H-leaf set has {len(tree._hleaves)} nodes, recomputed {len(hleaves)}")
    if tree._leaves & tree._hleaves:
        bad.append("a node is in both the D-leaf and the H-leaf set")
    _check_heap(tree, tree._heap, tree._leaves, "dver", "D", bad)
    _check_heap(tree, tree._hheap, tree._hleaves, "hver", "H", bad)
    _check_transfers(tree, bad)
    loading = [lo.slots for lo in tree._loads.values() if lo.slots is not None]
    for what, parts, extra in (("device", values, loading), ("host", hvalues, [])):
        if parts or extra:
            slots = np.concatenate([np.frombuffer(b"".join(parts), dtype="<i4"), *extra])
            if np.unique(slots).size != slots.size:
                bad.append(f"a {what} slot is owned by two tree positions or transfers")
    return bad


def _check_node(tree: "RadixTree", node: "Node", ref: int, through: bool, bad: list[str]) -> None:
    """I3, I4, I8-I13 for one non-root node."""
    isz, page = tree._isz, tree.page_size
    npos = len(node.key) // isz
    parent = node.parent
    if not node.key or len(node.key) % isz or npos % page:
        bad.append(f"node {node.id:#x} key length {len(node.key)} bytes is not whole pages")
    for what, v in (("device", node.value), ("host", node.host_value)):
        if v is not None and len(v) != npos * 4:
            bad.append(f"node {node.id:#x} has {len(v) // 4} {what} values for {npos} key positions")
    if node.value is None and node.host_value is None:
        bad.append(f"node {node.id:#x} is dead: no device and no host value")
    if node.host_value is not None and not tree.host:
        bad.append(f"node {node.id:#x} has a host value with the host tier off")
    if node.value is not None and parent.parent is not None and parent.value is None:
        bad.append(f"node {node.id:#x} is on device but its parent {parent.id:#x} is not (device closure)")
    if through and node.host_value is not None and parent.parent is not None and parent.host_value is None:
        bad.append(f"node {node.id:#x} is on host but its parent {parent.id:#x} is not (write-through closure)")
    if node.lock_ref < 0 or node.host_lock_ref < 0:
        bad.append(f"node {node.id:#x} has a negative lock count")
    if ref and node.value is None:
        bad.append(f"node {node.id:#x} is device-locked without a device value")
    span = node.hashes
    if span is not None:  # I5: one digest per page, continuing the parent's chain (lazy spans resolved here)
        from .hashes import chain, salt_seed, span_digests, span_last, span_pages
        if span_pages(span) != npos // page:
            bad.append(f"node {node.id:#x} has {span_pages(span)} page hashes for {npos // page} pages")
        elif parent.parent is None or parent.hashes is not None:
            prior = salt_seed(parent.ns[1]) if parent.parent is None else span_last(parent.hashes)
            if span_digests(span) != chain(node.key, tree._page_b, prior, tree.bigram):
                bad.append(f"node {node.id:#x} page hashes do not continue its parent's chain")
