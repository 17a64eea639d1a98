"""Store statistics (:func:`store_stats`) and the prefix tree (:func:`list_tree`)."""

import os
from typing import Any, Dict, List, Optional, Tuple

from ..disk.adapters import Layout
from ..disk.blobs import DTYPES, Blobs
from ..disk.chunking import root_hash
from ..disk.index import CorruptRecord, Index, NodeRecord
from ..disk.salts import tree_roots
from .common import (
    check_int,
    description_layout,
    known_namespaces,
    namespace_descriptions,
    opened,
    read_disk_budget,
    resolve_namespace,
)

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
        (creation times), ``last_access``, ``files`` / ``file_bytes`` (found on disk),
        ``salted_trees`` (``[{"root", "nodes", "tokens", "bytes"}]``: each salted
        tree by its root hash, largest first; the unsalted tree is the rest).
        Totals add ``bytes`` (counters) next to ``file_bytes`` (walked), temp and other
        files, the index file and the quarantine directory. Times are Unix seconds.

    Raises:
        StoreError: ``path`` is not a kvstore directory.
    """
    path = os.fspath(path)
    with opened(path, readonly=True) as (index, blobs):
        head, descs, per, counters = index.read(
            lambda txn: _scan_index(index, txn, path)
        )
        files = _file_sizes(blobs)
        index_bytes = os.lstat(os.path.join(path, "index", "data.mdb")).st_size
        quarantine = _dir_size(blobs.quarantine_dir)
    namespaces = [
        _namespace_entry(
            ns,
            descs.get(ns),
            per.get(ns, _new_acc()),
            counters.get(ns, (0, 0, 0, 0)),
            files["per_namespace"].get(ns, (0, 0)),
        )
        for ns in sorted(set(counters) | set(descs))
    ]
    totals = _totals(namespaces, files, index_bytes, quarantine)
    return {
        **head,
        "bytes_on_disk": totals["bytes"],  # chunk files, by the index's counters
        "file_bytes": totals["file_bytes"],  # chunk files found on disk
        "namespaces": namespaces,
        "totals": totals,
    }


def _scan_index(index: Index, txn, path: str) -> tuple:
    """The store's header fields, namespace descriptions, per-namespace tallies of
    the node records, and the index's counters, in one read transaction."""
    meta = index.db["meta"]
    created = txn.get(b"created", db=meta)
    head = {
        "path": path,
        "format_version": int(txn.get(b"format_version", db=meta)),
        "created": float(created) if created is not None else None,
        "disk_budget": read_disk_budget(index, txn),
    }
    descs = namespace_descriptions(index, txn)
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
        acc["records"][h] = (rec.parent, rec.start, rec.ntokens, rec.total_bytes)
        acc["pinned_nodes"] += rec.pinned
        acc["created"].append(rec.created)
        atime = index.atime(txn, ns, h)
        acc["last_access"] = max(acc["last_access"] or atime, atime)
    for key in keys:
        per[key[0]]["prompts"] += key not in parents
    counters = {ns: index.counters(ns, txn) for ns in known_namespaces(index, txn)}
    return head, descs, per, counters


def _namespace_entry(
    ns: bytes, desc: Any, acc: Dict[str, Any], counts: tuple, file_counts: tuple
) -> Dict[str, Any]:
    """One namespace of :func:`store_stats`: its description, the tallies of its node
    records, its index counters and the files found on disk."""
    desc = desc if isinstance(desc, dict) else {}
    try:
        layout = description_layout(desc)
    except ValueError:
        layout = None
    nodes, tokens, nbytes, pinned = counts
    nfiles, fbytes = file_counts
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
        "salted_trees": _salted_trees(ns, acc["records"]),
    }


def _totals(
    namespaces: List[Dict[str, Any]],
    files: Dict[str, Any],
    index_bytes: int,
    quarantine: Tuple[int, int],
) -> Dict[str, Any]:
    """The totals of :func:`store_stats`: the namespaces' sums and the files found."""
    q_files, q_bytes = quarantine
    totals = {
        key: sum(n[key] for n in namespaces)
        for key in (
            "nodes",
            "prompts",
            "tokens",
            "bytes",
            "pinned_bytes",
            "corrupt_records",
        )
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
    return totals


def _salted_trees(ns: bytes, records: Dict[bytes, tuple]) -> List[Dict[str, Any]]:
    """Nodes, tokens and bytes of each salted tree of a namespace, by its root hash
    (the salt itself is not in the store), largest first."""
    unsalted = root_hash(ns)
    roots = tree_roots({h: r[:2] for h, r in records.items()})
    trees: Dict[bytes, Dict[str, Any]] = {}
    for h, root in roots.items():
        if root == unsalted:
            continue
        tree = trees.setdefault(root, {"root": root.hex(), "nodes": 0})
        _, _, ntokens, nbytes = records[h]
        tree["nodes"] += 1
        tree["tokens"] = tree.get("tokens", 0) + ntokens
        tree["bytes"] = tree.get("bytes", 0) + nbytes
    return sorted(trees.values(), key=lambda t: (-t["bytes"], t["root"]))


def _new_acc() -> Dict[str, Any]:
    return {
        "records": {},  # hash -> (parent, start, tokens, bytes)
        "prompts": 0,
        "pinned_nodes": 0,
        "corrupt_records": 0,
        "created": [],
        "last_access": None,
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
