"""Shared maintenance helpers: opening a store, its disk budget, deletion (index first,
files afterwards), leaf-first LRU eviction (also for the room a save reserves before
writing), resolving namespace and node names, and argument checks."""

import json
import logging
import os
from collections.abc import Iterable as _IterableABC
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import (
    Any,
    Callable,
    Dict,
    Iterable,
    Iterator,
    List,
    Mapping,
    Optional,
    Set,
    Tuple,
)

from ..disk import reservations
from ..disk.adapters import Layout
from ..disk.blobs import DTYPES, Blobs
from ..disk.chunking import HASH_BYTES
from ..disk.index import MODEL_KEY_PREFIX, CorruptRecord, Index, NodeRecord
from ..disk.policy import DiskNode, disk_victims
from ..disk.publish import temp_writer
from ..disk.salts import GROUP_PREFIX
from ..disk.storecheck import check_store_dirs
from . import duetable, lru
from .walk import PageShedder

Key = Tuple[bytes, bytes]  # (namespace, node hash)

log = logging.getLogger("kvstore")

DISK_BUDGET_KEY = (
    b"disk_bytes"  # in the meta DB: the last budget a KVStore was opened with
)

# Nodes deleted, or files unlinked, per write transaction (the writer lock is held:
# ~0.3 s at a million nodes). At a million nodes each deletion changes random leaves,
# and a commit rewrites the branch pages above them: 2,048 a commit evicted half the
# store in 233 s against 271 s with 1,024 (4,096: 217 s, but its dirty pages took the
# process past 200 MB).
_RELEASE_BATCH = 2048
_FIRST_EVICT_BATCH = 8  # nodes a full disk's first eviction commit deletes
_MIN_PREFIX = 8  # hex digits needed to name a namespace or node by a prefix


# -- opening ---------------------------------------------------------------------------


@contextmanager
def opened(
    path, *, readonly: bool = False, check: str = "full"
) -> Iterator[Tuple[Index, Blobs]]:
    """The store's index (never created here) and chunk files; the index is closed
    after. ``readonly``: nothing is written (LMDB's read-only mode, no directory made).
    ``check="full"``: every page of the index is checked first (a scan of the whole
    index follows, and a damaged page would end the process in liblmdb:
    :mod:`kvstore.disk.mdbcheck`); ``"roots"``: the bounded check, for a command that
    reads only the small trees (the kept totals), in a time that does not grow with
    the index.
    """
    path = os.fspath(path)
    check_store_dirs(path)
    index = Index(
        os.path.join(path, "index"), create=False, readonly=readonly, check=check
    )
    try:
        blobs = Blobs.of_store(path, index.format_version, create=not readonly)
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
        return index.read(lambda t: read_disk_budget(index, t), guarded=True)
    raw = txn.get(DISK_BUDGET_KEY, db=index.db["meta"])
    try:
        value = int(raw) if raw is not None else None
    except ValueError:
        return None
    return value if value is None or value > 0 else None  # 0 (older kvstore): none


def disk_budget(path) -> Optional[int]:
    """The disk budget recorded in the store at ``path`` by ``KVStore(disk_bytes=...)``.

    Args:
        path: The store directory.

    Returns:
        The budget in bytes, or None when no budget was recorded.

    Raises:
        StoreError: ``path`` is not a kvstore directory.
    """
    with opened(path, readonly=True) as (index, _):
        return read_disk_budget(index)


def set_disk_budget(path, nbytes: Optional[int]) -> None:
    """Record (or with None, forget) the disk budget that :func:`gc` enforces by default.

    Args:
        path: The store directory.
        nbytes: The budget in bytes, or None.

    Raises:
        StoreError: ``path`` is not a kvstore directory.
    """
    if nbytes is not None:  # 0 would keep nothing: None is "no budget"
        check_int("nbytes", nbytes, minimum=1)
    with opened(path) as (index, _):
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
    failed: List[str] = field(default_factory=list)  # "path: why" of files left there


def release_files(
    index: Index,
    blobs: Blobs,
    keys: Iterable[Key],
    *,
    quarantine: Optional[Mapping[Key, str]] = None,
    deleted_in: Optional[int] = None,
    sizes: bool = True,
) -> Released:
    """Second step of a deletion: unlink (or quarantine) the files of deleted nodes.

    Runs write transactions (holding LMDB's writer lock) that re-check each node is
    still absent from the index, so a node another process re-added meanwhile keeps its
    file; no re-check while no transaction has committed since the one that deleted
    them (``deleted_in``): nothing can have been re-added.

    Args:
        index: The store's index.
        blobs: The store's chunk files.
        keys: ``(namespace, hash)`` of nodes already deleted from the index.
        quarantine: For the nodes whose file is broken: the reason, and the file is
            moved to the quarantine directory instead of being unlinked.
        deleted_in: The id of the write transaction that deleted them, if known.
        sizes: Count the unlinked files' bytes (a look at each file first); False
            for callers that know them from the records (``bytes`` stays 0).

    Returns:
        Counts of what was unlinked and where quarantined files went.
    """
    keys = list(dict.fromkeys(keys))
    quarantine = quarantine or {}
    out, shed = Released(), PageShedder(index)
    for i in range(0, len(keys), _RELEASE_BATCH):
        batch = keys[i : i + _RELEASE_BATCH]

        def release(txn):
            done = Released()
            # A write transaction's id is the last commit's plus one.
            unchanged = deleted_in is not None and txn.id() == deleted_in + 1
            for ns, h in batch:
                if not unchanged:
                    shed.tick()  # each lookup maps pages all over the index
                    if txn.get(ns + h, db=index.db["nodes"]) is not None:
                        continue  # re-added meanwhile: the file is its again
                reason = quarantine.get((ns, h))
                size = blobs.size(ns, h) if sizes or reason is not None else 0
                if size is None:
                    continue
                try:
                    if reason is None:
                        if blobs.remove(ns, h):
                            done.unlinked += 1
                            done.bytes += size
                    else:
                        where = blobs.quarantine(ns, h, reason)
                        if where:
                            done.quarantined.append(where)
                except OSError as e:  # another user's file (sudo), immutable...
                    done.failed.append(
                        cannot_remove(e.filename or blobs.path(ns, h), e)
                    )
            return done

        done = index.write(release)
        out.unlinked += done.unlinked
        out.bytes += done.bytes
        out.quarantined += done.quarantined
        out.failed += done.failed
    return out


def writer_alive(path: str) -> bool:
    """Whether the process that made temp file ``path`` may still be writing it (True
    for a name that does not say who made it)."""
    writer = temp_writer(os.path.basename(path))
    return writer is None or reservations.process_alive(*writer)


def cannot_remove(path: str, error: OSError) -> str:
    """Log and describe a file that could not be removed: the removal goes on with the
    other files (one file of another user must not stop an eviction or a gc)."""
    text = f"{path}: {error.strerror or error}"
    log.warning("kvstore: cannot remove %s; left in place", text)
    return text


@dataclass
class Dropped:
    """What :func:`delete_namespace` removed from the index."""

    nodes: int = 0
    bytes: int = 0  # the records' file bytes (delta and state files)
    delta_bytes: int = 0  # of the delta files only


def delete_namespace(index: Index, txn, ns: bytes) -> Dropped:
    """Remove everything of namespace ``ns`` from the index, in a write transaction.

    Streams (nothing is kept per node): the files go afterwards with
    :func:`release_namespace_files`, which finds them under the namespace's directory.
    """
    dropped = Dropped()
    for name in ("nodes", "children", "atime", "pins"):
        cur = txn.cursor(db=index.db[name])
        found = cur.set_range(ns)
        while found and bytes(cur.key()).startswith(ns):
            if name == "nodes":
                dropped.nodes += 1
                try:
                    rec = NodeRecord.decode(bytes(cur.value()))
                    dropped.bytes += rec.total_bytes
                    dropped.delta_bytes += rec.nbytes
                except CorruptRecord:
                    pass
            found = cur.delete()  # and on to the next key
    txn.delete(ns, db=index.db["counters"])
    txn.delete(ns, db=index.db["namespaces"])
    # Model keys naming it (kvstore.disk.namespace.model_key): few, one per model setup.
    for key, value in prefixed_items(txn, index.db["meta"], MODEL_KEY_PREFIX):
        if value == ns:
            txn.delete(key, db=index.db["meta"])
    # Which narrowed trees count against which tenant (kvstore.disk.salts.join_group).
    for key, _ in prefixed_items(txn, index.db["meta"], GROUP_PREFIX + ns):
        txn.delete(key, db=index.db["meta"])
    return dropped


def release_namespace_files(index: Index, blobs: Blobs, ns: bytes) -> Released:
    """After :func:`delete_namespace`'s commit: release the files under the
    namespace's directory whose nodes are not in the index (a batch at a time, as
    the directory is walked; :func:`release_files`)."""
    out, batch = Released(), []

    def release():
        done = release_files(index, blobs, batch)
        out.unlinked += done.unlinked
        out.bytes += done.bytes
        out.failed += done.failed
        batch.clear()

    for dirpath, _, names in os.walk(os.path.join(blobs.root, ns.hex())):
        for name in names:
            key = blobs.parse_path(os.path.join(dirpath, name))
            if key is not None and key[0] == ns:
                batch.append(key)
                if len(batch) >= _RELEASE_BATCH:
                    release()
    if batch:
        release()
    return out


def prefixed_items(txn, db, prefix: bytes) -> List[Tuple[bytes, bytes]]:
    """Every ``(key, value)`` of ``db`` whose key starts with ``prefix``, in order."""
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
    """What :func:`evict_to_budget` did (counts: a store's eviction may be millions of
    nodes, which are not listed)."""

    nodes: int = 0
    bytes: int = 0
    pinned: int = 0  # pinned nodes among them
    excess: int = 0  # bytes still above the budget (what could not be evicted)
    unremovable: List[str] = field(default_factory=list)  # "path: why", left there


def disk_nodes(index: Index, txn) -> Dict[Key, DiskNode]:
    """Every decodable node of the store as eviction sees it."""
    nodes = {}
    for ns, h, raw in index.iter_nodes(txn):
        try:
            rec = NodeRecord.decode(raw)
        except CorruptRecord:
            continue
        nodes[ns, h] = DiskNode(
            index.atime(txn, ns, h), rec.total_bytes, (ns, rec.parent), rec.pinned
        )
    return nodes


def evict_to_budget(
    index: Index,
    blobs: Blobs,
    max_bytes: int,
    *,
    pinned_last: bool = False,
    on_evict: Optional[Callable[[List[Key]], None]] = None,
) -> Eviction:
    """Evict least recently used leaves until the indexed bytes fit ``max_bytes``.

    The victims come from walks of the trie in bounded memory (:mod:`.lru`), in
    write transactions of growing size (re-checking that each is still a leaf, and
    unpinned unless ``pinned_last``), each followed by the release of their files
    (:func:`release_files`): on a full disk the first, small commit fits the spare
    room (:mod:`kvstore.disk.spare`) and its files make room for the next. Another round
    follows only if the store changed meanwhile and is still over the budget.

    Args:
        index: The store's index (all namespaces count against the budget).
        blobs: The store's chunk files.
        max_bytes: The budget.
        pinned_last: Evict pinned nodes too, after every unpinned one. Without it
            pinned nodes never go.
        on_evict: Called with the keys of each commit's evicted nodes.

    Returns:
        How many nodes and bytes went and how many bytes remain above the budget.
    """
    result = Eviction()
    while True:
        result.excess = max(0, index.total_bytes() - max_bytes)
        if result.excess == 0:
            return result
        lift = (
            index.read(lambda txn: lru.pinned_lift(index, txn)) if pinned_last else None
        )
        # A deletion (~0.3 ms at a million nodes) maps ~6 random stretches of the
        # index: a look every 16 keeps the pages over budget few, for ~0.4% of that.
        evicted, shed, committed = 0, PageShedder(index, every=16), [None]
        for batch in _victims(index, result.excess, lift):

            def evict(txn, batch=batch):
                committed[0] = txn.id()
                gone = []
                for ns, h in batch:
                    shed.tick()
                    try:
                        rec = index.get_node(ns, h, txn)
                    except CorruptRecord:
                        continue
                    if (
                        rec is not None
                        and (pinned_last or not rec.pinned)
                        and not index.has_children(txn, ns, h)
                    ):
                        index.delete_read_node(txn, ns, h, rec)
                        gone.append(((ns, h), rec))
                return gone

            gone = index.write(evict, frees=True)
            keys = [key for key, _ in gone]
            released = release_files(
                index, blobs, keys, deleted_in=committed[0], sizes=False
            )
            result.unremovable += released.failed
            result.nodes += len(gone)
            result.bytes += sum(rec.total_bytes for _, rec in gone)
            result.pinned += sum(rec.pinned for _, rec in gone)
            evicted += len(gone)
            if on_evict is not None and keys:
                on_evict(keys)
        if not evicted:  # another process changed the tree under us: stop here
            result.excess = max(0, index.total_bytes() - max_bytes)
            return result


def _victims(index: Index, excess: int, lift: Optional[float]) -> Iterator[List[Key]]:
    """The leaf-first LRU victims for ``excess`` bytes, in lists of growing size: from
    a table of every node where it fits its memory budget (one scan in key order),
    else from walks of the trie (bounded memory, random pages)."""
    rows = index.read(lambda txn: duetable.table_rows(index, txn))
    if rows is not None:
        table = duetable.DueTable(index, lift=lift, rows=rows)
        return table.victims(table.cut(excess), sizes=_batch_sizes())
    cut = lru.threshold(index, excess, lift=lift)
    return lru.victims(index, cut, lift=lift, sizes=_batch_sizes())


def _batch_sizes() -> Iterator[int]:
    """Evictions in commits of growing size: the first needs little room on a full
    disk (:mod:`kvstore.disk.spare`), and the files it unlinks make room for the next.
    """
    size = _FIRST_EVICT_BATCH
    while True:
        yield size
        size = min(2 * size, _RELEASE_BATCH)


def make_room(
    index: Index, txn, max_bytes: int, incoming: int, *, keep: Iterable[Key] = ()
) -> List[Tuple[Key, NodeRecord]]:
    """Inside a write transaction: delete least recently used unpinned leaves until the
    indexed bytes, the live reservations of saves in flight and ``incoming`` bytes fit
    ``max_bytes`` (stale reservations are deleted on the way).

    Eviction and the reservation (:func:`reserve_room`) or commit adding the bytes are
    one transaction, so writers in other processes cannot each find room for themselves
    and overshoot the budget together. The deleted nodes' files are still on disk: pass
    the keys to :func:`release_files` after the commit. Pinned nodes never go, so the
    bytes may still not fit; the caller goes on anyway.

    Args:
        index: The store's index (all namespaces count against the budget).
        txn: The write transaction.
        max_bytes: The budget.
        incoming: Bytes the transaction is about to add or reserve.
        keep: Nodes that must stay (the parents the new nodes hang from); their
            ancestors stay too.

    Returns:
        ``(key, record)`` of the deleted nodes, in eviction order.
    """
    reserved = reservations.live_bytes(index, txn)
    excess = index.total_bytes(txn) + reserved + incoming - max_bytes
    if excess <= 0:
        return []
    nodes = disk_nodes(index, txn)
    for key in keep:
        if key in nodes:
            nodes[key] = nodes[key]._replace(pinned=True)
    gone = []
    for ns, h in disk_victims(nodes, excess):  # children before their parents
        if not index.has_children(txn, ns, h):  # e.g. a child whose record is corrupt
            gone.append(((ns, h), index.delete_node(txn, ns, h)))
    return gone


def reserve_room(
    index: Index,
    txn,
    max_bytes: int,
    nbytes: int,
    *,
    key: bytes,
    keep: Iterable[Key] = (),
) -> List[Tuple[Key, NodeRecord]]:
    """Before a save writes its files: make room for ``nbytes`` (:func:`make_room`) and
    record reservation ``key`` of them, in one write transaction.

    Args:
        index: The store's index.
        txn: The write transaction.
        max_bytes: The budget.
        nbytes: Bytes of the files the save is about to write.
        key: The save's reservation (:func:`kvstore.disk.reservations.new_key`); the commit
            indexing the files deletes it.
        keep: Nodes that must stay (the parents the new nodes hang from).

    Returns:
        ``(key, record)`` of the deleted nodes: unlink their files
        (:func:`release_files`) before writing the new ones.
    """
    gone = make_room(index, txn, max_bytes, nbytes, keep=keep)
    reservations.put(index, txn, key, nbytes)
    return gone


# -- namespaces and names --------------------------------------------------------------


def namespace_descriptions(index: Index, txn) -> Dict[bytes, Any]:
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


def description_layout(desc: Any) -> Layout:
    """The cache layout a namespace description records; ValueError when unusable."""
    if isinstance(desc, str):
        raise ValueError(desc)
    obj = desc.get("layout") if isinstance(desc, dict) else None
    if not isinstance(obj, dict) or not obj.get("leaves"):
        raise ValueError("description has no cache layout")
    try:
        layout = Layout.from_json(obj)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ValueError(f"cache layout is malformed: {str(e)[:80]}") from None
    for leaf in layout.leaves:
        for _, dtype, shape in leaf.tensors:
            if dtype not in DTYPES or not all(isinstance(x, int) for x in shape):
                raise ValueError(f"layout of layer {leaf.name} is malformed")
    return layout


def kept_namespaces(index: Index, txn) -> Set[bytes]:
    """Namespaces with a description or counters: the small trees only (every
    namespace with nodes has counters; :func:`known_namespaces` also seeks nodes)."""
    out = {bytes(k) for k, _ in txn.cursor(db=index.db["namespaces"])}
    out |= {bytes(k) for k, _ in txn.cursor(db=index.db["counters"])}
    return {ns for ns in out if len(ns) == HASH_BYTES}  # a shorter key names none


def known_namespaces(index: Index, txn) -> Set[bytes]:
    """Namespaces with a description, counters or nodes (one cursor seek per namespace)."""
    out = kept_namespaces(index, txn)
    cur = txn.cursor(db=index.db["nodes"])
    found = cur.first()
    while found:
        ns = bytes(cur.key())[:HASH_BYTES]
        out.add(ns)
        after = _successor(ns)
        found = after is not None and cur.set_range(after)
    return {
        ns for ns in out if len(ns) == HASH_BYTES
    }  # a shorter key names no namespace


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
    if not _MIN_PREFIX <= len(s) <= 2 * HASH_BYTES or any(
        c not in "0123456789abcdef" for c in s
    ):
        raise ValueError(
            f"{what} {spec!r}: expected {_MIN_PREFIX} to 32 hex digits of an id"
        )
    return s


def resolve_namespace(known: Iterable[bytes], spec) -> bytes:
    """The namespace of ``known`` that the hex id or prefix ``spec`` names (as given
    to ``kvstore gc --namespace``); ValueError for none or several, TypeError."""
    s = _hex_spec(spec, "namespace")
    matches = sorted(ns for ns in known if ns.hex().startswith(s))
    if not matches:
        raise ValueError(f"no namespace {s} in this store")
    if len(matches) > 1:
        raise ValueError(
            f"namespace {s} is ambiguous: {', '.join(m.hex() for m in matches)}"
        )
    return matches[0]


def resolve_node(index: Index, txn, ns: bytes, spec) -> bytes:
    """The node of namespace ``ns`` that the hex id or prefix ``spec`` names;
    ValueError for none or several, TypeError."""
    s = _hex_spec(spec, "node")
    start = ns + bytes.fromhex(s[: len(s) // 2 * 2])
    matches = []
    for key, _ in prefixed_items(txn, index.db["nodes"], start):
        h = key[len(ns) :]
        if h.hex().startswith(s):
            matches.append(h)
            if len(matches) > 1:
                raise ValueError(f"node {s} is ambiguous in namespace {ns.hex()}")
    if not matches:
        raise ValueError(f"no node {s} in namespace {ns.hex()}")
    return matches[0]


# -- argument checks -------------------------------------------------------------------


def check_int(name: str, value, *, minimum: int) -> None:
    """Raise TypeError unless ``value`` is an int (not a bool), ValueError below ``minimum``."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def check_optional_int(name: str, value) -> None:
    """:func:`check_int` with ``minimum=0``, unless ``value`` is None."""
    if value is not None:
        check_int(name, value, minimum=0)


def spec_list(name: str, specs) -> list:
    """``specs`` (hex ids of namespaces or nodes) as a list; TypeError for a single
    string or a non-iterable."""
    if isinstance(specs, (str, bytes)) or not isinstance(specs, _IterableABC):
        raise TypeError(f"{name} must be a list of hex ids, got {type(specs).__name__}")
    return list(specs)
