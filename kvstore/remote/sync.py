"""Bulk sync: ``kvstore push`` (whole namespaces, not one prompt) and the listing of a
namespace's remote nodes that ``kvstore pull`` (:meth:`RemoteTier.pull`) walks."""

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Dict, Iterable, Optional, Set, Tuple

from ..disk.blobs import Blobs, CorruptBlob
from ..disk.chunking import root_hash
from ..disk.index import CorruptRecord, Index, NodeRecord
from ..disk.salts import tree_roots
from ..disk.storecheck import check_store_dirs
from ..maintenance.common import description_layout, namespace_descriptions
from .client import S3Client
from .manifest import CHILD_KEY, HEX32


def list_nodes(s3: S3Client, ns: bytes) -> Dict[bytes, Tuple[bytes, ...]]:
    """``hash -> parents`` (sorted) of every manifest of namespace ``ns`` on the
    remote. A node has one parent; a manifest copied under another one (a stray, or
    a hostile writer) lists it twice, and the listing's order must not pick one."""
    prefix = s3.key(ns, "nodes") + "/"
    out: Dict[bytes, Set[bytes]] = {}
    for key in s3.list_keys(prefix):
        parts = key[len(prefix) :].split("/")
        if len(parts) == 2 and HEX32.fullmatch(parts[0]):
            m = CHILD_KEY.fullmatch(parts[1])
            if m:
                h = bytes.fromhex(m.group(1))
                out.setdefault(h, set()).add(bytes.fromhex(parts[0]))
    return {h: tuple(sorted(parents)) for h, parents in out.items()}


def push(
    path: str,
    tier,
    *,
    namespaces: Optional[Iterable[bytes]] = None,
    progress: Optional[Callable[[int], None]] = None,
) -> dict:
    """Upload the nodes of the store at ``path`` that the remote lacks (no model needed).

    Every file is checked against its record and its namespace's layout before it is
    sent; salted trees (:mod:`kvstore.disk.salts`) are not. Remote failures raise
    RemoteError; local problems are reported.

    Args:
        path: The store directory.
        tier: An unbound :class:`~kvstore.remote.RemoteTier` (``tier.threads``
            nodes are sent at once).
        namespaces: Which namespaces (ids); None: every namespace with nodes.
    """
    check_store_dirs(path)
    index = Index(  # every page checked: a scan of the whole index follows
        os.path.join(path, "index"), create=False, readonly=True, check="full"
    )
    report = {"namespaces": 0, "nodes": 0, "uploaded": 0, "present": 0}
    report.update({"skipped": 0, "problems": []})
    try:
        blobs = Blobs.of_store(path, index.format_version, create=False)
        descs = index.read(lambda txn: namespace_descriptions(index, txn))

        def records(txn, ns):
            out = []
            for _, h, raw in index.iter_nodes(txn, ns):
                try:
                    out.append((h, NodeRecord.decode(raw)))
                except CorruptRecord as e:
                    report["problems"].append(f"node {h.hex()}: index record: {e}")
            return out

        selected = list(namespaces) if namespaces is not None else sorted(descs)
        for ns in selected:
            recs = index.read(lambda txn: records(txn, ns))
            # Salted trees stay on this machine: their roots need this store's secret.
            roots = tree_roots({h: (rec.parent, rec.start) for h, rec in recs})
            recs = [(h, rec) for h, rec in recs if roots.get(h) == root_hash(ns)]
            if not recs:
                continue
            try:
                layout = description_layout(descs.get(ns, "no description"))
            except ValueError as e:
                report["problems"].append(f"namespace {ns.hex()}: {e}")
                continue
            report["namespaces"] += 1
            report["nodes"] += len(recs)
            known = tier.list_nodes(ns)
            tier.put_namespace(ns, descs[ns])
            recs.sort(key=lambda item: item[1].start)  # parents before children

            def one(item):
                h, rec = item
                if rec.parent in known.get(h, ()) and not rec.has_state:
                    return "present"
                try:
                    sent = tier.upload_node(blobs, ns, h, rec, layout, head=h in known)
                except (CorruptBlob, OSError) as e:
                    report["problems"].append(f"node {h.hex()}: {e}")
                    return "skipped"
                return "uploaded" if sent else "present"

            with ThreadPoolExecutor(
                tier.threads, thread_name_prefix="kvstore-push"
            ) as io:
                for outcome in io.map(one, recs):
                    report[outcome] += 1
                    if progress is not None:
                        progress(1)
    finally:
        index.close()
    report["bytes_up"] = tier.stats()["bytes_up"]
    return report
