"""Leaf-first LRU eviction of a whole store in bounded memory and linear time.

:func:`kvstore.disk.policy.disk_victims` takes every node into memory. Here the same order
comes from walks of the trie (:class:`~.walk.TreeWalk`), each node after its
children, keeping only the path being walked:

* A node's **due time** is the latest access time in its subtree: leaf-first LRU
  evicts a parent only after its last child, so never before that child is due, and
  the nodes it evicts first are exactly those due earliest. A subtree holding a node
  that must stay (pinned, or a record that does not decode) is never due.
* :func:`threshold` finds the due time ``T`` at which the evicted bytes reach the
  excess: walks that count bytes in ever narrower windows of due times (a histogram
  of :data:`BINS` bins per walk), until the window holds few enough nodes to sort.
* :func:`victims` walks once more and yields every node due before ``T`` and nodes
  due at ``T`` until the excess is met, each only after all its children: the same
  nodes :func:`~kvstore.disk.policy.disk_victims` picks (up to ties), children first.

Memory: the walk's path and one histogram. Time: a few walks of the index, whatever
the excess.
"""

import math
import struct
from dataclasses import dataclass
from typing import Iterator, List, Optional, Tuple

from ..disk.index import CorruptRecord, Index
from .walk import PageShedder, TreeWalk, tree_roots

BINS = 4096  # histogram bins per walk
EXACT = 1 << 16  # a window holding at most this many nodes is sorted in memory
_MAX_WALKS = 8  # then the window's upper end is taken (float times cannot split)
_BATCH = 1024  # nodes a walk reads per read transaction

Key = Tuple[bytes, bytes]
_ATIME = struct.Struct("<d")  # as the index stores access times


@dataclass
class Cut:
    """Evict every node due before ``due``, and of those due at ``due`` up to
    ``tie_bytes`` (walk order); ``due`` infinite: everything that may go."""

    due: float
    tie_bytes: int


class _Due:
    """Own due time and bytes of a node: its access time (a pinned node's lifted
    above every other with ``lift``, or never due without it)."""

    def __init__(self, index: Index, lift: Optional[float]):
        self.index = index
        self.lift = lift
        self.shed = PageShedder(index)  # a node's lookups are random pages

    def __call__(self, txn, ns: bytes, h: bytes) -> Tuple[float, int]:
        self.shed.tick()
        try:
            rec = self.index.get_node(ns, h, txn)
        except CorruptRecord:
            return math.inf, 0
        if rec is None:
            return math.inf, 0
        atime = self.index.atime(txn, ns, h)
        if rec.pinned:
            atime = math.inf if self.lift is None else atime + self.lift
        return atime, rec.total_bytes


def pinned_lift(index: Index, txn) -> float:
    """How far pinned nodes' access times are lifted so that every pinned node is
    due after every unpinned one (one pass over the access times and pins)."""
    newest, oldest_pinned = -math.inf, math.inf
    atimes, shed = index.db["atime"], PageShedder(index)
    for _, raw in txn.cursor(db=atimes):
        shed.tick()
        if len(raw) == 8:
            newest = max(newest, _unpack(raw))
    for key, _ in txn.cursor(db=index.db["pins"]):
        shed.tick()
        raw = txn.get(bytes(key), db=atimes)
        if raw is not None and len(raw) == 8:
            oldest_pinned = min(oldest_pinned, _unpack(raw))
    if math.isinf(newest) or math.isinf(oldest_pinned):
        return 0.0
    return newest - oldest_pinned + 1.0


def _unpack(raw) -> float:
    return _ATIME.unpack(raw)[0]


def _due_times(index: Index, due: _Due) -> Iterator[Tuple[float, int]]:
    """``(due time, bytes)`` of every node that may go, walking every tree in one
    read transaction per :data:`_BATCH` nodes."""
    walks = [
        TreeWalk(index, ns, root)
        for ns, root in index.read(lambda t: tree_roots(index, t))
    ]
    for walk in walks:
        # Per depth: the latest due time among the children walked so far.
        below: List[float] = []
        while not walk.done:
            out = index.read(lambda txn: _batch(txn, walk, due, below))
            index.release_pages()
            yield from out


def _batch(txn, walk: TreeWalk, due: _Due, below: List[float]) -> list:
    out = []
    for h, depth in walk.nodes(txn, limit=_BATCH):
        own, nbytes = due(txn, walk.ns, h)
        while len(below) <= depth + 1:
            below.append(-math.inf)
        when = max(own, below[depth + 1])
        below[depth + 1] = -math.inf  # its children are done
        below[depth] = max(below[depth], when)
        if not math.isinf(when):
            out.append((when, nbytes))
    return out


def due_window(index: Index, txn, lift: Optional[float]) -> Tuple[float, float]:
    """Where every due time should lie, from one sequential pass over the access
    times: a node's due time is some node's access time (lifted with ``lift`` if
    pinned). ``(-inf, inf)`` when there are none; :func:`threshold` checks it."""
    lo, hi, shed = math.inf, -math.inf, PageShedder(index)
    for _, raw in txn.cursor(db=index.db["atime"]):
        shed.tick()
        if len(raw) == 8:
            when = _unpack(raw)
            lo, hi = min(lo, when), max(hi, when)
    if lo > hi:
        return -math.inf, math.inf
    return lo, hi + lift if lift is not None and lift > 0 else hi


def threshold(index: Index, excess: int, *, lift: Optional[float]) -> Cut:
    """The :class:`Cut` evicting ``excess`` bytes (or everything that may go).

    The first walk already counts in the window of the stored access times
    (:func:`due_window`); should a due time fall outside it (a node without a
    readable access time counts as due at 0), the walk widens the window to the due
    times it saw and walks again."""
    due = _Due(index, lift)
    lo, hi = index.read(lambda txn: due_window(index, txn, lift))  # the window
    before, trusted = 0, math.isinf(hi - lo)  # bytes due before it; it holds all
    for _ in range(_MAX_WALKS):
        listed: Optional[list] = []
        bins = [0] * BINS
        count, first, last = 0, math.inf, -math.inf
        width = (hi - lo) / BINS if not math.isinf(hi - lo) else 0.0
        under, low, high = 0, math.inf, -math.inf
        for when, nbytes in _due_times(index, due):
            low, high = min(low, when), max(high, when)
            if when < lo:
                under += nbytes
                continue
            if when > hi:
                continue
            count += 1
            first, last = min(first, when), max(last, when)
            if listed is not None:
                listed.append((when, nbytes))
                if len(listed) > EXACT:
                    listed = None
            if width > 0:
                bins[min(BINS - 1, int((when - lo) / width))] += nbytes
        if not trusted and (low < lo or high > hi):
            lo, hi, trusted = low, high, True  # the stored times missed some
            continue
        trusted = True
        before = under
        if listed is not None:
            return _exact(sorted(listed), before, excess)
        if first == last:
            return Cut(first, excess - before)
        if width == 0:  # the first walk: now the window's ends are known
            lo, hi = first, last
            continue
        acc = before
        for i, b in enumerate(bins):
            if acc + b >= excess:
                lo, hi = lo + i * width, min(hi, lo + (i + 1) * width)
                break
            acc += b
        else:
            return Cut(math.inf, 0)
    return Cut(hi, 0)


def _exact(listed: list, before: int, excess: int) -> Cut:
    acc = before
    for i, (when, nbytes) in enumerate(listed):
        if acc + nbytes >= excess:
            tied = sum(n for w, n in listed[:i] if w == when)
            return Cut(when, excess - (acc - tied))
        acc += nbytes
    return Cut(math.inf, 0)


def victims(
    index: Index, cut: Cut, *, lift: Optional[float], sizes: Iterator[int]
) -> Iterator[List[Key]]:
    """Lists of nodes to evict for ``cut`` (each at most the next of ``sizes`` long),
    children before their parents; each list is read in its own read transaction, so
    the caller deletes it before the walk goes on (the walk's state survives the
    deletions)."""
    due = _Due(index, lift)
    ties = [cut.tie_bytes]
    for ns, root in index.read(lambda t: tree_roots(index, t)):
        walk = TreeWalk(index, ns, root)
        # Per depth: (latest due time of the children walked, all of them chosen).
        below: List[list] = []
        while not walk.done:
            chosen: List[Key] = []
            batch = next(sizes)
            while not walk.done and len(chosen) < batch:
                chosen += index.read(
                    lambda txn: _choose(
                        txn, walk, due, below, cut, ties, batch - len(chosen)
                    )
                )
                index.release_pages()
            if chosen:
                yield chosen


def _choose(txn, walk, due, below, cut: Cut, ties: list, want: int) -> List[Key]:
    """Walk on (at most :data:`_BATCH` nodes) until ``want`` nodes are chosen."""
    out: List[Key] = []
    for h, depth in walk.nodes(txn, limit=_BATCH):
        own, nbytes = due(txn, walk.ns, h)
        while len(below) <= depth + 1:
            below.append([-math.inf, True])
        kids_when, kids_gone = below[depth + 1]
        below[depth + 1] = [-math.inf, True]
        when = max(own, kids_when)
        go = kids_gone and not math.isinf(when)
        if go and when >= cut.due:
            go = when == cut.due and ties[0] > 0
            if go:
                ties[0] -= nbytes
        if go:
            out.append((walk.ns, h))
        level = below[depth]
        level[0] = max(level[0], when)
        level[1] = level[1] and go
        if len(out) >= want:
            break
    return out
