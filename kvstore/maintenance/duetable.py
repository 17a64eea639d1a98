"""Leaf-first LRU eviction from a table of every node, built by one scan in key order.

:mod:`.lru` walks the trie in O(depth) memory, but each node it visits costs lookups of
its edge, record and access time: random pages of an index that at a million nodes is
many times what a scan keeps mapped, so nearly every lookup faults (three walks of a
million nodes took 234 + 123 s here, against 11 + 6 s for 100,000). A
:class:`DueTable` reads the nodes and their access times once, in key order, into
arrays of :data:`BYTES_PER_NODE` bytes a node, and finds the same :class:`~.lru.Cut`
and victims there (up to ties). :func:`table_rows` says when a store is small enough for
one; larger stores are walked.
"""

import math
import struct
from typing import Iterator, List, Optional

import numpy as np

from ..disk.chunking import HASH_BYTES
from ..disk.index import CorruptRecord, Index, NodeRecord
from .lru import Cut, Key
from .walk import SEQUENTIAL_BYTES, PageShedder

# Bytes a node: its hash, namespace, parent's row, start, place in the order, bytes and
# due time; the parent's hash while rows are linked, and the cut's sorting.
BYTES_PER_NODE = HASH_BYTES + 4 + 4 + 4 + 4 + 8 + 8 + HASH_BYTES + 16
TABLE_BYTES = 96 << 20  # the most a table may take: about 1.3M nodes
_SCAN_BATCH = 4096  # nodes read per read transaction (writers reuse pages between)
_ATIME = struct.Struct("<d")


def table_rows(index: Index, txn) -> Optional[int]:
    """The store's node count (its counters') if a table of them fits in
    :data:`TABLE_BYTES`, else None."""
    nodes = sum(
        Index.COUNTERS.unpack(bytes(v))[0]
        for _, v in txn.cursor(db=index.db["counters"])
        if len(v) == Index.COUNTERS.size
    )
    return nodes if nodes * BYTES_PER_NODE <= TABLE_BYTES else None


class DueTable:
    """Every node's due time (the latest access time in its subtree; never, above a
    pinned node without ``lift`` or a record that does not decode) and bytes.

    Args:
        index: The store's index.
        lift: Added to pinned nodes' access times (:func:`~.lru.pinned_lift`); None:
            pinned nodes never go.
        rows: The nodes expected (:func:`table_rows`); the arrays grow if more come.
    """

    def __init__(self, index: Index, *, lift: Optional[float], rows: int = 0):
        self.namespaces: List[bytes] = []
        self._columns(max(rows, 1))
        self.rows, shed, after = 0, PageShedder(index, budget=SEQUENTIAL_BYTES), b""
        while after is not None:
            after = index.read(
                lambda txn, after=after: self._scan(index, txn, after, lift, shed)
            )
        index.release_pages()
        for name in ("h", "ns", "start", "nbytes", "due", "parents"):
            setattr(self, name, getattr(self, name)[: self.rows])
        self.parent = self._link()
        del self.parents
        # Children before parents: a child starts where its parent ends.
        self.order = np.argsort(-self.start, kind="stable").astype(np.int32)
        self._propagate()

    def _columns(self, n: int) -> None:
        """Room for ``n`` rows (the rows so far kept)."""
        kinds = {
            "h": f"S{HASH_BYTES}",
            "ns": np.uint32,
            "start": np.int32,
            "nbytes": np.int64,
            "due": np.float64,
            "parents": f"S{HASH_BYTES}",
        }
        for name, dtype in kinds.items():
            new = np.empty(n, dtype=dtype)
            if hasattr(self, name):
                old = getattr(self, name)
                new[: len(old)] = old
            setattr(self, name, new)

    def _scan(self, index, txn, after: bytes, lift, shed) -> Optional[bytes]:
        """Add the next :data:`_SCAN_BATCH` nodes; the key to go on after, None at the
        end."""
        cur = txn.cursor(db=index.db["nodes"])
        atimes, batch, last = index.db["atime"], [], None
        if not index.cover(txn, "nodes") or not cur.set_range(after):
            return None
        for k, v in cur:
            shed.tick()
            last = k = bytes(k)
            if len(k) != 2 * HASH_BYTES:
                continue  # not a node key: verify reports it
            try:
                rec = NodeRecord.decode(bytes(v))
                raw = txn.get(k, db=atimes)  # keyed as the nodes: pages in order
                when = _ATIME.unpack(raw)[0] if raw and len(raw) == 8 else 0.0
                if rec.pinned:
                    when = math.inf if lift is None else when + lift
                row = (rec.parent, rec.start, rec.total_bytes, when)
            except CorruptRecord:  # never due; its parent keeps the edge to it
                row = (bytes(HASH_BYTES), 0, 0, math.inf)
            ns = k[:HASH_BYTES]
            if not self.namespaces or self.namespaces[-1] != ns:
                self.namespaces.append(ns)  # the keys are sorted: one run each
            batch.append((k[HASH_BYTES:], len(self.namespaces) - 1) + row)
            if len(batch) >= _SCAN_BATCH:
                break
        self._add(batch)
        return last + b"\0" if len(batch) >= _SCAN_BATCH else None

    def _add(self, batch: list) -> None:
        if not batch:
            return
        lo, hi = self.rows, self.rows + len(batch)
        if hi > len(self.h):
            self._columns(max(2 * len(self.h), hi))
        h, ns, parents, start, nbytes, due = zip(*batch)
        self.h[lo:hi], self.ns[lo:hi], self.parents[lo:hi] = h, ns, parents
        self.start[lo:hi], self.nbytes[lo:hi], self.due[lo:hi] = start, nbytes, due
        self.rows = hi

    def _link(self) -> np.ndarray:
        """Each row's parent row (-1: the parent is not a node), namespace by
        namespace: the keys are sorted, so each namespace's hashes are too."""
        out = np.full(self.rows, -1, dtype=np.int32)
        bounds = np.flatnonzero(self.ns[1:] != self.ns[:-1]) + 1
        step = 1 << 16  # parents looked up at once: small temporaries
        for lo, hi in zip(np.r_[0, bounds], np.r_[bounds, self.rows]):
            hashes = self.h[lo:hi]
            for a in range(lo, hi, step):
                b = min(a + step, hi)
                want = self.parents[a:b]
                at = np.searchsorted(hashes, want).clip(max=hi - lo - 1)
                found = hashes[at] == want
                out[a:b][found] = (at + lo)[found]
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
        finds it (ties in another order: the cut does not depend on it)."""
        order = np.argsort(self.due, kind="stable")  # never due: last
        may = int(np.isfinite(self.due).sum())
        total = np.cumsum(self.nbytes[order[:may]])
        i = int(np.searchsorted(total, excess))  # the first to reach the excess
        if i == may:
            return Cut(math.inf, 0)
        when = self.due[order[i]]
        first = int(np.searchsorted(self.due[order[:may]], when))  # its first tie
        before = int(total[first] - self.nbytes[order[first]])
        return Cut(float(when), excess - before)

    def victims(self, cut: Cut, *, sizes: Iterator[int]) -> Iterator[List[Key]]:
        """Lists of nodes to evict for ``cut`` (each at most the next of ``sizes``
        long), children before their parents, as :func:`~.lru.victims` gives them.
        This spends the table: only the victims' keys are kept while the caller
        deletes them (its commits need the memory)."""
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
        hashes, spaces = self.h[chosen], self.ns[chosen]
        del due, order, go, tied, chosen
        for name in ("h", "ns", "start", "nbytes", "due", "parent", "order"):
            setattr(self, name, None)
        at = 0
        while at < len(hashes):
            n = next(sizes)
            yield [
                (self.namespaces[ns], h.ljust(HASH_BYTES, b"\0"))
                for h, ns in zip(
                    hashes[at : at + n].tolist(), spaces[at : at + n].tolist()
                )
            ]
            at += n
