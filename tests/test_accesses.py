"""Access times: a request's end exact, its ancestors at most every
ANCESTOR_RESOLUTION_S, and eviction unchanged by that."""

import os
import struct

import numpy as np
from conftest import compute_cache, random_tokens

from kvstore import KVStore
from kvstore import maintenance as m
from kvstore.disk.chunking import chain_hashes, root_hash, split_spans
from kvstore.disk.index import Index
from kvstore.disk.policy import DiskNode, disk_victims
from kvstore.engine import accesses as acc_mod
from kvstore.engine.accesses import ANCESTOR_RESOLUTION_S, Accesses

C = 16
NS = bytes(range(16))


def hsh(i: int) -> bytes:
    return struct.pack(">QQ", 0xABCD, i)


def node_hashes(ns: bytes, tokens) -> list:
    arr = np.asarray(tokens, dtype=np.int32)
    return chain_hashes(root_hash(ns), arr, split_spans(0, len(arr), C))


def read_atimes(path, ns: bytes, hashes) -> list:
    index = Index(os.path.join(path, "index"), create=False)
    try:
        return index.read(lambda txn: [index.atime(txn, ns, h) for h in hashes])
    finally:
        index.close()


class _Writer:
    def __init__(self):
        self.jobs = []

    def submit(self, job, nbytes=0):
        self.jobs.append(job)
        return True


def test_accesses_note_ancestors_once_per_resolution(monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(acc_mod.time, "time", lambda: clock[0])
    a = Accesses(index=None, namespace=NS, writer=_Writer(), rates=None)
    a.touch([hsh(1), hsh(2), hsh(3)])
    assert a.take() == {
        hsh(1): (1000.0, False),
        hsh(2): (1000.0, False),
        hsh(3): (1000.0, True),
    }
    clock[0] += 5
    a.touch([hsh(1), hsh(2), hsh(3), hsh(4)])  # the same path, one node deeper
    assert a.take() == {hsh(3): (1005.0, False), hsh(4): (1005.0, True)}
    clock[0] += 5
    a.touch([hsh(1), hsh(2)])  # a request ending at an ancestor: exact
    a.touch([hsh(1), hsh(2), hsh(5)])  # still an end in this batch
    assert a.take() == {hsh(2): (1010.0, True), hsh(5): (1010.0, True)}
    clock[0] += ANCESTOR_RESOLUTION_S
    a.touch([hsh(1), hsh(2), hsh(3)])
    assert set(a.take()) == {hsh(1), hsh(2), hsh(3)}


def test_disk_victims_take_a_parent_at_its_subtree_s_time():
    """A parent's own time older than its child's (an ancestor's coarse time): it
    still goes only after its child, and right after it; its own newer time (a
    request ended there) keeps it longer."""
    nodes = {
        "p": DiskNode(1.0, 10, None, False),
        "c": DiskNode(50.0, 10, "p", False),
        "x": DiskNode(20.0, 10, None, False),
        "y": DiskNode(60.0, 10, None, False),
        "q": DiskNode(70.0, 10, None, False),
        "d": DiskNode(30.0, 10, "q", False),
    }
    assert disk_victims(nodes, 60) == ["x", "d", "c", "p", "y", "q"]


def test_repeated_fetches_rewrite_only_the_end_and_gc_keeps_the_used_chain(
    tmp_path, model
):
    used = random_tokens(6 * C, seed=1)  # a chain of 6 nodes, fetched again
    stale = random_tokens(6 * C, seed=2)  # saved after it, never used again
    path = str(tmp_path / "s")
    with KVStore(path, model, chunk_tokens=C) as s:
        s.save(used, compute_cache(model, used))
        s.flush()
        s.save(stale, compute_cache(model, stale))
        s.flush()
        ns, total = s.namespace, s.stats()["bytes_on_disk"]
        before = read_atimes(path, ns, node_hashes(ns, used))
        assert s.fetch(used + [1])[1] == len(used)
        s.flush()
        after = read_atimes(path, ns, node_hashes(ns, used))
    assert after[:-1] == before[:-1]  # ancestors written when saved: kept
    assert after[-1] > before[-1]  # the end: exact
    report = m.gc(path, max_bytes=total // 2)
    assert report["evicted_nodes"] == 6
    hashes = set(node_hashes(ns, used))
    index = Index(os.path.join(path, "index"), create=False)
    try:
        left = index.read(lambda txn: {h for _, h, _ in index.iter_nodes(txn, ns)})
    finally:
        index.close()
    assert left == hashes  # the stale prompt went whole, the used chain stayed
