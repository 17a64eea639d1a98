"""Disk full and I/O errors while a save or prefill writes: injected ``ENOSPC``/``EIO``.

Whatever fails, at whichever node of a multi-node save: the caller's call returns
normally, no file of the failed save is left under its final name, no temp file is
left, the index is unchanged, the failure is counted in ``stats()["writes_failed"]``
and logged, and a later save is stored and restores exactly.
"""

import errno
import glob
import logging
import os
import stat
from types import SimpleNamespace

import lmdb
import mlx.core as mx
import pytest
from conftest import compute_cache, random_tokens

import kvstore.blobs
import kvstore.fsutil
from kvstore import KVStore

C = 32
KEPT = random_tokens(70, seed=20)  # stored before the failure: must survive it
NEW = random_tokens(150, seed=21)  # 5 nodes: the failing save
LATER = random_tokens(100, seed=22)


def files(root, pattern):
    found = glob.glob(os.path.join(root, "**", pattern), recursive=True)
    return sorted(
        found + glob.glob(os.path.join(root, "**", "." + pattern), recursive=True)
    )


def failing_os(op: str, err: int, at_node: int):
    """A stand-in for ``os`` in kvstore.blobs whose ``op`` fails with ``err`` while the
    ``at_node``-th file of the save is written (1-based); everything else is real."""
    real = os
    state = {"node": 0, "failed": 0}
    fake = SimpleNamespace(
        **{k: getattr(real, k) for k in dir(real) if not k.startswith("__")}
    )

    def fail():
        state["failed"] += 1
        raise OSError(err, os.strerror(err))

    def open_(path, flags, *a, **kw):
        if flags & real.O_EXCL:  # a new temp file: the next node's write begins
            state["node"] += 1
        return real.open(path, flags, *a, **kw)

    def now() -> bool:
        return state["node"] == at_node

    def write(fd, data):
        if op == "write" and now():
            fail()
        if op == "write-partial" and now():
            if not state.get("landed") and len(data) > 100:
                state["landed"] = True  # the first call lands 100 bytes
                return real.write(fd, bytes(data[:100]))
            fail()
        return real.write(fd, data)

    def fsync(fd):
        is_dir = stat.S_ISDIR(real.fstat(fd).st_mode)
        if now() and op == ("fsync-dir" if is_dir else "fsync-file"):
            fail()
        return real.fsync(fd)

    def link(src, dst):
        if op == "link" and now():
            fail()
        return real.link(src, dst)

    fake.open, fake.write, fake.fsync, fake.link = open_, write, fsync, link
    return fake, state


def snapshot(store):
    s = store.stats()
    root = store.path
    return (s["nodes"], s["stored_tokens"], s["bytes_on_disk"]), files(
        root, "*.safetensors"
    )


def assert_restores(model, store, tokens):
    cache, n = store.fetch(tokens + [1])
    assert n == len(tokens)
    for got, want in zip(cache, compute_cache(model, tokens)):
        assert mx.array_equal(got.keys[:, :, :n], want.keys[:, :, :n]).item()
        assert mx.array_equal(got.values[:, :, :n], want.values[:, :, :n]).item()


CASES = [
    ("write", errno.ENOSPC, 1),
    ("write", errno.ENOSPC, 3),
    ("write-partial", errno.ENOSPC, 1),
    ("write-partial", errno.ENOSPC, 4),
    ("write", errno.EIO, 2),
    ("fsync-file", errno.EIO, 1),
    ("fsync-file", errno.ENOSPC, 5),
    ("link", errno.EIO, 3),
    ("link", errno.ENOSPC, 1),
    ("fsync-dir", errno.EIO, 1),  # after the file got its final name
    ("fsync-dir", errno.EIO, 5),
]


@pytest.mark.parametrize("how", ["save", "prefill"])
@pytest.mark.parametrize(
    "op, err, at_node",
    CASES,
    ids=[f"{o}-{errno.errorcode[e]}-node{n}" for o, e, n in CASES],
)
def test_write_error(tmp_path, model, monkeypatch, caplog, op, err, at_node, how):
    caplog.set_level(logging.WARNING, logger="kvstore")
    with KVStore(tmp_path / "s", model, chunk_tokens=C) as store:
        store.save(KEPT, compute_cache(model, KEPT))
        store.flush()
        before = snapshot(store)
        fake, state = failing_os(op, err, at_node)
        monkeypatch.setattr(kvstore.blobs, "os", fake)
        monkeypatch.setattr(kvstore.fsutil, "os", fake)  # fsyncs go through fsutil

        if how == "save":
            assert store.save(NEW, compute_cache(model, NEW)) == 5
        else:
            assert store.prefill(NEW)["computed"] == len(NEW)
        store.flush()
        assert state["failed"] >= 1 and state["node"] == at_node

        stats = store.stats()
        assert stats["writes_failed"] == 1 and stats["errors"] == 0
        assert snapshot(store) == before  # index and chunk files as they were
        assert files(store.path, "*.tmp") == []
        assert any(
            r.exc_info and os.strerror(err) in str(r.exc_info[1])
            for r in caplog.records
        ), caplog.text
        # Nothing of the failed save is restorable; what was stored before is.
        assert store.fetch(NEW + [1])[1] == 0
        assert_restores(model, store, KEPT)

        monkeypatch.undo()  # space again
        store.save(LATER, compute_cache(model, LATER))
        store.prefill(NEW)
        store.flush()
        assert store.stats()["writes_failed"] == 1
        for tokens in (KEPT, LATER, NEW):
            assert_restores(model, store, tokens)


def test_index_commit_error_removes_the_published_files(tmp_path, model, monkeypatch):
    """The files are on disk but the LMDB commit fails (its own disk full): the files
    go, the index is unchanged."""
    with KVStore(tmp_path / "s", model, chunk_tokens=C) as store:
        store.save(KEPT, compute_cache(model, KEPT))
        store.flush()
        before = snapshot(store)
        real_write = type(store.index).write

        def write(index, fn):
            if getattr(fn, "__name__", "") == "commit":
                raise lmdb.DiskError("mdb_txn_commit: No space left on device")
            return real_write(index, fn)

        monkeypatch.setattr(type(store.index), "write", write)
        store.save(NEW, compute_cache(model, NEW))
        store.flush()
        monkeypatch.undo()
        assert store.stats()["writes_failed"] == 1
        assert snapshot(store) == before
        assert files(store.path, "*.tmp") == []
        store.save(NEW, compute_cache(model, NEW))
        store.flush()
        assert_restores(model, store, NEW)
