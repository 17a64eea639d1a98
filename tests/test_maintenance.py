"""Store maintenance without a model (kvstore.maintenance), on tiny random llama stores:
stats, the prefix tree, verify and fix, gc, budgets, pins."""

import dataclasses
import os
import shutil
import threading
import time
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest
from conftest import compute_cache, random_tokens

from kvstore import KVStore, StoreError
from kvstore import maintenance as m
from kvstore.disk.blobs import Blobs
from kvstore.disk.chunking import chain_hashes, root_hash, split_spans
from kvstore.disk.index import _OPEN, FORMAT_VERSION, Index

C = 64
A = random_tokens(300, seed=21)  # 4 full chunks and a 44-token tail: nodes a[0..4]
B = A[:128] + random_tokens(
    100, seed=22
)  # shares a[0], a[1]; then b[2] (64), b[3] (36)
X = random_tokens(150, seed=23)  # the other model's prompt: 64 + 64 + 22


def node_hashes(ns: bytes, tokens) -> list:
    arr = np.asarray(tokens, dtype=np.int32)
    return chain_hashes(root_hash(ns), arr, split_spans(0, len(arr), C))


def blob_path(path, ns: bytes, h: bytes) -> str:
    return Blobs(os.path.join(path, "blobs"), os.path.join(path, "quarantine")).path(
        ns, h
    )


def with_index(path, fn):
    """Run ``fn(index, txn)`` in a write transaction on the store's index."""
    index = Index(os.path.join(path, "index"), create=False)
    try:
        return index.write(lambda txn: fn(index, txn))
    finally:
        index.close()


def node_ids(path, ns: bytes) -> set:
    return with_index(path, lambda idx, txn: {h for _, h, _ in idx.iter_nodes(txn, ns)})


def pinned_ids(path, ns: bytes) -> set:
    index = Index(os.path.join(path, "index"), create=False)
    try:
        return set(index.pinned(ns))
    finally:
        index.close()


def ns_stats(path, ns: bytes) -> dict:
    stats = m.store_stats(path, full=True)
    return next(n for n in stats["namespaces"] if n["id"] == ns.hex())


def assert_restores(model, path, tokens, expect_n):
    """A fresh KVStore restores exactly ``expect_n`` tokens, bit-identical to a cold run."""
    with KVStore(path, model, chunk_tokens=C, ram_bytes=0) as s:
        cache, n = s.fetch(tokens + [1])
        assert n == expect_n
        ref = compute_cache(model, tokens)
        for got, want in zip(cache, ref):
            assert mx.array_equal(got.keys[:, :, :n], want.keys[:, :, :n]).item()
            assert mx.array_equal(got.values[:, :, :n], want.values[:, :, :n]).item()
        assert s.stats()["corrupt"] == 0


@pytest.fixture
def store(tmp_path, model, other_model):
    """Two namespaces: A and B (sharing two chunks) for ``model``, X for ``other_model``."""
    path = tmp_path / "store"
    with KVStore(path, model, chunk_tokens=C) as s:
        s.save(A, compute_cache(model, A))
        s.flush()
        s.save(B, compute_cache(model, B))
        s.flush()
        ns, stats = s.namespace, s.stats()
    with KVStore(path, other_model, chunk_tokens=C) as s:
        s.save(X, compute_cache(other_model, X))
        s.flush()
        other, other_stats = s.namespace, s.stats()
    return SimpleNamespace(
        path=path,
        ns=ns,
        other=other,
        stats=stats,
        other_stats=other_stats,
        a=node_hashes(ns, A),
        b=node_hashes(ns, B),
        x=node_hashes(other, X),
    )


# -- stats and tree ---------------------------------------------------------------------


def test_stats_answer_without_waiting_for_the_full_page_check(store, monkeypatch):
    """Plain stats reads the kept totals (small trees, their pages checked first):
    it does not wait for the open's full page check (~5 s at a million nodes)."""
    import threading

    from kvstore.disk import pageguard

    monkeypatch.setattr(pageguard.PageAudit, "start", lambda self, *a, **kw: None)
    out = {}
    t = threading.Thread(
        target=lambda: out.update(m.store_stats(store.path)), daemon=True
    )
    t.start()
    t.join(30)
    assert out, "stats waited for a page check that never ends"
    nodes = store.stats["nodes"] + store.other_stats["nodes"]
    assert out["totals"]["nodes"] == nodes


def test_stats_match_what_was_saved(store):
    t0 = time.time()
    st = m.store_stats(store.path, full=True)
    assert st["format_version"] == FORMAT_VERSION
    assert st["disk_budget"] is None
    assert [n["id"] for n in st["namespaces"]] == sorted(
        [store.ns.hex(), store.other.hex()]
    )
    mine = ns_stats(store.path, store.ns)
    assert store.stats["nodes"] == mine["nodes"] == 7
    assert store.stats["stored_tokens"] == mine["tokens"] == 400
    assert store.stats["bytes_on_disk"] == mine["bytes"] == mine["file_bytes"]
    assert mine["prompts"] == 2 and mine["files"] == 7
    assert mine["pinned_bytes"] == mine["pinned_nodes"] == mine["corrupt_records"] == 0
    assert (mine["model_type"], mine["chunk_tokens"], mine["layers"]) == ("llama", C, 2)
    assert mine["dtype"] == "float32" and mine["tokenizer"] is False
    # 2 layers x 2 heads x (16 + 16) dims x 4 bytes; headers add a little per file
    assert mine["bytes_per_token"] == 512
    assert 400 * 512 < mine["bytes"] < 400 * 512 + 7 * 4096
    assert t0 - 600 < mine["oldest"] <= mine["newest"] <= mine["last_access"] <= t0
    other = ns_stats(store.path, store.other)
    assert (other["nodes"], other["prompts"], other["tokens"]) == (3, 1, 150)
    assert other["bytes"] == store.other_stats["bytes_on_disk"]
    totals = st["totals"]
    assert (totals["namespaces"], totals["nodes"], totals["prompts"]) == (2, 10, 3)
    assert (
        totals["bytes"]
        == st["bytes_on_disk"]
        == store.other_stats["store_bytes_on_disk"]
    )
    assert totals["file_bytes"] == st["file_bytes"] == totals["bytes"]
    assert (
        totals["files"] == 10
        and totals["temp_files"] == totals["quarantine_files"] == 0
    )
    assert totals["index_bytes"] > 0
    # Without ``full``: the same counters and descriptions, no scan's fields.
    kept = m.store_stats(store.path)
    assert kept["full"] is False and st["full"] is True
    for a, b in zip(kept["namespaces"], st["namespaces"]):
        for key in ("id", "nodes", "tokens", "bytes", "pinned_bytes", "layers"):
            assert a[key] == b[key]
        assert a["prompts"] is a["files"] is a["salted_trees"] is a["oldest"] is None
    assert kept["totals"]["bytes"] == totals["bytes"]
    assert kept["totals"]["file_bytes"] is kept["totals"]["prompts"] is None


def test_list_tree_shape(store):
    trees = m.list_tree(store.path)
    assert [t["namespace"] for t in trees] == sorted(
        [store.ns.hex(), store.other.hex()]
    )
    mine = next(t for t in trees if t["namespace"] == store.ns.hex())
    assert (mine["model_type"], mine["nodes"], mine["more"]) == ("llama", 7, 0)
    (n0,) = mine["children"]
    assert n0["id"] == store.a[0].hex() and n0["short"] == store.a[0].hex()[:12]
    assert (n0["tokens"], n0["start"], n0["first_tokens"]) == (64, 0, A[:16])
    assert (n0["kind"], n0["pinned"], n0["error"]) == ("user", False, None)
    assert n0["nbytes"] > 0 and n0["last_use"] > 0
    (n1,) = n0["children"]
    assert n1["first_tokens"] == A[64:80]
    by_id = {c["id"]: c for c in n1["children"]}
    assert set(by_id) == {store.a[2].hex(), store.b[2].hex()}
    # Depth 4 (the default) ends at a[3], whose one child is counted, not shown.
    a3 = by_id[store.a[2].hex()]["children"][0]
    assert a3["id"] == store.a[3].hex() and a3["children"] == [] and a3["more"] == 1
    b3 = by_id[store.b[2].hex()]["children"][0]
    assert (b3["id"], b3["tokens"], b3["start"]) == (store.b[3].hex(), 36, 192)
    assert b3["children"] == [] and b3["more"] == 0
    other = next(t for t in trees if t["namespace"] == store.other.hex())
    assert [c["tokens"] for c in [other["children"][0]]] == [64]
    assert other["children"][0]["first_tokens"] == X[:16]


def test_list_tree_limits(store):
    (tree,) = m.list_tree(
        store.path, namespace=store.ns.hex()[:8], max_depth=2, max_children=1
    )
    assert tree["namespace"] == store.ns.hex()
    n1 = tree["children"][0]["children"][0]
    assert n1["children"] == [] and n1["more"] == 2
    (tree,) = m.list_tree(store.path, namespace=store.ns.hex(), max_children=1)
    n1 = tree["children"][0]["children"][0]
    assert len(n1["children"]) == 1 and n1["more"] == 1
    for tree in m.list_tree(store.path, max_depth=0):
        assert tree["children"] == [] and tree["more"] == 1
    assert m.list_tree(store.path, max_children=0)[0]["children"] == []
    with pytest.raises(ValueError, match="hex digits"):
        m.list_tree(store.path, namespace="abc")
    with pytest.raises(ValueError, match="no namespace"):
        m.list_tree(store.path, namespace="f" * 32)
    with pytest.raises(ValueError, match="max_depth"):
        m.list_tree(store.path, max_depth=-1)


def test_directory_that_is_not_a_store(tmp_path):
    (tmp_path / "photos").mkdir()
    for fn in (m.store_stats, m.list_tree, m.verify, m.gc, m.disk_budget):
        with pytest.raises(StoreError, match="no kvstore index"):
            fn(tmp_path / "photos")
        with pytest.raises(StoreError):
            fn(tmp_path / "missing")
    with pytest.raises(StoreError):
        m.pin_path(tmp_path / "photos", "0" * 32, "0" * 32, True)
    assert os.listdir(tmp_path / "photos") == [] and not (tmp_path / "missing").exists()


def test_every_call_closes_the_index(store):
    key = os.path.realpath(os.path.join(store.path, "index"))
    m.store_stats(store.path)
    m.list_tree(store.path)
    m.verify(store.path, fix=True)
    m.gc(store.path)
    m.pin_path(store.path, store.ns.hex(), store.a[4].hex(), True)
    with pytest.raises(ValueError):
        m.set_pinned(store.path, store.ns.hex(), ["0" * 32], True)
    assert not any(path == key for path, _ in _OPEN)


# -- verify -----------------------------------------------------------------------------


def test_empty_store(tmp_path, model):
    path = tmp_path / "s"
    KVStore(path, model, chunk_tokens=C).close()
    st = m.store_stats(path, full=True)
    (ns,) = st["namespaces"]
    assert (ns["nodes"], ns["prompts"], ns["oldest"], ns["last_access"]) == (
        0,
        0,
        None,
        None,
    )
    assert st["bytes_on_disk"] == st["file_bytes"] == 0
    assert m.list_tree(path)[0]["children"] == []
    assert m.verify(path)["clean"] and m.verify(path)["nodes"] == 0
    assert m.gc(path, max_bytes=0)["bytes_freed"] == 0


def test_verify_clean_store(store):
    report = m.verify(store.path)
    assert report["clean"] and report["errors"] == 0 and report["problems"] == []
    assert (report["namespaces"], report["nodes"], report["files_checked"]) == (
        2,
        10,
        10,
    )
    assert report["bytes_checked"] == m.store_stats(store.path)["bytes_on_disk"]
    assert report["fixed"] is None
    assert m.verify(store.path, fix=True)["fixed"] is None  # nothing to do


def _damage(path: str, how: str, source: str) -> None:
    if how == "delete":
        os.unlink(path)
        return
    with open(path, "rb") as f:
        data = bytearray(f.read())
    if how == "flip-data":
        data[-10] ^= 0xFF
    elif how == "flip-header":
        data[20] ^= 0x01  # inside the JSON header
    elif how == "truncate":
        data = data[: len(data) // 2]
    elif how.startswith("other-"):
        with open(source, "rb") as f:
            data = f.read()  # same size and header, another node's KV
    with open(path, "wb") as f:
        f.write(data)


DAMAGE = {
    "truncate": "size",
    "flip-data": "checksum",
    "flip-header": "header",
    "delete": "missing",
    "other-node": "checksum",
    "other-namespace": "namespace",
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_verify_finds_and_fixes_a_broken_file(store, model, damage):
    victim = blob_path(store.path, store.ns, store.a[2])  # tokens 128..192, A's only
    if (
        damage == "other-namespace"
    ):  # the other model's first node: same shapes and size
        source = blob_path(store.path, store.other, store.x[0])
    else:
        source = blob_path(store.path, store.ns, store.a[3])
    _damage(victim, damage, source=source)
    report = m.verify(store.path)
    assert not report["clean"] and report["errors"] == 1
    (problem,) = report["problems"]
    assert problem["kind"] == DAMAGE[damage]
    assert (
        problem["namespace"] == store.ns.hex() and problem["node"] == store.a[2].hex()
    )
    assert problem["file"] == victim and problem["detail"]

    fixed = m.verify(store.path, fix=True)["fixed"]
    assert fixed["nodes_removed"] == 3  # a[2] with its descendants a[3], a[4]
    assert fixed["skipped"] == 0 and fixed["files_unlinked"] == 2
    assert len(fixed["quarantined"]) == (0 if damage == "delete" else 1)
    assert all(
        q.startswith(str(store.path / "quarantine")) for q in fixed["quarantined"]
    )
    after = m.verify(store.path)
    assert after["clean"] and after["problems"] == []
    mine = ns_stats(store.path, store.ns)
    assert (mine["nodes"], mine["tokens"], mine["prompts"]) == (4, 228, 1)
    assert mine["bytes"] == mine["file_bytes"]
    assert_restores(model, store.path, A, 128)
    assert_restores(model, store.path, B, len(B))


def test_verify_opens_a_batch_on_several_threads_and_finds_each_broken_file(
    tmp_path, model, monkeypatch
):
    """A batch of files opened on the verify's opener threads, each a part of it:
    damaged files in different parts are each reported, every other file checked,
    and no descriptor is left open."""
    from kvstore.maintenance import readahead

    path = tmp_path / "store"
    prompts = [random_tokens(16 * 8, seed=100 + i) for i in range(6)]
    with KVStore(path, model, chunk_tokens=16) as s:
        for p in prompts:
            s.save(p, compute_cache(model, p))
        s.flush()
        ns = s.namespace
    hashes = sorted(h for p in prompts for h in node_hashes_c(ns, p, 16))
    assert len(hashes) == 48 >= 2 * readahead.OPENERS  # opened by the threads
    victims = {hashes[1]: "missing", hashes[20]: "checksum", hashes[45]: "size"}
    for h, kind in victims.items():
        how = {"missing": "delete", "checksum": "flip-data", "size": "truncate"}
        _damage(blob_path(path, ns, h), how[kind], source="")
    calls, opener = [], readahead.ReadAhead._open

    def recorded(self, items):
        calls.append(threading.current_thread().name)
        return opener(self, items)

    monkeypatch.setattr(readahead.ReadAhead, "_open", recorded)
    monkeypatch.setattr(readahead, "SLOW_OPEN_S", -1.0)  # as if read from the disk
    fds = os.listdir("/proc/self/fd") if os.path.isdir("/proc/self/fd") else None
    report = m.verify(path)
    # The first file probed on this thread, the rest in OPENERS parts on the pool
    # (which of its threads runs which part is the pool's choice).
    assert calls[0] == threading.current_thread().name
    assert len(calls) == 1 + readahead.OPENERS
    assert all(n.startswith("kvstore-open") for n in calls[1:])
    if fds is not None:
        assert len(os.listdir("/proc/self/fd")) == len(fds)
    found = {bytes.fromhex(p["node"]): p["kind"] for p in report["problems"]}
    assert found == victims
    assert report["files_checked"] == 48


def test_openers_use_threads_only_while_opens_are_slow():
    """A batch's first files are opened on the calling thread, each timed alone: the
    first slow one (an inode read from the disk) sends the rest to the opener
    threads; while they are fast (cached) the whole batch stays on the calling
    thread, where threads would only add their switching. (A clock of its own: the
    opens take the time they are charged.)"""
    from concurrent.futures import ThreadPoolExecutor

    from kvstore.maintenance import readahead

    now, charge, threads = [0.0], [0.0], []
    lock = threading.Lock()

    def open_part(items):
        with lock:
            threads.append(threading.current_thread().name)
            now[0] += charge[0] * len(items)
        return {i: i for i in items}

    main = threading.current_thread().name
    batch = list(range(4 * readahead.OPENERS))
    with ThreadPoolExecutor(readahead.OPENERS, thread_name_prefix="opener") as pool:
        openers = readahead.Openers(pool, clock=lambda: now[0])
        charge[0] = 2 * readahead.SLOW_OPEN_S  # cold: the first open is slow
        assert openers.run(open_part, batch) == {i: i for i in batch}
        assert threads[0] == main and len(threads) == 1 + readahead.OPENERS
        assert all(t.startswith("opener") for t in threads[1:])
        threads.clear()
        charge[0] = readahead.SLOW_OPEN_S / 10  # cached: all on this thread
        assert openers.run(open_part, batch) == {i: i for i in batch}
        assert set(threads) == {main} and len(threads) == readahead.PROBE + 1
        threads.clear()
        charge[0] = 2 * readahead.SLOW_OPEN_S
        assert openers.run(open_part, [1, 2]) == {1: 1, 2: 2}  # too few to split
        assert set(threads) == {main}


def node_hashes_c(ns: bytes, tokens, chunk: int) -> list:
    arr = np.asarray(tokens, dtype=np.int32)
    return chain_hashes(root_hash(ns), arr, split_spans(0, len(arr), chunk))


def test_verify_checks_each_distinct_header_once_and_never_trusts_a_stale_one(store):
    from kvstore.disk.blobs import DELTA_PART, CorruptBlob
    from kvstore.maintenance import common
    from kvstore.maintenance.verify import _checked_header

    def read(idx, txn):
        descs = common.namespace_descriptions(idx, txn)
        layout = common.description_layout(descs[store.ns])
        other = common.description_layout(descs[store.other])
        recs = [idx.get_node(store.ns, h, txn=txn) for h in store.a[:2]]
        return layout, other, recs

    layout, other, (r0, r1) = with_index(store.path, read)
    files = []
    for h in store.a[:2]:
        with open(blob_path(store.path, store.ns, h), "rb") as f:
            files.append(f.read())
    assert files[0] != files[1] and r0.ntokens == r1.ntokens == C
    headers = {}
    meta = _checked_header(files[0], DELTA_PART, layout, r0, headers)
    assert meta["namespace"] == store.ns.hex() and len(headers) == 1
    # The same header and size: taken from the memo, whatever the KV after it.
    assert _checked_header(files[1], DELTA_PART, layout, r1, headers) is meta
    assert len(headers) == 1
    # A record of other token count, or another layout, is checked afresh.
    short = dataclasses.replace(r1, tokens=r1.tokens[:10])
    with pytest.raises(CorruptBlob):
        _checked_header(files[1], DELTA_PART, layout, short, headers)
    _checked_header(files[1], DELTA_PART, other, r1, headers)
    assert len(headers) == 2


def test_verify_finds_and_fixes_corrupt_index_records(store, model):
    def corrupt(idx, txn):
        txn.put(store.ns + store.a[2], b"garbage!" * 5, db=idx.db["nodes"])
        txn.put(b"short key", b"junk", db=idx.db["nodes"])

    with_index(store.path, corrupt)
    report = m.verify(store.path)
    assert not report["clean"]
    assert sorted(p["kind"] for p in report["problems"]) == ["record", "record"]
    assert store.a[2].hex() in {p["node"] for p in report["problems"]}
    fixed = m.verify(store.path, fix=True)["fixed"]
    assert len(fixed["quarantined"]) == 1  # a[2]'s file; its descendants' are unlinked
    assert fixed["index_repairs"] >= 2  # a[1]'s edge to a[2], and the counters
    assert m.verify(store.path)["problems"] == []
    mine = ns_stats(store.path, store.ns)
    assert (mine["nodes"], mine["tokens"], mine["bytes"]) == (
        4,
        228,
        mine["file_bytes"],
    )
    assert_restores(model, store.path, A, 128)
    assert_restores(model, store.path, B, len(B))


def test_unreachable_nodes_are_removed(store, model):
    # a[3]'s record goes (as a crash-damaged index might lose it): a[4] hangs from nothing
    with_index(store.path, lambda idx, txn: idx.delete_node(txn, store.ns, store.a[3]))
    report = m.verify(store.path)
    assert not report["clean"] and report["orphans"] == 1
    kinds = {p["kind"]: p for p in report["problems"]}
    assert set(kinds) == {"unreachable", "orphan"}
    assert kinds["unreachable"]["node"] == store.a[4].hex()
    assert kinds["orphan"]["node"] == store.a[3].hex()
    fixed = m.verify(store.path, fix=True)["fixed"]
    assert fixed["nodes_removed"] == 1 and fixed["files_unlinked"] == 1
    assert fixed["quarantined"] == []  # a sound file that nothing reaches: unlinked
    report = m.verify(store.path)
    assert report["clean"] and report["orphans"] == 1  # left to gc
    assert m.gc(store.path)["orphans_removed"] == 1
    assert m.verify(store.path)["problems"] == []
    assert_restores(model, store.path, A, 192)


def test_verify_repairs_index_tables(store):
    packer = Index.COUNTERS

    def damage(idx, txn):
        txn.put(store.ns, packer.pack(1, 2, 3, 4), db=idx.db["counters"])
        txn.delete(store.ns + store.a[0], db=idx.db["atime"])
        txn.put(store.ns + b"\x01" * 16, b"", db=idx.db["pins"])

    with_index(store.path, damage)
    report = m.verify(store.path)
    assert sorted(p["kind"] for p in report["problems"]) == [
        "counters",
        "index",
        "index",
    ]
    assert m.verify(store.path, fix=True)["fixed"]["index_repairs"] == 3
    assert m.verify(store.path)["problems"] == []
    mine = ns_stats(store.path, store.ns)
    assert (mine["nodes"], mine["tokens"], mine["bytes"]) == (
        7,
        400,
        store.stats["bytes_on_disk"],
    )


def test_orphans_and_temp_files_are_reported_but_clean(store):
    src = blob_path(store.path, store.ns, store.a[0])
    orphan = blob_path(store.path, store.ns, b"\xab" * 16)
    os.makedirs(os.path.dirname(orphan), exist_ok=True)
    shutil.copy(src, orphan)
    other_dir = "cd" if not store.a[0].hex().startswith("cd") else "ef"
    misplaced = os.path.join(os.path.dirname(src), other_dir * 16 + ".safetensors")
    shutil.copy(src, misplaced)
    temp = os.path.join(os.path.dirname(src), f".{store.a[0].hex()}.123.deadbeef.tmp")
    with open(temp, "wb") as f:
        f.write(b"half a file")
    with open(store.path / "blobs" / "notes.txt", "w") as f:
        f.write("not ours")
    report = m.verify(store.path)
    assert report["clean"] and report["errors"] == 0
    assert (report["orphans"], report["temp_files"], report["stray_files"]) == (2, 1, 1)
    files = {p["kind"]: p["file"] for p in report["problems"] if p["kind"] != "orphan"}
    assert files == {"temp": temp, "stray": str(store.path / "blobs" / "notes.txt")}
    assert {p["file"] for p in report["problems"] if p["kind"] == "orphan"} == {
        orphan,
        misplaced,
    }


# -- gc ---------------------------------------------------------------------------------


def test_gc_removes_orphans_and_old_temp_files(store):
    src = blob_path(store.path, store.ns, store.a[0])
    orphan = blob_path(store.path, store.ns, b"\xab" * 16)
    os.makedirs(os.path.dirname(orphan), exist_ok=True)
    shutil.copy(src, orphan)
    directory = os.path.dirname(src)
    old, fresh = (os.path.join(directory, f".{n}.1.aa.tmp") for n in ("old", "fresh"))
    for p in (old, fresh):
        with open(p, "wb") as f:
            f.write(b"x" * 100)
    os.utime(old, (time.time() - 7200, time.time() - 7200))
    report = m.gc(store.path)
    assert report["orphans_removed"] == 1 and report["orphan_bytes"] == os.path.getsize(
        src
    )
    assert (report["temp_removed"], report["temp_bytes"], report["temp_kept"]) == (
        1,
        100,
        1,
    )
    assert report["budget"] is None and report["evicted_nodes"] == 0
    assert report["broken_nodes"] == 0 and report["namespaces_dropped"] == []
    assert report["bytes_freed"] == report["orphan_bytes"] + 100
    assert report["bytes_before"] == report["bytes_after"]
    assert (
        not os.path.exists(orphan) and not os.path.exists(old) and os.path.exists(fresh)
    )
    assert os.path.exists(src) and ns_stats(store.path, store.ns)["nodes"] == 7
    assert m.verify(store.path)["temp_files"] == 1
    # An hour later the fresh one is old too.
    assert m.gc(store.path, now=time.time() + 3700)["temp_removed"] == 1
    assert m.verify(store.path)["problems"] == []


def test_gc_removes_broken_nodes(store, model):
    _damage(blob_path(store.path, store.ns, store.a[2]), "truncate", "")
    _damage(blob_path(store.path, store.ns, store.b[2]), "flip-data", "")
    quick = m.gc(store.path, check_data=False)  # sizes only: finds the truncated file
    assert quick["broken_nodes"] == 3 and [p["kind"] for p in quick["problems"]] == [
        "size"
    ]
    assert len(quick["quarantined"]) == 1
    full = m.gc(store.path)
    assert full["broken_nodes"] == 2 and [p["kind"] for p in full["problems"]] == [
        "checksum"
    ]
    assert m.verify(store.path)["problems"] == []
    assert_restores(model, store.path, B, 128)


def test_gc_evicts_unpinned_lru_leaves_first_and_pinned_last(tmp_path, model):
    prompts = [
        random_tokens(128, seed=400 + i) for i in range(4)
    ]  # two equal nodes each
    path = tmp_path / "s"
    with KVStore(path, model, chunk_tokens=C) as s:
        for i, p in enumerate(prompts):
            s.save(p, compute_cache(model, p), pin=i == 0)
            s.flush()
        assert s.fetch(prompts[1] + [1])[1] == 128  # prompts[1] is now the most recent
        s.flush()
        ns, total = s.namespace, s.stats()["bytes_on_disk"]
    per = total // 4
    hashes = [node_hashes(ns, p) for p in prompts]

    def stored():
        ids = node_ids(path, ns)
        return [sum(h in ids for h in hs) for hs in hashes]

    report = m.gc(path, max_bytes=3 * per)
    assert (
        report["evicted_nodes"],
        report["evicted_pinned"],
        report["over_budget"],
    ) == (2, 0, 0)
    assert report["evicted_bytes"] == per and report["bytes_after"] == 3 * per
    assert stored() == [2, 2, 0, 2]  # the least recently used unpinned prompt, whole
    report = m.gc(path, max_bytes=per)
    assert (report["evicted_nodes"], report["evicted_pinned"]) == (4, 0)
    assert stored() == [2, 0, 0, 0]
    report = m.gc(
        path, max_bytes=per // 2
    )  # nothing unpinned is left: a pinned leaf goes
    assert (
        report["evicted_nodes"],
        report["evicted_pinned"],
        report["over_budget"],
    ) == (1, 1, 0)
    assert node_ids(path, ns) == {hashes[0][0]}
    assert m.verify(path)["problems"] == []
    assert_restores(model, path, prompts[0], 64)


def test_gc_evicts_a_whole_chain_in_one_walk(tmp_path, model, monkeypatch):
    """A parent whose children went earlier in the same commit goes too: the whole
    chain leaves in one walk of the cut, not one node per round."""
    prompt = random_tokens(12 * C, seed=450)  # a chain of 12 nodes
    path = tmp_path / "s"
    with KVStore(path, model, chunk_tokens=C) as s:
        s.save(prompt, compute_cache(model, prompt))
        s.flush()
        ns = s.namespace
    from kvstore.maintenance import common

    walks = []
    victims = common._victims
    monkeypatch.setattr(common, "_victims", lambda *a: walks.append(a) or victims(*a))
    report = m.gc(path, max_bytes=0)
    assert (report["evicted_nodes"], report["over_budget"]) == (12, 0)
    assert node_ids(path, ns) == set() and len(walks) == 1
    assert m.verify(path)["problems"] == []


def test_gc_pinned_last_in_one_pass(tmp_path, model):
    prompts = [random_tokens(128, seed=500 + i) for i in range(3)]
    path = tmp_path / "s"
    with KVStore(path, model, chunk_tokens=C) as s:
        for i, p in enumerate(prompts):
            s.save(p, compute_cache(model, p), pin=i == 1)
            s.flush()
        ns, total = s.namespace, s.stats()["bytes_on_disk"]
    report = m.gc(path, max_bytes=total // 6)
    assert (report["evicted_nodes"], report["evicted_pinned"]) == (5, 1)
    assert node_ids(path, ns) == {node_hashes(ns, prompts[1])[0]}


def test_gc_drops_a_namespace_and_nothing_else(store, model, other_model):
    mine_before = ns_stats(store.path, store.ns)
    report = m.gc(store.path, drop_namespaces=[store.other.hex()[:8]])
    assert report["namespaces_dropped"] == [store.other.hex()]
    assert report["dropped_nodes"] == 3
    assert report["dropped_bytes"] == store.other_stats["bytes_on_disk"]
    st = m.store_stats(store.path, full=True)
    assert [n["id"] for n in st["namespaces"]] == [store.ns.hex()]
    assert st["bytes_on_disk"] == st["file_bytes"] == mine_before["bytes"]
    assert not (store.path / "blobs" / store.other.hex()).exists()

    def leftovers(idx, txn):
        return [
            name
            for name in Index.DATABASES
            for k, _ in txn.cursor(db=idx.db[name])
            if bytes(k).startswith(store.other)
        ]

    assert with_index(store.path, leftovers) == []
    assert m.verify(store.path)["problems"] == []
    assert_restores(model, store.path, A, len(A))
    with KVStore(store.path, other_model, chunk_tokens=C) as s:
        assert s.fetch(X + [1])[1] == 0


def test_gc_keep_namespaces_and_bad_names(store):
    before = m.store_stats(store.path)
    with pytest.raises(ValueError, match="hex digits"):
        m.gc(store.path, drop_namespaces=["abc"])
    with pytest.raises(ValueError, match="no namespace"):
        m.gc(store.path, drop_namespaces=["f" * 32])
    with pytest.raises(TypeError, match="list"):
        m.gc(store.path, drop_namespaces=store.other.hex())
    with pytest.raises(ValueError, match="both"):
        m.gc(
            store.path,
            drop_namespaces=[store.other.hex()],
            keep_namespaces=[store.other.hex()],
        )
    with pytest.raises(ValueError, match="max_bytes"):
        m.gc(store.path, max_bytes=-1)
    assert m.store_stats(store.path)["totals"] == before["totals"]  # nothing happened
    report = m.gc(store.path, keep_namespaces=[store.ns.hex()[:10]])
    assert report["namespaces_dropped"] == [store.other.hex()]
    assert [n["id"] for n in m.store_stats(store.path)["namespaces"]] == [
        store.ns.hex()
    ]


def test_disk_budget_is_recorded_and_used_by_gc(tmp_path, model):
    path = tmp_path / "s"
    with KVStore(path, model, chunk_tokens=C) as s:
        s.save(A, compute_cache(model, A))
        s.flush()
        total = s.stats()["bytes_on_disk"]
    assert m.disk_budget(path) is None and m.store_stats(path)["disk_budget"] is None
    budget = total // 2
    with KVStore(path, model, chunk_tokens=C, disk_bytes=budget):
        pass  # records the budget; enforced only when something is written
    with KVStore(path, model, chunk_tokens=C):
        pass  # opened without a budget: the recorded one stays
    assert m.disk_budget(path) == budget == m.store_stats(path)["disk_budget"]
    assert m.store_stats(path)["bytes_on_disk"] == total
    report = m.gc(path)
    assert report["budget"] == budget and report["evicted_nodes"] == 3
    assert report["bytes_after"] <= budget and report["evicted_pinned"] == 0
    assert m.gc(path, max_bytes=0)["evicted_nodes"] == 2  # an explicit budget wins
    m.set_disk_budget(path, None)
    assert m.disk_budget(path) is None


@pytest.mark.parametrize("deletion_known", [False, True])
def test_release_files_keeps_the_file_of_a_re_added_node(store, deletion_known):
    """Also when told which commit deleted the node: another commit came since."""
    ns, h = store.ns, store.a[4]
    index = Index(os.path.join(store.path, "index"), create=False)
    try:
        blobs = Blobs(
            os.path.join(store.path, "blobs"), os.path.join(store.path, "quarantine")
        )
        deleted_in = []

        def delete(txn):
            deleted_in[:] = [txn.id()] if deletion_known else [None]
            return index.delete_node(txn, ns, h)

        rec = index.write(delete)
        index.write(
            lambda txn: index.put_node(txn, ns, h, rec)
        )  # another process re-adds it
        got = m.release_files(index, blobs, [(ns, h)], deleted_in=deleted_in[0])
        assert got.unlinked == 0
        assert os.path.exists(blobs.path(ns, h))
        index.write(delete)
        released = m.release_files(index, blobs, [(ns, h)], deleted_in=deleted_in[0])
        assert (released.unlinked, released.bytes) == (1, rec.nbytes)
        assert not os.path.exists(blobs.path(ns, h))
    finally:
        index.close()


# -- pins -------------------------------------------------------------------------------


def test_pin_path_and_set_pinned(store, model):
    path, ns, a, b = store.path, store.ns, store.a, store.b
    assert m.pin_path(path, ns.hex(), a[4].hex()[:12], True) == 5
    assert pinned_ids(path, ns) == set(a)
    assert (
        m.pin_path(path, ns.hex()[:8], b[3].hex(), True) == 2
    )  # a[0], a[1] already are
    assert ns_stats(path, ns)["pinned_bytes"] == store.stats["bytes_on_disk"]
    # Unpinning A releases what only A needs; the prefix B shares stays pinned.
    assert m.pin_path(path, ns.hex(), a[4].hex(), False) == 3
    assert pinned_ids(path, ns) == set(b)
    # Unpinning an inner node releases its subtree and the ancestors nothing else needs.
    assert m.pin_path(path, ns.hex(), b[1].hex(), False) == 4
    assert pinned_ids(path, ns) == set()
    assert m.set_pinned(path, ns.hex(), [a[2].hex(), a[3].hex()[:10]], True) == 2
    assert m.set_pinned(path, ns.hex(), [a[2].hex()], True) == 0
    with pytest.raises(ValueError, match="no node"):
        m.set_pinned(path, ns.hex(), [a[4].hex(), "f" * 32], True)
    with pytest.raises(TypeError):
        m.set_pinned(path, ns.hex(), a[4].hex(), True)
    assert pinned_ids(path, ns) == {a[2], a[3]}  # the failed call changed nothing
    mine = ns_stats(path, ns)
    assert mine["pinned_nodes"] == 2
    report = m.verify(path)
    assert report["problems"] == []  # pins table and counters agree with the records
    with KVStore(path, model, chunk_tokens=C) as s:
        assert s.stats()["pinned_bytes"] == mine["pinned_bytes"] > 0
