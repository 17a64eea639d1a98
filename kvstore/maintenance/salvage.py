"""Salvaging a damaged index (``kvstore verify --fix`` on a store whose
``index/data.mdb`` fails the page check of :mod:`kvstore.disk.mdbcheck`).

As ``mdb_dump -r`` or SQLite's ``.recover`` do for their files, every record that can
still be read goes into a fresh index, built beside the old one; the damaged index is
then moved aside (``index.damaged-<time>/``), never deleted. liblmdb is never asked to
read the damaged file: its pages are read with ``pread`` (:func:`kvstore.disk.mdbcheck.walk`).

Records come from the trees of both meta pages (the newest first: the older one is the
store one commit earlier, often whole where the newer is not), then from every page of
the file that reads as a leaf, reachable or not, for the records a lost branch page
cut off. A record found that way is taken only if it proves itself: a node record's
key is the hash of its parent and tokens, a namespace description's key the hash of
its text. A node is kept when it hangs from a root (or is the first node of a salted
tree) through kept nodes, starts where its parent ends, and its files pass
:func:`kvstore.maintenance.verify`'s checks (size, header, layout, namespace,
checksum); access times, pins and counters are rebuilt from the kept records. Node
files whose record was lost stay where they are, as orphans (``kvstore gc`` removes
them): the report counts them.
"""

import json
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

import xxhash

from ..disk import mdbcheck, storecheck
from ..disk.blobs import FANOUT_CHARS, Blobs
from ..disk.chunking import HASH_BYTES, chain_hash, root_hash
from ..disk.index import FORMAT_VERSION, READ_FORMATS, CorruptRecord, Index, NodeRecord
from ..platform.fsutil import fsync_dir, open_regular
from .common import Key, description_layout

# verify's check of a node's files: (blobs, ns, h, record, layout, *, check_data)
# -> (kind, detail) of what is wrong, or None.
CheckFile = Callable[..., Optional[Tuple[str, str]]]

SALVAGE_DIR = "index.salvage"  # the new index while it is built
DAMAGED_PREFIX = "index.damaged-"  # where the damaged index goes
_SKIP = {"reservations"}  # saves in flight when the index broke: none now
_NAMED = set(Index.DATABASES)
_MAX_LISTED = 50  # lost nodes named in the report


@dataclass
class _Found:
    """Records read from the damaged file, by database; the first copy of a key wins
    (trees of the newest meta page first), later copies of node records are kept as
    alternatives (an older record of a node evicted and saved again)."""

    records: Dict[str, Dict[bytes, bytes]] = field(default_factory=dict)
    node_copies: Dict[Key, List[bytes]] = field(default_factory=dict)
    damage: List[str] = field(default_factory=list)
    from_scan: int = 0
    kvstore_dbs: bool = False  # the main database named kvstore's databases

    def add(self, db: str, key: bytes, value: bytes) -> bool:
        records = self.records.setdefault(db, {})
        if db == "nodes" and len(key) == 2 * HASH_BYTES:
            copies = self.node_copies.setdefault(
                (key[:HASH_BYTES], key[HASH_BYTES:]), []
            )
            if value not in copies:
                copies.append(value)
        if key in records:
            return False
        records[key] = value
        return True


def _read_damaged(data_path: str) -> _Found:
    """Every record of the damaged ``data.mdb`` that can be read (see the module)."""
    found = _Found()
    fd = open_regular(data_path)
    try:
        size = os.fstat(fd).st_size
        metas = [m for m in mdbcheck.read_meta_pages(fd) if m is not None]
        if not metas:
            return found
        psize = metas[0].page_size
        for meta in sorted(metas, key=lambda m: -m.txnid):
            if meta.page_size != psize:
                found.damage.append(f"meta page {meta.number} has another page size")
                continue
            for db, key, value in mdbcheck.walk(fd, meta, size, found.damage.append):
                found.kvstore_dbs |= db in _NAMED
                if db in _NAMED and db not in _SKIP:
                    found.add(db, key, value)
        for _, key, value in mdbcheck.leaf_records(fd, psize, size):
            db = _proves_itself(key, value)
            if db is not None and found.add(db, key, value):
                found.from_scan += 1
    finally:
        os.close(fd)
    return found


def _proves_itself(key: bytes, value: bytes) -> Optional[str]:
    """The database a record found on an unreachable page belongs to, when its key
    proves it ("nodes": the hash of parent and tokens; "namespaces": of the text)."""
    if len(key) == 2 * HASH_BYTES:
        try:
            rec = NodeRecord.decode(value)
        except CorruptRecord:
            return None
        return (
            "nodes" if chain_hash(rec.parent, rec.tokens) == key[HASH_BYTES:] else None
        )
    if len(key) == HASH_BYTES and xxhash.xxh3_128_digest(value) == key:
        return "namespaces"
    return None


@dataclass
class _Kept:
    nodes: Dict[Key, NodeRecord] = field(default_factory=dict)
    lost: Dict[Key, str] = field(default_factory=dict)  # node -> why


def _choose_nodes(
    found: _Found, blobs: Blobs, layouts: Dict[bytes, Any], check_file: CheckFile
) -> _Kept:
    """The node records to keep: decodable, hashing to their key, hanging from a root
    through kept nodes, with whole files (parents are decided before children)."""
    out = _Kept()
    candidates: Dict[Key, List[NodeRecord]] = {}
    for (ns, h), copies in found.node_copies.items():
        recs = []
        for raw in copies:
            try:
                rec = NodeRecord.decode(raw)
            except CorruptRecord as e:
                out.lost[ns, h] = f"record: {e}"
                continue
            if chain_hash(rec.parent, rec.tokens) != h:
                out.lost[ns, h] = "record does not hash to its key"
                continue
            recs.append(rec)
        if recs:
            out.lost.pop((ns, h), None)
            candidates[ns, h] = recs
    # Parents first: by start token, then settle each node once its parent is.
    for (ns, h), recs in sorted(candidates.items(), key=lambda kv: kv[1][0].start):
        why = None
        for rec in recs:
            why = _why_not(rec, ns, out.nodes, layouts, h)
            if why is None:
                bad = check_file(blobs, ns, h, rec, layouts[ns], check_data=True)
                why = None if bad is None else f"{bad[0]}: {bad[1]}"
            if why is None:
                out.nodes[ns, h] = rec
                break
        if why is not None:
            out.lost[ns, h] = why
    return out


def _why_not(rec, ns, kept, layouts, h) -> Optional[str]:
    """Why the record of node ``h`` cannot be kept, its files aside (None: it can)."""
    if ns not in layouts:
        return "its namespace's description was lost"
    if rec.parent == root_hash(ns):
        if rec.start != 0:
            return f"hangs from the root but starts at token {rec.start}"
    elif rec.start != 0:  # a salted tree's first node hangs from its tenant's root
        parent = kept.get((ns, rec.parent))
        if parent is None:
            return "its parent was lost"
        if parent.end != rec.start:
            return f"starts at {rec.start}, its parent ends at {parent.end}"
    return None


def salvage(path: str, *, check_file: CheckFile) -> Dict[str, Any]:
    """Rebuild the damaged index of the store at ``path`` from what can be read;
    ``check_file`` checks a node's files (:mod:`.verify`'s check).

    Returns:
        ``{"damage", "moved_to", "nodes_found", "nodes_kept", "nodes_lost",
        "lost", "records_from_scan", "namespaces", "meta_records",
        "orphan_files"}``: ``damage`` what the read met (first ones), ``lost`` the
        nodes dropped and why (the first :data:`_MAX_LISTED`), ``orphan_files`` the
        node files no kept record names (their records were on unreadable pages).

    Raises:
        StoreError: another process has the store open, or the file holds nothing
            of a kvstore index.
    """
    index_dir = os.path.join(path, "index")
    with storecheck.alone(index_dir):
        found = _read_damaged(os.path.join(index_dir, "data.mdb"))
        if not (found.kvstore_dbs or found.records.get("namespaces")):
            raise storecheck.StoreError(
                f"{path}: index/data.mdb is damaged and holds nothing recognizable "
                "as a kvstore index; left as it is"
            )
        # The new index keeps the store's format: its files stay where they are.
        version = _store_format(found, os.path.join(path, "blobs"))
        blobs = Blobs.of_store(path, version)
        namespaces = found.records.get("namespaces", {})
        layouts = {}
        for ns, raw in namespaces.items():
            try:
                layouts[ns] = description_layout(json.loads(raw))
            except ValueError:
                pass
        kept = _choose_nodes(found, blobs, layouts, check_file)
        new_dir = os.path.join(path, SALVAGE_DIR)
        described = {ns: namespaces[ns] for ns in layouts}
        _build(new_dir, found, kept, described, format_version=version)
        aside = _swap(path, index_dir, new_dir)
    orphans = _orphan_files(blobs, kept)
    lost = sorted(kept.lost.items())
    return {
        "damage": list(dict.fromkeys(found.damage))[:10],
        "moved_to": aside,
        "nodes_found": len(found.node_copies),
        "nodes_kept": len(kept.nodes),
        "nodes_lost": len(lost),
        "lost": [
            {"namespace": ns.hex(), "node": h.hex(), "why": why}
            for (ns, h), why in lost[:_MAX_LISTED]
        ],
        "records_from_scan": found.from_scan,
        "namespaces": len(layouts),
        "meta_records": len(found.records.get("meta", {})),
        "orphan_files": orphans,
    }


def _store_format(found: _Found, blobs_root: str) -> int:
    """The damaged store's format version: as its meta database records it, else as
    its node directories' names show (:data:`kvstore.disk.blobs.FANOUT_CHARS`),
    else a new store's."""
    raw = found.records.get("meta", {}).get(b"format_version", b"")
    if raw.isdigit() and int(raw) in READ_FORMATS:
        return int(raw)
    lengths: Dict[int, int] = {}
    try:
        for ns in os.listdir(blobs_root):
            for name in os.listdir(os.path.join(blobs_root, ns)):
                lengths[len(name)] = lengths.get(len(name), 0) + 1
    except OSError:
        pass
    by_fanout = {chars: v for v, chars in FANOUT_CHARS.items()}
    seen = [n for n in sorted(lengths, key=lengths.get, reverse=True) if n in by_fanout]
    return by_fanout[seen[0]] if seen else FORMAT_VERSION


def _build(
    new_dir: str, found: _Found, kept: _Kept, namespaces: Dict, *, format_version: int
) -> None:
    """Write the kept records into a new index at ``new_dir`` (one commit) of the
    store's ``format_version``."""
    if os.path.lexists(new_dir):  # an earlier salvage that did not finish
        _remove_index_dir(new_dir)
    index = Index(new_dir, create=True, format_version=format_version)
    try:
        atimes = found.records.get("atime", {})

        def write(txn):
            for ns, raw in namespaces.items():
                txn.put(ns, raw, db=index.db["namespaces"])
            for key, value in found.records.get("meta", {}).items():
                if key not in (b"format_version",):
                    txn.put(key, value, db=index.db["meta"])
            for (ns, h), rec in sorted(kept.nodes.items(), key=lambda kv: kv[1].start):
                index.put_node(txn, ns, h, rec)
                when = atimes.get(ns + h)
                if when is not None and len(when) == 8:
                    txn.put(ns + h, when, db=index.db["atime"])

        index.write(write)
    finally:
        index.close()


def _remove_index_dir(path: str) -> None:
    """Remove a half-built salvage directory (only the files an index has)."""
    for name in os.listdir(path):
        os.unlink(os.path.join(path, name))
    os.rmdir(path)


def _swap(store: str, index_dir: str, new_dir: str) -> str:
    """Move the damaged index aside and the new one into its place; returns where the
    damaged one went."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    aside = os.path.join(store, DAMAGED_PREFIX + stamp)
    n = 1
    while os.path.lexists(aside):
        n += 1
        aside = os.path.join(store, f"{DAMAGED_PREFIX}{stamp}-{n}")
    os.rename(index_dir, aside)
    os.rename(new_dir, index_dir)
    fsync_dir(store)
    return aside


def _orphan_files(blobs: Blobs, kept: _Kept) -> int:
    """Node files under ``blobs/`` that no kept record names."""
    orphans: Set[Tuple[bytes, bytes]] = set()
    for kind, p in blobs.iter_files():
        key = blobs.parse_path(p) if kind == "blob" else None
        if key is not None and key not in kept.nodes:
            orphans.add(key)
    return len(orphans)


def salvage_if_damaged(path: str, *, check_file: CheckFile) -> Optional[Dict[str, Any]]:
    """:func:`salvage` the store at ``path`` when its index is damaged (None when it
    opens: nothing done)."""
    try:
        index_dir = os.path.join(path, "index")
        Index(index_dir, create=False, readonly=True, check="full").close()
    except storecheck.IndexDamaged as e:
        report = salvage(path, check_file=check_file)
        report["damage"] = list(dict.fromkeys([e.problem] + report["damage"]))
        return report
    return None


def with_salvage(report: Dict[str, Any], salvaged: Dict[str, Any]) -> Dict[str, Any]:
    """:func:`kvstore.maintenance.verify`'s report of a store salvaged first: the
    damage is its first problem (the store was not clean), ``salvaged`` the rest."""
    problem = {
        "kind": "index",
        "namespace": None,
        "node": None,
        "file": os.path.join("index", "data.mdb"),
        "detail": f"damaged, salvaged into a new index ({salvaged['nodes_kept']} of "
        f"{salvaged['nodes_found']} nodes kept; the damaged index is at "
        f"{salvaged['moved_to']})",
    }
    out = dict(report, salvaged=salvaged)
    out["problems"] = [problem] + report["problems"]
    out["errors"] = report["errors"] + 1
    out["clean"] = False
    return out
