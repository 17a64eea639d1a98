"""Hostile chunk files and index records met through ``KVStore.fetch``.

Each damage must give a miss from the damaged node on (the nodes before it restore
exactly), a report in ``stats()["corrupt"]``, the node quarantined, no exception, no
unbounded allocation, and never wrong KV. The index record decoder and a store whose
record is mutated at random are fuzzed; the figures (corrupt inputs tried, wrong
restores) are printed (``pytest -s``).
"""

import json
import os
import random
import shutil
import struct
import threading

import mlx.core as mx
import numpy as np
import pytest
from conftest import compute_cache, random_tokens

import kvstore.disk.blobs
import kvstore.engine.restore
from kvstore import KVStore
from kvstore.disk.blobs import file_checksum
from kvstore.disk.index import KINDS, RECORD_VERSION, CorruptRecord, NodeRecord

C = 32
STORED = random_tokens(150, seed=3)  # 4 full chunks and a 22-token tail
VICTIM = 64  # start of the damaged node: a full chunk found by its hash
TAIL = 128  # start of the tail node: found by a token-prefix search
PEAK_BYTES = 64 << 20  # a restore of this store needs far less
HEAD = NodeRecord._HEAD.size  # bytes before a record's tokens (version 1)


def head_size(raw: bytes) -> int:
    """Bytes before the tokens: version 2 records add the state file's fields."""
    return HEAD + (NodeRecord._STATE.size if raw[0] == RECORD_VERSION else 0)


def node_at(store, start):
    path = store.index.read(
        lambda txn: store.parts.reads.trie.walk(
            txn, np.array(STORED, dtype=np.int32), limit=len(STORED)
        )
    )
    return next(step.h for step in path if step.rec.start == start)


def raw_record(store, h):
    ns = store.namespace
    return store.index.read(
        lambda txn: bytes(txn.get(ns + h, db=store.index.db["nodes"]))
    )


def put_raw_record(store, h, raw):
    ns = store.namespace
    store.index.write(lambda txn: txn.put(ns + h, raw, db=store.index.db["nodes"]))


def match_record_to_file(store, h):
    """Make the index record agree with whatever file is now at the node's path, so
    that only the reader's own checks stand between a hostile file and the caller."""
    with open(store.blobs.path(store.namespace, h), "rb") as f:
        data = f.read()
    rec = NodeRecord.decode(raw_record(store, h))
    fields = {**rec.__dict__, "nbytes": len(data), "checksum": file_checksum(data)}
    put_raw_record(store, h, NodeRecord(**fields).encode())


def split_file(data: bytes):
    (hlen,) = struct.unpack_from("<Q", data)
    return json.loads(data[8 : 8 + hlen]), data[8 + hlen :]


def join_file(header: dict, body: bytes) -> bytes:
    raw = json.dumps(header, separators=(",", ":")).encode()
    return struct.pack("<Q", len(raw)) + raw + body


def rewrite_header(path, change):
    """Apply ``change(header)`` to a chunk file's header, keeping its data bytes."""
    with open(path, "rb") as f:
        header, body = split_file(f.read())
    change(header)
    with open(path, "wb") as f:
        f.write(join_file(header, body))


def _transpose_shapes(header):  # same bytes, heads and tokens swapped
    for name, info in header.items():
        if name != "__metadata__":
            b, heads, n, d = info["shape"]
            info["shape"] = [b, n, heads, d]


def _int_dtype(header):  # same shapes and bytes, read as int32
    for name, info in header.items():
        if name != "__metadata__":
            info["dtype"] = "I32"


def _half_dtype(header):  # the dtype and sizes of a float16 cache
    offset = 0
    for name in sorted(k for k in header if k != "__metadata__"):
        info = header[name]
        size = (info["data_offsets"][1] - info["data_offsets"][0]) // 2
        info["dtype"], info["data_offsets"] = "F16", [offset, offset + size]
        offset += size


def _huge_shape(header):
    name = min(k for k in header if k != "__metadata__")
    header[name]["shape"] = [1, 2, 1 << 40, 16]
    s, _ = header[name]["data_offsets"]
    header[name]["data_offsets"] = [s, s + (1 << 40) * 2 * 16 * 4]


def _offsets_outside(header):
    name = max(k for k in header if k != "__metadata__")
    s, e = header[name]["data_offsets"]
    header[name]["data_offsets"] = [s + (1 << 30), e + (1 << 30)]


def _other_namespace(header):
    header["__metadata__"]["namespace"] = "ab" * 16


FILE_DAMAGE = {
    "wrong-shapes": _transpose_shapes,
    "wrong-dtype-same-size": _int_dtype,
    "wrong-dtype-float16": _half_dtype,
    "huge-shape": _huge_shape,
    "offsets-outside-file": _offsets_outside,
    "other-namespace-metadata": _other_namespace,
}


def huge_header_length(path):
    with open(path, "r+b") as f:
        f.write(struct.pack("<Q", 1 << 62))


@pytest.fixture
def stored(tmp_path, model):
    path = str(tmp_path / "s")
    with KVStore(path, model, chunk_tokens=C) as s:
        s.save(STORED, compute_cache(model, STORED))
    return path


class _Allocations:
    """``bytearray`` for kvstore.engine.restore and kvstore.disk.blobs (where restores allocate the
    buffers whose size comes from the index or a file), recording the largest size asked
    for and refusing sizes beyond :data:`PEAK_BYTES`."""

    def __init__(self):
        self.largest = 0

    def __call__(self, *args):
        size = args[0] if args and isinstance(args[0], int) else 0
        self.largest = max(self.largest, size)
        if size > PEAK_BYTES:
            raise MemoryError(f"test: refused a bytearray of {size} bytes")
        return bytearray(*args)


@pytest.fixture(autouse=True)
def allocations(monkeypatch):
    watch = _Allocations()
    monkeypatch.setattr(kvstore.engine.restore, "bytearray", watch, raising=False)
    monkeypatch.setattr(kvstore.disk.blobs, "bytearray", watch, raising=False)
    yield watch
    assert watch.largest <= PEAK_BYTES, f"a restore asked for {watch.largest} bytes"


def fetch_checked(model, store, tokens):
    """Fetch; check the restored KV against recomputation.

    Returns ``(n, wrong)``: tokens restored and whether the KV differed.
    """
    cache, n = store.fetch(tokens)
    wrong = False
    if n:
        for got, want in zip(cache, compute_cache(model, tokens[:n])):
            wrong |= not mx.array_equal(got.keys[:, :, :n], want.keys[:, :, :n]).item()
            wrong |= not mx.array_equal(
                got.values[:, :, :n], want.values[:, :, :n]
            ).item()
    return n, wrong


def assert_miss_from(model, path, start, *, quarantined=True):
    """The damaged node and everything after it is a miss, reported and quarantined."""
    with KVStore(path, model, chunk_tokens=C, ram_bytes=0) as s:
        n, wrong = fetch_checked(model, s, STORED + [1])
        assert (n, wrong) == (start, False)
        s.flush()
        stats = s.stats()
        assert stats["corrupt"] == 1 and stats["errors"] == 0, stats
        assert len(stats["quarantined"]) == int(quarantined)
        # Out of the index now: the next fetch is the same miss without a new report.
        assert fetch_checked(model, s, STORED + [1]) == (start, False)
        assert s.stats()["corrupt"] == 1
        # Saving again heals it.
        s.save(STORED, compute_cache(model, STORED))
        s.flush()
        assert fetch_checked(model, s, STORED + [1]) == (len(STORED), False)


@pytest.mark.parametrize("record", ["file-only", "record-matches-file"])
@pytest.mark.parametrize("damage", sorted(FILE_DAMAGE) + ["huge-header-length"])
def test_hostile_file(stored, model, damage, record):
    with KVStore(stored, model, chunk_tokens=C, ram_bytes=0) as s:
        h = node_at(s, VICTIM)
        path = s.blobs.path(s.namespace, h)
        if damage == "huge-header-length":
            huge_header_length(path)
        else:
            rewrite_header(path, FILE_DAMAGE[damage])
        if record == "record-matches-file":
            match_record_to_file(s, h)
    assert_miss_from(model, stored, VICTIM)


def test_two_broken_nodes_cut_at_the_first(stored, model):
    """Readers run nodes out of order: the restore still ends at the first broken one,
    which is the one reported (the later one is cut off anyway)."""
    with KVStore(stored, model, chunk_tokens=C, ram_bytes=0) as s:
        for start in (VICTIM, TAIL):
            rewrite_header(s.blobs.path(s.namespace, node_at(s, start)), _int_dtype)
    assert_miss_from(model, stored, VICTIM)


@pytest.mark.parametrize("read_threads", [1, 3])
@pytest.mark.parametrize("stage", ["open", "read"])
def test_crash_in_a_node_read_is_a_miss_and_an_error(
    stored, model, monkeypatch, read_threads, stage
):
    """Not a broken file but a bug or a resource error while opening (ahead, on
    another thread) or reading one node: the fetch restores the nodes before it,
    counts an error, and does not raise."""
    with KVStore(stored, model, chunk_tokens=C, ram_bytes=0) as s:
        victim = node_at(s, VICTIM)
    Blobs = kvstore.disk.blobs.Blobs
    real_open, real_read = Blobs.open_checked, Blobs.read_into
    victim_fds = set()

    def open_checked(self, ns, h, **kwargs):
        if h == victim and stage == "open":
            raise RuntimeError("test: open crashed")
        opened = real_open(self, ns, h, **kwargs)
        if h == victim:
            victim_fds.add(opened.fd)
        return opened

    def read_into(self, opened, **kwargs):
        if opened.fd in victim_fds:
            opened.close()
            raise RuntimeError("test: read crashed")
        return real_read(self, opened, **kwargs)

    Source = kvstore.engine.loadpath.FileSource  # the restore path CUDA takes
    real_source_read = Source.read

    def source_read(self, pieces):
        if self.opened.fd in victim_fds:
            raise RuntimeError("test: read crashed")
        return real_source_read(self, pieces)

    monkeypatch.setattr(Blobs, "open_checked", open_checked)
    monkeypatch.setattr(Blobs, "read_into", read_into)
    monkeypatch.setattr(Source, "read", source_read)
    with KVStore(
        stored, model, chunk_tokens=C, ram_bytes=0, read_threads=read_threads
    ) as s:
        assert fetch_checked(model, s, STORED + [1]) == (VICTIM, False)
        stats = s.stats()
        assert stats["errors"] == 1 and stats["corrupt"] == 0, stats


def test_a_fetch_leaves_no_file_open(stored, model, monkeypatch):
    """Files opened ahead are closed, also for nodes cut off by a broken one."""
    Blobs = kvstore.disk.blobs.Blobs
    real_open = Blobs.open_checked
    opened = []
    monkeypatch.setattr(
        Blobs,
        "open_checked",
        lambda self, *a, **k: opened.append(real_open(self, *a, **k)) or opened[-1],
    )
    with KVStore(stored, model, chunk_tokens=C, ram_bytes=0) as s:
        assert fetch_checked(model, s, STORED + [1]) == (len(STORED), False)
        rewrite_header(s.blobs.path(s.namespace, node_at(s, 0)), _int_dtype)
        assert s.fetch(STORED + [1])[1] == 0
    assert len(opened) >= 5 and all(f.fd == -1 for f in opened)


@pytest.mark.parametrize("record", ["file-only", "record-matches-file"])
def test_file_of_another_model_copied_over(stored, model, other_model, record):
    """Same tokens, same shapes, same size: only the namespace tells them apart."""
    with KVStore(stored, other_model, chunk_tokens=C) as other:
        other.save(STORED, compute_cache(other_model, STORED))
        other.flush()
        theirs = other.blobs.path(other.namespace, node_at(other, VICTIM))
    with KVStore(stored, model, chunk_tokens=C, ram_bytes=0) as s:
        h = node_at(s, VICTIM)
        ours = s.blobs.path(s.namespace, h)
        assert os.path.getsize(ours) == os.path.getsize(theirs)
        shutil.copyfile(theirs, ours)
        if record == "record-matches-file":
            match_record_to_file(s, h)
    assert_miss_from(model, stored, VICTIM)


def _garbage(rec: NodeRecord) -> bytes:
    return b"\x01garbage"


def _fields(**changes):
    return lambda rec: NodeRecord(**{**rec.__dict__, **changes}).encode()


RECORD_DAMAGE = {
    "garbage": _garbage,
    "format-version": lambda rec: bytes([RECORD_VERSION + 1]) + rec.encode()[1:],
    "truncated": lambda rec: rec.encode()[:-3],
    "huge-nbytes": _fields(nbytes=1 << 62),
    "nbytes-8GiB": _fields(nbytes=8 << 30),
    "nbytes-zero": _fields(nbytes=0),
    "wrong-checksum": lambda rec: _fields(checksum=rec.checksum ^ 1)(rec),
}


@pytest.mark.parametrize("start", [VICTIM, TAIL], ids=["full-chunk", "tail"])
@pytest.mark.parametrize("damage", sorted(RECORD_DAMAGE))
def test_corrupt_index_record(stored, model, damage, start):
    with KVStore(stored, model, chunk_tokens=C, ram_bytes=0) as s:
        h = node_at(s, start)
        rec = NodeRecord.decode(raw_record(s, h))
        put_raw_record(s, h, RECORD_DAMAGE[damage](rec))
    assert_miss_from(model, stored, start)


# -- fuzzing -------------------------------------------------------------------------


def _valid_record(rng: random.Random) -> NodeRecord:
    n = rng.choice([1, 2, 3, 31, 32, 64, 257])
    return NodeRecord(
        parent=rng.randbytes(16),
        start=rng.randrange(1 << 32),
        tokens=np.array([rng.randrange(1 << 31) for _ in range(n)], dtype=np.int32),
        nbytes=rng.randrange(1 << 64),
        checksum=rng.randrange(1 << 64),
        kind=rng.choice(KINDS),
        pinned=rng.random() < 0.5,
        created=rng.random() * 2e9,
    )


def _mutant(rng: random.Random, raw: bytes, other: bytes) -> bytes:
    how = rng.randrange(8)
    b = bytearray(raw)
    if how == 0:  # random bytes of a random length
        return rng.randbytes(rng.randrange(0, 2 * len(raw) + 2))
    if how == 1:  # bit flips
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
    elif how == 2:  # byte values anywhere in the head
        for _ in range(rng.randint(1, 3)):
            b[rng.randrange(min(len(b), HEAD))] = rng.choice([0, 1, 2, 3, 127, 255])
    elif how == 3:  # truncation or extension
        cut = rng.randrange(len(b) + 9)
        b = b[:cut] if cut <= len(b) else b + rng.randbytes(cut - len(b))
    elif how == 4:  # token count field: off by one, zero, huge
        n = struct.unpack_from("<I", b, 8)[0]
        value = rng.choice(
            [0, n - 1, n + 1, 1 << 31, (1 << 32) - 1, rng.randrange(1 << 32)]
        )
        struct.pack_into("<I", b, 8, value % (1 << 32))
    elif how == 5:  # version, kind, flags
        b[rng.randrange(3)] = rng.randrange(256)
    elif how == 6:  # splice with another record
        cut = rng.randrange(len(b))
        b = b[:cut] + other[cut:]
    else:  # empty or just the head
        b = b[: rng.choice([0, 1, 7, HEAD - 1, HEAD])]
    return bytes(b)


def test_fuzz_record_decoder_raises_only_corrupt_record():
    rng = random.Random(1234)
    tried = decoded = 0
    for _ in range(30_000):
        raw = _valid_record(rng).encode()
        bad = _mutant(rng, raw, _valid_record(rng).encode())
        if bad == raw:
            continue
        tried += 1
        try:
            rec = NodeRecord.decode(bad)
        except CorruptRecord:
            continue
        decoded += 1  # a mutation that is still a well-formed record
        assert rec.kind in KINDS and isinstance(rec.pinned, bool)
        assert (
            len(rec.parent) == 16
            and 0 < rec.ntokens == (len(bad) - head_size(bad)) // 4
        )
        if bad[0] == RECORD_VERSION:  # a version 1 record is re-encoded as version 2
            again = rec.encode()
            assert again[:3] + again[4:] == bad[:3] + bad[4:]  # byte 3 is padding
    print(
        f"\nrecord decoder fuzz: {tried} mutated inputs, {tried - decoded} rejected "
        f"(CorruptRecord), {decoded} still well-formed records, 0 other exceptions"
    )
    assert tried > 25_000


def test_fuzz_records_through_the_store(stored, model, tmp_path):
    """Mutated records of one node in a real store: every fetch is exact or a miss
    from that node, never an exception or an error."""
    rng = random.Random(99)
    with KVStore(stored, model, chunk_tokens=C, ram_bytes=0) as s:
        victims = {start: node_at(s, start) for start in (0, VICTIM, TAIL)}
        originals = {start: raw_record(s, h) for start, h in victims.items()}
    rounds = int(os.environ.get("KVSTORE_RECORD_FUZZ_ROUNDS", "200"))
    tried = wrong = reported = 0
    for i in range(rounds):
        start = rng.choice(sorted(victims))
        bad = _mutant(rng, originals[start], originals[rng.choice(sorted(victims))])
        if bad == originals[start]:
            continue
        tried += 1
        copy = str(tmp_path / f"round{i}")
        shutil.copytree(stored, copy)
        with KVStore(copy, model, chunk_tokens=C, ram_bytes=0) as s:
            put_raw_record(s, victims[start], bad)
            n, bad_kv = fetch_checked(model, s, STORED + [1])
            s.flush()
            stats = s.stats()
        shutil.rmtree(copy)
        wrong += bad_kv
        reported += stats["corrupt"]
        assert stats["errors"] == 0, f"round {i}: {bad.hex()}"
        assert n >= start or n == 0 and start == 0
    print(
        f"\nstore record fuzz: {tried} corrupt records, {reported} reported, "
        f"{wrong} wrong restores"
    )
    assert wrong == 0 and tried > rounds // 2


@pytest.mark.parametrize("planted", ["fifo", "symlink-outside", "directory"])
def test_planted_non_file_is_a_quick_miss(stored, model, tmp_path, planted):
    """A FIFO would block a plain open for ever; a symlink leads out of the store."""
    with KVStore(stored, model, chunk_tokens=C, ram_bytes=0) as s:
        path = s.blobs.path(s.namespace, node_at(s, VICTIM))
    outside = tmp_path / "outside"
    outside.write_bytes(open(path, "rb").read())  # even a byte-identical copy
    os.unlink(path)
    if planted == "fifo":
        os.mkfifo(path)
    elif planted == "symlink-outside":
        os.symlink(outside, path)
    else:
        os.mkdir(path)
    errors = []

    def check():
        try:
            assert_miss_from(model, stored, VICTIM)
        except BaseException as e:  # reported by the test's thread below
            errors.append(e)

    worker = threading.Thread(target=check, daemon=True)
    worker.start()
    worker.join(60)
    assert not worker.is_alive(), f"a fetch over a planted {planted} hangs"
    if errors:
        raise errors[0]
