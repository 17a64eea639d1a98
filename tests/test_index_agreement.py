"""verify's scan of the index in key order (kvstore.maintenance.agreement): a healthy
index agrees, every kind of damage the exact checks repair disagrees (so they run), and
verify reports the same either way."""

import importlib
import os
import struct

import numpy as np
import pytest
from conftest import compute_cache, random_tokens

from kvstore import KVStore
from kvstore import maintenance as m
from kvstore.disk.index import Index, NodeRecord, child_key
from kvstore.maintenance import agreement

verify_mod = importlib.import_module("kvstore.maintenance.verify")

C = 16
A = random_tokens(70, seed=31)  # nodes a[0..4]: 4 full chunks and a 6-token tail
B = A[:32] + random_tokens(40, seed=32)  # shares a[0] and a[1]


@pytest.fixture
def store(tmp_path, model):
    path = tmp_path / "store"
    with KVStore(path, model, chunk_tokens=C) as s:
        s.save(A, compute_cache(model, A), pin=True)
        s.save(B, compute_cache(model, B))
        s.save(B[:20], compute_cache(model, B[:20]), salt="tenant")
        s.flush()
    return path


def agreed(path):
    index = Index(os.path.join(path, "index"), create=False)
    try:
        return index.read(lambda txn: agreement.index_agrees(index, txn))
    finally:
        index.close()


def damage(path, fn):
    index = Index(os.path.join(path, "index"), create=False)
    try:
        index.write(lambda txn: fn(index, txn))
    finally:
        index.close()


def records(index, txn):
    """``(ns, h, record)`` of every node."""
    return [(ns, h, NodeRecord.decode(raw)) for ns, h, raw in index.iter_nodes(txn)]


def test_a_healthy_index_agrees_and_sums_to_its_counters(store):
    got = agreed(store)
    assert got is not None and got.nodes == sum(s[0] for s in got.sums.values())
    index = Index(os.path.join(store, "index"), create=False)
    try:
        for ns, sums in got.sums.items():
            assert tuple(sums) == index.read(
                lambda txn, ns=ns: Index.COUNTERS.unpack(
                    bytes(txn.get(ns, db=index.db["counters"]))
                )
            )
    finally:
        index.close()


def test_verify_of_a_healthy_index_skips_the_lookups(store, monkeypatch):
    """The exact checks (a lookup per node) run only when the scans disagree."""

    def never(*args, **kwargs):
        raise AssertionError("the exact checks ran on a healthy index")

    monkeypatch.setattr(verify_mod, "_node_diffs", never)
    monkeypatch.setattr(verify_mod, "_stale_entries", never)
    report = m.verify(store)
    assert report["clean"] and report["problems"] == []


def _first(kind):
    """A damage function acting on the first node (of the pinned prompt A, or not)."""

    def pick(index, txn, pinned=None):
        for ns, h, rec in records(index, txn):
            if pinned is None or rec.pinned == pinned:
                return ns, h, rec
        raise AssertionError("no such node")

    def drop_edge(index, txn):
        ns, h, rec = pick(index, txn)
        txn.delete(child_key(ns, rec.parent, rec.tokens, h), db=index.db["children"])

    def stale_edge(index, txn):
        ns, h, rec = pick(index, txn)
        key = child_key(ns, h, np.array([7, 7], np.int32), b"\x05" * 16)
        txn.put(key, b"", db=index.db["children"])

    def edge_of_another_child(index, txn):
        # The edge names a child the record of which hangs elsewhere.
        ns, h, rec = pick(index, txn)
        txn.delete(child_key(ns, rec.parent, rec.tokens, h), db=index.db["children"])
        txn.put(
            child_key(ns, rec.parent, rec.tokens[::-1], h), b"", db=index.db["children"]
        )

    def drop_atime(index, txn):
        ns, h, _ = pick(index, txn)
        txn.delete(ns + h, db=index.db["atime"])

    def bad_atime(index, txn):
        ns, h, _ = pick(index, txn)
        txn.put(ns + h, b"\x01\x02", db=index.db["atime"])

    def stale_atime(index, txn):
        ns, _, _ = pick(index, txn)
        txn.put(ns + b"\x09" * 16, struct.pack("<d", 1.0), db=index.db["atime"])

    def drop_pin(index, txn):
        ns, h, _ = pick(index, txn, pinned=True)
        txn.delete(ns + h, db=index.db["pins"])

    def stale_pin(index, txn):
        ns, h, _ = pick(index, txn, pinned=False)
        txn.put(ns + h, b"", db=index.db["pins"])

    def wrong_start(index, txn):
        # A child that no longer starts where its parent ends.
        for ns, h, rec in records(index, txn):
            if rec.start:
                moved = NodeRecord(**{**rec.__dict__, "start": rec.start + 1})
                txn.put(ns + h, moved.encode(), db=index.db["nodes"])
                return
        raise AssertionError("no child node")

    def lost_parent(index, txn):
        for ns, h, rec in records(index, txn):
            if rec.start and txn.get(ns + rec.parent, db=index.db["nodes"]):
                index.delete_node(txn, ns, rec.parent)
                return
        raise AssertionError("no child node")

    def corrupt_record(index, txn):
        ns, h, _ = pick(index, txn)
        txn.put(ns + h, b"garbage!" * 5, db=index.db["nodes"])

    def short_key(index, txn):
        txn.put(b"short key", b"junk", db=index.db["nodes"])

    return locals()[kind]


KINDS = [
    "drop_edge",
    "stale_edge",
    "edge_of_another_child",
    "drop_atime",
    "bad_atime",
    "stale_atime",
    "drop_pin",
    "stale_pin",
    "wrong_start",
    "lost_parent",
    "corrupt_record",
    "short_key",
]


@pytest.mark.parametrize("kind", KINDS)
def test_every_damage_disagrees_and_verify_reports_it(store, kind):
    assert agreed(store) is not None
    damage(store, _first(kind))
    assert agreed(store) is None
    report = m.verify(store)
    assert not report["clean"], report["problems"]
    m.verify(store, fix=True)
    assert m.verify(store)["clean"]
    assert agreed(store) is not None  # repaired: the scans agree again
