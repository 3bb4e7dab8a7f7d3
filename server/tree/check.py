"""The tree's sanity check: every derived structure recomputed from scratch and compared."""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from .tree import RadixTree


def check_tree(tree: "RadixTree") -> list[str]:
    """Return a list of human-readable violations (empty when the tree is consistent)."""
    bad: list[str] = []
    isz, page, pb = tree._isz, tree.page_size, tree._page_b
    seen: dict[int, object] = {}
    own_locks: dict[int, int] = {}
    for node in tree._receipts.values():
        own_locks[node.id] = own_locks.get(node.id, 0) + 1
    evictable = protected = 0
    leaves = set()
    values = []
    for ns, root in tree._roots.items():
        if root.parent is not None or root.ns != ns:
            bad.append(f"root of namespace {ns} has a parent or wrong namespace")
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
        for node in reversed(order):  # children before parents
            ref = own_locks.get(node.id, 0) + sum(expect_ref[c.id] for c in node.children.values())
            expect_ref[node.id] = ref
            if node.lock_ref != ref:
                bad.append(f"node {node.id:#x} lock_ref {node.lock_ref}, recomputed {ref}")
            if node.parent is None:
                continue
            npos = len(node.key) // isz
            if not node.key or len(node.key) % isz or npos % page:
                bad.append(f"node {node.id:#x} key length {len(node.key)} bytes is not whole pages")
            if node.value is None:
                bad.append(f"node {node.id:#x} has no device value (host tier not enabled)")
                continue
            if len(node.value) != npos * 4:
                bad.append(f"node {node.id:#x} has {len(node.value) // 4} values for {npos} key positions")
            values.append(node.value)
            if ref:
                protected += npos
            else:
                evictable += npos
                if not node.children:
                    leaves.add(node)
    if set(seen) != set(tree._nodes):
        bad.append(f"node table has {len(tree._nodes)} entries, {len(seen)} reachable")
    for node in tree._receipts.values():
        if tree._nodes.get(node.id) is not node:
            bad.append(f"receipt anchored on unreachable node {node.id:#x}")
    if evictable != tree.evictable_size:
        bad.append(f"evictable_size {tree.evictable_size}, recomputed {evictable}")
    if protected != tree.protected_size:
        bad.append(f"protected_size {tree.protected_size}, recomputed {protected}")
    if leaves != tree._leaves:
        bad.append(f"evictable leaf set has {len(tree._leaves)} nodes, recomputed {len(leaves)}")
    live = {}
    for key, _, ver, node in tree._heap:
        if ver == node.hver and node in tree._leaves:
            live[node] = key
    for node in leaves:
        if node not in live:
            bad.append(f"evictable leaf {node.id:#x} has no live heap entry")
        elif live[node] != tree._key_of(node):
            bad.append(f"evictable leaf {node.id:#x} heap key {live[node]} is stale, now {tree._key_of(node)}")
    if values:
        slots = np.frombuffer(b"".join(values), dtype="<i4")
        if np.unique(slots).size != slots.size:
            bad.append("a device slot is owned by two tree positions")
    return bad
