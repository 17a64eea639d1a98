"""LMDB reader slots left behind by processes SIGKILLed inside a read transaction.

A killed reader's slot stays in the lock file while any other process keeps the index
open (a server, say). Its snapshot pins every page freed after it, so writers cannot
reuse space and the map grows without need. kvstore clears such slots when a process
opens the index and when a write finds the map full (:func:`index._clear_stale_readers`).
"""

import os
import signal
import subprocess
import sys

import mlx.core as mx
import pytest
from conftest import compute_cache, random_tokens

from kvstore import KVStore
from kvstore.disk.index import Index

pytestmark = pytest.mark.slow

C = 32

_HOLD_READ = """
import sys, time
from kvstore.disk.index import Index

index = Index(sys.argv[1], create=False)

def hold(txn):
    txn.get(b"format_version", db=index.db["meta"])
    print("reading", flush=True)
    time.sleep(600)

index.read(hold)
"""


def kill_inside_read_transaction(index_dir: str) -> int:
    """Start a process that opens ``index_dir`` and blocks in a read transaction, then
    SIGKILL it. Returns its pid."""
    child = subprocess.Popen(
        [sys.executable, "-c", _HOLD_READ, index_dir],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout.readline().strip() == "reading"
    finally:
        child.kill()
        child.wait(30)
        child.stdout.close()
    assert child.returncode == -signal.SIGKILL
    return child.pid


def reader_pids(index: Index) -> set:
    lines = index.env.readers().splitlines()[1:]  # header: pid thread txnid
    return {int(line.split()[0]) for line in lines if line.strip()}


def test_stale_slot_is_cleared_when_another_process_opens(tmp_path, model):
    path = str(tmp_path / "s")
    prompt = random_tokens(100, seed=1)
    with KVStore(path, model, chunk_tokens=C) as server:  # keeps the index open
        server.save(prompt, compute_cache(model, prompt))
        server.flush()
        dead = kill_inside_read_transaction(os.path.join(path, "index"))
        assert dead in reader_pids(server.index)  # the slot is stale now

        # Any process opening the store clears it.
        opened = subprocess.run(
            [
                sys.executable,
                "-c",
                "import sys; from kvstore.disk.index import Index; "
                "Index(sys.argv[1], create=False).close()",
                os.path.join(path, "index"),
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert opened.returncode == 0, opened.stderr
        assert dead not in reader_pids(server.index)

        # Writers proceed and readers get exactly the stored KV.
        more = prompt[:64] + random_tokens(80, seed=2)
        server.save(more, compute_cache(model, more))
        server.flush()
        for tokens in (prompt, more):
            cache, n = server.fetch(tokens + [1])
            assert n == len(tokens)
            for got, want in zip(cache, compute_cache(model, tokens)):
                assert mx.array_equal(got.keys[:, :, :n], want.keys[:, :, :n]).item()
                assert mx.array_equal(
                    got.values[:, :, :n], want.values[:, :, :n]
                ).item()
        stats = server.stats()
        assert stats["errors"] == stats["writes_failed"] == stats["corrupt"] == 0


def test_full_map_reuses_the_pages_a_dead_reader_pinned(tmp_path):
    path = str(tmp_path / "index")
    index = Index(path, map_size=2 << 20)
    try:
        meta = index.db["meta"]
        index.write(lambda txn: txn.put(b"big", b"\0" * (512 << 10), db=meta))
        dead = kill_inside_read_transaction(path)
        assert dead in reader_pids(index)

        # 40 rewrites of 512 KiB: 20 MiB of freed pages, which the dead reader's
        # snapshot would pin. The first full map clears its slot instead of growing.
        for i in range(40):
            value = bytes([i]) * (512 << 10)
            index.write(lambda txn: txn.put(b"big", value, db=meta))
        assert dead not in reader_pids(index)
        assert index.env.info()["map_size"] == 2 << 20
        assert index.read(lambda txn: bytes(txn.get(b"big", db=meta)[:1])) == b"\x27"

        # The map still grows when the data needs it.
        for i in range(8):
            value = bytes([i]) * (512 << 10)
            index.write(lambda txn: txn.put(b"k%d" % i, value, db=meta))
        assert index.env.info()["map_size"] > 2 << 20
        assert index.read(lambda txn: txn.stat(meta)["entries"]) >= 9
    finally:
        index.close()
