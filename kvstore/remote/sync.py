"""Bulk sync (``kvstore push`` / ``kvstore pull``): whole namespaces, not one prompt."""

import os
from collections import defaultdict
from typing import TYPE_CHECKING, Callable, Dict, Iterable, Optional

from ..blobs import CorruptBlob
from ..index import CorruptRecord, NodeRecord
from .client import S3Client
from .errors import RemoteCorrupt
from .manifest import CHILD_KEY, HEX32

if TYPE_CHECKING:
    from .tier import RemoteTier


def list_nodes(s3: S3Client, ns: bytes) -> Dict[bytes, bytes]:
    """``hash -> parent`` of every manifest of namespace ``ns`` on the remote."""
    prefix = s3.key(ns, "nodes") + "/"
    out = {}
    for key in s3.list_keys(prefix):
        parts = key[len(prefix) :].split("/")
        if len(parts) == 2 and HEX32.fullmatch(parts[0]):
            m = CHILD_KEY.fullmatch(parts[1])
            if m:
                out[bytes.fromhex(m.group(1))] = bytes.fromhex(parts[0])
    return out


def pull(
    tier: "RemoteTier", *, progress: Optional[Callable[[int], None]] = None
) -> dict:
    """Download every node of the tier's bound store's namespace that it lacks.

    The trie is walked from the root, parents before children; every manifest and
    file is validated as in a fetch, an invalid node is reported and its subtree
    skipped. Remote failures (network, credentials, bucket) raise RemoteError.
    """
    store = tier._store
    ns, C = store.namespace, store.chunk_tokens
    nodes = tier.list_nodes(ns)
    children = defaultdict(list)
    for h, parent in nodes.items():
        children[parent].append(h)
    report = {"remote_nodes": len(nodes), "pulled": 0, "present": 0}
    report.update({"invalid": 0, "unreachable": 0, "problems": []})

    def manifest(h, parent, start):
        return tier._reader.manifest(
            ns, parent, h, start=start, chunk_tokens=C, strict=True
        )

    reached = 0
    level = [(h, store.root, 0) for h in sorted(children[store.root])]
    while level:
        jobs = [(h, tier._io.submit(manifest, h, p, s)) for h, p, s in level]
        good = []
        for h, job in jobs:
            try:
                rec = job.result()
            except RemoteCorrupt as e:
                tier._reader.report_corrupt(str(e))
                report["problems"].append(str(e))
                report["invalid"] += 1
                continue
            if rec is not None:
                good.append((h, rec))
        reached += len(level)
        local = {h for h, _ in good if store.index.get_node(ns, h) is not None}
        report["present"] += len(local)
        before = len(report["problems"])
        pulled = tier._download_commit(
            [(h, rec) for h, rec in good if h not in local],
            chain_mode=False,
            problems=report["problems"],
        )
        report["pulled"] += pulled
        report["invalid"] += len(report["problems"]) - before
        if progress is not None:
            progress(pulled + len(local))
        level = [
            (c, h, rec.end)
            for h, rec in good
            if store.index.get_node(ns, h) is not None
            for c in sorted(children[h])
        ]
    report["unreachable"] = len(nodes) - reached
    report["bytes_down"] = tier.stats()["bytes_down"]
    return report


def push(
    path: str,
    tier: "RemoteTier",
    *,
    namespaces: Optional[Iterable[bytes]] = None,
    progress: Optional[Callable[[int], None]] = None,
) -> dict:
    """Upload the nodes of the store at ``path`` that the remote lacks (no model needed).

    Every file is checked against its record and its namespace's layout before it is
    sent. Remote failures raise RemoteError; local problems are reported.

    Args:
        path: The store directory.
        tier: An unbound :class:`RemoteTier`.
        namespaces: Which namespaces (ids); None: every namespace with nodes.
    """
    from ..blobs import Blobs
    from ..index import Index
    from ..maintenance.common import _descriptions, _layout
    from ..storecheck import check_store_dirs

    check_store_dirs(path)
    index = Index(os.path.join(path, "index"), create=False, readonly=True)
    report = {"namespaces": 0, "nodes": 0, "uploaded": 0, "present": 0}
    report.update({"skipped": 0, "problems": []})
    try:
        blobs = Blobs(
            os.path.join(path, "blobs"), os.path.join(path, "quarantine"), create=False
        )
        descs = index.read(lambda txn: _descriptions(index, txn))

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
            if not recs:
                continue
            try:
                layout = _layout(descs.get(ns, "no description"))
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
                if known.get(h) == rec.parent and not rec.has_state:
                    return "present"
                try:
                    sent = tier.upload_node(blobs, ns, h, rec, layout, head=h in known)
                except (CorruptBlob, OSError) as e:
                    report["problems"].append(f"node {h.hex()}: {e}")
                    return "skipped"
                return "uploaded" if sent else "present"

            for outcome in tier._io.map(one, recs):
                report[outcome] += 1
                if progress is not None:
                    progress(1)
    finally:
        index.close()
    report["bytes_up"] = tier.stats()["bytes_up"]
    return report
