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
from types import SimpleNamespace

import lmdb
import mlx.core as mx
import pytest
from conftest import compute_cache, random_tokens
from serving import KEY, provider

import kvstore.disk.blobs
import kvstore.disk.publish
import kvstore.platform.fsutil
from kvstore import KVStore
from kvstore.server import PersistentPromptCache

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
    """A stand-in for ``os`` in kvstore.disk.blobs, kvstore.disk.publish and kvstore.platform.fsutil whose
    ``op`` fails with ``err`` for the ``at_node``-th file of the save (1-based): that
    file's write, fsync or link, or the fsync of its directory; everything else is
    real. Files are told apart by descriptor and path, not by the moment: a save
    writes all its files before it fsyncs or links any of them."""
    real = os
    state = {"node": 0, "failed": 0, "failed_at": set()}
    fd_node, tmp_node, dir_nodes, dir_fd = {}, {}, {}, {}
    fake = SimpleNamespace(
        **{k: getattr(real, k) for k in dir(real) if not k.startswith("__")}
    )

    def fail(node):
        state["failed"] += 1
        state["failed_at"].add(node)
        raise OSError(err, os.strerror(err))

    def open_(path, flags, *a, **kw):
        fd = real.open(path, flags, *a, **kw)
        if flags & real.O_EXCL:  # a new temp file: the save's next file
            state["node"] += 1
            fd_node[fd] = tmp_node[path] = state["node"]
            dir_nodes.setdefault(real.path.dirname(path), set()).add(state["node"])
        elif flags & real.O_DIRECTORY:
            dir_fd[fd] = path
        return fd

    def close(fd):
        fd_node.pop(fd, None)
        dir_fd.pop(fd, None)
        return real.close(fd)

    def write_op(fd, data, call):
        node = fd_node.get(fd)
        if op == "write" and node == at_node:
            fail(node)
        if op == "write-partial" and node == at_node:
            raw = b"".join(bytes(b) for b in data) if call is real.writev else data
            if not state.get("landed") and len(raw) > 100:
                state["landed"] = True  # the first call lands 100 bytes
                return real.write(fd, bytes(raw[:100]))
            fail(node)
        return call(fd, data)

    def fsync(fd):
        if op == "fsync-dir" and fd in dir_fd:
            if at_node in dir_nodes.get(dir_fd[fd].rstrip("/"), ()):
                fail(at_node)
        elif op == "fsync-file" and fd_node.get(fd) == at_node:
            fail(at_node)
        return real.fsync(fd)

    def link(src, dst):
        if op == "link" and tmp_node.get(src) == at_node:
            fail(at_node)
        return real.link(src, dst)

    fake.open, fake.close, fake.fsync, fake.link = open_, close, fsync, link
    fake.write = lambda fd, data: write_op(fd, data, real.write)
    fake.writev = lambda fd, buffers: write_op(fd, buffers, real.writev)
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
        monkeypatch.setattr(kvstore.disk.blobs, "os", fake)
        monkeypatch.setattr(kvstore.disk.publish, "os", fake)
        # fsyncs go through fsutil
        monkeypatch.setattr(kvstore.platform.fsutil, "os", fake)
        full = getattr(kvstore.platform.fsutil.fcntl, "F_FULLFSYNC", None)
        if full is not None:  # macOS (or the tests' macOS mode): fsync is this fcntl
            monkeypatch.setattr(
                kvstore.platform.fsutil,
                "fcntl",
                SimpleNamespace(F_FULLFSYNC=full, fcntl=lambda fd, cmd: fake.fsync(fd)),
            )

        if how == "save":
            assert store.save(NEW, compute_cache(model, NEW)) == 5
        else:
            assert store.prefill(NEW)["computed"] == len(NEW)
        store.flush()
        assert state["failed"] >= 1 and state["failed_at"] == {at_node}

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


# -- kvstore serve's prompt cache ----------------------------------------------------


@pytest.mark.slow
def test_disk_full_at_write_time(tmp_path, model, tokenizer, monkeypatch, caplog):
    caplog.set_level(logging.WARNING)
    root = str(tmp_path / "s")
    pc = PersistentPromptCache(root, provider(model, tokenizer))
    store = pc.open_store(KEY)

    # Keep what an earlier save stored: a failed write must not touch it.
    kept = random_tokens(40, seed=10)
    pc.insert_cache(KEY, kept, compute_cache(model, kept))
    pc.flush()
    before = store.stats()
    assert before["nodes"] >= 1 and before["writes_failed"] == 0
    files_before = files(root, "*.safetensors")

    # Writes of chunk files (kvstore.platform.fsutil): a few bytes land, then the disk is full.
    real_os, calls = os, {"n": 0}

    def full_write(fd, data):
        calls["n"] += 1
        if calls["n"] == 1:
            return real_os.write(fd, bytes(data[:100]))
        raise OSError(errno.ENOSPC, "No space left on device")

    def full_writev(fd, buffers):
        return full_write(fd, b"".join(bytes(b) for b in buffers))

    fake_os = SimpleNamespace(
        **{k: getattr(real_os, k) for k in dir(real_os) if not k.startswith("__")}
    )
    fake_os.write, fake_os.writev = full_write, full_writev
    monkeypatch.setattr(kvstore.platform.fsutil, "os", fake_os)

    tokens = random_tokens(300, seed=11)
    cache = compute_cache(model, tokens)
    pc.insert_cache(KEY, tokens, cache)  # must not raise
    pc.flush()
    assert calls["n"] >= 2  # the write really was attempted

    after = store.stats()
    assert after["writes_failed"] == before["writes_failed"] + 1
    assert (after["nodes"], after["stored_tokens"], after["bytes_on_disk"]) == (
        before["nodes"],
        before["stored_tokens"],
        before["bytes_on_disk"],
    )
    assert files(root, "*.tmp") == []
    assert files(root, "*.safetensors") == files_before
    failures = [
        r for r in caplog.records if r.levelno >= logging.WARNING and r.exc_info
    ]
    assert any(
        "No space left on device" in str(r.exc_info[1]) for r in failures
    ), caplog.text
    # The RAM cache still serves the prompt.
    got, rest = pc.fetch_nearest_cache(KEY, tokens + [5])
    assert rest == [5] and got[0].offset == 300

    # Space again: a later save is stored.
    monkeypatch.undo()
    later = random_tokens(200, seed=12)
    pc.insert_cache(KEY, later, compute_cache(model, later))
    pc.flush()
    final = store.stats()
    assert (
        final["nodes"] > before["nodes"]
        and final["writes_failed"] == after["writes_failed"]
    )
    assert files(root, "*.tmp") == []
    pc.close()

    fresh = PersistentPromptCache(root, provider(model, tokenizer))  # from disk alone
    got, rest = fresh.fetch_nearest_cache(KEY, later + [7])
    assert rest == [7] and got[0].offset == 200
    got, rest = fresh.fetch_nearest_cache(KEY, tokens + [7])
    assert got is None and len(rest) == 301  # the failed save left nothing behind
    fresh.close()
