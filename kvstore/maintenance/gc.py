"""Garbage collection (:func:`gc`) and pinning (:func:`set_pinned`, :func:`pin_path`)."""

import os
import time
from typing import Any, Dict, Iterable, List, Optional, Set

from ..disk import reservations, spare
from ..disk.chunking import root_hash
from ..disk.index import CorruptRecord, Index, StoreError
from .common import (
    Eviction,
    cannot_remove,
    check_optional_int,
    delete_namespace,
    evict_to_budget,
    known_namespaces,
    opened,
    prefixed_items,
    read_disk_budget,
    release_files,
    release_namespace_files,
    resolve_namespace,
    resolve_node,
    spec_list,
    writer_alive,
)
from .verify import Fixed, scan_files, verify_open_store

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
    first); finally unlinks orphan chunk files, temp files whose writer process is
    gone and any older than ``temp_age_seconds``, and drops the disk reservations of saves whose process is
    gone. Every deletion leaves the index first and unlinks the file afterwards,
    re-checking the index under the writer lock.

    Args:
        path: The store directory.
        max_bytes: Budget for the indexed chunk files; None: the budget recorded by
            ``KVStore(disk_bytes=...)`` (:func:`disk_budget`), or no eviction if none.
        drop_namespaces: Namespaces to remove entirely (nodes, files, pins, counters,
            description): hex ids or prefixes of at least 8 hex digits.
        keep_namespaces: If given, every namespace not named here is dropped too.
        temp_age_seconds: Temp files younger than this may be writes in progress and
            are kept, unless the process that made them is gone.
        now: The current time (Unix seconds) for temp file ages; default ``time.time()``.
        check_data: Read and checksum every file to find broken nodes; False checks
            only that files exist with the recorded size.

    Returns:
        ``path`` and counts of what went: ``namespaces_dropped`` (hex ids), ``dropped_nodes``,
        ``dropped_bytes``, ``broken_nodes``, ``broken_bytes``, ``problems`` (the errors
        found, as in :func:`verify`), ``quarantined``, ``index_repairs``, ``budget``,
        ``evicted_nodes``, ``evicted_bytes``, ``evicted_pinned``, ``over_budget``
        (bytes still above the budget), ``orphans_removed``, ``orphan_bytes``,
        ``temp_removed``, ``temp_bytes``, ``temp_kept``, ``unremovable``
        (``"path: why"`` of each file that could not be removed, another user's say:
        left in place while gc goes on with the others), ``reservations_dropped``
        (stale reservations of saves in flight), ``bytes_before`` /
        ``bytes_after`` (indexed bytes) and ``bytes_freed`` (the recorded sizes of the
        dropped, broken and evicted nodes plus the orphan and temp files unlinked).

    Raises:
        StoreError: ``path`` is not a kvstore directory.
        ValueError: a namespace is unknown or ambiguous, or named both to drop and to
            keep; bad budgets or ages.
    """
    check_optional_int("max_bytes", max_bytes)
    if isinstance(temp_age_seconds, bool) or not isinstance(
        temp_age_seconds, (int, float)
    ):
        raise TypeError(f"temp_age_seconds must be a number, got {temp_age_seconds!r}")
    if temp_age_seconds < 0:
        raise ValueError(f"temp_age_seconds must be >= 0, got {temp_age_seconds}")
    drop_specs = spec_list("drop_namespaces", drop_namespaces)
    keep_specs = (
        None
        if keep_namespaces is None
        else spec_list("keep_namespaces", keep_namespaces)
    )
    now = time.time() if now is None else now
    path = os.fspath(path)
    with opened(path) as (index, blobs):
        report: Dict[str, Any] = {"path": path, "bytes_before": index.total_bytes()}
        unremovable: List[str] = []

        def step(done: Dict[str, Any]) -> None:
            unremovable.extend(done.pop("unremovable", ()))
            report.update(done)

        drop = _namespaces_to_drop(index, drop_specs, keep_specs)
        step(_drop_namespaces(index, blobs, drop))
        step(_remove_broken(index, blobs, check_data=check_data, now=now))
        step(_evict(index, blobs, max_bytes))
        step(_remove_orphans(index, blobs, now=now))
        step(_remove_temp_files(blobs, now=now, min_age=temp_age_seconds))
        report["unremovable"] = list(dict.fromkeys(unremovable))  # evicted, then orphan
        for ns in drop:
            _remove_empty_dirs(os.path.join(blobs.root, ns.hex()))
        report.update(
            # Real time, not ``now``: a reservation's age says whether its save lives.
            reservations_dropped=reservations.drop_stale(index),
            bytes_after=index.total_bytes(),
        )
        spare.ensure(index.path)  # the room a full disk's next gc starts with
    report["bytes_freed"] = (
        report["dropped_bytes"]
        + report["broken_bytes"]
        + report["evicted_bytes"]
        + report["orphan_bytes"]
        + report["temp_bytes"]
    )
    return report


def _namespaces_to_drop(
    index: Index, drop_specs: list, keep_specs: Optional[list]
) -> Set[bytes]:
    """Step 1: the namespaces ``drop_specs`` name, and all not in ``keep_specs``."""
    known = index.read(lambda txn: known_namespaces(index, txn))
    drop = {resolve_namespace(known, s) for s in drop_specs}
    if keep_specs is not None:
        keep = {resolve_namespace(known, s) for s in keep_specs}
        if drop & keep:
            both = ", ".join(sorted(ns.hex() for ns in drop & keep))
            raise ValueError(f"namespaces named both to drop and to keep: {both}")
        drop |= known - keep
    return drop


def _drop_namespaces(index: Index, blobs, drop: Set[bytes]) -> Dict[str, Any]:
    """Step 1: remove whole namespaces, index first, then their files."""
    dropped_nodes = dropped_bytes = 0
    unremovable: List[str] = []
    for ns in sorted(drop):
        gone = index.write(
            lambda txn, ns=ns: delete_namespace(index, txn, ns), frees=True
        )
        dropped_nodes += gone.nodes
        dropped_bytes += gone.bytes
        unremovable += release_namespace_files(index, blobs, ns).failed
    return dict(
        namespaces_dropped=sorted(ns.hex() for ns in drop),
        dropped_nodes=dropped_nodes,
        dropped_bytes=dropped_bytes,
        unremovable=unremovable,
    )


def _remove_broken(
    index: Index, blobs, *, check_data: bool, now: float
) -> Dict[str, Any]:
    """Step 2: broken nodes, removed as ``verify(fix=True)`` does."""
    checked = verify_open_store(
        index, blobs, fix=True, check_data=check_data, walk_files=False, now=now
    )
    fixed = checked["fixed"] or Fixed().report()
    return dict(
        problems=checked["problems"],
        broken_nodes=fixed["nodes_removed"],
        broken_bytes=fixed["bytes_removed"],
        quarantined=fixed["quarantined"],
        index_repairs=fixed["index_repairs"],
        unremovable=fixed["unremovable"],
    )


def _evict(index: Index, blobs, max_bytes: Optional[int]) -> Dict[str, Any]:
    """Step 3: the budget; unpinned leaves first, pinned only when nothing else is
    left."""
    budget = max_bytes if max_bytes is not None else read_disk_budget(index)
    evicted = (
        evict_to_budget(index, blobs, budget, pinned_last=True)
        if budget is not None
        else Eviction()
    )
    return dict(
        budget=budget,
        evicted_nodes=evicted.nodes,
        evicted_bytes=evicted.bytes,
        evicted_pinned=evicted.pinned,
        over_budget=evicted.excess,
        unremovable=evicted.unremovable,
    )


def _remove_orphans(index: Index, blobs, *, now: float) -> Dict[str, Any]:
    """Step 4: chunk files no index record names."""
    orphans = [
        f for f in scan_files(index, blobs, now=now) if f.problem["kind"] == "orphan"
    ]
    released = release_files(
        index, blobs, [f.key for f in orphans if f.key is not None]
    )
    for f in orphans:
        if f.key is None:  # no node can ever name it: no index check needed
            try:
                size = os.lstat(f.problem["file"]).st_size
                os.unlink(f.problem["file"])
            except FileNotFoundError:
                continue
            except OSError as e:
                released.failed.append(cannot_remove(f.problem["file"], e))
                continue
            released.unlinked += 1
            released.bytes += size
    return dict(
        orphans_removed=released.unlinked,
        orphan_bytes=released.bytes,
        unremovable=released.failed,
    )


def _remove_temp_files(blobs, *, now: float, min_age: float) -> Dict[str, Any]:
    """Step 4: temp files whose writer is gone (its pid and start time are in the
    name: :func:`kvstore.disk.publish.temp_writer`), and any older than ``min_age``
    seconds (younger ones of live writers may be writes in progress)."""
    temp_removed = temp_bytes = temp_kept = 0
    unremovable: List[str] = []
    for kind, p in blobs.iter_files():
        if kind != "temp":
            continue
        try:
            st = os.lstat(p)
            if now - st.st_mtime <= min_age and writer_alive(p):
                temp_kept += 1
                continue
            os.unlink(p)
        except FileNotFoundError:
            continue
        except OSError as e:
            unremovable.append(cannot_remove(p, e))
            continue
        temp_removed += 1
        temp_bytes += st.st_size
    return dict(
        temp_removed=temp_removed,
        temp_bytes=temp_bytes,
        temp_kept=temp_kept,
        unremovable=unremovable,
    )


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
    specs = spec_list("node_hexes", node_hexes)
    with opened(path) as (index, _):

        def apply(txn):
            ns = resolve_namespace(known_namespaces(index, txn), namespace_hex)
            hashes = [resolve_node(index, txn, ns, s) for s in specs]
            return sum(
                _set_pin(index, txn, ns, h, pinned) for h in dict.fromkeys(hashes)
            )

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
    with opened(path) as (index, _):

        def apply(txn):
            ns = resolve_namespace(known_namespaces(index, txn), namespace_hex)
            h = resolve_node(index, txn, ns, leaf_hex)
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
                for key, _ in prefixed_items(txn, index.db["pins"], ns):
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
        raise StoreError(
            f"node {h.hex()} has a corrupt record ({e}); run verify --fix"
        ) from None


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
