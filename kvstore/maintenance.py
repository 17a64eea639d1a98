"""Store maintenance that needs no model: statistics, the prefix tree, verification and
repair, garbage collection, eviction down to a byte budget, pins.

Every public function takes the store directory, opens its index without creating one
(a directory that is not a store raises :class:`~kvstore.index.StoreError`) and closes
it before returning: nothing here keeps an LMDB environment a ``fork()`` could carry
into a child. Namespaces and nodes are named by hex ids or unambiguous prefixes of at
least 8 hex digits.

:class:`kvstore.KVStore` uses the deletion and eviction helpers of this module too, so
their rules live in one place:

* **Delete, then unlink.** Nodes leave the index in one write transaction
  (:func:`delete_subtree`, :func:`evict_to_budget`); their files are unlinked or
  quarantined afterwards inside a second write transaction that re-checks that each node
  is still absent (:func:`release_files`). A node another process re-added in between
  keeps its file; a crash in between leaves orphan files, which :func:`gc` removes.
* **Leaf-first LRU eviction** (:func:`evict_to_budget`): least recently used leaves go
  first (:func:`kvstore.policy.disk_victims`); a parent whose last child went competes
  by its own access time, so no descendant is ever orphaned.
"""

import json
import os
import struct
import time
from collections.abc import Iterable as _IterableABC
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, Iterator, List, Mapping, Optional, Set, Tuple

from .adapters import LayerLayout, expected_tensors
from .blobs import DTYPES, Blobs, CorruptBlob, check_layout, file_checksum, parse_header
from .chunking import HASH_BYTES, chain_hash, root_hash
from .index import CorruptRecord, Index, NodeRecord, StoreError, child_key
from .policy import DiskNode, disk_victims

Key = Tuple[bytes, bytes]  # (namespace, node hash)

DISK_BUDGET_KEY = b"disk_bytes"  # in the meta DB: the last budget a KVStore was opened with

# Findings that are reported but do not make a store unclean: leftovers of crashes and
# of writes in progress, which gc removes (orphans, old temp files) or leaves (strays).
INFO_KINDS = frozenset({"orphan", "temp", "stray"})

_RELEASE_BATCH = 1024  # files unlinked per write transaction (the writer lock is held)
_MIN_PREFIX = 8  # hex digits needed to name a namespace or node by a prefix


# -- opening ---------------------------------------------------------------------------


@contextmanager
def _opened(path) -> Iterator[Tuple[Index, Blobs]]:
    """The store's index (never created here) and chunk files; the index is closed after."""
    path = os.fspath(path)
    index = Index(os.path.join(path, "index"), create=False)
    try:
        blobs = Blobs(os.path.join(path, "blobs"), os.path.join(path, "quarantine"))
        yield index, blobs
    finally:
        index.close()


# -- disk budget -----------------------------------------------------------------------


def write_disk_budget(index: Index, nbytes: Optional[int]) -> None:
    """Record ``nbytes`` as the store's disk budget (None: forget it)."""

    def put(txn):
        if nbytes is None:
            txn.delete(DISK_BUDGET_KEY, db=index.db["meta"])
        else:
            txn.put(DISK_BUDGET_KEY, str(int(nbytes)).encode(), db=index.db["meta"])

    index.write(put)


def read_disk_budget(index: Index, txn=None) -> Optional[int]:
    """The recorded disk budget in bytes, or None when none (or an unreadable one) is."""
    if txn is None:
        return index.read(lambda t: read_disk_budget(index, t))
    raw = txn.get(DISK_BUDGET_KEY, db=index.db["meta"])
    try:
        value = int(raw) if raw is not None else None
    except ValueError:
        return None
    return value if value is None or value >= 0 else None


def disk_budget(path) -> Optional[int]:
    """The disk budget recorded in the store at ``path`` by ``KVStore(disk_bytes=...)``.

    Args:
        path: The store directory.

    Returns:
        The budget in bytes, or None when no budget was recorded.

    Raises:
        StoreError: ``path`` is not a kvstore directory.
    """
    with _opened(path) as (index, _):
        return read_disk_budget(index)


def set_disk_budget(path, nbytes: Optional[int]) -> None:
    """Record (or with None, forget) the disk budget that :func:`gc` enforces by default.

    Args:
        path: The store directory.
        nbytes: The budget in bytes, or None.

    Raises:
        StoreError: ``path`` is not a kvstore directory.
    """
    _check_optional_int("nbytes", nbytes)
    with _opened(path) as (index, _):
        write_disk_budget(index, nbytes)


# -- deleting: index first, files afterwards -------------------------------------------


def delete_subtree(
    index: Index, txn, ns: bytes, h: bytes
) -> List[Tuple[bytes, Optional[NodeRecord]]]:
    """Remove node ``h`` and all its descendants from the index (files are left alone).

    Runs inside a write transaction; counters follow (:meth:`Index.delete_node`).

    Returns:
        ``(hash, record)`` of every node that was in the index (record None for a
        record that did not decode). Pass them to :func:`release_files` afterwards.
    """
    gone, todo, seen = [], [h], set()
    while todo:
        x = todo.pop()
        if x in seen:
            continue
        seen.add(x)
        todo.extend(index.children(ns, x, txn))
        existed = txn.get(ns + x, db=index.db["nodes"]) is not None
        rec = index.delete_node(txn, ns, x)
        if existed:
            gone.append((x, rec))
    return gone


@dataclass
class Released:
    """What :func:`release_files` did."""

    unlinked: int = 0
    bytes: int = 0  # bytes of the unlinked files
    quarantined: List[str] = field(default_factory=list)  # where quarantined files went


def release_files(
    index: Index,
    blobs: Blobs,
    keys: Iterable[Key],
    *,
    quarantine: Optional[Mapping[Key, str]] = None,
) -> Released:
    """Second step of a deletion: unlink (or quarantine) the files of deleted nodes.

    Runs write transactions (holding LMDB's writer lock) that re-check each node is
    still absent from the index, so a node another process re-added meanwhile keeps its
    file.

    Args:
        index: The store's index.
        blobs: The store's chunk files.
        keys: ``(namespace, hash)`` of nodes already deleted from the index.
        quarantine: For the nodes whose file is broken: the reason, and the file is
            moved to the quarantine directory instead of being unlinked.

    Returns:
        Counts of what was unlinked and where quarantined files went.
    """
    keys = list(dict.fromkeys(keys))
    quarantine = quarantine or {}
    out = Released()
    for i in range(0, len(keys), _RELEASE_BATCH):
        batch = keys[i : i + _RELEASE_BATCH]

        def release(txn):
            done = Released()
            for ns, h in batch:
                if txn.get(ns + h, db=index.db["nodes"]) is not None:
                    continue  # re-added meanwhile: the file is its again
                try:
                    size = os.stat(blobs.path(ns, h)).st_size
                except FileNotFoundError:
                    continue
                reason = quarantine.get((ns, h))
                if reason is None:
                    blobs.remove(ns, h)
                    done.unlinked += 1
                    done.bytes += size
                else:
                    where = blobs.quarantine(ns, h, reason)
                    if where:
                        done.quarantined.append(where)
            return done

        done = index.write(release)
        out.unlinked += done.unlinked
        out.bytes += done.bytes
        out.quarantined += done.quarantined
    return out


def _delete_namespace(index: Index, txn, ns: bytes) -> List[Tuple[bytes, Optional[NodeRecord]]]:
    """Remove everything of namespace ``ns`` from the index, in a write transaction.

    Returns ``(hash, record)`` of its nodes (record None where it did not decode).
    """
    gone = []
    for key, raw in _prefixed(txn, index.db["nodes"], ns):
        try:
            rec = NodeRecord.decode(raw)
        except CorruptRecord:
            rec = None
        gone.append((key[len(ns) :], rec))
    for name in ("nodes", "children", "atime", "pins"):
        for key, _ in _prefixed(txn, index.db[name], ns):
            txn.delete(key, db=index.db[name])
    txn.delete(ns, db=index.db["counters"])
    txn.delete(ns, db=index.db["namespaces"])
    return gone


def _prefixed(txn, db, prefix: bytes) -> List[Tuple[bytes, bytes]]:
    cur = txn.cursor(db=db)
    out = []
    if cur.set_range(prefix):
        for k, v in cur:
            if not k.startswith(prefix):
                break
            out.append((bytes(k), bytes(v)))
    return out


# -- eviction --------------------------------------------------------------------------


@dataclass
class Eviction:
    """What :func:`evict_to_budget` did."""

    gone: List[Tuple[Key, NodeRecord]] = field(default_factory=list)  # in eviction order
    excess: int = 0  # bytes still above the budget (what could not be evicted)

    @property
    def nodes(self) -> int:
        return len(self.gone)

    @property
    def bytes(self) -> int:
        return sum(rec.nbytes for _, rec in self.gone)

    @property
    def pinned(self) -> int:
        return sum(rec.pinned for _, rec in self.gone)


def disk_nodes(index: Index, txn) -> Dict[Key, DiskNode]:
    """Every decodable node of the store as eviction sees it."""
    nodes = {}
    for ns, h, raw in index.iter_nodes(txn):
        try:
            rec = NodeRecord.decode(raw)
        except CorruptRecord:
            continue
        nodes[ns, h] = DiskNode(index.atime(txn, ns, h), rec.nbytes, (ns, rec.parent), rec.pinned)
    return nodes


def _pinned_last(nodes: Mapping[Key, DiskNode]) -> Dict[Key, DiskNode]:
    """The same nodes, all evictable, with every pinned node ranked after every other.

    Pinned access times are lifted above the newest unpinned one, so leaf-first LRU
    order takes unpinned leaves (and parents freed by them) first and pinned leaves only
    when nothing else is left, least recently used first among them.
    """
    pinned = [n.atime for n in nodes.values() if n.pinned]
    if not pinned:
        return dict(nodes)
    lift = max(n.atime for n in nodes.values()) - min(pinned) + 1.0
    return {
        k: n._replace(atime=n.atime + lift, pinned=False) if n.pinned else n
        for k, n in nodes.items()
    }


def evict_to_budget(
    index: Index, blobs: Blobs, max_bytes: int, *, pinned_last: bool = False
) -> Eviction:
    """Evict least recently used leaves until the indexed bytes fit ``max_bytes``.

    Each round deletes its victims from the index in one write transaction (re-checking
    that each is still a leaf, and unpinned unless ``pinned_last``), then releases their
    files (:func:`release_files`).

    Args:
        index: The store's index (all namespaces count against the budget).
        blobs: The store's chunk files.
        max_bytes: The budget.
        pinned_last: Evict pinned nodes too, after every unpinned one. Without it
            pinned nodes never go.

    Returns:
        The evicted nodes and how many bytes remain above the budget.
    """
    result = Eviction()
    while True:
        result.excess = max(0, index.total_bytes() - max_bytes)
        if result.excess == 0:
            return result
        nodes = index.read(lambda txn: disk_nodes(index, txn))
        victims = disk_victims(_pinned_last(nodes) if pinned_last else nodes, result.excess)
        if not victims:
            return result

        def evict(txn):
            gone = []
            for ns, h in victims:
                try:
                    rec = index.get_node(ns, h, txn)
                except CorruptRecord:
                    continue
                if (
                    rec is not None
                    and (pinned_last or not rec.pinned)
                    and not index.has_children(txn, ns, h)
                ):
                    index.delete_node(txn, ns, h)
                    gone.append(((ns, h), rec))
            return gone

        gone = index.write(evict)
        release_files(index, blobs, [key for key, _ in gone])
        result.gone += gone
        if not gone:  # another process changed the tree under us: stop here
            return result


# -- namespaces and names --------------------------------------------------------------


def _descriptions(index: Index, txn) -> Dict[bytes, Any]:
    """Namespace descriptions by id: the parsed JSON, or a string saying why it is unusable."""
    out = {}
    for k, v in txn.cursor(db=index.db["namespaces"]):
        try:
            desc = json.loads(bytes(v))
            if not isinstance(desc, dict):
                desc = "description is not a JSON object"
        except (ValueError, UnicodeDecodeError) as e:
            desc = f"description is not JSON: {str(e)[:80]}"
        out[bytes(k)] = desc
    return out


def _layout(desc: Any) -> List[LayerLayout]:
    """The cache layout a namespace description records; ValueError when unusable."""
    if isinstance(desc, str):
        raise ValueError(desc)
    layers = desc.get("layout") if isinstance(desc, dict) else None
    if not isinstance(layers, list) or not layers:
        raise ValueError("description has no cache layout")
    out = []
    for i, d in enumerate(layers):
        try:
            lay = LayerLayout(**d)
        except TypeError:
            raise ValueError(f"layout of layer {i} is malformed") from None
        dims = (lay.heads, lay.k_dim, lay.v_dim)
        if lay.dtype not in DTYPES or not all(isinstance(x, int) and x > 0 for x in dims):
            raise ValueError(f"layout of layer {i} is malformed")
        out.append(lay)
    return out


def _known_namespaces(index: Index, txn) -> Set[bytes]:
    """Namespaces with a description, counters or nodes (one cursor seek per namespace)."""
    out = {bytes(k) for k, _ in txn.cursor(db=index.db["namespaces"])}
    out |= {bytes(k) for k, _ in txn.cursor(db=index.db["counters"])}
    cur = txn.cursor(db=index.db["nodes"])
    found = cur.first()
    while found:
        ns = bytes(cur.key())[:HASH_BYTES]
        out.add(ns)
        after = _successor(ns)
        found = after is not None and cur.set_range(after)
    return {ns for ns in out if len(ns) == HASH_BYTES}  # a shorter key names no namespace


def _successor(prefix: bytes) -> Optional[bytes]:
    """The smallest key after every key starting with ``prefix``, None if there is none."""
    n = int.from_bytes(prefix, "big") + 1
    return None if n >> (8 * len(prefix)) else n.to_bytes(len(prefix), "big")


def _hex_spec(spec, what: str) -> str:
    if isinstance(spec, (bytes, bytearray)):
        return bytes(spec).hex()
    if not isinstance(spec, str):
        raise TypeError(f"{what} must be a hex string, got {type(spec).__name__}")
    s = spec.strip().lower()
    if not _MIN_PREFIX <= len(s) <= 2 * HASH_BYTES or any(c not in "0123456789abcdef" for c in s):
        raise ValueError(f"{what} {spec!r}: expected {_MIN_PREFIX} to 32 hex digits of an id")
    return s


def _resolve_namespace(known: Iterable[bytes], spec) -> bytes:
    s = _hex_spec(spec, "namespace")
    matches = sorted(ns for ns in known if ns.hex().startswith(s))
    if not matches:
        raise ValueError(f"no namespace {s} in this store")
    if len(matches) > 1:
        raise ValueError(f"namespace {s} is ambiguous: {', '.join(m.hex() for m in matches)}")
    return matches[0]


def _resolve_node(index: Index, txn, ns: bytes, spec) -> bytes:
    s = _hex_spec(spec, "node")
    start = ns + bytes.fromhex(s[: len(s) // 2 * 2])
    matches = []
    for key, _ in _prefixed(txn, index.db["nodes"], start):
        h = key[len(ns) :]
        if h.hex().startswith(s):
            matches.append(h)
            if len(matches) > 1:
                raise ValueError(f"node {s} is ambiguous in namespace {ns.hex()}")
    if not matches:
        raise ValueError(f"no node {s} in namespace {ns.hex()}")
    return matches[0]


# -- stats -----------------------------------------------------------------------------


def _file_sizes(blobs: Blobs) -> Dict[str, Any]:
    """Walk the chunk files: bytes per namespace, temp and other files."""
    out = {"per_namespace": {}, "files": 0, "file_bytes": 0}
    out.update(temp_files=0, temp_bytes=0, other_files=0, other_bytes=0)
    for kind, p in blobs.iter_files():
        try:
            size = os.stat(p).st_size
        except FileNotFoundError:
            continue
        key = blobs.parse_path(p) if kind == "blob" else None
        if key is not None:
            files, nbytes = out["per_namespace"].get(key[0], (0, 0))
            out["per_namespace"][key[0]] = (files + 1, nbytes + size)
            out["files"] += 1
            out["file_bytes"] += size
        elif kind == "temp":
            out["temp_files"] += 1
            out["temp_bytes"] += size
        else:
            out["other_files"] += 1
            out["other_bytes"] += size
    return out


def _dir_size(path: str) -> Tuple[int, int]:
    files = nbytes = 0
    for dirpath, _, names in os.walk(path):
        for name in names:
            try:
                nbytes += os.stat(os.path.join(dirpath, name)).st_size
                files += 1
            except FileNotFoundError:
                pass
    return files, nbytes


def _bytes_per_token(layout: List[LayerLayout]) -> int:
    return sum(lay.heads * (lay.k_dim + lay.v_dim) * DTYPES[lay.dtype][1] for lay in layout)


def store_stats(path) -> Dict[str, Any]:
    """Counts for a store directory, per namespace and in total, without loading a model.

    Args:
        path: The store directory.

    Returns:
        ``{"path", "format_version", "created", "disk_budget", "bytes_on_disk",
        "file_bytes", "namespaces": [...], "totals": {...}}``: ``bytes_on_disk`` is
        the chunk files' bytes by the index's counters, ``file_bytes`` as found by
        walking ``blobs/``. Each namespace entry holds ``id`` (hex), ``model_type``,
        ``chunk_tokens``, ``layers``, ``dtype``, ``bytes_per_token``, ``tokenizer``
        (whether a vocabulary is part of the namespace), ``nodes``, ``tokens``,
        ``bytes``, ``pinned_bytes`` (from the index's counters), ``prompts`` (leaf
        nodes), ``pinned_nodes``, ``corrupt_records``, ``oldest`` / ``newest``
        (creation times), ``last_access``, ``files`` / ``file_bytes`` (found on disk).
        Totals add ``bytes`` (counters) next to ``file_bytes`` (walked), temp and other
        files, the index file and the quarantine directory. Times are Unix seconds.

    Raises:
        StoreError: ``path`` is not a kvstore directory.
    """
    path = os.fspath(path)
    with _opened(path) as (index, blobs):

        def scan(txn):
            meta = index.db["meta"]
            created = txn.get(b"created", db=meta)
            head = {
                "path": path,
                "format_version": int(txn.get(b"format_version", db=meta)),
                "created": float(created) if created is not None else None,
                "disk_budget": read_disk_budget(index, txn),
            }
            descs = _descriptions(index, txn)
            per: Dict[bytes, Dict[str, Any]] = {}
            keys, parents = [], set()
            for ns, h, raw in index.iter_nodes(txn):
                acc = per.setdefault(ns, _new_acc())
                try:
                    rec = NodeRecord.decode(raw)
                except CorruptRecord:
                    acc["corrupt_records"] += 1
                    continue
                keys.append((ns, h))
                parents.add((ns, rec.parent))
                acc["pinned_nodes"] += rec.pinned
                acc["created"].append(rec.created)
                atime = index.atime(txn, ns, h)
                acc["last_access"] = max(acc["last_access"] or atime, atime)
            for key in keys:
                per[key[0]]["prompts"] += key not in parents
            counters = {ns: index.counters(ns, txn) for ns in _known_namespaces(index, txn)}
            return head, descs, per, counters

        head, descs, per, counters = index.read(scan)
        files = _file_sizes(blobs)
        index_bytes = os.path.getsize(os.path.join(path, "index", "data.mdb"))
        q_files, q_bytes = _dir_size(blobs.quarantine_dir)

    namespaces = []
    for ns in sorted(set(counters) | set(descs)):
        desc = descs.get(ns)
        desc = desc if isinstance(desc, dict) else {}
        try:
            layout = _layout(desc)
        except ValueError:
            layout = None
        acc = per.get(ns, _new_acc())
        nodes, tokens, nbytes, pinned = counters.get(ns, (0, 0, 0, 0))
        nfiles, fbytes = files["per_namespace"].get(ns, (0, 0))
        namespaces.append(
            {
                "id": ns.hex(),
                "model_type": desc.get("model_type"),
                "chunk_tokens": desc.get("chunk_tokens"),
                "layers": len(layout) if layout else None,
                "dtype": ",".join(sorted({lay.dtype for lay in layout})) if layout else None,
                "bytes_per_token": _bytes_per_token(layout) if layout else None,
                "tokenizer": desc.get("vocab") is not None,
                "nodes": nodes,
                "prompts": acc["prompts"],
                "tokens": tokens,
                "bytes": nbytes,
                "pinned_bytes": pinned,
                "pinned_nodes": acc["pinned_nodes"],
                "corrupt_records": acc["corrupt_records"],
                "oldest": min(acc["created"]) if acc["created"] else None,
                "newest": max(acc["created"]) if acc["created"] else None,
                "last_access": acc["last_access"],
                "files": nfiles,
                "file_bytes": fbytes,
            }
        )
    totals = {
        key: sum(n[key] for n in namespaces)
        for key in ("nodes", "prompts", "tokens", "bytes", "pinned_bytes", "corrupt_records")
    }
    totals.update(
        namespaces=len(namespaces),
        files=files["files"],
        file_bytes=files["file_bytes"],
        temp_files=files["temp_files"],
        temp_bytes=files["temp_bytes"],
        other_files=files["other_files"],
        other_bytes=files["other_bytes"],
        index_bytes=index_bytes,
        quarantine_files=q_files,
        quarantine_bytes=q_bytes,
    )
    return {
        **head,
        "bytes_on_disk": totals["bytes"],  # chunk files, by the index's counters
        "file_bytes": totals["file_bytes"],  # chunk files found on disk
        "namespaces": namespaces,
        "totals": totals,
    }


def _new_acc() -> Dict[str, Any]:
    return {
        "prompts": 0,
        "pinned_nodes": 0,
        "corrupt_records": 0,
        "created": [],
        "last_access": None,
    }


# -- the tree --------------------------------------------------------------------------


def list_tree(path, *, namespace=None, max_depth: int = 4, max_children: int = 20) -> List[dict]:
    """The stored prefixes of each namespace as a tree, limited in depth and fan-out.

    Args:
        path: The store directory.
        namespace: Only this namespace (hex id or a prefix of at least 8 hex digits).
        max_depth: Levels of nodes shown below each namespace (0: none).
        max_children: Children shown per node; the rest are counted in ``more``.

    Returns:
        One entry per namespace: ``{"namespace", "model_type", "nodes", "children",
        "more"}``. Each node is ``{"id" (32 hex digits), "short" (first 12), "tokens"
        (count), "start", "first_tokens" (first 16 token ids), "kind", "pinned",
        "last_use" (Unix seconds), "nbytes", "error", "children", "more"}``; ``more`` is
        the number of children not shown (by ``max_children``, or all of them at
        ``max_depth``), 0 when nothing is hidden. A node whose index record is corrupt
        has ``error`` set and None in the record's fields. Children come in the trie's
        order: by their token ids.

    Raises:
        StoreError: ``path`` is not a kvstore directory.
        ValueError: ``namespace`` names no namespace of the store, or several.
    """
    _check_int("max_depth", max_depth, minimum=0)
    _check_int("max_children", max_children, minimum=0)
    with _opened(path) as (index, _):

        def kids(txn, ns: bytes, parent: bytes, depth: int) -> Tuple[List[dict], int]:
            hashes = index.children(ns, parent, txn)
            if depth > max_depth:
                return [], len(hashes)
            shown = []
            for h in hashes[:max_children]:
                node = _tree_node(index, txn, ns, h)
                if node is not None:
                    node["children"], node["more"] = kids(txn, ns, h, depth + 1)
                    shown.append(node)
            return shown, len(hashes) - len(hashes[:max_children])

        def build(txn):
            known = _known_namespaces(index, txn)
            spaces = [_resolve_namespace(known, namespace)] if namespace is not None else known
            descs = _descriptions(index, txn)
            out = []
            for ns in sorted(spaces):
                desc = descs.get(ns)
                children, more = kids(txn, ns, root_hash(ns), 1)
                out.append(
                    {
                        "namespace": ns.hex(),
                        "model_type": desc.get("model_type") if isinstance(desc, dict) else None,
                        "nodes": index.counters(ns, txn)[0],
                        "children": children,
                        "more": more,
                    }
                )
            return out

        return index.read(build)


def _tree_node(index: Index, txn, ns: bytes, h: bytes) -> Optional[dict]:
    node = {"id": h.hex(), "short": h.hex()[:12], "error": None}
    try:
        rec = index.get_node(ns, h, txn)
    except CorruptRecord as e:
        fields = ("tokens", "start", "first_tokens", "kind", "pinned", "last_use", "nbytes")
        return {**node, **dict.fromkeys(fields), "error": str(e)}
    if rec is None:  # an edge left without its node: verify reports it
        return None
    return {
        **node,
        "tokens": rec.ntokens,
        "start": rec.start,
        "first_tokens": rec.tokens[:16].tolist(),
        "kind": rec.kind,
        "pinned": rec.pinned,
        "last_use": index.atime(txn, ns, h),
        "nbytes": rec.nbytes,
    }


# -- verify ----------------------------------------------------------------------------


@dataclass
class _Finding:
    """One problem, and what fixing it takes."""

    problem: Dict[str, Any]
    key: Optional[Key] = None  # the node concerned
    raw: Optional[bytes] = None  # its record when found: a fix acts only if it is unchanged
    action: Optional[str] = None  # "quarantine", "remove", "drop", "delete_key", "repair"
    apply: Optional[Callable[[Any], None]] = None  # for "repair": run in a write transaction


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
    descriptions: Dict[bytes, Any]
    layouts: Dict[bytes, List[LayerLayout]]
    nodes: Dict[Key, Tuple[bytes, Optional[NodeRecord]]]  # raw record, decoded (None: corrupt)
    findings: List[_Finding]


def _scan_index(index: Index, txn) -> _IndexScan:
    """Check every record and description; no file is read."""
    descs = _descriptions(index, txn)
    layouts, findings = {}, []
    for ns, desc in descs.items():
        try:
            layouts[ns] = _layout(desc)
        except ValueError as e:
            findings.append(
                _Finding(_problem("description", ns, detail=str(e)), key=(ns, b""), action="drop")
            )
    nodes: Dict[Key, Tuple[bytes, Optional[NodeRecord]]] = {}
    for ns, h, raw in index.iter_nodes(txn):
        if len(ns) + len(h) != 2 * HASH_BYTES:
            nodes[ns, h] = (raw, None)
            detail = f"index key of {len(ns) + len(h)} bytes"
            findings.append(
                _Finding(_problem("record", detail=detail), (ns, h), raw, action="delete_key")
            )
            continue
        try:
            nodes[ns, h] = (raw, NodeRecord.decode(raw))
        except CorruptRecord as e:
            nodes[ns, h] = (raw, None)
            findings.append(
                _Finding(_problem("record", ns, h, detail=str(e)), (ns, h), raw, "quarantine")
            )
    counts: Dict[bytes, int] = {}
    for (ns, h), (raw, rec) in nodes.items():
        if len(ns) + len(h) == 2 * HASH_BYTES:  # a malformed key is no namespace's
            counts[ns] = counts.get(ns, 0) + 1
        if rec is None:
            continue
        parent = nodes.get((ns, rec.parent))
        if rec.parent == root_hash(ns):
            bad = rec.start != 0 and f"starts at token {rec.start} but hangs from the root"
        elif parent is None:
            detail = f"parent {rec.parent.hex()[:12]} is not in the index"
            findings.append(
                _Finding(_problem("unreachable", ns, h, detail=detail), (ns, h), raw, "remove")
            )
            continue
        else:
            end = parent[1].end if parent[1] is not None else rec.start
            bad = end != rec.start and f"starts at token {rec.start}, its parent ends at {end}"
        if not bad and chain_hash(rec.parent, rec.tokens) != h:
            bad = "node id does not match its parent and tokens"
        if bad:
            findings.append(
                _Finding(_problem("record", ns, h, detail=bad), (ns, h), raw, "quarantine")
            )
    for ns in sorted(set(counts) - set(descs)):
        detail = f"{counts[ns]} nodes but no namespace description"
        findings.append(
            _Finding(_problem("description", ns, detail=detail), (ns, b""), action="drop")
        )
    return _IndexScan(descs, layouts, nodes, findings)


def _index_diffs(index: Index, txn, scan: _IndexScan) -> List[_Finding]:
    """Where trie edges, access times, pins and counters disagree with the node records.

    Namespaces with corrupt records or unusable descriptions are left out of the
    comparison (their own findings cover them; fixing those comes first).
    """
    skip = {ns for (ns, _), (_, rec) in scan.nodes.items() if rec is None}
    skip |= {ns for ns in scan.descriptions if ns not in scan.layouts}
    skip |= {ns for ns, _ in scan.nodes if ns not in scan.descriptions}
    good = {k: rec for k, (_, rec) in scan.nodes.items() if rec is not None and k[0] not in skip}
    raw_keys = {ns + h for ns, h in scan.nodes}
    out: List[_Finding] = []

    def diff(db: str, key: bytes, value: Optional[bytes], ns: bytes, h: Optional[bytes], detail):
        def apply(t, db=db, key=key, value=value):
            if value is None:
                t.delete(key, db=index.db[db])
            else:
                t.put(key, value, db=index.db[db])

        out.append(_Finding(_problem("index", ns, h, detail=detail), action="repair", apply=apply))

    edges = {child_key(ns, rec.parent, rec.tokens, h): (ns, h) for (ns, h), rec in good.items()}
    seen = set()
    for k, _ in txn.cursor(db=index.db["children"]):
        k = bytes(k)
        ns = k[:HASH_BYTES]
        if k in edges:
            seen.add(k)
        elif ns not in skip:
            diff("children", k, None, ns, k[-HASH_BYTES:], "trie edge without its node")
    for k in edges.keys() - seen:
        ns, h = edges[k]
        diff("children", k, b"", ns, h, "node has no trie edge")
    with_atime = set()
    for k, v in txn.cursor(db=index.db["atime"]):
        k = bytes(k)
        ns, h = k[:HASH_BYTES], k[HASH_BYTES:]
        if k not in raw_keys and ns not in skip:
            diff("atime", k, None, ns, h, "access time of a node not in the index")
        elif len(v) == 8:
            with_atime.add(k)
    for (ns, h), rec in good.items():
        if ns + h not in with_atime:
            when = struct.pack("<d", rec.created)  # as Index.put_node writes it
            diff("atime", ns + h, when, ns, h, "node has no (readable) access time")
    pinned = set()
    for k, _ in txn.cursor(db=index.db["pins"]):
        k = bytes(k)
        ns, h = k[:HASH_BYTES], k[HASH_BYTES:]
        rec = good.get((ns, h))
        if rec is not None and rec.pinned:
            pinned.add(k)
        elif ns not in skip:
            diff("pins", k, None, ns, h, "pin of an unpinned node or of no node")
    for (ns, h), rec in good.items():
        if rec.pinned and ns + h not in pinned:
            diff("pins", ns + h, b"", ns, h, "pinned node missing from the pins table")
    sums: Dict[bytes, List[int]] = {}
    for (ns, _), rec in good.items():
        s = sums.setdefault(ns, [0, 0, 0, 0])
        s[0] += 1
        s[1] += rec.ntokens
        s[2] += rec.nbytes
        s[3] += rec.nbytes * rec.pinned
    packer = Index._COUNTERS  # the counters' record format, owned by the index
    stored = {bytes(k): bytes(v) for k, v in txn.cursor(db=index.db["counters"])}
    for ns in sorted((set(sums) | set(stored)) - skip):
        want = tuple(sums.get(ns, (0, 0, 0, 0)))
        raw = stored.get(ns)
        have = packer.unpack(raw) if raw is not None and len(raw) == packer.size else None
        if have != want and not (raw is None and want == (0, 0, 0, 0)):
            out.append(
                _Finding(
                    _problem("counters", ns, detail=f"counters say {have}, the records {want}"),
                    action="repair",
                    apply=lambda t, ns=ns, want=want: t.put(
                        ns, packer.pack(*want), db=index.db["counters"]
                    ),
                )
            )
    return out


def _file_marker() -> str:
    from .store import _MARKER  # late: the store imports this module

    return _MARKER


def _check_file(
    blobs: Blobs,
    ns: bytes,
    h: bytes,
    rec: NodeRecord,
    expected: Mapping[str, Tuple[str, Tuple]],
    *,
    check_data: bool,
) -> Optional[Tuple[str, str]]:
    """``(kind, detail)`` of what is wrong with a node's file, or None."""
    path = blobs.path(ns, h)
    try:
        size = os.stat(path).st_size
    except FileNotFoundError:
        return "missing", "file is missing"
    if size != rec.nbytes:
        return "size", f"file has {size} bytes, the index says {rec.nbytes}"
    if not check_data:
        return None
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        return "missing", f"file cannot be read: {e}"
    if len(data) != rec.nbytes:
        return "size", f"file has {len(data)} bytes, the index says {rec.nbytes}"
    try:
        _, tensors, meta = parse_header(data, len(data))
        check_layout(tensors, expected)
    except CorruptBlob as e:
        return "header", str(e)
    if meta.get("format") != _file_marker() or meta.get("namespace") != ns.hex():
        return "namespace", f"file metadata names namespace {meta.get('namespace')!r}"
    if file_checksum(data) != rec.checksum:
        return "checksum", "checksum mismatch"
    return None


def _check_files(
    index: Index, blobs: Blobs, scan: _IndexScan, *, check_data: bool
) -> Tuple[List[_Finding], int, int]:
    """Check every node file against its record and namespace layout.

    Returns the findings still true after a re-read of the index (a node evicted while
    its file was checked is not a problem), the files checked and their bytes.
    """
    findings, expected, checked, nbytes = [], {}, 0, 0
    for (ns, h), (raw, rec) in scan.nodes.items():
        if rec is None or ns not in scan.layouts:
            continue
        exp = expected.get((ns, rec.ntokens))
        if exp is None:
            exp = expected[ns, rec.ntokens] = expected_tensors(scan.layouts[ns], rec.ntokens)
        bad = _check_file(blobs, ns, h, rec, exp, check_data=check_data)
        checked += 1
        nbytes += rec.nbytes
        if bad:
            problem = _problem(bad[0], ns, h, blobs.path(ns, h), bad[1])
            findings.append(_Finding(problem, (ns, h), raw, "quarantine"))

    def still(txn):
        return [f for f in findings if txn.get(f.key[0] + f.key[1], db=index.db["nodes"]) == f.raw]

    return (index.read(still) if findings else []), checked, nbytes


def _scan_files(index: Index, blobs: Blobs, *, now: float) -> List[_Finding]:
    """Orphan chunk files, temp files and files kvstore did not write, under ``blobs/``.

    An orphan is a ``.safetensors`` file no index record names: at a node's path but
    without the node (its finding has the node's key), or at a path no node can have
    (misnamed or misplaced: no key).
    """
    out, candidates = [], []
    for kind, p in blobs.iter_files():
        try:
            st = os.stat(p)
        except FileNotFoundError:
            continue
        key = blobs.parse_path(p) if kind == "blob" else None
        if key is not None:
            candidates.append((key, p, st.st_size))
        elif kind == "blob":
            detail = f"{st.st_size} bytes, not at the path of any node"
            out.append(_Finding(_problem("orphan", file=p, detail=detail)))
        elif kind == "temp":
            age = max(0.0, now - st.st_mtime)
            detail = f"temp file of {st.st_size} bytes, {age:.0f} s old"
            out.append(_Finding(_problem("temp", file=p, detail=detail)))
        else:
            detail = f"not a kvstore file ({st.st_size} bytes)"
            out.append(_Finding(_problem("stray", file=p, detail=detail)))

    def orphans(txn):
        return [
            _Finding(_problem("orphan", ns, h, p, f"{size} bytes, no index entry"), (ns, h))
            for (ns, h), p, size in candidates
            if txn.get(ns + h, db=index.db["nodes"]) is None
        ]

    return index.read(orphans) + out


@dataclass
class _Fixed:
    nodes_removed: int = 0
    bytes_removed: int = 0
    index_repairs: int = 0
    skipped: int = 0  # problem nodes changed by another process before the fix
    quarantined: List[str] = field(default_factory=list)
    files_unlinked: int = 0

    def report(self) -> Dict[str, Any]:
        return dict(self.__dict__)


def _fix(index: Index, blobs: Blobs, file_findings: List[_Finding]) -> _Fixed:
    """Remove broken nodes (and descendants) and repair the index, then release files.

    File problems found outside the transaction are acted on only if the node's record
    is unchanged; index problems are found again inside the write transaction, until a
    re-scan finds none, so nodes cut off by a removal go too.
    """

    def fix(txn):
        done, gone, quarantine = _Fixed(), {}, {}

        def remove(f: _Finding) -> bool:
            """Act on one finding; False when nothing changed."""
            ns, h = f.key
            if f.action == "drop":
                existed = txn.get(ns, db=index.db["namespaces"]) is not None
                removed = _delete_namespace(index, txn, ns)
                if not (existed or removed):
                    return False
            elif f.action == "delete_key":
                if not txn.delete(ns + h, db=index.db["nodes"]):
                    return False
                done.nodes_removed += 1
                return True
            elif (ns, h) in gone:  # already removed with a broken ancestor
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
        for f in _index_diffs(index, txn, scan):
            f.apply(txn)
            done.index_repairs += 1
        return done, [k for k in gone if len(k[1]) == HASH_BYTES], quarantine

    done, gone, quarantine = index.write(fix)
    released = release_files(index, blobs, gone, quarantine=quarantine)
    done.quarantined = released.quarantined
    done.files_unlinked = released.unlinked
    return done


def _verify(
    index: Index, blobs: Blobs, *, fix: bool, check_data: bool, walk_files: bool, now: float
) -> Dict[str, Any]:
    def index_scan(txn):
        scan = _scan_index(index, txn)
        return scan, scan.findings + _index_diffs(index, txn, scan)

    scan, findings = index.read(index_scan)
    file_findings, checked, nbytes = _check_files(index, blobs, scan, check_data=check_data)
    findings += file_findings
    if walk_files:
        findings += _scan_files(index, blobs, now=now)
    problems = [f.problem for f in findings]
    kinds = [p["kind"] for p in problems]
    errors = sum(k not in INFO_KINDS for k in kinds)
    report = {
        "clean": errors == 0,
        "errors": errors,
        "orphans": kinds.count("orphan"),
        "temp_files": kinds.count("temp"),
        "stray_files": kinds.count("stray"),
        "namespaces": len(set(scan.descriptions) | {ns for ns, _ in scan.nodes}),
        "nodes": len(scan.nodes),
        "files_checked": checked,
        "bytes_checked": nbytes,
        "problems": problems,
        "fixed": None,
    }
    if fix and errors:
        report["fixed"] = _fix(index, blobs, file_findings).report()
    return report


def verify(path, *, fix: bool = False) -> Dict[str, Any]:
    """Check every index record and chunk file of a store, without loading a model.

    Each node's file must exist, have the recorded size, a valid header whose tensors
    match the namespace's layout for the node's token count, metadata naming the node's
    namespace, and the recorded xxh3-64 checksum (the whole file is read). Records must
    decode, hang from the root or from a node in the index, start where their parent
    ends and carry the id their parent and tokens hash to; trie edges, access times,
    pins and counters must agree with the records. Files in ``blobs/`` that no record
    names are reported too.

    Problem kinds: ``missing``, ``size``, ``header``, ``namespace`` (file of another
    namespace), ``checksum``, ``record`` (corrupt or inconsistent index record),
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
            are left to :func:`gc`.

    Returns:
        ``{"path", "clean", "errors", "orphans", "temp_files", "stray_files",
        "namespaces", "nodes", "files_checked", "bytes_checked", "problems", "fixed"}``:
        ``clean`` is
        True when nothing but orphan, temp and stray files was found (before any fix);
        each problem is ``{"kind", "namespace", "node", "file", "detail"}`` (hex ids,
        None where not applicable); ``fixed`` is None, or with ``fix`` and errors,
        ``{"nodes_removed", "bytes_removed", "index_repairs", "skipped", "quarantined",
        "files_unlinked"}`` (``skipped``: problem nodes another process changed before
        the fix, left alone).

    Raises:
        StoreError: ``path`` is not a kvstore directory.
    """
    path = os.fspath(path)
    with _opened(path) as (index, blobs):
        report = _verify(index, blobs, fix=fix, check_data=True, walk_files=True, now=time.time())
    return {"path": path, **report}


# -- gc --------------------------------------------------------------------------------


def gc(
    path,
    *,
    max_bytes: Optional[int] = None,
    drop_namespaces: Iterable = (),
    keep_namespaces: Optional[Iterable] = None,
    temp_age_seconds: float = 3600,
    now: Optional[float] = None,
    check_data: bool = True,
) -> Dict[str, Any]:
    """Collect garbage and shrink a store, without loading a model.

    In order: drops whole namespaces; removes broken nodes as ``verify(fix=True)``
    does; evicts down to the budget, least recently used unpinned leaves first
    (leaf-first) and only if that is not enough, pinned leaves too (least recently used
    first); finally unlinks orphan chunk files and temp files older than
    ``temp_age_seconds``. Every deletion leaves the index first and unlinks the file
    afterwards, re-checking the index under the writer lock.

    Args:
        path: The store directory.
        max_bytes: Budget for the indexed chunk files; None: the budget recorded by
            ``KVStore(disk_bytes=...)`` (:func:`disk_budget`), or no eviction if none.
        drop_namespaces: Namespaces to remove entirely (nodes, files, pins, counters,
            description): hex ids or prefixes of at least 8 hex digits.
        keep_namespaces: If given, every namespace not named here is dropped too.
        temp_age_seconds: Temp files younger than this may be writes in progress and
            are kept.
        now: The current time (Unix seconds) for temp file ages; default ``time.time()``.
        check_data: Read and checksum every file to find broken nodes; False checks
            only that files exist with the recorded size.

    Returns:
        ``path`` and counts of what went: ``namespaces_dropped`` (hex ids), ``dropped_nodes``,
        ``dropped_bytes``, ``broken_nodes``, ``broken_bytes``, ``problems`` (the errors
        found, as in :func:`verify`), ``quarantined``, ``index_repairs``, ``budget``,
        ``evicted_nodes``, ``evicted_bytes``, ``evicted_pinned``, ``over_budget``
        (bytes still above the budget), ``orphans_removed``, ``orphan_bytes``,
        ``temp_removed``, ``temp_bytes``, ``temp_kept``, ``bytes_before`` /
        ``bytes_after`` (indexed bytes) and ``bytes_freed`` (the recorded sizes of the
        dropped, broken and evicted nodes plus the orphan and temp files unlinked).

    Raises:
        StoreError: ``path`` is not a kvstore directory.
        ValueError: a namespace is unknown or ambiguous, or named both to drop and to
            keep; bad budgets or ages.
    """
    _check_optional_int("max_bytes", max_bytes)
    if isinstance(temp_age_seconds, bool) or not isinstance(temp_age_seconds, (int, float)):
        raise TypeError(f"temp_age_seconds must be a number, got {temp_age_seconds!r}")
    if temp_age_seconds < 0:
        raise ValueError(f"temp_age_seconds must be >= 0, got {temp_age_seconds}")
    drop_specs = _spec_list("drop_namespaces", drop_namespaces)
    keep_specs = None if keep_namespaces is None else _spec_list("keep_namespaces", keep_namespaces)
    now = time.time() if now is None else now
    path = os.fspath(path)
    with _opened(path) as (index, blobs):
        report: Dict[str, Any] = {"path": path, "bytes_before": index.total_bytes()}

        # 1. Whole namespaces.
        known = index.read(lambda txn: _known_namespaces(index, txn))
        drop = {_resolve_namespace(known, s) for s in drop_specs}
        if keep_specs is not None:
            keep = {_resolve_namespace(known, s) for s in keep_specs}
            if drop & keep:
                both = ", ".join(sorted(ns.hex() for ns in drop & keep))
                raise ValueError(f"namespaces named both to drop and to keep: {both}")
            drop |= known - keep
        dropped_nodes = dropped_bytes = 0
        for ns in sorted(drop):
            gone = index.write(lambda txn, ns=ns: _delete_namespace(index, txn, ns))
            dropped_nodes += len(gone)
            dropped_bytes += sum(rec.nbytes for _, rec in gone if rec is not None)
            release_files(index, blobs, [(ns, h) for h, _ in gone if len(h) == HASH_BYTES])
        report.update(
            namespaces_dropped=sorted(ns.hex() for ns in drop),
            dropped_nodes=dropped_nodes,
            dropped_bytes=dropped_bytes,
        )

        # 2. Broken nodes.
        checked = _verify(index, blobs, fix=True, check_data=check_data, walk_files=False, now=now)
        fixed = checked["fixed"] or _Fixed().report()
        report.update(
            problems=checked["problems"],
            broken_nodes=fixed["nodes_removed"],
            broken_bytes=fixed["bytes_removed"],
            quarantined=fixed["quarantined"],
            index_repairs=fixed["index_repairs"],
        )

        # 3. The budget: unpinned leaves first, pinned only when nothing else is left.
        budget = max_bytes if max_bytes is not None else read_disk_budget(index)
        evicted = (
            evict_to_budget(index, blobs, budget, pinned_last=True)
            if budget is not None
            else Eviction()
        )
        report.update(
            budget=budget,
            evicted_nodes=evicted.nodes,
            evicted_bytes=evicted.bytes,
            evicted_pinned=evicted.pinned,
            over_budget=evicted.excess,
        )

        # 4. Orphan and temp files.
        orphans = [f for f in _scan_files(index, blobs, now=now) if f.problem["kind"] == "orphan"]
        released = release_files(index, blobs, [f.key for f in orphans if f.key is not None])
        for f in orphans:
            if f.key is None:  # no node can ever name it: no index check needed
                try:
                    size = os.stat(f.problem["file"]).st_size
                    os.unlink(f.problem["file"])
                except FileNotFoundError:
                    continue
                released.unlinked += 1
                released.bytes += size
        temp_removed = temp_bytes = temp_kept = 0
        for kind, p in blobs.iter_files():
            if kind != "temp":
                continue
            try:
                st = os.stat(p)
                if now - st.st_mtime <= temp_age_seconds:
                    temp_kept += 1
                    continue
                os.unlink(p)
            except FileNotFoundError:
                continue
            temp_removed += 1
            temp_bytes += st.st_size
        for ns in drop:
            _remove_empty_dirs(os.path.join(blobs.root, ns.hex()))
        report.update(
            orphans_removed=released.unlinked,
            orphan_bytes=released.bytes,
            temp_removed=temp_removed,
            temp_bytes=temp_bytes,
            temp_kept=temp_kept,
            bytes_after=index.total_bytes(),
        )
    report["bytes_freed"] = (
        dropped_bytes + fixed["bytes_removed"] + evicted.bytes + released.bytes + temp_bytes
    )
    return report


def _remove_empty_dirs(root: str) -> None:
    for dirpath, _, _ in sorted(os.walk(root), key=lambda w: -len(w[0])):
        try:
            os.rmdir(dirpath)
        except OSError:
            pass  # not empty, or gone


# -- pins ------------------------------------------------------------------------------


def set_pinned(path, namespace_hex, node_hexes: Iterable, pinned: bool) -> int:
    """Pin or unpin individual nodes (no ancestors or descendants; see :func:`pin_path`).

    A pinned node is never evicted by ``KVStore`` (and by :func:`gc` only when nothing
    unpinned is left); its ancestors stay anyway, since eviction is leaf-first.

    Args:
        path: The store directory.
        namespace_hex: The namespace (hex id or a prefix of at least 8 hex digits).
        node_hexes: Node ids (hex, or prefixes of at least 8 hex digits).
        pinned: Pin (True) or unpin (False).

    Returns:
        How many nodes changed.

    Raises:
        StoreError: ``path`` is not a kvstore directory.
        ValueError: an unknown or ambiguous namespace or node (nothing is changed).
    """
    specs = _spec_list("node_hexes", node_hexes)
    with _opened(path) as (index, _):

        def apply(txn):
            ns = _resolve_namespace(_known_namespaces(index, txn), namespace_hex)
            hashes = [_resolve_node(index, txn, ns, s) for s in specs]
            return sum(_set_pin(index, txn, ns, h, pinned) for h in dict.fromkeys(hashes))

        return index.write(apply)


def pin_path(path, namespace_hex, leaf_hex, pinned: bool) -> int:
    """Pin or unpin a whole stored prefix: a node and the path from the root to it.

    Pinning pins the node and all its ancestors. Unpinning releases the node, all its
    descendants (a pinned descendant would keep the node anyway) and each ancestor that
    no other pinned node still depends on, i.e. that has no pinned descendant outside
    the released subtree. So pinning a prompt and unpinning it again restores the pins
    as they were, and unpinning one prompt never unpins a prefix another pinned prompt
    shares.

    Args:
        path: The store directory.
        namespace_hex: The namespace (hex id or a prefix of at least 8 hex digits).
        leaf_hex: The node (hex id or a prefix of at least 8 hex digits); usually a
            prompt's last node.
        pinned: Pin (True) or unpin (False).

    Returns:
        How many nodes changed.

    Raises:
        StoreError: ``path`` is not a kvstore directory, or a record on the path is
            corrupt (run ``verify(fix=True)``).
        ValueError: an unknown or ambiguous namespace or node.
    """
    with _opened(path) as (index, _):

        def apply(txn):
            ns = _resolve_namespace(_known_namespaces(index, txn), namespace_hex)
            h = _resolve_node(index, txn, ns, leaf_hex)
            path_up = _ancestry(index, txn, ns, h)  # h first
            if pinned:
                targets = path_up
            else:
                below = [h]
                todo = [h]
                while todo:
                    kids = index.children(ns, todo.pop(), txn)
                    below += kids
                    todo += kids
                # Pinned nodes off the released path and subtree keep their ancestors.
                released = set(below) | set(path_up)
                needed: Set[bytes] = set()
                for key, _ in _prefixed(txn, index.db["pins"], ns):
                    other = key[len(ns) :]
                    if other not in released and other not in needed:
                        needed.update(_ancestry(index, txn, ns, other))
                targets = below
                for a in path_up[1:]:  # bottom-up; above a needed node, all are needed
                    if a in needed:
                        break
                    targets.append(a)
            return sum(_set_pin(index, txn, ns, x, pinned) for x in targets)

        return index.write(apply)


def _set_pin(index: Index, txn, ns: bytes, h: bytes, pinned: bool) -> bool:
    try:
        return index.set_pinned(txn, ns, h, pinned)
    except CorruptRecord as e:
        raise StoreError(f"node {h.hex()} has a corrupt record ({e}); run verify --fix") from None


def _ancestry(index: Index, txn, ns: bytes, h: bytes) -> List[bytes]:
    """``h`` and its ancestors, up to the root (``h`` first)."""
    root, out, seen = root_hash(ns), [], set()
    while h != root and h not in seen:
        seen.add(h)
        try:
            rec = index.get_node(ns, h, txn)
        except CorruptRecord as e:
            raise StoreError(
                f"node {h.hex()} has a corrupt record ({e}); run verify --fix"
            ) from None
        if rec is None:
            break
        out.append(h)
        h = rec.parent
    return out


# -- argument checks -------------------------------------------------------------------


def _check_int(name: str, value, *, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def _check_optional_int(name: str, value) -> None:
    if value is not None:
        _check_int(name, value, minimum=0)


def _spec_list(name: str, specs) -> list:
    if isinstance(specs, (str, bytes)) or not isinstance(specs, _IterableABC):
        raise TypeError(f"{name} must be a list of hex ids, got {type(specs).__name__}")
    return list(specs)
