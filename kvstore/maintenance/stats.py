"""Store statistics (:func:`store_stats`) and the prefix tree (:func:`list_tree`)."""

import os
from typing import Any, Dict, List, Optional, Tuple

from ..disk.adapters import Layout
from ..disk.blobs import DTYPES, Blobs
from ..disk.chunking import root_hash
from ..disk.index import CHILD_KEY_TOKENS, CorruptRecord, Index, NodeRecord
from .common import (
    check_int,
    description_layout,
    kept_namespaces,
    known_namespaces,
    namespace_descriptions,
    opened,
    read_disk_budget,
    resolve_namespace,
)
from .walk import PageShedder, TreeWalk, tree_roots

# -- stats -----------------------------------------------------------------------------


def _file_sizes(blobs: Blobs) -> Dict[str, Any]:
    """Walk the chunk files: bytes per namespace, temp and other files."""
    out = {"per_namespace": {}, "files": 0, "file_bytes": 0}
    out.update(temp_files=0, temp_bytes=0, other_files=0, other_bytes=0)
    for kind, p in blobs.iter_files():
        try:
            size = os.lstat(p).st_size
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
                nbytes += os.lstat(os.path.join(dirpath, name)).st_size
                files += 1
            except FileNotFoundError:
                pass
    return files, nbytes


def _bytes_per_token(layout: Layout) -> int:
    """KV bytes per token of the delta layers (state checkpoints are per node)."""
    return sum(
        heads * width * DTYPES[dtype][1] for dtype, heads, width in layout.rows.values()
    )


def store_stats(path, *, full: bool = False) -> Dict[str, Any]:
    """Counts for a store directory, per namespace and in total, without loading a model.

    By default everything comes from totals the index keeps (its per-namespace
    counters, the namespace descriptions, the index file's size): the same time and
    memory at a thousand nodes as at millions. ``full`` also reads every record and
    walks ``blobs/`` and ``quarantine/`` (time linear in the store, memory bounded).

    Args:
        path: The store directory.
        full: Also count what only a scan knows (prompts, pinned nodes, corrupt
            records, times, salted trees, the files on disk).

    Returns:
        ``{"path", "format_version", "created", "disk_budget", "full",
        "bytes_on_disk", "file_bytes", "namespaces": [...], "totals": {...}}``:
        ``bytes_on_disk`` is the chunk files' bytes by the index's counters,
        ``file_bytes`` as found by walking ``blobs/``. Each namespace entry holds
        ``id`` (hex), ``model_type``, ``chunk_tokens``, ``layers``, ``dtype``,
        ``bytes_per_token``, ``tokenizer`` (whether a vocabulary is part of the
        namespace), ``nodes``, ``tokens``, ``bytes``, ``pinned_bytes`` (from the
        index's counters), and from the scan (None without ``full``): ``prompts``
        (leaf nodes), ``pinned_nodes``, ``corrupt_records``, ``oldest`` / ``newest``
        (creation times), ``last_access``, ``files`` / ``file_bytes`` (found on
        disk), ``salted_trees`` (``[{"root", "nodes", "tokens", "bytes"}]``: each
        salted tree by its root hash, largest first; the unsalted tree is the rest).
        Totals add ``bytes`` (counters), ``index_bytes`` and, from the scan,
        ``file_bytes`` (walked), temp and other files and the quarantine
        directory. Times are Unix seconds.

    Raises:
        StoreError: ``path`` is not a kvstore directory.
    """
    path = os.fspath(path)
    # Without the scan only the small trees are read (meta, descriptions, counters),
    # which the bounded page check covers whole: checking every page is the scan's.
    check = "full" if full else "roots"
    with opened(path, readonly=True, check=check) as (index, blobs):
        kept = None
        if not full:  # the small trees' pages checked first: no wait for the rest
            kept = index.read(lambda txn: _kept_checked(index, txn, path), guarded=True)
        if kept is None:  # (or their snapshot was gone: after the full page check)
            kept = index.read(lambda txn: _kept(index, txn, path, scan=full))
        head, descs, counters = kept
        index_bytes = os.lstat(os.path.join(path, "index", "data.mdb")).st_size
        per, files, quarantine = {}, None, None
        if full:
            per = index.read(lambda txn: _scan_records(index, txn))
            files = _file_sizes(blobs)
            quarantine = _dir_size(blobs.quarantine_dir)
    namespaces = [
        _namespace_entry(
            ns,
            descs.get(ns),
            per.get(ns, _new_acc()) if full else None,
            counters.get(ns, (0, 0, 0, 0)),
            files["per_namespace"].get(ns, (0, 0)) if full else None,
        )
        for ns in sorted(set(counters) | set(descs))
    ]
    totals = _totals(namespaces, files, index_bytes, quarantine)
    return {
        **head,
        "full": full,
        "bytes_on_disk": totals["bytes"],  # chunk files, by the index's counters
        "file_bytes": totals["file_bytes"],  # chunk files found on disk (full)
        "namespaces": namespaces,
        "totals": totals,
    }


def _kept(index: Index, txn, path: str, *, scan: bool) -> tuple:
    """The store's header fields, namespace descriptions and the index's counters:
    what the index keeps, read without a scan. ``scan``: the namespaces include
    those found only in the node records (a seek each in the large ``nodes`` tree,
    whose pages only the full check covers); else those with a description or
    counters, which every namespace with nodes has."""
    meta = index.db["meta"]
    created = txn.get(b"created", db=meta)
    head = {
        "path": path,
        "format_version": int(txn.get(b"format_version", db=meta)),
        "created": float(created) if created is not None else None,
        "disk_budget": read_disk_budget(index, txn),
    }
    descs = namespace_descriptions(index, txn)
    known = known_namespaces(index, txn) if scan else kept_namespaces(index, txn)
    counters = {ns: index.counters(ns, txn) for ns in known}
    return head, descs, counters


def _kept_checked(index: Index, txn, path: str) -> Optional[tuple]:
    """:func:`_kept` without the scan, the pages its cursors read checked first
    (:meth:`~kvstore.disk.index.Index.cover`); None: they could not be checked."""
    if not all(index.cover(txn, name) for name in ("namespaces", "counters")):
        return None
    return _kept(index, txn, path, scan=False)


def _scan_records(index: Index, txn) -> Dict[bytes, Dict[str, Any]]:
    """Per-namespace tallies of every node record, in one pass (memory: one
    accumulator per namespace; salted trees are walked from their roots)."""
    per: Dict[bytes, Dict[str, Any]] = {}
    shed = PageShedder(index)
    for ns, h, raw in index.iter_nodes(txn):
        shed.tick()
        acc = per.setdefault(ns, _new_acc())
        try:
            rec = NodeRecord.decode(raw)
        except CorruptRecord:
            acc["corrupt_records"] += 1
            continue
        acc["prompts"] += not index.has_children(txn, ns, h)
        acc["pinned_nodes"] += rec.pinned
        acc["oldest"] = min(acc["oldest"] or rec.created, rec.created)
        acc["newest"] = max(acc["newest"] or rec.created, rec.created)
        atime = index.atime(txn, ns, h)
        acc["last_access"] = max(acc["last_access"] or atime, atime)
    for ns, root in tree_roots(index, txn):
        if root != root_hash(ns):
            tree = _tree_totals(index, txn, ns, root, shed)
            per.setdefault(ns, _new_acc())["salted_trees"].append(tree)
    return per


def _tree_totals(index: Index, txn, ns: bytes, root: bytes, shed) -> Dict[str, Any]:
    """Nodes, tokens and bytes of the tree below ``root`` (corrupt records skipped)."""
    tree = {"root": root.hex(), "nodes": 0, "tokens": 0, "bytes": 0}
    for h, _ in TreeWalk(index, ns, root).nodes(txn):
        shed.tick()
        try:
            rec = index.get_node(ns, h, txn)
        except CorruptRecord:
            continue
        if rec is not None:
            tree["nodes"] += 1
            tree["tokens"] += rec.ntokens
            tree["bytes"] += rec.total_bytes
    return tree


def _namespace_entry(
    ns: bytes,
    desc: Any,
    acc: Optional[Dict[str, Any]],
    counts: tuple,
    file_counts: Optional[tuple],
) -> Dict[str, Any]:
    """One namespace of :func:`store_stats`: its description, its index counters and
    (from a full scan; None: not scanned) the tallies of its node records and the
    files found on disk."""
    desc = desc if isinstance(desc, dict) else {}
    try:
        layout = description_layout(desc)
    except ValueError:
        layout = None
    nodes, tokens, nbytes, pinned = counts
    nfiles, fbytes = file_counts if file_counts is not None else (None, None)
    scanned = acc if acc is not None else dict.fromkeys(_new_acc())
    trees = acc["salted_trees"] if acc is not None else None
    return {
        "id": ns.hex(),
        "model_type": desc.get("model_type"),
        "chunk_tokens": desc.get("chunk_tokens"),
        "layers": len(layout.tree) if layout else None,
        "cache_types": (
            ",".join(sorted({leaf.cls for leaf in layout.leaves})) if layout else None
        ),
        "dtype": (
            ",".join(sorted({d for leaf in layout.leaves for _, d, _ in leaf.tensors}))
            if layout
            else None
        ),
        "bytes_per_token": _bytes_per_token(layout) if layout else None,
        "tokenizer": desc.get("vocab") is not None,
        "nodes": nodes,
        "prompts": scanned["prompts"],
        "tokens": tokens,
        "bytes": nbytes,
        "pinned_bytes": pinned,
        "pinned_nodes": scanned["pinned_nodes"],
        "corrupt_records": scanned["corrupt_records"],
        "oldest": scanned["oldest"],
        "newest": scanned["newest"],
        "last_access": scanned["last_access"],
        "files": nfiles,
        "file_bytes": fbytes,
        "salted_trees": (
            sorted(trees, key=lambda t: (-t["bytes"], t["root"]))
            if trees is not None
            else None
        ),
    }


def _totals(
    namespaces: List[Dict[str, Any]],
    files: Optional[Dict[str, Any]],
    index_bytes: int,
    quarantine: Optional[Tuple[int, int]],
) -> Dict[str, Any]:
    """The totals of :func:`store_stats`: the namespaces' sums and, from a full scan
    (None: not scanned), the files found."""

    def total(key):
        values = [n[key] for n in namespaces]
        return None if None in values else sum(values)

    totals = {
        key: total(key)
        for key in (
            "nodes",
            "prompts",
            "tokens",
            "bytes",
            "pinned_bytes",
            "corrupt_records",
        )
    }
    files = files or {}
    q_files, q_bytes = quarantine if quarantine is not None else (None, None)
    totals.update(
        namespaces=len(namespaces),
        files=files.get("files"),
        file_bytes=files.get("file_bytes"),
        temp_files=files.get("temp_files"),
        temp_bytes=files.get("temp_bytes"),
        other_files=files.get("other_files"),
        other_bytes=files.get("other_bytes"),
        index_bytes=index_bytes,
        quarantine_files=q_files,
        quarantine_bytes=q_bytes,
    )
    return totals


def _new_acc() -> Dict[str, Any]:
    return {
        "prompts": 0,
        "pinned_nodes": 0,
        "corrupt_records": 0,
        "oldest": None,
        "newest": None,
        "last_access": None,
        "salted_trees": [],
    }


# -- the tree --------------------------------------------------------------------------


def list_tree(
    path, *, namespace=None, max_depth: int = 4, max_children: int = 20
) -> List[dict]:
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
    check_int("max_depth", max_depth, minimum=0)
    check_int("max_children", max_children, minimum=0)
    with opened(path, readonly=True) as (index, _):
        # A few nodes' lookups touch pages all over the index, and a fault may map a
        # large stretch of the cached file (measured: 46 MB for 200 nodes shown).
        shed = PageShedder(index, every=4)

        def kids(txn, ns: bytes, parent: bytes, depth: int) -> Tuple[List[dict], int]:
            keep = max_children if depth <= max_depth else 0
            hashes, count = _first_children(index, txn, ns, parent, keep, shed)
            shown = []
            for h in hashes:
                shed.tick()
                node = _tree_node(index, txn, ns, h)
                if node is not None:
                    node["children"], node["more"] = kids(txn, ns, h, depth + 1)
                    shown.append(node)
            return shown, count - len(hashes)

        def build(txn):
            known = known_namespaces(index, txn)
            spaces = (
                [resolve_namespace(known, namespace)]
                if namespace is not None
                else known
            )
            descs = namespace_descriptions(index, txn)
            out = []
            for ns in sorted(spaces):
                desc = descs.get(ns)
                children, more = kids(txn, ns, root_hash(ns), 1)
                out.append(
                    {
                        "namespace": ns.hex(),
                        "model_type": (
                            desc.get("model_type") if isinstance(desc, dict) else None
                        ),
                        "nodes": index.counters(ns, txn)[0],
                        "children": children,
                        "more": more,
                    }
                )
            return out

        return index.read(build)


def _first_children(
    index: Index, txn, ns: bytes, parent: bytes, keep: int, shed: PageShedder
) -> Tuple[List[bytes], int]:
    """The first ``keep`` children of ``parent`` (in token order) and how many it
    has: a node with a million children costs a count, not a list."""
    prefix = ns + parent
    tail = len(prefix) + 4 * CHILD_KEY_TOKENS
    cur = txn.cursor(db=index.db["children"])
    out, count = [], 0
    if cur.set_range(prefix):
        for key in cur.iternext(values=False):
            if not key.startswith(prefix):
                break
            if count < keep:
                out.append(bytes(key[tail:]))
            count += 1
            if count % 256 == 0:  # keys in order: a page holds a dozen
                shed.tick()
    return out, count


def _tree_node(index: Index, txn, ns: bytes, h: bytes) -> Optional[dict]:
    node = {"id": h.hex(), "short": h.hex()[:12], "error": None}
    try:
        rec = index.get_node(ns, h, txn)
    except CorruptRecord as e:
        fields = (
            "tokens",
            "start",
            "first_tokens",
            "kind",
            "pinned",
            "last_use",
            "nbytes",
        )
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
        "nbytes": rec.total_bytes,
    }
