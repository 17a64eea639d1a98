"""Verification and repair of a store's index records and chunk files (:func:`verify`).

Every pass streams: the index in one read transaction, each table in key order
(:mod:`.agreement`) and, where they disagree, again with lookups by key to say what
is wrong (nothing is kept per node), the files in batches of records read in short
read transactions, the ``blobs/`` directory as it is walked. Memory holds the findings and one entry per
namespace, whatever the store's size (:mod:`.walk` keeps the index's pages from
piling up in the process).
"""

import os
import struct
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import (
    Any,
    Callable,
    Dict,
    Iterator,
    List,
    Mapping,
    Optional,
    Set,
    Tuple,
)

from ..disk.adapters import Layout
from ..disk.blobs import (
    DELTA_PART,
    MAX_HEADER_BYTES,
    STATE_PART,
    Blobs,
    CorruptBlob,
    check_layout,
    file_checksum,
    metadata_matches,
    parse_header,
)
from ..disk.chunking import HASH_BYTES, chain_hash, root_hash
from ..disk.index import CorruptRecord, Index, NodeRecord, child_key
from ..platform.fsutil import NotRegularFile
from .agreement import index_agrees
from .common import (
    Key,
    delete_namespace,
    delete_subtree,
    description_layout,
    namespace_descriptions,
    opened,
    release_files,
    release_namespace_files,
    writer_alive,
)
from .readahead import OPENERS, Openers, ReadAhead
from .salvage import salvage_if_damaged, with_salvage
from .walk import PageShedder

# Findings that are reported but do not make a store unclean: leftovers of crashes and
# of writes in progress, which gc removes (orphans, old temp files) or leaves (strays).
INFO_KINDS = frozenset({"orphan", "temp", "stray"})
_FILE_BATCH = 512  # records read per read transaction while their files are checked
_READ_AHEAD = 128  # files asked for at once while their data is checked
_ORPHAN_BATCH = 512  # files found in blobs/ looked up per read transaction
_HEADERS_KEPT = 1024  # distinct checked headers a file scan remembers


# -- verify ----------------------------------------------------------------------------


@dataclass
class _Finding:
    """One problem, and what fixing it takes."""

    problem: Dict[str, Any]
    key: Optional[Key] = None  # the node concerned
    raw: Optional[bytes] = (
        None  # its record when found: a fix acts only if it is unchanged
    )
    action: Optional[str] = (
        None  # "quarantine", "remove", "drop", "delete_key", "repair"
    )
    apply: Optional[Callable[[Any], None]] = (
        None  # for "repair": run in a write transaction
    )


def _problem(kind: str, ns=None, h=None, file=None, detail: str = "") -> Dict[str, Any]:
    return {
        "kind": kind,
        "namespace": ns.hex() if ns is not None else None,
        "node": h.hex() if h is not None else None,
        "file": file,
        "detail": detail,
    }


@dataclass
class _IndexScan:
    """What one pass over the index found; no record is kept (memory: the findings,
    one entry per namespace)."""

    descriptions: Dict[bytes, Any]
    layouts: Dict[bytes, Layout]
    findings: List[_Finding]  # records, reachability, descriptions
    diffs: List[_Finding]  # edges, access times, pins, counters (index repairs)
    nodes: int = 0  # node keys, well-formed or not
    namespaces: Set[bytes] = field(default_factory=set)  # of the node keys


class _Diffs:
    """Index repairs found while streaming, with their namespace: those of namespaces
    left out of the comparison (corrupt records, unusable description) are dropped
    at the end, once that is known."""

    ORDER = ("edge-", "edge+", "atime-", "atime+", "pin-", "pin+")

    def __init__(self):
        self.found: Dict[str, List[Tuple[bytes, _Finding]]] = {
            k: [] for k in self.ORDER
        }

    def add(self, what: str, ns: bytes, finding: _Finding) -> None:
        self.found[what].append((ns, finding))

    def kept(self, skip: Set[bytes]) -> List[_Finding]:
        return [f for k in self.ORDER for ns, f in self.found[k] if ns not in skip]


def _scan_index(index: Index, txn) -> _IndexScan:
    """Check every record, description, trie edge, access time, pin and counter; no
    file is read. First in scans of each table in key order (:mod:`.agreement`); if
    they do not agree, in one streaming pass that looks up each node's parent, edge,
    access time and pin and says what is wrong (nothing is held per node).

    Trie edges, access times, pins and counters are compared with the records
    except in namespaces with corrupt records or unusable descriptions (their own
    findings cover them; fixing those comes first).
    """
    descs = namespace_descriptions(index, txn)
    layouts, findings = {}, []
    for ns, desc in descs.items():
        try:
            layouts[ns] = description_layout(desc)
        except ValueError as e:
            findings.append(
                _Finding(
                    _problem("description", ns, detail=str(e)),
                    key=(ns, b""),
                    action="drop",
                )
            )
    scan = _IndexScan(descs, layouts, findings, [])
    agreed = index_agrees(index, txn)
    if agreed is not None and set(agreed.sums) <= set(descs):
        # Healthy tables (the usual case): only the counters are left to compare.
        scan.nodes, scan.namespaces = agreed.nodes, set(agreed.sums)
        skip = {ns for ns in descs if ns not in layouts}
        scan.diffs = _counter_diffs(index, txn, agreed.sums, skip)
        return scan
    counts: Dict[bytes, int] = {}
    sums: Dict[bytes, List[int]] = {}
    skip: Set[bytes] = set()  # namespaces whose records cannot all be compared
    diffs = _Diffs()
    shed = PageShedder(index)
    for ns, h, raw in index.iter_nodes(txn):
        shed.tick()
        scan.nodes += 1
        scan.namespaces.add(ns)
        if len(ns) + len(h) != 2 * HASH_BYTES:
            skip.add(ns)
            detail = f"index key of {len(ns) + len(h)} bytes"
            findings.append(
                _Finding(
                    _problem("record", detail=detail), (ns, h), raw, action="delete_key"
                )
            )
            continue
        counts[ns] = counts.get(ns, 0) + 1
        try:
            rec = NodeRecord.decode(raw)
        except CorruptRecord as e:
            skip.add(ns)
            findings.append(
                _Finding(
                    _problem("record", ns, h, detail=str(e)), (ns, h), raw, "quarantine"
                )
            )
            continue
        finding = _check_record(index, txn, ns, h, rec, raw)
        if finding is not None:
            findings.append(finding)
        _node_diffs(index, txn, ns, h, rec, diffs)
        s = sums.setdefault(ns, [0, 0, 0, 0])
        s[:] = [n + d for n, d in zip(s, rec.counts)]
    for ns in sorted(set(counts) - set(descs)):
        detail = f"{counts[ns]} nodes but no namespace description"
        findings.append(
            _Finding(
                _problem("description", ns, detail=detail), (ns, b""), action="drop"
            )
        )
    skip |= {ns for ns in descs if ns not in layouts}
    skip |= {ns for ns in scan.namespaces if ns not in descs}
    _stale_entries(index, txn, diffs, shed)
    scan.diffs = diffs.kept(skip) + _counter_diffs(index, txn, sums, skip)
    return scan


def _check_record(
    index: Index, txn, ns: bytes, h: bytes, rec: NodeRecord, raw: bytes
) -> Optional[_Finding]:
    """A record that hangs from nothing, starts where its parent does not end, or
    does not carry the id its parent and tokens hash to."""
    if rec.parent == root_hash(ns):
        bad = rec.start != 0 and f"starts at token {rec.start} but hangs from the root"
    else:
        parent_raw = txn.get(ns + rec.parent, db=index.db["nodes"])
        if parent_raw is None and rec.start != 0:
            detail = f"parent {rec.parent.hex()[:12]} is not in the index"
            return _Finding(
                _problem("unreachable", ns, h, detail=detail), (ns, h), raw, "remove"
            )
        if parent_raw is None:
            bad = False  # the first node of a salted tree (kvstore.disk.salts)
        else:
            try:
                end = NodeRecord.decode(bytes(parent_raw)).end
            except CorruptRecord:  # the parent's own finding covers it
                end = rec.start
            bad = (
                end != rec.start
                and f"starts at token {rec.start}, its parent ends at {end}"
            )
    if not bad and chain_hash(rec.parent, rec.tokens) != h:
        bad = "node id does not match its parent and tokens"
    if not bad:
        return None
    return _Finding(_problem("record", ns, h, detail=bad), (ns, h), raw, "quarantine")


def _node_diffs(
    index: Index, txn, ns: bytes, h: bytes, rec: NodeRecord, diffs: _Diffs
) -> None:
    """A node's trie edge, readable access time and pin, where it lacks one."""
    key = ns + h
    edge = child_key(ns, rec.parent, rec.tokens, h)
    if txn.get(edge, db=index.db["children"]) is None:
        detail = "node has no trie edge"
        diffs.add("edge+", ns, _repair(index, "children", edge, b"", ns, h, detail))
    atime = txn.get(key, db=index.db["atime"])
    if atime is None or len(atime) != 8:
        when = struct.pack("<d", rec.created)  # as Index.put_node writes it
        detail = "node has no (readable) access time"
        diffs.add("atime+", ns, _repair(index, "atime", key, when, ns, h, detail))
    if rec.pinned and txn.get(key, db=index.db["pins"]) is None:
        detail = "pinned node missing from the pins table"
        diffs.add("pin+", ns, _repair(index, "pins", key, b"", ns, h, detail))


def _stale_entries(index: Index, txn, diffs: _Diffs, shed: PageShedder) -> None:
    """Trie edges, access times and pins of no node (or not of the node named)."""
    nodes = index.db["nodes"]

    def record(key: bytes) -> Optional[NodeRecord]:
        raw = txn.get(key, db=nodes)
        try:
            return None if raw is None else NodeRecord.decode(bytes(raw))
        except CorruptRecord:
            return None

    for k in txn.cursor(db=index.db["children"]).iternext(values=False):
        shed.tick()
        k = bytes(k)
        ns, h = k[:HASH_BYTES], k[-HASH_BYTES:]
        if txn.get(ns + h, db=nodes) is not None:
            rec = record(ns + h)
            if rec is None or child_key(ns, rec.parent, rec.tokens, h) == k:
                continue  # a corrupt record's edge: its namespace is skipped
        detail = "trie edge without its node"
        diffs.add("edge-", ns, _repair(index, "children", k, None, ns, h, detail))
    for k in txn.cursor(db=index.db["atime"]).iternext(values=False):
        shed.tick()
        k = bytes(k)
        if txn.get(k, db=nodes) is None:
            ns, h = k[:HASH_BYTES], k[HASH_BYTES:]
            detail = "access time of a node not in the index"
            diffs.add("atime-", ns, _repair(index, "atime", k, None, ns, h, detail))
    for k in txn.cursor(db=index.db["pins"]).iternext(values=False):
        shed.tick()
        k = bytes(k)
        rec = record(k)
        if rec is None or not rec.pinned:
            ns, h = k[:HASH_BYTES], k[HASH_BYTES:]
            detail = "pin of an unpinned node or of no node"
            diffs.add("pin-", ns, _repair(index, "pins", k, None, ns, h, detail))


def _counter_diffs(
    index: Index, txn, sums: Dict[bytes, List[int]], skip: Set[bytes]
) -> List[_Finding]:
    """Namespaces whose counters differ from the sums of their records."""
    out = []
    packer = Index.COUNTERS  # the counters' record format, owned by the index
    stored = {bytes(k): bytes(v) for k, v in txn.cursor(db=index.db["counters"])}
    for ns in sorted((set(sums) | set(stored)) - skip):
        want = tuple(sums.get(ns, (0, 0, 0, 0)))
        raw = stored.get(ns)
        have = (
            packer.unpack(raw) if raw is not None and len(raw) == packer.size else None
        )
        if have != want and not (raw is None and want == (0, 0, 0, 0)):
            out.append(
                _Finding(
                    _problem(
                        "counters",
                        ns,
                        detail=f"counters say {have}, the records {want}",
                    ),
                    action="repair",
                    apply=lambda t, ns=ns, want=want: t.put(
                        ns, packer.pack(*want), db=index.db["counters"]
                    ),
                )
            )
    return out


def _repair(
    index: Index,
    db: str,
    key: bytes,
    value: Optional[bytes],
    ns: bytes,
    h: Optional[bytes],
    detail,
) -> _Finding:
    """An index finding whose fix sets ``key`` of ``db`` to ``value`` (None: deletes)."""

    def apply(t, db=db, key=key, value=value):
        if value is None:
            t.delete(key, db=index.db[db])
        else:
            t.put(key, value, db=index.db[db])

    return _Finding(
        _problem("index", ns, h, detail=detail), action="repair", apply=apply
    )


def _check_file(
    blobs: Blobs,
    ns: bytes,
    h: bytes,
    rec: NodeRecord,
    layout: Layout,
    *,
    check_data: bool,
    ahead: Optional[ReadAhead] = None,
    headers: Optional[Dict[tuple, dict]] = None,
) -> Optional[Tuple[str, str]]:
    """``(kind, detail)`` of what is wrong with a node's files, or None (``ahead``:
    the files opened and asked for before; ``headers``: see :func:`_checked_header`)."""
    parts = [(DELTA_PART, rec.nbytes, rec.checksum)]
    if rec.has_state:
        parts.append((STATE_PART, rec.state_nbytes, rec.state_checksum))
    for part, nbytes, checksum in parts:
        what = "state file" if part == STATE_PART else "file"
        fd = ahead.take(ns, h, part) if ahead is not None else None
        try:
            f = os.fdopen(fd if fd is not None else blobs.open_file(ns, h, part), "rb")
        except FileNotFoundError:
            return "missing", f"{what} is missing"
        except NotRegularFile as e:  # never followed nor read: a FIFO would block
            return "missing", f"{what} {e.strerror}: {e.filename}"
        except OSError as e:  # EMFILE, EACCES, EIO...: no evidence the data is bad
            return "unreadable", f"{what} cannot be opened: {e}"
        with f:
            size = os.fstat(f.fileno()).st_size
            if size != nbytes:
                return "size", f"{what} has {size} bytes, the index says {nbytes}"
            if not check_data:
                continue
            try:
                data = f.read(nbytes + 1)
            except OSError as e:
                return "unreadable", f"{what} cannot be read: {e}"
        if len(data) != nbytes:
            return "size", f"{what} has {len(data)} bytes, the index says {nbytes}"
        try:
            meta = _checked_header(data, part, layout, rec, headers)
        except CorruptBlob as e:
            return "header", f"{what}: {e}"
        if not metadata_matches(meta, ns):
            return (
                "namespace",
                f"{what} metadata names namespace {meta.get('namespace')!r}",
            )
        if file_checksum(data) != checksum:
            return "checksum", f"{what}: checksum mismatch"
    return None


def _checked_header(
    data: bytes,
    part: str,
    layout: Layout,
    rec: NodeRecord,
    headers: Optional[Dict[tuple, dict]],
) -> dict:
    """The metadata of a file whose header is checked against its layout.

    Files of as many tokens share their header byte for byte, so a scan checks each
    distinct delta header once: ``headers`` keeps the checked ones' metadata. A state
    file's check reads its data too, so it is never taken from there.

    Raises:
        CorruptBlob: the header is inconsistent or does not fit the layout.
    """
    key = None
    if headers is not None and part == DELTA_PART and len(data) >= 8:
        (hlen,) = struct.unpack_from("<Q", data)
        if hlen <= MAX_HEADER_BYTES:
            key = (data[: 8 + hlen], len(data), rec.ntokens, id(layout))
            meta = headers.get(key)
            if meta is not None:
                return meta
    _, tensors, meta = parse_header(data, len(data))
    if part == STATE_PART:
        layout.decode_state(memoryview(data), tensors, rec.end)
    else:
        check_layout(tensors, layout.delta_tensors(rec.ntokens))
    if key is not None:
        if len(headers) >= _HEADERS_KEPT:
            headers.clear()
        headers[key] = meta
    return meta


def _record_batches(index: Index, *, size: int) -> Iterator[List[Tuple[bytes, bytes]]]:
    """``(key, raw record)`` of every node, ``size`` at a time, each batch read in its
    own short read transaction (a long one would keep writers from reusing pages
    while every file is read)."""
    after = b""

    def read(txn):
        cur = txn.cursor(db=index.db["nodes"])
        out = []
        if cur.set_range(after):
            for k, v in cur:
                out.append((bytes(k), bytes(v)))
                if len(out) >= size:
                    break
        return out

    while True:
        batch = index.read(read)
        index.release_pages()
        if not batch:
            return
        yield batch
        after = batch[-1][0] + b"\0"  # the smallest key after the last one read


def _check_files(
    index: Index, blobs: Blobs, layouts: Mapping[bytes, Layout], *, check_data: bool
) -> Tuple[List[_Finding], int, int]:
    """Check every node file against its record and namespace layout, a batch of
    records at a time.

    Returns the findings still true after a re-read of the index (a node evicted while
    its file was checked is not a problem), the files checked and their bytes.
    """
    with ThreadPoolExecutor(OPENERS, thread_name_prefix="kvstore-open") as pool:
        return _check_files_with(
            index, blobs, layouts, check_data=check_data, openers=Openers(pool)
        )


def _check_files_with(index, blobs, layouts, *, check_data: bool, openers):
    """:func:`_check_files`, the files of each batch opened by ``openers``."""
    findings, checked, nbytes = [], 0, 0
    headers: Dict[tuple, dict] = {}
    for batch in _record_batches(index, size=_FILE_BATCH):
        found, items = [], []
        for key, raw in batch:
            ns, h = key[:HASH_BYTES], key[HASH_BYTES:]
            if len(h) != HASH_BYTES or ns not in layouts:
                continue
            try:
                items.append((ns, h, NodeRecord.decode(raw), raw))
            except CorruptRecord:
                continue
        for i in range(0, len(items), _READ_AHEAD):
            ahead = ReadAhead(blobs, openers) if check_data else None
            try:
                if ahead is not None:
                    ahead.ask([x[:3] for x in items[i : i + _READ_AHEAD]])
                for ns, h, rec, raw in items[i : i + _READ_AHEAD]:
                    bad = _check_file(
                        blobs,
                        ns,
                        h,
                        rec,
                        layouts[ns],
                        check_data=check_data,
                        ahead=ahead,
                        headers=headers,
                    )
                    checked += 1
                    nbytes += rec.total_bytes
                    if bad:
                        problem = _problem(bad[0], ns, h, blobs.path(ns, h), bad[1])
                        action = None if bad[0] == "unreadable" else "quarantine"
                        found.append(_Finding(problem, (ns, h), raw, action))
            finally:
                if ahead is not None:
                    ahead.close()
        if found:

            def still(txn, found=found):
                return [
                    f
                    for f in found
                    if txn.get(f.key[0] + f.key[1], db=index.db["nodes"]) == f.raw
                ]

            findings += index.read(still)
    return findings, checked, nbytes


def scan_files(index: Index, blobs: Blobs, *, now: float) -> List[_Finding]:
    """Orphan chunk files, temp files and files kvstore did not write, under ``blobs/``.

    An orphan is a ``.safetensors`` file no index record names: at a node's path but
    without the node (its finding has the node's key), or at a path no node can have
    (misnamed or misplaced: no key). Files at nodes' paths are looked up a batch at a
    time, as the directory is walked.
    """
    out, candidates = [], []

    def orphans(txn):
        return [
            (key, p)
            for key, p in candidates
            if txn.get(key[0] + key[1], db=index.db["nodes"]) is None
        ]

    def orphan(key: Key, p: str) -> Optional[_Finding]:
        try:
            size = os.lstat(p).st_size
        except FileNotFoundError:  # removed meanwhile: nothing left to report
            return None
        detail = f"{size} bytes, no index entry"
        return _Finding(_problem("orphan", key[0], key[1], p, detail), key)

    found = []
    for kind, p in blobs.iter_files():
        key = blobs.parse_path(p) if kind == "blob" else None
        if key is not None:  # stat only once known to be an orphan (rarely)
            candidates.append((key, p))
            if len(candidates) >= _ORPHAN_BATCH:
                found += index.read(orphans)
                index.release_pages()
                candidates = []
            continue
        try:
            st = os.lstat(p)
        except FileNotFoundError:
            continue
        if kind == "blob":
            detail = f"{st.st_size} bytes, not at the path of any node"
            out.append(_Finding(_problem("orphan", file=p, detail=detail)))
        elif kind == "temp":
            age = max(0.0, now - st.st_mtime)
            detail = f"temp file of {st.st_size} bytes, {age:.0f} s old"
            if not writer_alive(p):
                detail += ", of a writer process that is gone: `kvstore gc` removes it"
            out.append(_Finding(_problem("temp", file=p, detail=detail)))
        else:
            detail = f"not a kvstore file ({st.st_size} bytes)"
            out.append(_Finding(_problem("stray", file=p, detail=detail)))
    if candidates:
        found += index.read(orphans)
    return [f for f in (orphan(key, p) for key, p in found) if f is not None] + out


@dataclass
class Fixed:
    """What a fix (``verify(fix=True)``, ``gc``) removed and repaired."""

    nodes_removed: int = 0
    bytes_removed: int = 0
    index_repairs: int = 0
    skipped: int = 0  # problem nodes changed by another process before the fix
    quarantined: List[str] = field(default_factory=list)
    files_unlinked: int = 0
    unremovable: List[str] = field(default_factory=list)  # "path: why", left there

    def report(self) -> Dict[str, Any]:
        return dict(self.__dict__)


def _fix(index: Index, blobs: Blobs, file_findings: List[_Finding]) -> Fixed:
    """Remove broken nodes (and descendants) and repair the index, then release files.

    File problems found outside the transaction are acted on only if the node's record
    is unchanged; index problems are found again inside the write transaction, until a
    re-scan finds none, so nodes cut off by a removal go too.
    """

    def fix(txn):
        done, gone, quarantine, dropped = Fixed(), {}, {}, set()

        def remove(f: _Finding) -> bool:
            """Act on one finding; False when nothing changed."""
            ns, h = f.key
            if f.action == "drop":
                existed = txn.get(ns, db=index.db["namespaces"]) is not None
                removed = delete_namespace(index, txn, ns)
                if not (existed or removed.nodes):
                    return False
                dropped.add(ns)
                done.nodes_removed += removed.nodes
                done.bytes_removed += removed.delta_bytes
                return True
            if f.action == "delete_key":
                if not txn.delete(ns + h, db=index.db["nodes"]):
                    return False
                done.nodes_removed += 1
                return True
            if (ns, h) in gone:  # already removed with a broken ancestor
                removed = []
            elif txn.get(ns + h, db=index.db["nodes"]) != f.raw:
                done.skipped += 1
                return False
            else:
                removed = delete_subtree(index, txn, ns, h)
                gone[ns, h] = None
            if f.action == "quarantine":
                quarantine[ns, h] = f"{f.problem['kind']}: {f.problem['detail']}"
            for x, rec in removed:
                gone[ns, x] = rec
                done.nodes_removed += 1
                done.bytes_removed += rec.nbytes if rec is not None else 0
            return True

        for f in file_findings:
            remove(f)
        while True:  # until a re-scan finds nothing more (or nothing more can be done)
            scan = _scan_index(index, txn)
            if not any([remove(f) for f in scan.findings]):
                break
        for f in scan.diffs:
            f.apply(txn)
            done.index_repairs += 1
        gone_keys = [k for k in gone if len(k[1]) == HASH_BYTES]
        return done, gone_keys, quarantine, dropped

    done, gone, quarantine, dropped = index.write(fix, frees=True)
    released = release_files(index, blobs, gone, quarantine=quarantine)
    for ns in sorted(dropped):
        more = release_namespace_files(index, blobs, ns)
        released.unlinked += more.unlinked
        released.failed += more.failed
    done.quarantined = released.quarantined
    done.files_unlinked = released.unlinked
    done.unremovable = released.failed
    return done


def verify_open_store(
    index: Index,
    blobs: Blobs,
    *,
    fix: bool,
    check_data: bool,
    walk_files: bool,
    now: float,
) -> Dict[str, Any]:
    """:func:`verify` of an opened store (also run by :func:`~.gc.gc`):
    ``check_data`` reads every file's data, ``walk_files`` lists ``blobs/`` for
    orphan, temp and stray files. Returns :func:`verify`'s report without ``path``."""
    scan = index.read(lambda txn: _scan_index(index, txn))
    findings = scan.findings + scan.diffs
    file_findings, checked, nbytes = _check_files(
        index, blobs, scan.layouts, check_data=check_data
    )
    findings += file_findings
    if walk_files:
        findings += scan_files(index, blobs, now=now)
    problems = [f.problem for f in findings]
    kinds = [p["kind"] for p in problems]
    errors = sum(k not in INFO_KINDS for k in kinds)
    report = {
        "clean": errors == 0,
        "errors": errors,
        "orphans": kinds.count("orphan"),
        "temp_files": kinds.count("temp"),
        "dead_writer_temp_files": sum(
            p["kind"] == "temp" and "writer process that is gone" in p["detail"]
            for p in problems
        ),
        "stray_files": kinds.count("stray"),
        "namespaces": len(set(scan.descriptions) | scan.namespaces),
        "nodes": scan.nodes,
        "files_checked": checked,
        "bytes_checked": nbytes,
        "problems": problems,
        "fixed": None,
    }
    if fix and errors:
        fixable = [f for f in file_findings if f.action is not None]
        report["fixed"] = _fix(index, blobs, fixable).report()
    return report


def verify(path, *, fix: bool = False) -> Dict[str, Any]:
    """Check every index record and chunk file of a store, without loading a model.

    Each node's file must exist, have the recorded size, a valid header whose tensors
    match the namespace's layout for the node's token count, metadata naming the node's
    namespace, and the recorded xxh3-64 checksum (the whole file is read). Records must
    decode, hang from a root (at token 0) or from a node in the index, start where their parent
    ends and carry the id their parent and tokens hash to; trie edges, access times,
    pins and counters must agree with the records. Files in ``blobs/`` that no record
    names are reported too.

    Problem kinds: ``missing``, ``size``, ``header``, ``namespace`` (file of another
    namespace), ``checksum``, ``unreadable`` (a file that cannot be opened or read
    now: permissions, out of descriptors, EIO; reported, never removed by a fix),
    ``record`` (corrupt or inconsistent index record),
    ``unreachable`` (parent not in the index), ``description`` (namespace description
    missing or unusable), ``index`` (edges, access times, pins), ``counters``; and,
    not counted as errors, ``orphan`` (chunk file without a record), ``temp`` (a temp
    file: a write in progress or a crash's leftover) and ``stray`` (not a kvstore file).

    Args:
        path: The store directory.
        fix: Repair what is broken: broken nodes leave the index with their
            descendants (counters follow), broken nodes' files go to the quarantine
            directory and their descendants' files are unlinked; the nodes of a
            namespace without a usable description are dropped; edges, access times,
            pins and counters are rewritten from the records. Orphan and temp files
            are left to :func:`gc`. A damaged index (one that fails the page check
            of :mod:`kvstore.disk.mdbcheck`) is first salvaged into a new one
            (:mod:`.salvage`): the report then has ``salvaged``, and the damage as
            its first problem (kind ``index``).

    Returns:
        ``{"path", "clean", "errors", "orphans", "temp_files",
        "dead_writer_temp_files", "stray_files",
        "namespaces", "nodes", "files_checked", "bytes_checked", "problems", "fixed"}``:
        ``clean`` is
        True when nothing but orphan, temp and stray files was found (before any fix);
        each problem is ``{"kind", "namespace", "node", "file", "detail"}`` (hex ids,
        None where not applicable); ``fixed`` is None, or with ``fix`` and errors,
        ``{"nodes_removed", "bytes_removed", "index_repairs", "skipped", "quarantined",
        "files_unlinked", "unremovable"}`` (``skipped``: problem nodes another process
        changed before the fix, left alone; ``unremovable``: ``"path: why"`` of files
        that could not be unlinked or moved, left in place).

    Raises:
        StoreError: ``path`` is not a kvstore directory.
    """
    path = os.fspath(path)
    # A damaged index is rebuilt first, its node files checked as here.
    salvaged = salvage_if_damaged(path, check_file=_check_file) if fix else None
    with opened(path, readonly=not fix) as (index, blobs):
        report = verify_open_store(
            index, blobs, fix=fix, check_data=True, walk_files=True, now=time.time()
        )
    if salvaged is not None:
        report = with_salvage(report, salvaged)
    return {"path": path, **report}
