"""The hybrid tree's checker: recomputes every per-component counter, lock and list from scratch (SPEC 7.5)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from .components import FULL, MAMBA, SWA

if TYPE_CHECKING:
    from .hybrid import HNode, HybridTree


def _expected_locks(tree: "HybridTree") -> dict[int, list[int]]:
    """Lock references every live receipt accounts for, per node: [FULL, SWA, MAMBA]."""
    want: dict[int, list[int]] = {}
    for r in tree._receipts.values():
        cur = r.node
        while cur.parent is not None:
            want.setdefault(cur.id, [0, 0, 0])[0] += 1
            cur = cur.parent
        if r.node.parent is None:
            continue
        if tree.swa is not None and not r.swa_released:
            cur, covered = r.node, 0
            while cur.parent is not None:
                want.setdefault(cur.id, [0, 0, 0])[1] += 1
                covered += len(cur.key) >> 2
                if (r.swa_uuid and cur.suuid == r.swa_uuid) or (not r.swa_uuid and covered >= tree.swa.window):
                    break
                cur = cur.parent
        if tree.mamba is not None and not r.swa_released and not r.skip_mamba:
            want.setdefault(r.node.id, [0, 0, 0])[2] += 1
    return want


def check_hybrid(tree: "HybridTree") -> list[str]:
    """Every violated invariant, described; an empty list means the tree is consistent."""
    bad: list[str] = []
    ev = {FULL: 0, SWA: 0, MAMBA: 0}
    pr = {FULL: 0, SWA: 0, MAMBA: 0}
    seen: set[int] = set()
    want = _expected_locks(tree)
    ps4 = tree.page_size * 4
    stack: list["HNode"] = list(tree._roots.values())
    for ns, root in tree._roots.items():
        if root.ns != ns or root.parent is not None or tree._nodes.get(root.id) is not root:
            bad.append(f"namespace root {root.id} is not filed as the root of {ns}")
        elif ns != ("", "") and not root.children:
            bad.append(f"namespace {ns}: an empty root was kept")
    while stack:
        node = stack.pop()
        seen.add(node.id)
        if node.parent is not None and node.ns != node.parent.ns:
            bad.append(f"node {node.id}: namespace {node.ns} under a node of {node.parent.ns}")
        for k, child in node.children.items():
            if child.parent is not node:
                bad.append(f"node {child.id}: parent pointer does not name its parent {node.id}")
            if not child.key or len(child.key) % ps4 or child.key[:ps4] != k:
                bad.append(f"node {child.id}: key of {len(child.key) >> 2} tokens is empty, unaligned or "
                           "filed under another page")
            stack.append(child)
        if node.parent is None:
            continue
        n = len(node.key) >> 2
        if node.full is None or len(node.full) != n:
            bad.append(f"node {node.id}: FULL value does not cover its {n} tokens")
            continue
        exp = want.get(node.id, [0, 0, 0])
        got = [node.lock, node.slock, node.mlock]
        if got[0] != exp[0] or (tree.swa is not None and got[1] != exp[1]) or (
                tree.mamba is not None and got[2] != exp[2]):
            bad.append(f"node {node.id}: lock refs FULL/SWA/MAMBA {got}, the receipts account for {exp}")
        if node.slock > node.lock or node.mlock > node.lock:
            bad.append(f"node {node.id}: an auxiliary lock exceeds the FULL lock ({got})")
        (pr if node.lock else ev)[FULL] += n
        if node.swa:
            (pr if node.slock else ev)[SWA] += n
        if node.mamba >= 0:
            (pr if node.mlock else ev)[MAMBA] += 1
        is_leaf = tree._is_leaf(node)
        if is_leaf != (node in tree._leaves):
            bad.append(f"node {node.id}: D-leaf is {is_leaf} but the leaf set says {node in tree._leaves}")
        for comp in tree.aux:
            if comp.has(node) != (node in comp.lru):
                bad.append(f"node {node.id}: {comp.name} data {comp.has(node)} but LRU membership "
                           f"{node in comp.lru}")
    if seen != set(tree._nodes):
        bad.append(f"{len(set(tree._nodes) - seen)} registered nodes are unreachable, "
                   f"{len(seen - set(tree._nodes))} reachable ones unregistered")
    for leaf in tree._leaves:
        if leaf.id not in tree._nodes:
            bad.append(f"leaf set holds deleted node {leaf.id}")
    for comp in tree.aux:
        order = comp.lru.order()
        if len(order) != len(comp.lru) or len(set(order)) != len(order):
            bad.append(f"{comp.name} LRU is not a well-formed list")
        for nd in order:
            if nd.id not in tree._nodes:
                bad.append(f"{comp.name} LRU holds deleted node {nd.id}")
    for c in tree.components:
        if (ev[c], pr[c]) != (tree.evictable[c], tree.protected[c]):
            bad.append(f"{c}: evictable/protected {tree.evictable[c]}/{tree.protected[c]}, recounted "
                       f"{ev[c]}/{pr[c]}")
    if tree._hits is not None:
        gone = [n for n in tree._hits if tree._nodes.get(n.id) is not n]
        if gone:
            bad.append(f"{len(gone)} write-through counts of nodes no longer in the tree (first: {gone[0]!r})")
        if any(h < 1 for h in tree._hits.values()):
            bad.append("a write-through count below 1")
    return bad
