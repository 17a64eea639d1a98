"""Whether an index's tables agree with its node records, from scans in key order.

verify's exact checks look up each node's parent, trie edge, access time and pin: four
random pages per node, in an index that at a million nodes is many times the pages a
scan keeps mapped (:class:`~.walk.PageShedder`), so nearly every lookup faults and the
scan's cost per node grows with the store. Here every table is read once, in key order,
and each side of each agreement is folded into an order-independent :class:`Digest`:

* trie edges: every node's edge key with the token its record starts at, against every
  edge key with the token where its parent ends (0 where the parent is not a node: the
  namespace's root, or a salted tree's);
* access times: every node's key, against every key of the access-time table holding
  a readable time;
* pins: every pinned node's key, against the pins table.

Equal digests prove the index healthy but with a chance of 2**-128; any difference,
or a record that does not decode or whose id does not hash from its parent and tokens,
sends verify to its exact checks, which say what is wrong and how to repair it.
"""

import struct
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import xxhash

from ..disk.chunking import HASH_BYTES, chain_hash
from ..disk.index import CorruptRecord, Index, NodeRecord, child_key
from .walk import SEQUENTIAL_BYTES, PageShedder

_MASK = (1 << 128) - 1
_AT = struct.Struct("<Q")  # a token position, appended to an edge key


class Digest:
    """Order-independent digest of a multiset of byte strings: their number and the
    sum of their 128-bit hashes. Different multisets have equal digests with a chance
    of about 2**-128."""

    __slots__ = ("count", "total")

    def __init__(self):
        self.count = 0
        self.total = 0

    def add(self, item: bytes) -> None:
        self.count += 1
        self.total = (self.total + xxhash.xxh3_128_intdigest(item)) & _MASK

    def __eq__(self, other) -> bool:
        return (self.count, self.total) == (other.count, other.total)


@dataclass
class Agreed:
    """The sums an agreeing index's records add up to.

    ``sums``: per namespace, nodes, tokens, bytes and pinned bytes, as the index's
    counters keep them."""

    nodes: int = 0
    sums: Dict[bytes, List[int]] = field(default_factory=dict)


def index_agrees(index: Index, txn) -> Optional[Agreed]:
    """The record sums if every node record decodes, has the id its parent and tokens
    hash to, and agrees with the trie edges, access times and pins (see the module's
    docstring); None if anything does not (the exact checks then find what)."""
    shed = PageShedder(index, budget=SEQUENTIAL_BYTES)
    want = {"edges": Digest(), "atime": Digest(), "pins": Digest()}
    agreed = Agreed()
    for ns, h, raw in index.iter_nodes(txn):
        shed.tick()
        if len(ns) + len(h) != 2 * HASH_BYTES:
            return None
        try:
            rec = NodeRecord.decode(raw)
        except CorruptRecord:
            return None
        if chain_hash(rec.parent, rec.tokens) != h:
            return None
        want["edges"].add(
            child_key(ns, rec.parent, rec.tokens, h) + _AT.pack(rec.start)
        )
        want["atime"].add(ns + h)
        if rec.pinned:
            want["pins"].add(ns + h)
        agreed.nodes += 1
        s = agreed.sums.setdefault(ns, [0, 0, 0, 0])
        s[:] = [n + d for n, d in zip(s, rec.counts)]
    have = {
        "edges": _edges(index, txn, shed),
        "atime": _keys(index, txn, "atime", shed, value_bytes=8),
        "pins": _keys(index, txn, "pins", shed),
    }
    return (
        agreed
        if all(have[k] is not None and have[k] == want[k] for k in want)
        else None
    )


def _edges(index: Index, txn, shed: PageShedder) -> Optional[Digest]:
    """Every trie edge with the token its parent ends at. Edges are ordered by parent,
    as the nodes are by id: the parents are looked up in key order, page after page."""
    nodes = index.db["nodes"]
    out, parent, end = Digest(), None, 0
    for key in txn.cursor(db=index.db["children"]).iternext(values=False):
        shed.tick()
        key = bytes(key)
        if key[: 2 * HASH_BYTES] != parent:
            parent = key[: 2 * HASH_BYTES]
            raw = txn.get(parent, db=nodes)
            try:
                end = 0 if raw is None else NodeRecord.decode(bytes(raw)).end
            except CorruptRecord:
                return None
        out.add(key + _AT.pack(end))
    return out


def _keys(
    index: Index, txn, db: str, shed: PageShedder, value_bytes: Optional[int] = None
) -> Optional[Digest]:
    """The keys of table ``db``; None if a value is not ``value_bytes`` long."""
    out = Digest()
    for key, value in txn.cursor(db=index.db[db]):
        shed.tick()
        if value_bytes is not None and len(value) != value_bytes:
            return None
        out.add(bytes(key))
    return out
