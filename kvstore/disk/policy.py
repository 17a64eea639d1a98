"""Eviction order as data: which entries go first, in RAM and on disk. No I/O here."""

import heapq
from collections import Counter
from typing import Hashable, List, Mapping, NamedTuple, Tuple

from .index import KINDS

# mlx-lm's tier order: assistant turns go first, then user turns, system prompts last.
RAM_ORDER: Tuple[Tuple[bool, str], ...] = tuple(
    (pinned, kind) for pinned in (False, True) for kind in KINDS
)


class DiskNode(NamedTuple):
    """What eviction needs to know of a node on disk."""

    atime: float
    nbytes: int
    parent: Hashable
    pinned: bool


KIND_RANK = {kind: rank for rank, kind in enumerate(KINDS)}


def stronger_kind(a: str, b: str) -> str:
    """The kind that is evicted later (system > user > assistant)."""
    return a if KIND_RANK[a] >= KIND_RANK[b] else b


def disk_victims(nodes: Mapping[Hashable, DiskNode], excess: int) -> List[Hashable]:
    """Least recently used leaves, leaf-first, whose sizes add up to ``excess`` bytes.

    A parent whose last child goes becomes a leaf itself and competes by its own
    access time, so the result never orphans a descendant. That is the order of due
    times (a node's latest access in its subtree): children go in time order, so a
    parent whose own time is older than its last child's is due now and goes next.
    Its own time matters only when it is newer (a request ended there), which is why
    the times of a request's ancestors need not be exact
    (:data:`kvstore.engine.accesses.ANCESTOR_RESOLUTION_S`). Pinned nodes never go.

    Args:
        nodes: Every node of the store, by key.
        excess: How many bytes must go.

    Returns:
        Keys in eviction order (children before their parents).
    """
    children = Counter(n.parent for n in nodes.values() if n.parent in nodes)
    heap = [
        (n.atime, i, key)
        for i, (key, n) in enumerate(nodes.items())
        if not n.pinned and children[key] == 0
    ]
    heapq.heapify(heap)
    victims, freed, tie = [], 0, len(nodes)
    while heap and freed < excess:
        _, _, key = heapq.heappop(heap)
        victims.append(key)
        freed += nodes[key].nbytes
        parent = nodes[key].parent
        if parent in nodes:
            children[parent] -= 1
            if children[parent] == 0 and not nodes[parent].pinned:
                tie += 1
                heapq.heappush(heap, (nodes[parent].atime, tie, parent))
    return victims
