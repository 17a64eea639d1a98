"""A save's files written from the arrays' own memory and made durable together
(:mod:`kvstore.disk.publish`, :class:`kvstore.disk.blobs.NodeFile`, the fsutil write primitives):
the file bytes, the order of the durability steps on Linux, with the Linux-only
``sync_file_range`` hidden (the fallback), and with ``F_FULLFSYNC`` (macOS's path),
and the bound on open descriptors."""

import ctypes
import errno
import fcntl
import logging
import os
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest
from conftest import compute_cache, random_tokens
from safetensors.numpy import load

import kvstore.disk.publish as publish
import kvstore.platform.fsutil as fsutil
from kvstore import KVStore
from kvstore.disk.blobs import DATA_ALIGN, NodeFile, _blocks, parse_header
from kvstore.disk.index import Index

C = 32
META = {"format": "KVSTORE", "namespace": "00" * 16}

# -- node file bytes ---------------------------------------------------------------


def strided_cases():
    """Arrays as a save sees them: slices of a cache's buffers, and odd layouts."""
    rng = np.random.default_rng(0)
    buf = rng.integers(0, 1 << 16, size=(1, 3, 512, 64), dtype=np.uint16)
    return {
        "contiguous": buf[:, :, :40].copy(),
        "node-of-a-buffer": buf[:, :, 256:300],  # 3 runs of 44 rows
        "leading-axes-that-do-not-merge": np.broadcast_to(
            buf[:, :1, 8:24], (2, 3, 16, 64)
        )[:, :, :, :],
        "short-runs": buf[:, :, 3:5],  # 256-byte runs: gathered in one copy
        "transposed": buf[0, :, :8].transpose(1, 0, 2),  # last axes not contiguous
        "empty": buf[:, :, 7:7],
        "one-row": buf[:, :, 9:10],
    }


@pytest.mark.parametrize("case", list(strided_cases()))
def test_blocks_are_the_bytes_in_c_order(case):
    a = strided_cases()[case]
    blocks = _blocks(a)
    assert b"".join(bytes(b) for b in blocks) == np.ascontiguousarray(a).tobytes()
    if case == "node-of-a-buffer":
        assert len(blocks) == 3 and all(np.shares_memory(b, a) for b in blocks)


def test_node_file_from_strided_views_is_safetensors():
    """A node file made from views of cache buffers: safetensors' own reader gives the
    node's tokens back, the data starts aligned, the bytes equal a file made from
    contiguous copies, and no byte of KV was copied to make it."""
    rng = np.random.default_rng(1)
    keys = rng.integers(0, 1 << 16, size=(1, 3, 512, 64), dtype=np.uint16)
    values = rng.standard_normal((1, 3, 512, 32)).astype(np.float32)
    views = {
        "0.keys": ("float16", (1, 3, 44, 64), keys[:, :, 256:300]),  # as a save: bits
        "0.values": ("float32", (1, 3, 44, 32), values[:, :, 256:300]),
    }
    f = NodeFile.from_tensors(views, META)
    copies = {k: (d, s, np.ascontiguousarray(a)) for k, (d, s, a) in views.items()}
    raw = f.tobytes()
    assert raw == NodeFile.from_tensors(copies, META).tobytes()
    assert len(raw) == f.nbytes
    data_start, tensors, meta = parse_header(raw, len(raw))
    assert data_start % DATA_ALIGN == 0 and meta == META
    loaded = load(raw)
    for name, (_, _, a) in views.items():
        np.testing.assert_array_equal(loaded[name].view(a.dtype), a)
    data = [b for b in f.buffers[1:]]
    assert len(data) == 6 and all(
        np.shares_memory(b, keys) or np.shares_memory(b, values) for b in data
    )


def test_node_file_refuses_data_that_does_not_fit_its_shape():
    a = np.zeros((1, 2, 4, 8), np.uint16)
    with pytest.raises(ValueError, match=r"'x': 128 bytes of data.*need 256"):
        NodeFile.from_tensors({"x": ("float16", (1, 2, 8, 8), a)}, META)


# -- fsutil: vectored writes and the writeback hint ----------------------------------


@pytest.fixture(params=["writev", "write"])
def write_mode(request, monkeypatch):
    if request.param == "write":
        monkeypatch.delattr(os, "writev")  # a platform without it
    return request.param


def test_write_all_writes_every_buffer_in_order(tmp_path, write_mode):
    parts = [b"head", memoryview(b""), np.arange(1000, dtype=np.uint8), b"x" * 70000]
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT)
    try:
        assert fsutil.write_all(fd, parts) == 4 + 1000 + 70000
    finally:
        os.close(fd)
    assert (tmp_path / "f").read_bytes() == b"".join(bytes(p) for p in parts)


def test_write_all_resumes_short_writes_and_refuses_none(tmp_path, monkeypatch):
    real = os.writev
    monkeypatch.setattr(os, "writev", lambda fd, bufs: real(fd, [bytes(bufs[0])[:7]]))
    parts = [b"a" * 10, b"b" * 3, b"c" * 20]
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT)
    try:
        assert fsutil.write_all(fd, parts) == 33
        monkeypatch.setattr(os, "writev", lambda fd, bufs: 0)
        with pytest.raises(OSError, match="no bytes"):
            fsutil.write_all(fd, [b"more"])
    finally:
        os.close(fd)
    assert (tmp_path / "f").read_bytes() == b"a" * 10 + b"b" * 3 + b"c" * 20


def test_start_writeback_and_its_fallbacks(tmp_path, monkeypatch):
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT)
    try:
        os.write(fd, b"x" * 100000)
        if os.path.isdir("/proc/self"):  # Linux: the real call
            assert fsutil.sync_file_range is not None
            assert fsutil.start_writeback(fd) is True
        monkeypatch.setattr(fsutil, "sync_file_range", None)  # macOS: nothing to do
        assert fsutil.start_writeback(fd) is False

        def failing(err):
            def fn(*args):
                ctypes.set_errno(err)
                return -1

            return fn

        # A file system without it: not an error, and not asked again.
        monkeypatch.setattr(fsutil, "sync_file_range", failing(errno.EINVAL))
        assert fsutil.start_writeback(fd) is False
        assert fsutil.sync_file_range is None
        # A real I/O error is one.
        monkeypatch.setattr(fsutil, "sync_file_range", failing(errno.EIO))
        with pytest.raises(OSError) as e:
            fsutil.start_writeback(fd)
        assert e.value.errno == errno.EIO
    finally:
        os.close(fd)


def test_writeback_error_fails_the_save_cleanly(tmp_path, model, monkeypatch, caplog):
    caplog.set_level(logging.WARNING, logger="kvstore")

    def fn(*args):
        ctypes.set_errno(errno.EIO)
        return -1

    tokens = random_tokens(3 * C, seed=1)
    with KVStore(tmp_path / "s", model, chunk_tokens=C) as store:
        monkeypatch.setattr(fsutil, "sync_file_range", fn)
        store.save(tokens, compute_cache(model, tokens))
        store.flush()
        monkeypatch.undo()
        assert store.stats()["writes_failed"] == 1 and store.stats()["nodes"] == 0
        assert [k for k, _ in store.blobs.iter_files()] == []
        store.save(tokens, compute_cache(model, tokens))
        store.flush()
        assert store.fetch(tokens + [1])[1] == len(tokens)


# -- the order of a save's durability steps ----------------------------------------


class Recorder:
    """Stands in for ``os`` in fsutil and publish (and ``fcntl`` in fsutil, for the
    macOS case): records temp file syncs, links, directory syncs and commits."""

    def __init__(self, monkeypatch, *, full_fsync: bool):
        self.events, self.paths, self.open_temps, self.max_open = [], {}, set(), 0
        fake = SimpleNamespace(
            **{k: getattr(os, k) for k in dir(os) if not k.startswith("__")}
        )
        fake.open, fake.close, fake.fsync, fake.link = (
            self.open,
            self.close,
            self.fsync,
            self.link,
        )
        for module in (fsutil, publish):
            monkeypatch.setattr(module, "os", fake)
        # Linux's fcntl has no F_FULLFSYNC; the tests' macOS mode adds one: drop it
        # (the Linux cases), or put this recorder's own in its place (the macOS case).
        real_fcntl = {k: getattr(fcntl, k) for k in dir(fcntl) if k != "F_FULLFSYNC"}
        if full_fsync:
            flag = 0x7F00  # any number: only this fake fcntl knows it
            real_fcntl.update(F_FULLFSYNC=flag, fcntl=self.fcntl)
        monkeypatch.setattr(fsutil, "fcntl", SimpleNamespace(**real_fcntl))
        real_wb = fsutil.start_writeback
        monkeypatch.setattr(
            fsutil,
            "start_writeback",
            lambda fd: self.record("writeback", fd) or real_wb(fd),
        )
        real_write = Index.write

        def write(index, fn):
            if getattr(fn, "__name__", "") == "commit":
                self.events.append(("commit", None))
            return real_write(index, fn)

        monkeypatch.setattr(Index, "write", write)

    def record(self, what, fd):
        self.events.append((what, self.paths.get(fd)))

    def open(self, path, flags, *args, **kw):
        fd = os.open(path, flags, *args, **kw)
        if flags & os.O_EXCL:
            self.paths[fd] = ("tmp", str(path))
            self.open_temps.add(fd)
            self.max_open = max(self.max_open, len(self.open_temps))
        elif flags & os.O_DIRECTORY:
            self.paths[fd] = ("dir", str(path).rstrip("/"))
        return fd

    def close(self, fd):
        self.paths.pop(fd, None)
        self.open_temps.discard(fd)
        return os.close(fd)

    def fsync(self, fd):
        self.record("fsync", fd)
        return os.fsync(fd)

    def fcntl(self, fd, flag):
        self.record("full", fd)
        return os.fsync(fd)

    def link(self, src, dst):
        self.events.append(("link", ("tmp", src)))
        return os.link(src, dst)

    def first(self, what, kind=None):
        return next(
            i
            for i, (w, p) in enumerate(self.events)
            if w == what and (kind is None or p and p[0] == kind)
        )

    def last(self, what, kind=None):
        n = len(self.events)
        return (
            n
            - 1
            - next(
                i
                for i, (w, p) in enumerate(reversed(self.events))
                if w == what and (kind is None or p and p[0] == kind)
            )
        )

    def syncs(self, kind):
        return [
            (i, w, p[1])
            for i, (w, p) in enumerate(self.events)
            if w in ("fsync", "full") and p and p[0] == kind
        ]


@pytest.mark.parametrize("platform", ["linux", "no-sync_file_range", "F_FULLFSYNC"])
@pytest.mark.parametrize("open_files", [32, 2])
def test_a_save_is_durable_before_linked_and_linked_before_committed(
    tmp_path, model, monkeypatch, platform, open_files
):
    """Every temp file is fsynced before any file gets its final name; every directory
    that received a file (or a new directory) is fsynced once, after its last link;
    the index commit comes last. With F_FULLFSYNC (macOS) the drive's cache is
    flushed twice per save (after the files, after the directories), not per file;
    with ``open_files`` 2 no more than 3 temp files are open at once."""
    tokens = random_tokens(5 * C - 10, seed=3)  # 5 nodes
    cache = compute_cache(model, tokens)
    monkeypatch.setattr(publish, "OPEN_FILES", open_files)
    if platform == "no-sync_file_range":
        monkeypatch.setattr(fsutil, "sync_file_range", None)
    store = KVStore(tmp_path / "s", model, chunk_tokens=C)  # a fresh namespace
    rec = Recorder(monkeypatch, full_fsync=platform == "F_FULLFSYNC")
    store.save(tokens, cache)
    store.flush()
    monkeypatch.undo()

    file_syncs = rec.syncs("tmp")
    temps = [p for w, p in rec.events if w == "link"]
    assert len(temps) == len(set(temps)) == 5
    assert sorted(p for _, _, p in file_syncs) == sorted(p for _, p in temps)
    assert rec.last("fsync", "tmp") < rec.first("link") or platform == "F_FULLFSYNC"
    assert max(i for i, _, _ in file_syncs) < rec.first("link")
    assert rec.max_open <= open_files + 1

    finals = {os.path.dirname(p) for _, p in temps}
    ns_dir = os.path.dirname(next(iter(finals)))
    dir_syncs = rec.syncs("dir")
    synced_dirs = [p for _, _, p in dir_syncs]
    # Each directory once; the new namespace directory and the blobs root too.
    assert len(synced_dirs) == len(set(synced_dirs))
    assert set(synced_dirs) == finals | {ns_dir, os.path.dirname(ns_dir)}
    assert min(i for i, _, _ in dir_syncs) > rec.last("link")
    assert rec.last("commit") > max(i for i, _, _ in dir_syncs)

    full = [e for e in rec.events if e[0] == "full"]
    if platform == "F_FULLFSYNC":
        assert [i for i, w, _ in file_syncs if w == "full"] == [file_syncs[-1][0]]
        assert [i for i, w, _ in dir_syncs if w == "full"] == [dir_syncs[-1][0]]
        assert len(full) == 2
    else:
        assert full == []
    writebacks = [p for w, p in rec.events if w == "writeback"]
    assert len(writebacks) == 5  # asked for each file; a no-op without the call

    with store:
        restored, n = store.fetch(tokens + [1])
        assert n == len(tokens)
        for got, want in zip(restored, cache):
            assert mx.array_equal(got.keys[:, :, :n], want.keys[:, :, :n]).item()
            assert mx.array_equal(got.values[:, :, :n], want.values[:, :, :n]).item()


def test_a_save_from_a_cache_of_views_writes_no_copy(tmp_path, model, monkeypatch):
    """The bytes written for a node come from the cache's own buffers: the only
    buffers handed to writev that are not views of them are the headers."""
    tokens = random_tokens(3 * C, seed=4)
    cache = compute_cache(model, tokens)
    buffers = [np.asarray(c.keys) for c in cache] + [
        np.asarray(c.values) for c in cache
    ]
    seen = []
    real = fsutil.write_all
    monkeypatch.setattr(
        fsutil, "write_all", lambda fd, bufs: seen.extend(bufs) or real(fd, bufs)
    )
    with KVStore(tmp_path / "s", model, chunk_tokens=C) as store:
        store.save(tokens, cache)
        store.flush()
    data = [b for b in seen if not isinstance(b, (bytes, memoryview))]
    headers = [b for b in seen if isinstance(b, (bytes, memoryview))]
    assert len(headers) == 3
    assert data and all(any(np.shares_memory(b, a) for a in buffers) for b in data)


def test_ram_tier_keeps_the_last_nodes_of_a_save_bigger_than_it(tmp_path, model):
    tokens = random_tokens(6 * C, seed=5)
    with KVStore(tmp_path / "probe", model, chunk_tokens=C) as probe:
        probe.save(tokens[:C], compute_cache(model, tokens[:C]))
        probe.flush()
        node = probe.stats()["bytes_on_disk"]
    with KVStore(tmp_path / "s", model, chunk_tokens=C, ram_bytes=2 * node) as store:
        store.save(tokens, compute_cache(model, tokens))
        store.flush()
        assert len(store.ram) == 2 and store.ram.nbytes == 2 * node
        path = store.index.read(
            lambda txn: store.parts.reads.trie.walk(
                txn, np.array(tokens), limit=len(tokens)
            )
        )
        assert [s.h in store.ram for s in path] == [False] * 4 + [True] * 2
