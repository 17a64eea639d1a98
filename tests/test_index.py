"""Unit tests for kvstore.disk.index: node records and the LMDB index."""

import os
import signal
import struct
import subprocess
import sys
import textwrap

import lmdb
import numpy as np
import pytest

from kvstore.disk import cleanmark
from kvstore.disk.chunking import common_prefix
from kvstore.disk.index import (
    CHILD_KEY_TOKENS,
    FORMAT_VERSION,
    KINDS,
    RECORD_VERSION,
    CorruptRecord,
    Index,
    NodeRecord,
    StoreError,
)

NS = bytes(range(16))
NS2 = bytes(range(16, 32))
ROOT = b"\x00" * 16


def rec(
    tokens,
    *,
    parent=ROOT,
    start=0,
    nbytes=1000,
    checksum=123,
    kind="user",
    pinned=False,
    created=1.5,
):
    return NodeRecord(
        parent,
        start,
        np.asarray(tokens, dtype=np.int32),
        nbytes,
        checksum,
        kind,
        pinned,
        created,
    )


def hsh(i: int) -> bytes:
    return struct.pack(">QQ", 0xABCD, i)


def same_record(a: NodeRecord, b: NodeRecord) -> bool:
    return (
        a.parent == b.parent
        and a.start == b.start
        and np.array_equal(a.tokens, b.tokens)
        and a.tokens.dtype == b.tokens.dtype
        and (a.nbytes, a.checksum, a.kind, a.pinned, a.created)
        == (b.nbytes, b.checksum, b.kind, b.pinned, b.created)
    )


@pytest.fixture
def index(tmp_path):
    idx = Index(str(tmp_path / "index"))
    yield idx
    idx.close()


def put(index, ns, h, r):
    return index.write(lambda txn: index.put_node(txn, ns, h, r))


# ---------------------------------------------------------------------------
# NodeRecord encoding
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("pinned", [False, True])
def test_record_round_trip(kind, pinned):
    r = rec(
        [0, 1, 2**31 - 1, 256, 70000],
        parent=bytes(range(50, 66)),
        start=2**32 - 1,
        nbytes=2**64 - 1,
        checksum=2**64 - 2,
        kind=kind,
        pinned=pinned,
        created=1712345678.25,
    )
    back = NodeRecord.decode(r.encode())
    assert same_record(r, back)
    assert back.ntokens == 5
    assert back.end == 2**32 - 1 + 5


def test_record_encoding_layout():
    r = rec([1, 2, 300])
    raw = r.encode()
    assert raw[0] == RECORD_VERSION
    # tokens are stored last, as little-endian int32, after the state file's fields
    assert raw[-12:] == struct.pack("<3i", 1, 2, 300)
    assert raw[-28:-12] == struct.pack("<QQ", 0, 0)
    assert raw[-44:-28] == ROOT
    assert len(rec([1]).encode()) + 8 == len(rec([1, 2, 3]).encode())


def test_record_with_state_roundtrip_and_version_1_still_decodes():
    r = NodeRecord(
        ROOT, 0, np.array([5, 6], np.int32), 100, 7, "system", True, 1.5, 40, 9
    )
    back = NodeRecord.decode(r.encode())
    assert (back.state_nbytes, back.state_checksum) == (40, 9)
    assert back.has_state and back.total_bytes == 140
    # A version 1 record: the same head, no state fields.
    raw = bytearray(rec([1, 2]).encode())
    v1 = bytes([1]) + bytes(raw[1:-24]) + bytes(raw[-8:])
    old = NodeRecord.decode(v1)
    assert list(old.tokens) == [1, 2] and not old.has_state


def _corrupt(raw: bytes, offset: int, value: int) -> bytes:
    out = bytearray(raw)
    out[offset] = value
    return bytes(out)


def test_record_decode_rejects_damage():
    raw = rec([1, 2, 3], kind="system").encode()
    head = len(raw) - 12
    n_offset = 8  # <BBBx I I: version, kind, flags, pad, start, n
    cases = {
        "empty": b"",
        "short": raw[:10],
        "head only": raw[:head],
        "one token short": raw[:-4],
        "one byte short": raw[:-1],
        "extra byte": raw + b"\0",
        "extra token": raw + b"\0" * 4,
        "version 0": _corrupt(raw, 0, 0),
        "version 2": _corrupt(raw, 0, RECORD_VERSION + 1),
        "kind out of range": _corrupt(raw, 1, len(KINDS)),
        "kind 255": _corrupt(raw, 1, 255),
        "flags 2": _corrupt(raw, 2, 2),
        "huge n": raw[:n_offset] + struct.pack("<I", 2**32 - 1) + raw[n_offset + 4 :],
        "n zero": raw[:n_offset] + struct.pack("<I", 0) + raw[n_offset + 4 : head],
        "garbage": b"\xff" * len(raw),
    }
    assert NodeRecord.decode(raw).kind == "system"
    for name, bad in cases.items():
        with pytest.raises(CorruptRecord):
            NodeRecord.decode(bad)
            pytest.fail(f"{name} decoded")


def test_record_decode_random_garbage_never_crashes():
    rng = np.random.default_rng(0)
    raw = rec([5, 6, 7, 8]).encode()
    for _ in range(500):
        bad = bytearray(raw)
        for pos in rng.integers(0, len(raw), size=int(rng.integers(1, 4))):
            bad[pos] = int(rng.integers(0, 256))
        bad = bytes(bad[: int(rng.integers(0, len(raw) + 5))])
        try:
            r = NodeRecord.decode(bad)
        except CorruptRecord:
            continue
        assert r.kind in KINDS and len(r.tokens) > 0 and len(r.parent) == 16


# ---------------------------------------------------------------------------
# Index basics
# ---------------------------------------------------------------------------


def test_put_get_delete(index):
    r = rec([1, 2, 3], nbytes=500)
    assert index.get_node(NS, hsh(1)) is None
    assert put(index, NS, hsh(1), r) is True
    assert put(index, NS, hsh(1), rec([9], nbytes=1)) is False  # existing node kept
    got = index.get_node(NS, hsh(1))
    assert same_record(got, r)
    assert index.get_node(NS2, hsh(1)) is None  # other namespace
    assert index.counters(NS) == (1, 3, 500, 0)

    gone = index.write(lambda txn: index.delete_node(txn, NS, hsh(1)))
    assert same_record(gone, r)
    assert index.get_node(NS, hsh(1)) is None
    assert index.children(NS, ROOT) == []
    assert index.counters(NS) == (0, 0, 0, 0)
    assert index.write(lambda txn: index.delete_node(txn, NS, hsh(1))) is None
    assert index.counters(NS) == (0, 0, 0, 0)


def test_counters_per_namespace_and_total(index):
    put(index, NS, hsh(1), rec([1, 2], nbytes=100))
    put(
        index,
        NS,
        hsh(2),
        rec([1, 2, 3], nbytes=200, pinned=True, parent=hsh(1), start=2),
    )
    put(index, NS2, hsh(1), rec([4], nbytes=7))
    assert index.counters(NS) == (2, 5, 300, 200)
    assert index.counters(NS2) == (1, 1, 7, 0)
    assert index.counters(bytes(16)) == (0, 0, 0, 0)
    assert index.total_bytes() == 307
    index.write(lambda txn: index.delete_node(txn, NS, hsh(2)))
    assert index.counters(NS) == (1, 2, 100, 0)
    assert index.total_bytes() == 107


def test_children_and_has_children(index):
    put(index, NS, hsh(1), rec([1, 2]))
    put(index, NS, hsh(2), rec([3, 4], parent=hsh(1), start=2))
    put(index, NS, hsh(3), rec([3, 5], parent=hsh(1), start=2))
    put(index, NS, hsh(4), rec([3, 4, 5], parent=hsh(2), start=4))
    put(index, NS2, hsh(5), rec([3, 4], parent=hsh(1), start=2))  # other namespace
    assert index.children(NS, ROOT) == [hsh(1)]
    assert sorted(index.children(NS, hsh(1))) == [hsh(2), hsh(3)]
    assert index.children(NS, hsh(2)) == [hsh(4)]
    assert index.children(NS, hsh(4)) == []
    assert index.children(NS2, hsh(1)) == [hsh(5)]

    def flags(txn):
        return [index.has_children(txn, NS, hsh(i)) for i in range(1, 6)]

    assert index.read(flags) == [True, True, False, False, False]
    index.write(lambda txn: index.delete_node(txn, NS, hsh(4)))
    assert index.read(flags) == [True, False, False, False, False]


def test_children_sort_by_first_tokens(index):
    rng = np.random.default_rng(3)
    toks = {}
    for i in range(40):
        t = rng.integers(0, 2**31 - 1, size=int(rng.integers(1, 5))).tolist()
        t[0] = int(rng.choice([1, 255, 256, 65536, 2**24, 2**31 - 1]))
        toks[hsh(i)] = t
        put(index, NS, hsh(i), rec(t))
    pad = [2**32]  # shorter token lists sort after longer ones sharing their tokens
    order = sorted(
        toks, key=lambda h: (toks[h] + pad * (CHILD_KEY_TOKENS - len(toks[h])), h)
    )
    assert index.children(NS, ROOT) == order


def test_pinned_and_set_pinned(index):
    put(index, NS, hsh(1), rec([1], nbytes=10))
    put(index, NS, hsh(2), rec([2], nbytes=20, pinned=True))
    put(index, NS2, hsh(3), rec([3], nbytes=30, pinned=True))
    assert index.pinned(NS) == [hsh(2)]
    assert index.counters(NS)[3] == 20

    assert index.write(lambda txn: index.set_pinned(txn, NS, hsh(1), True)) is True
    assert index.write(lambda txn: index.set_pinned(txn, NS, hsh(1), True)) is False
    assert index.write(lambda txn: index.set_pinned(txn, NS, hsh(9), True)) is False
    assert sorted(index.pinned(NS)) == [hsh(1), hsh(2)]
    assert index.get_node(NS, hsh(1)).pinned is True
    assert index.counters(NS) == (2, 2, 30, 30)

    assert index.write(lambda txn: index.set_pinned(txn, NS, hsh(2), False)) is True
    assert index.pinned(NS) == [hsh(1)]
    assert index.get_node(NS, hsh(2)).pinned is False
    assert index.counters(NS) == (2, 2, 30, 10)
    assert index.pinned(NS2) == [hsh(3)]

    index.write(lambda txn: index.delete_node(txn, NS, hsh(1)))
    assert index.pinned(NS) == []
    assert index.counters(NS) == (1, 1, 20, 0)


def test_touch_and_atime(index):
    put(index, NS, hsh(1), rec([1], created=100.0))
    assert index.read(lambda txn: index.atime(txn, NS, hsh(1))) == 100.0
    index.write(lambda txn: index.touch(txn, NS, hsh(1), 250.5))
    assert index.read(lambda txn: index.atime(txn, NS, hsh(1))) == 250.5
    index.write(
        lambda txn: index.touch(txn, NS, hsh(2), 300.0)
    )  # unknown node: no entry
    assert index.read(lambda txn: index.atime(txn, NS, hsh(2))) == 0.0
    index.write(lambda txn: index.delete_node(txn, NS, hsh(1)))
    assert index.read(lambda txn: index.atime(txn, NS, hsh(1))) == 0.0


def test_touch_keeps_a_recent_time_within_the_resolution(index):
    put(index, NS, hsh(1), rec([1], created=100.0))

    def atime(h=hsh(1)):
        return index.read(lambda txn: index.atime(txn, NS, h))

    index.write(lambda txn: index.touch(txn, NS, hsh(1), 150.0, resolution=60))
    assert atime() == 100.0  # 50 s newer: kept
    index.write(lambda txn: index.touch(txn, NS, hsh(1), 170.0, resolution=60))
    assert atime() == 170.0
    index.write(lambda txn: index.touch(txn, NS, hsh(1), 171.0))
    assert atime() == 171.0  # exact
    index.write(lambda txn: index.touch(txn, NS, hsh(2), 500.0, resolution=60))
    assert atime(hsh(2)) == 0.0  # unknown node: no entry


def test_iter_nodes_by_namespace(index):
    put(index, NS, hsh(1), rec([1]))
    put(index, NS, hsh(2), rec([2]))
    put(index, NS2, hsh(3), rec([3]))
    mine = index.read(lambda txn: list(index.iter_nodes(txn, NS)))
    assert [(ns, h) for ns, h, _ in mine] == [(NS, hsh(1)), (NS, hsh(2))]
    assert NodeRecord.decode(mine[1][2]).tokens.tolist() == [2]
    everything = index.read(lambda txn: list(index.iter_nodes(txn)))
    assert sorted((ns, h) for ns, h, _ in everything) == [
        (NS, hsh(1)),
        (NS, hsh(2)),
        (NS2, hsh(3)),
    ]


def test_namespaces_register_once(index):
    index.register_namespace(NS, {"model": "a"})
    index.register_namespace(NS, {"model": "b"})  # does not overwrite
    index.register_namespace(NS2, {"model": "c"})
    assert index.namespaces() == {NS: {"model": "a"}, NS2: {"model": "c"}}


def test_corrupt_record_in_db(index):
    put(index, NS, hsh(1), rec([1, 2], nbytes=50))
    index.write(lambda txn: txn.put(NS + hsh(1), b"\x01garbage", db=index.db["nodes"]))
    with pytest.raises(CorruptRecord):
        index.get_node(NS, hsh(1))
    # deleting a corrupt node removes it without touching the counters
    assert index.write(lambda txn: index.delete_node(txn, NS, hsh(1))) is None
    assert index.read(lambda txn: txn.get(NS + hsh(1), db=index.db["nodes"])) is None
    assert index.get_node(NS, hsh(1)) is None


# ---------------------------------------------------------------------------
# nearest_children against brute force
# ---------------------------------------------------------------------------


def test_nearest_children_matches_brute_force(index):
    rng = np.random.default_rng(42)
    parent = hsh(10**6)
    children = {}

    def tok(n, hi=8):
        # few distinct small ids (many shared prefixes) plus some big ones
        t = rng.integers(0, hi, size=n)
        big = rng.random(n) < 0.1
        t[big] = rng.choice(
            [255, 256, 257, 65535, 65536, 2**24 + 1, 2**31 - 1], size=big.sum()
        )
        return t.astype(np.int32)

    common = tok(80)
    for i in range(500):
        r = rng.random()
        if r < 0.25:  # share the first 64+ tokens, differ later
            k = int(rng.integers(CHILD_KEY_TOKENS, 80))
            t = np.concatenate([common[:k], tok(int(rng.integers(1, 60)))])
        elif r < 0.45:  # short tail children
            t = tok(int(rng.integers(1, 8)))
        elif r < 0.55:  # strict prefixes of the common run
            t = common[: int(rng.integers(1, 80))].copy()
        else:
            t = tok(int(rng.integers(1, 140)))
        children[hsh(i)] = t

    def add_all(txn):
        for h, t in children.items():
            index.put_node(txn, NS, h, rec(t, parent=parent, start=64))
        # noise under other parents and another namespace
        for j, t in enumerate(list(children.values())[:50]):
            index.put_node(txn, NS, hsh(10**5 + j), rec(t, parent=hsh(7), start=64))
            index.put_node(txn, NS2, hsh(10**5 + j), rec(t, parent=parent, start=64))

    index.write(add_all)

    queries = [tok(int(rng.integers(1, 160))) for _ in range(100)]
    queries += [t.copy() for t in list(children.values())[:60]]  # exact children
    for t in list(children.values())[60:120]:  # a child's prefix, then divergence
        k = int(rng.integers(0, len(t) + 1))
        queries.append(np.concatenate([t[:k], tok(int(rng.integers(0, 100)), hi=1000)]))
    for k in (1, 10, 63, 64, 65, 79, 80):
        queries.append(common[:k].copy())
        queries.append(np.concatenate([common[:k], tok(50)]))
    queries.append(np.array([2**31 - 1], dtype=np.int32))
    queries.append(np.array([12345], dtype=np.int32))

    nonempty = 0
    for q in queries:
        best = max(common_prefix(t, q) for t in children.values())
        got = index.nearest_children(NS, parent, q)
        if best == 0:
            assert got == []
            continue
        nonempty += 1
        assert got, f"no candidate for query {q[:10]}..., best {best}"
        assert (
            got[0][2] == best
        ), f"query {q.tolist()[:70]}: got {got[0][2]}, best {best}"
        ns_hashes = set(children)
        for h, r, n in got:
            assert h in ns_hashes  # never another parent's child
            assert np.array_equal(r.tokens, children[h])
            assert n == common_prefix(children[h], q) > 0
        assert [n for _, _, n in got] == sorted((n for _, _, n in got), reverse=True)
        # every child sharing the query's first 64 tokens (or all of a short query) is listed
        full = {
            h
            for h, t in children.items()
            if common_prefix(t, q) >= CHILD_KEY_TOKENS
            or (len(t) == len(q) < CHILD_KEY_TOKENS and common_prefix(t, q) == len(q))
        }
        assert full <= {h for h, _, _ in got}
    assert nonempty > 200


def test_nearest_children_empty_and_other_parent(index):
    assert index.nearest_children(NS, ROOT, np.array([1, 2], np.int32)) == []
    put(index, NS, hsh(1), rec([1, 2, 3], parent=hsh(99)))
    assert index.nearest_children(NS, ROOT, np.array([1, 2], np.int32)) == []
    assert index.nearest_children(NS2, hsh(99), np.array([1, 2], np.int32)) == []
    got = index.nearest_children(NS, hsh(99), np.array([1, 2], np.int32))
    assert [(h, n) for h, _, n in got] == [(hsh(1), 2)]
    assert index.nearest_children(NS, hsh(99), np.array([2, 1], np.int32)) == []


def test_nearest_children_query_after_every_key(index):
    # Only this parent's keys exist and the query sorts after all of them.
    put(index, NS2, hsh(1), rec([1, 2]))
    put(index, NS2, hsh(2), rec([3, 1, 7]))
    got = index.nearest_children(NS2, ROOT, np.array([3, 2], np.int32))
    assert [(h, n) for h, _, n in got] == [(hsh(2), 1)]
    got = index.nearest_children(NS2, ROOT, np.array([2**31 - 1], np.int32))
    assert got == []


def test_nearest_children_skips_deleted(index):
    put(index, NS, hsh(1), rec([1, 2, 3]))
    put(index, NS, hsh(2), rec([1, 2, 4, 5]))
    q = np.array([1, 2, 3, 9], np.int32)
    assert [(h, n) for h, _, n in index.nearest_children(NS, ROOT, q)][0] == (hsh(1), 3)
    index.write(lambda txn: index.delete_node(txn, NS, hsh(1)))
    assert [(h, n) for h, _, n in index.nearest_children(NS, ROOT, q)] == [(hsh(2), 2)]


# ---------------------------------------------------------------------------
# map growth, reopening, format version
# ---------------------------------------------------------------------------


def test_map_grows_when_full(tmp_path):
    path = str(tmp_path / "index")
    idx = Index(path, map_size=128 << 10)
    start_size = idx.env.info()["map_size"]
    rng = np.random.default_rng(5)
    toks = {
        hsh(i): rng.integers(0, 2**31 - 1, size=1000).astype(np.int32)
        for i in range(300)
    }
    items = list(toks.items())
    for h, t in items[:200]:  # one transaction each: ~800 KB of records
        assert put(idx, NS, h, rec(t, nbytes=4000))

    def put_many(txn):  # one transaction that alone overflows the map
        return [idx.put_node(txn, NS, h, rec(t, nbytes=4000)) for h, t in items[200:]]

    assert idx.write(put_many) == [True] * 100
    grown = idx.env.info()["map_size"]
    assert grown >= 8 * start_size  # overflowed several times
    for h, t in toks.items():
        assert np.array_equal(idx.get_node(NS, h).tokens, t)
    assert idx.counters(NS) == (300, 300_000, 1_200_000, 0)
    assert len(idx.children(NS, ROOT)) == 300
    idx.close()

    # reopened with the tiny initial size, everything is still there
    idx = Index(path, create=False, map_size=128 << 10)
    assert idx.counters(NS) == (300, 300_000, 1_200_000, 0)
    for h, t in toks.items():
        assert np.array_equal(idx.get_node(NS, h).tokens, t)
    assert put(idx, NS, hsh(999), rec(np.arange(5000), nbytes=1))
    idx.close()


def test_second_index_sees_records(tmp_path):
    path = str(tmp_path / "index")
    a = Index(path)
    put(a, NS, hsh(1), rec([1, 2, 3], nbytes=11))
    a.register_namespace(NS, {"m": 1})
    a.close()
    b = Index(path, create=False)
    assert same_record(b.get_node(NS, hsh(1)), rec([1, 2, 3], nbytes=11))
    assert b.namespaces() == {NS: {"m": 1}}
    put(b, NS, hsh(2), rec([4], parent=hsh(1), start=3))
    b.close()
    c = Index(path)
    assert c.children(NS, hsh(1)) == [hsh(2)]
    assert c.counters(NS)[0] == 2
    c.close()


@pytest.mark.slow
def test_concurrent_index_in_other_process(tmp_path):
    """Another process writes (and grows the map) while this one keeps its Index open."""
    path = str(tmp_path / "index")
    a = Index(path, map_size=128 << 10)
    put(a, NS, hsh(1), rec([1, 2, 3]))
    small = a.env.info()["map_size"]
    child = textwrap.dedent(f"""
        import numpy as np
        from kvstore.disk.index import Index, NodeRecord
        idx = Index({path!r}, create=False, map_size=128 << 10)
        ns, root = bytes(range(16)), bytes(16)
        assert idx.get_node(ns, bytes.fromhex({hsh(1).hex()!r})).tokens.tolist() == [1, 2, 3]
        for i in range(100):
            toks = np.full(1000, i, dtype=np.int32)
            rec = NodeRecord(root, 0, toks, 4000, i, "assistant", False, 2.0)
            h = (1 << 64 | i).to_bytes(16, "big")
            idx.write(lambda txn: idx.put_node(txn, ns, h, rec))
        print(idx.env.info()["map_size"])
        idx.close()
        """)
    out = subprocess.run(
        [sys.executable, "-c", child], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.split()[-1]) > small  # the other process grew the map
    # this process adopts the grown map and sees every record
    for i in range(100):
        r = a.get_node(NS, (1 << 64 | i).to_bytes(16, "big"))
        assert r.kind == "assistant" and r.tokens[0] == i and len(r.tokens) == 1000
    assert a.counters(NS)[0] == 101
    assert put(a, NS, hsh(2), rec(np.arange(20000)))  # and can still write
    assert len(a.children(NS, ROOT)) == 102
    a.close()


def test_format_version_mismatch(tmp_path):
    path = str(tmp_path / "index")
    idx = Index(path)
    put(idx, NS, hsh(1), rec([1]))
    assert (
        idx.read(lambda txn: bytes(txn.get(b"format_version", db=idx.db["meta"])))
        == str(FORMAT_VERSION).encode()
    )
    idx.close()

    env = lmdb.open(path, max_dbs=8, subdir=True)
    meta = env.open_db(b"meta")
    with env.begin(write=True) as txn:
        txn.put(b"format_version", str(FORMAT_VERSION + 1).encode(), db=meta)
    env.close()
    with pytest.raises(StoreError, match="format version"):
        Index(path)
    with pytest.raises(StoreError):
        Index(path, create=False)


def test_open_missing_without_create(tmp_path):
    with pytest.raises(StoreError):
        Index(str(tmp_path / "nothing"), create=False)
    assert not os.path.exists(tmp_path / "nothing" / "data.mdb")


def _index_of_many_pages(tmp_path) -> str:
    """An index whose nodes tree has ~100 pages: an open checks its root only."""
    path = str(tmp_path / "index")
    idx = Index(path)
    items = [(hsh(i), rec(np.arange(20) + i)) for i in range(3000)]
    idx.write(lambda txn: [idx.put_node(txn, NS, h, r) for h, r in items])
    idx.close()
    cleanmark.unlink(path)  # the next open checks every page (kvstore.disk.cleanmark)
    return path


@pytest.mark.parametrize("where", ["thread", "process"])
def test_the_background_page_check_finds_damage_below_the_roots(
    tmp_path, monkeypatch, where
):
    """The open's full page check (kvstore.disk.pageguard) passes a sound index and
    finds a zeroed leaf, in a thread or, for a large file, in a child process."""
    import mdbdamage as damage

    from kvstore.disk import pageguard

    path = _index_of_many_pages(tmp_path)
    monkeypatch.setattr(pageguard, "CHILD_PAGES", 0 if where == "process" else 1 << 40)
    idx = Index(path, create=False)
    audit = idx._shared.audit
    assert audit.wait() is None and audit.passed and audit.checked_by == where
    idx.close()

    damage.zero_page(tmp_path, damage.find(tmp_path, "nodes", leaf=True)[3])
    idx = Index(path, create=False)  # the bounded check reads the tree's root only
    try:
        problem = idx._shared.audit.wait()
        assert problem is not None and "is zeroed" in problem, problem
        assert "is zeroed" in (idx.problem or ""), idx.problem
        with pytest.raises(StoreError):
            put(idx, NS, hsh(10_000), rec([1, 2, 3]))
    finally:
        idx.close()


def test_a_page_check_process_that_fails_leaves_writes_to_check(tmp_path, monkeypatch):
    """No child process to check the pages (no interpreter at sys.executable): the
    first write checks them itself, then writes."""
    from kvstore.disk import pageguard

    path = _index_of_many_pages(tmp_path)
    monkeypatch.setattr(pageguard, "CHILD_PAGES", 0)
    monkeypatch.setattr(pageguard.sys, "executable", str(tmp_path / "no-python"))
    idx = Index(path, create=False)
    try:
        audit = idx._shared.audit
        assert audit.wait() is not None and not audit.passed
        assert put(idx, NS, hsh(10_000), rec([1, 2, 3]))
        assert audit.passed and idx.get_node(NS, hsh(10_000)) is not None
    finally:
        idx.close()


def test_closing_ends_a_running_page_check_process(tmp_path, monkeypatch):
    """close() while the check's child process runs ends that process (it is
    killed and reaped, not left to finish), and the index closes."""
    from kvstore.disk import pageguard

    path = _index_of_many_pages(tmp_path)
    monkeypatch.setattr(pageguard, "CHILD_PAGES", 0)
    started = []

    class Recorded(pageguard.subprocess.Popen):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            started.append(self)

    monkeypatch.setattr(pageguard.subprocess, "Popen", Recorded)
    for _ in range(5):
        idx = Index(path, create=False)
        audit = idx._shared.audit
        idx.close()
        cleanmark.unlink(path)  # a check that passed marked the index
        assert audit.done.is_set() and audit.failure in (None, "stopped")
    assert started and all(child.returncode is not None for child in started)
    # Closed a moment after the open: the child had not finished its check.
    assert any(child.returncode == -signal.SIGKILL for child in started)
