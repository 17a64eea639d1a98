"""Leaf-first LRU eviction from a table of every node, built by one scan in key order.

:mod:`.lru` walks the trie in O(depth) memory, but each node it visits costs lookups of
its edge, record and access time: random pages of an index that at a million nodes is
many times what a scan keeps mapped, so nearly every lookup faults (three walks of a
million nodes took 234 + 123 s here, against 11 + 6 s for 100,000). A
:class:`DueTable` reads the nodes and their access times once, in key order, into
arrays of :data:`BYTES_PER_NODE` bytes a node, and finds the same :class:`~.lru.Cut`
and victims there (up to ties). :func:`fits` says when a store is small enough for one;
larger stores are walked.
"""

import math
import struct
from array import array
from typing import Iterator, List, Optional

import numpy as np

from ..disk.chunking import HASH_BYTES
from ..disk.index import CorruptRecord, Index, NodeRecord
from .lru import Cut, Key
from .walk import PageShedder

KEY = 2 * HASH_BYTES  # a node's key: namespace, hash
# Kept a node: its key, its parent's row, start, bytes, due time and a flag; the
# parents' hashes (16 bytes) only while rows are linked.
BYTES_PER_NODE = KEY + 4 + 4 + 8 + 8 + 1
TABLE_BYTES = 96 << 20  # the most a table may take: about 1.3M nodes
_SCAN_BATCH = 4096  # nodes read per read transaction (writers reuse pages between)
_ATIME = struct.Struct("<d")


def fits(index: Index, txn) -> bool:
    """Whether a table of the store's nodes (the counters' count) fits in
    :data:`TABLE_BYTES`."""
    nodes = sum(
        Index.COUNTERS.unpack(bytes(v))[0]
        for _, v in txn.cursor(db=index.db["counters"])
        if len(v) == Index.COUNTERS.size
    )
    return nodes * (BYTES_PER_NODE + HASH_BYTES) <= TABLE_BYTES


class DueTable:
    """Every node's due time (the latest access time in its subtree; never, above a
    pinned node without ``lift`` or a record that does not decode) and bytes.

    Args:
        index: The store's index.
        lift: Added to pinned nodes' access times (:func:`~.lru.pinned_lift`); None:
            pinned nodes never go.
    """

    def __init__(self, index: Index, *, lift: Optional[float]):
        keys, parents = bytearray(), bytearray()
        start, nbytes, due = array("i"), array("q"), array("d")
        shed, after = PageShedder(index), b""
        while True:
            after = index.read(
                lambda txn, after=after: self._scan(
                    index, txn, after, lift, shed, (keys, parents, start, nbytes, due)
                )
            )
            if after is None:
                break
        index.release_pages()
        self.keys = np.frombuffer(keys, dtype=f"S{KEY}")
        self.start = np.frombuffer(start, dtype=np.int32)
        self.nbytes = np.frombuffer(nbytes, dtype=np.int64)
        self.due = np.frombuffer(due, dtype=np.float64).copy()
        self.parent = self._link(np.frombuffer(parents, dtype=f"S{HASH_BYTES}"))
        # Children before parents: a child starts where its parent ends.
        self.order = np.argsort(-self.start, kind="stable").astype(np.int32)
        self._propagate()

    @staticmethod
    def _scan(index, txn, after: bytes, lift, shed, out) -> Optional[bytes]:
        """Append the next :data:`_SCAN_BATCH` nodes; the key to go on after, None at
        the end."""
        keys, parents, start, nbytes, due = out
        cur = txn.cursor(db=index.db["nodes"])
        atimes, last, n = index.db["atime"], None, 0
        if not index.cover(txn, "nodes") or not cur.set_range(after):
            return None
        for k, v in cur:
            shed.tick()
            if len(k) != KEY:
                continue  # not a node key: verify reports it
            k = bytes(k)
            try:
                rec = NodeRecord.decode(bytes(v))
                raw = txn.get(k, db=atimes)  # keyed as the nodes: pages in order
                when = _ATIME.unpack(raw)[0] if raw and len(raw) == 8 else 0.0
                if rec.pinned:
                    when = math.inf if lift is None else when + lift
                parent, size = rec.parent, rec.total_bytes
            except CorruptRecord:  # never due; its parent keeps the edge to it
                parent, size, when, rec = bytes(HASH_BYTES), 0, math.inf, None
            keys += k
            parents += parent
            start.append(rec.start if rec is not None else 0)
            nbytes.append(size)
            due.append(when)
            last, n = k, n + 1
            if n >= _SCAN_BATCH:
                return last + b"\0"
        return None

    def _link(self, parents: np.ndarray) -> np.ndarray:
        """Each row's parent row (-1: the parent is not a node), namespace by
        namespace: the keys are sorted, so each namespace's hashes are too."""
        out = np.full(len(self.keys), -1, dtype=np.int32)
        pairs = self.keys.view([("ns", f"S{HASH_BYTES}"), ("h", f"S{HASH_BYTES}")])
        ns = pairs["ns"]
        bounds = np.flatnonzero(ns[1:] != ns[:-1]) + 1
        for lo, hi in zip(np.r_[0, bounds], np.r_[bounds, len(ns)]):
            if lo == hi:
                continue  # no nodes at all
            hashes = np.ascontiguousarray(pairs["h"][lo:hi])
            want = parents[lo:hi]
            at = np.searchsorted(hashes, want).clip(max=hi - lo - 1)
            found = hashes[at] == want
            out[lo:hi][found] = (at + lo)[found]
        return out

    def _propagate(self) -> None:
        """A node's due time becomes the latest of its subtree: the rows of each
        start, children first, lift their parents."""
        order, parent, due = self.order, self.parent, self.due
        starts = self.start[order]
        bounds = np.flatnonzero(starts[1:] != starts[:-1]) + 1
        for lo, hi in zip(np.r_[0, bounds], np.r_[bounds, len(order)]):
            rows = order[lo:hi]
            rows = rows[parent[rows] >= 0]
            np.maximum.at(due, parent[rows], due[rows])

    def cut(self, excess: int) -> Cut:
        """The :class:`~.lru.Cut` evicting ``excess`` bytes, as :func:`~.lru.threshold`
        finds it (ties in another order)."""
        may = np.isfinite(self.due)
        when, size = self.due[may], self.nbytes[may]
        order = np.lexsort((size, when))
        when, total = when[order], np.cumsum(size[order])
        i = int(np.searchsorted(total, excess))  # first reaching the excess
        if i == len(total):
            return Cut(math.inf, 0)
        first = int(np.searchsorted(when, when[i]))  # the first of its ties
        before = int(total[first] - size[order][first])
        return Cut(float(when[i]), excess - before)

    def victims(self, cut: Cut, *, sizes: Iterator[int]) -> Iterator[List[Key]]:
        """Lists of nodes to evict for ``cut`` (each at most the next of ``sizes``
        long), children before their parents, as :func:`~.lru.victims` gives them."""
        due, order = self.due, self.order
        go = np.isfinite(due) & (due < cut.due)
        tied = order[due[order] == cut.due] if math.isfinite(cut.due) else order[:0]
        if len(tied):
            # A tie goes while tie bytes are left and all its children went (those
            # due earlier always go; a later one would make it due later).
            blocked, left = set(), cut.tie_bytes
            for row in tied.tolist():
                if left > 0 and row not in blocked:
                    go[row] = True
                    left -= int(self.nbytes[row])
                elif self.parent[row] >= 0:
                    blocked.add(int(self.parent[row]))
        chosen = order[go[order]]
        at = 0
        while at < len(chosen):
            n = next(sizes)
            yield [
                (k[:HASH_BYTES], k[HASH_BYTES:])
                for k in (
                    self.keys[row].ljust(KEY, b"\0") for row in chosen[at : at + n]
                )
            ]
            at += n
