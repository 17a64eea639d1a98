"""Walking the stored trees through their trie edges in bounded memory.

A store of millions of nodes is never held in memory here: :func:`tree_roots` finds
each tree's root with one key seek per parent, and :class:`TreeWalk` visits a tree
depth first, children before their parent, keeping only the path from the root. Its
state is plain keys, so a walk goes on in a later transaction (eviction deletes what it
walked past between two). :class:`PageShedder` keeps the index pages such a scan
touches from piling up in the process (see :func:`kvstore.platform.memutil.release_file_pages`).
"""

from typing import Iterator, List, Optional, Tuple

from ..disk.chunking import HASH_BYTES
from ..disk.index import Index
from ..platform import memutil

# Records (or walk steps) a scan reads between two looks at how many of the index's
# pages it holds; past SHED_BYTES they are released. Each step touches a few random
# pages, and a fault maps a stretch of the cached file around the page (fault-around).
# A release costs ~50 us, and the pages touched next fault in again: releasing at
# every look (16 steps) took ~10 faults a node, about as much system time as the
# scan's own work; with a budget the upper levels of the trees stay mapped. A look
# reads /proc/self/statm (~20 us here: 7% of gc's time when looking every 16 steps).
SHED_EVERY = 64
SHED_BYTES = 64 << 20
# For a scan in key order, which never comes back to a page it left.
SEQUENTIAL_BYTES = 16 << 20


class PageShedder:
    """Keeps a scan's resident index pages under ``budget`` bytes: every ``every``
    records it looks at the process's file-backed resident memory
    (:func:`kvstore.platform.memutil.resident_file_bytes`) and releases the index's
    pages once they hold more than ``budget`` above what it held after the last
    release. An LMDB scan otherwise keeps every page it touched resident, as much
    memory as the index file (about 1 KB per node). Where that memory cannot be
    read (no ``/proc``), it releases at every look."""

    def __init__(self, index: Index, every: int = SHED_EVERY, budget: int = SHED_BYTES):
        self.index = index
        self.every = every
        self.budget = budget
        self.count = 0
        self.base = self._release()

    def tick(self, n: int = 1) -> None:
        self.count += n
        if self.count < self.every:
            return
        self.count = 0
        held = memutil.resident_file_bytes()
        if held is None or self.base is None or held - self.base > self.budget:
            self.base = self._release()

    def _release(self) -> Optional[int]:
        """Release the index's pages; the file-backed resident bytes left (the
        process's other files), None where unknown."""
        self.index.release_pages()
        return memutil.resident_file_bytes()


def successor(prefix: bytes) -> Optional[bytes]:
    """The smallest key after every key starting with ``prefix``, None if none is."""
    n = int.from_bytes(prefix, "big") + 1
    return None if n >> (8 * len(prefix)) else n.to_bytes(len(prefix), "big")


def tree_roots(
    index: Index, txn, ns: Optional[bytes] = None
) -> List[Tuple[bytes, bytes]]:
    """``(namespace, root)`` of every tree (of one namespace): the parents named by trie
    edges that are not nodes themselves (the namespace's root, or a salted tree's).
    One key seek per distinct parent; only the roots are kept."""
    cur = txn.cursor(db=index.db["children"])
    nodes = index.db["nodes"]
    found = cur.set_range(ns or b"")
    out = []
    shed = PageShedder(index)
    while found:
        key = bytes(cur.key())
        if ns is not None and not key.startswith(ns):
            break
        parent = key[: 2 * HASH_BYTES]
        if len(parent) == 2 * HASH_BYTES and txn.get(parent, db=nodes) is None:
            out.append((parent[:HASH_BYTES], parent[HASH_BYTES:]))
        after = successor(parent)
        found = after is not None and cur.set_range(after)
        shed.tick()
    return out


class TreeWalk:
    """Depth-first walk of the tree below ``root``, each node after its children.

    The state is the path from the root, with the edge key to seek next at each
    level: O(depth) memory, and :meth:`nodes` goes on where it stopped in any later
    transaction. An edge to a node already on the path (a damaged index) is skipped.

    Args:
        index: The store's index.
        ns: The namespace.
        root: The tree's root hash (not a node).
    """

    def __init__(self, index: Index, ns: bytes, root: bytes):
        self.index = index
        self.ns = ns
        self.path: List[list] = [[root, ns + root]]  # [hash, next edge key to seek]
        self.on_path = {root}
        self.shed = PageShedder(index)  # a deep chain is many seeks before a node

    @property
    def done(self) -> bool:
        return not self.path

    def nodes(self, txn, limit: Optional[int] = None) -> Iterator[Tuple[bytes, int]]:
        """Yield ``(hash, depth)`` of the next nodes, children before their parent
        (depth 1: hangs from the root), at most ``limit`` of them."""
        cur = txn.cursor(db=self.index.db["children"])
        ns, given = self.ns, 0
        tail = len(ns) + HASH_BYTES  # an edge key: ns, parent, first tokens, child
        while self.path and (limit is None or given < limit):
            top = self.path[-1]
            prefix = ns + top[0]
            self.shed.tick()
            if cur.set_range(top[1]):
                key = bytes(cur.key())
                if key.startswith(prefix) and len(key) > tail:
                    top[1] = key + b"\0"  # the next edge key after this one
                    child = key[-HASH_BYTES:]
                    if child not in self.on_path:
                        self.path.append([child, ns + child])
                        self.on_path.add(child)
                    continue
            self.path.pop()
            self.on_path.discard(top[0])
            if self.path:  # the root itself is not a node
                given += 1
                yield top[0], len(self.path)
