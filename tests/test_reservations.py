"""Disk reservations of saves in flight (:mod:`kvstore.disk.reservations`): a save reserves
its files' bytes before writing them and drops the reservation when it commits or
fails; reservations of dead processes, this process's leftovers and old ones are
dropped; a store made before the reservations DB existed opens."""

import errno
import logging
import os
import subprocess
import sys
import time

import lmdb
import pytest
from conftest import compute_cache, random_tokens

import kvstore.maintenance as m
from kvstore import KVStore
from kvstore.disk import reservations
from kvstore.disk.index import Index
from kvstore.disk.publish import WriteBatch

C = 32
LINUX = os.path.isdir("/proc/self")


def chunk_bytes(model, path) -> int:
    """Bytes of one C-token node's file (measured in a scratch store)."""
    tokens = random_tokens(C, seed=999)
    with KVStore(path, model, chunk_tokens=C) as store:
        store.save(tokens, compute_cache(model, tokens))
        store.flush()
        return store.stats()["bytes_on_disk"]


def listed(store):
    return store.index.read(lambda txn: reservations.listed(store.index, txn))


def put(store, key, nbytes, **kw):
    store.index.write(lambda txn: reservations.put(store.index, txn, key, nbytes, **kw))


def save(store, model, seed, n=C, **kw):
    tokens = random_tokens(n, seed=seed)
    store.save(tokens, compute_cache(model, tokens), **kw)
    store.flush()
    return tokens


@pytest.fixture
def sleeper():
    """A live process other than this one, and its start time."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc, reservations.process_start_time(proc.pid) or 0
    proc.kill()
    proc.wait()


def test_a_save_reserves_its_bytes_while_writing(tmp_path, model, monkeypatch):
    chunk = chunk_bytes(model, tmp_path / "probe")
    with KVStore(tmp_path / "s", model, chunk_tokens=C, disk_bytes=10 * chunk) as s:
        seen = []
        real = WriteBatch.add

        def add(*args, **kw):  # each file of the save, before it is written
            seen.append([(r.pid, r.nbytes) for r in listed(s)])
            return real(*args, **kw)

        monkeypatch.setattr(WriteBatch, "add", add)
        save(s, model, 1, 3 * C)
        # Before the first file is written the whole save is reserved, once.
        assert seen == [[(os.getpid(), 3 * chunk)]] * 3
        assert listed(s) == []
        assert s.stats()["bytes_on_disk"] == 3 * chunk


def test_live_reservation_of_another_process_makes_room(tmp_path, model, sleeper):
    chunk = chunk_bytes(model, tmp_path / "probe")
    proc, start = sleeper
    with KVStore(tmp_path / "s", model, chunk_tokens=C, disk_bytes=4 * chunk) as s:
        for seed in range(3):
            save(s, model, seed)
        other = reservations.key_for(proc.pid, start, 1)
        put(s, other, 2 * chunk)
        save(s, model, 10)
        # 3 stored + 2 reserved + 1 new must fit 4: two stored chunks went first.
        assert s.stats()["nodes_evicted"] == 2
        assert s.stats()["bytes_on_disk"] == 2 * chunk
        assert [r.key for r in listed(s)] == [other]

        proc.kill()
        proc.wait()
        save(s, model, 11)  # the dead process's bytes count no more
        assert listed(s) == []
        assert s.stats()["nodes_evicted"] == 2
        assert s.stats()["bytes_on_disk"] == 3 * chunk


@pytest.mark.skipif(not LINUX, reason="start times come from /proc")
def test_reservation_of_a_reused_pid_is_stale(tmp_path, model, sleeper):
    proc, start = sleeper
    assert start > 0
    with KVStore(tmp_path / "s", model, chunk_tokens=C) as s:
        put(s, reservations.key_for(proc.pid, start, 1), 100)
        put(s, reservations.key_for(proc.pid, start + 1, 1), 100)  # another process
        assert m.gc(s.path)["reservations_dropped"] == 1
        assert [(r.pid, r.start) for r in listed(s)] == [(proc.pid, start)]


def test_stale_reservations_are_dropped(tmp_path, model, sleeper):
    chunk = chunk_bytes(model, tmp_path / "probe")
    proc, start = sleeper
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    path = tmp_path / "s"
    with KVStore(path, model, chunk_tokens=C) as s:
        keep = reservations.key_for(proc.pid, start, 1)
        put(s, keep, 100)
        put(s, reservations.key_for(dead.pid, 0, 1), 100 * chunk)
        put(s, reservations.key_for(dead.pid, 0, 2), 100 * chunk)
        old = time.time() - reservations.STALE_SECONDS - 1
        put(s, reservations.key_for(proc.pid, start, 2), 100 * chunk, now=old)
    report = m.gc(path)
    assert report["reservations_dropped"] == 3
    with KVStore(path, model, chunk_tokens=C, disk_bytes=3 * chunk) as s:
        assert [r.key for r in listed(s)] == [keep]
        put(s, reservations.key_for(dead.pid, 0, 3), 100 * chunk)
        save(s, model, 1)
        save(s, model, 2)
        # The dead reservation was dropped by the first save: nothing was evicted.
        assert s.stats()["nodes_evicted"] == 0
        assert [r.key for r in listed(s)] == [keep]


def test_own_leftovers_go_at_open_and_live_ones_stay(tmp_path, model):
    path = tmp_path / "s"
    pid, start = os.getpid(), reservations.process_start_time(os.getpid()) or 0
    with KVStore(path, model, chunk_tokens=C) as s:
        # Ours but held by no save: a leftover (as after a failed delete).
        put(s, reservations.key_for(pid, start, 0), 100)
        live = reservations.new_key()  # held, as by a save of another store object
        put(s, live, 100)
        with KVStore(path, model, chunk_tokens=C) as s2:  # same process, same index
            assert [r.key for r in listed(s2)] == [live]
        reservations.forget(live)
    with KVStore(path, model, chunk_tokens=C) as s:
        assert listed(s) == []


@pytest.mark.parametrize("at", ["write", "commit"])
def test_failed_save_leaves_no_reservation(tmp_path, model, monkeypatch, caplog, at):
    caplog.set_level(logging.WARNING, logger="kvstore")
    chunk = chunk_bytes(model, tmp_path / "probe")
    with KVStore(tmp_path / "s", model, chunk_tokens=C, disk_bytes=4 * chunk) as s:
        save(s, model, 1)
        calls = []
        if at == "write":
            real = WriteBatch.add

            def add(*args, **kw):
                calls.append(1)
                if len(calls) == 2:  # the second node of the save: disk full
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                return real(*args, **kw)

            monkeypatch.setattr(WriteBatch, "add", add)
        else:
            real = type(s.index).write

            def write(index, fn):
                if getattr(fn, "__name__", "") == "commit":
                    calls.append(1)
                    raise lmdb.DiskError("mdb_txn_commit: No space left on device")
                return real(index, fn)

            monkeypatch.setattr(type(s.index), "write", write)
        save(s, model, 2, 3 * C)
        monkeypatch.undo()
        assert calls and s.stats()["writes_failed"] == 1
        assert listed(s) == []
        assert s.stats()["bytes_on_disk"] == chunk
        # The budget is whole again: a save of the full budget evicts only the old node.
        save(s, model, 3, 4 * C)
        assert s.stats()["nodes_evicted"] == 1
        assert s.stats()["bytes_on_disk"] == 4 * chunk


def test_save_bigger_than_the_budget_with_everything_pinned(tmp_path, model, caplog):
    chunk = chunk_bytes(model, tmp_path / "probe")
    with KVStore(tmp_path / "s", model, chunk_tokens=C, disk_bytes=chunk) as s:
        pinned = save(s, model, 1, 3 * C, pin=True)
        assert s.stats()["nodes_written"] == 3
        caplog.set_level(logging.WARNING, logger="kvstore")
        tokens = save(s, model, 2, 2 * C)  # cannot fit: written anyway, then evicted
        stats = s.stats()
        assert stats["nodes_written"] == 5 and stats["writes_failed"] == 0
        assert "disk budget exceeded" in caplog.text
        assert listed(s) == []
        assert stats["bytes_on_disk"] == 3 * chunk  # the unpinned save went again
        assert s.fetch(pinned + [1])[1] == 3 * C
        assert s.fetch(tokens + [1])[1] == 0


def test_store_made_before_the_reservations_db_opens(tmp_path, model):
    path = tmp_path / "s"
    with KVStore(path, model, chunk_tokens=C) as s:
        tokens = save(s, model, 1, 2 * C)
    env = lmdb.open(str(path / "index"), max_dbs=len(Index.DATABASES))
    with env.begin(write=True) as txn:
        txn.drop(env.open_db(b"reservations", txn=txn), delete=True)
    with env.begin() as txn:
        names = {bytes(k) for k, _ in txn.cursor()}
    env.close()
    assert b"reservations" not in names and b"nodes" in names

    assert m.store_stats(path)["totals"]["nodes"] == 2  # the model-less tools
    assert m.verify(path)["clean"]
    with KVStore(path, model, chunk_tokens=C, disk_bytes=1 << 30) as s:
        assert s.fetch(tokens + [1])[1] == 2 * C
        save(s, model, 2)
        assert s.stats()["nodes"] == 3 and listed(s) == []


def test_files_of_nodes_the_commit_skips_are_removed(tmp_path, model, monkeypatch):
    """The parent of a save's nodes is evicted (by another process) after the save
    reserved and before it commits: the nodes are not indexed, and their files,
    which no budget counts any more, do not stay as orphans."""
    path = tmp_path / "s"
    with KVStore(path, model, chunk_tokens=C, disk_bytes=1 << 30) as s:
        first = save(s, model, 1)
        (parent,) = s.index.read(lambda txn: s.index.children(s.namespace, s.root, txn))
        real = WriteBatch.publish

        def publish(*args, **kw):  # the files have their final names: evict
            published = real(*args, **kw)
            gone = s.index.write(
                lambda txn: m.delete_subtree(s.index, txn, s.namespace, parent)
            )
            m.release_files(s.index, s.blobs, [(s.namespace, h) for h, _ in gone])
            return published

        monkeypatch.setattr(WriteBatch, "publish", publish)
        tokens = first + random_tokens(2 * C, seed=2)
        s.save(tokens, compute_cache(model, tokens))
        s.flush()
        monkeypatch.undo()
        assert s.stats()["nodes"] == 0 and s.stats()["writes_failed"] == 0
        assert s.stats()["nodes_skipped"] == 2  # the two new chunks, counted
        assert listed(s) == []
    report = m.verify(path)
    assert report["clean"] and report["orphans"] == 0, report["problems"]
