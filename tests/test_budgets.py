"""Budgets under concurrency: the disk budget with several writer processes saving
into one store while a sampler measures it, and the RAM tier with threads saving and
fetching while another samples it.

``KVSTORE_BUDGET_SECONDS`` sets the run time of the writers (default 6 s).
"""

import multiprocessing as mp
import os
import random
import threading
import time

import mlx.core as mx
import pytest
from conftest import compute_cache, random_tokens, tiny_llama

from kvstore import KVStore
from kvstore.disk.blobs import Blobs
from kvstore.disk.index import Index

pytestmark = pytest.mark.slow

C = 32
WRITERS = 4
BUDGET_CHUNKS = 12


def _writer(path: str, seed: int, seconds: float, budget: int, out) -> None:
    """Save one-chunk prompts (fresh ones, and old ones again) until the time is up."""
    rng = random.Random(seed)
    model = tiny_llama(0)
    saves = 0
    with KVStore(path, model, chunk_tokens=C, disk_bytes=budget) as store:
        deadline = time.time() + seconds
        while time.time() < deadline:
            tokens = random_tokens(C, rng.randrange(10 * BUDGET_CHUNKS))
            store.save(tokens, compute_cache(model, tokens))
            store.flush()
            saves += 1
        stats = store.stats()
    out.put((saves, stats["nodes_evicted"], stats["errors"] + stats["writes_failed"]))


def _files_bytes_locked(index: Index, blobs_dir: str) -> int:
    """:func:`_files_bytes` under LMDB's writer lock, so that it never counts more
    than the files the index and the live reservations account for at the walk's end.

    A plain walk is not atomic: listing an evicted file before its unlink and a new
    file after its write counts both (with the fix, 3 writers, it saw +2 chunks).
    kvstore unlinks chunk files only inside write transactions (``release_files``), so
    under the lock no chunk file goes away; files written meanwhile belong to
    reservations still live at the walk's end (dropping one takes the lock), as do the
    temp files of writes that lost the race to their final name and went away after
    being counted.
    """
    return index.write(lambda txn: _files_bytes(blobs_dir))


def _files_bytes(blobs_dir: str) -> int:
    """Bytes of every chunk file and temp file under ``blobs_dir`` (a temp file
    hard-linked to its final name counts once)."""
    sizes = {}
    for dirpath, _, names in os.walk(blobs_dir):
        for name in names:
            try:
                st = os.stat(os.path.join(dirpath, name))
            except FileNotFoundError:
                continue  # unlinked meanwhile
            sizes[st.st_ino] = st.st_size
    return sum(sizes.values())


def test_disk_budget_holds_with_concurrent_writers(tmp_path, model):
    path = str(tmp_path / "s")
    first = random_tokens(C, 10**6)
    with KVStore(path, model, chunk_tokens=C) as store:  # measure one chunk's file
        store.save(first, compute_cache(model, first))
        store.flush()
        chunk = store.stats()["bytes_on_disk"]
    budget = BUDGET_CHUNKS * chunk

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["mlx.core", "mlx_lm", "kvstore", "conftest"])
    seconds = float(os.environ.get("KVSTORE_BUDGET_SECONDS", "6"))
    out = ctx.Queue()
    procs = [
        ctx.Process(target=_writer, args=(path, i, seconds, budget, out))
        for i in range(WRITERS)
    ]
    for p in procs:
        p.start()

    index = Index(os.path.join(path, "index"), create=False)
    blobs_dir = os.path.join(path, "blobs")
    samples, max_indexed, max_files = 0, 0, 0
    try:
        while any(p.is_alive() for p in procs):
            max_indexed = max(max_indexed, index.total_bytes())
            max_files = max(max_files, _files_bytes_locked(index, blobs_dir))
            samples += 1
            time.sleep(0.001)  # let the writers take the lock
        results = [out.get(timeout=120) for _ in procs]
    finally:
        for p in procs:
            p.join(60)
        index.close()
    assert all(p.exitcode == 0 for p in procs)
    saves = sum(r[0] for r in results)
    evicted = sum(r[1] for r in results)
    print(
        f"\ndisk budget: {WRITERS} writers, {saves} saves, {evicted} evictions, "
        f"{samples} samples; budget {budget} B = {BUDGET_CHUNKS} chunks of {chunk} B; "
        f"max indexed {max_indexed} B, max files on disk {max_files} B "
        f"(+{(max_files - budget) / chunk:.2f} chunks)"
    )
    assert sum(r[2] for r in results) == 0
    assert evicted > 0 and samples > 100  # the budget was really under pressure
    # The index never holds more than the budget: eviction and the commit adding
    # nodes are one transaction.
    assert max_indexed <= budget
    # Files: a writer reserves its file's bytes (evicting, and unlinking the evicted
    # files) before writing it, so the in-flight files of all writers fit the budget
    # together. The one chunk of slack: eviction takes whole nodes, so a reservation's
    # victims may exceed its bytes by less than one node until they are unlinked just
    # after it (not here, all nodes being one chunk: +0 chunks measured; without
    # reservations, +WRITERS chunks).
    assert max_files <= budget + chunk
    blobs = Blobs(blobs_dir, str(tmp_path / "q"))
    assert sum(1 for kind, _ in blobs.iter_files() if kind == "temp") == 0
    with KVStore(path, model, chunk_tokens=C) as store:
        assert store.stats()["store_bytes_on_disk"] <= budget


def test_ram_tier_never_exceeds_its_budget_under_threads(tmp_path, model):
    prompts = [random_tokens(40 + 24 * (i % 5), 300 + i) for i in range(16)]
    caches = [compute_cache(model, p) for p in prompts]
    with KVStore(tmp_path / "s", model, chunk_tokens=C, ram_bytes=0) as probe:
        probe.save(prompts[0], caches[0])
        probe.flush()
        chunk = probe.stats()["bytes_on_disk"] // 2  # 40 tokens: two nodes
    budget = 5 * chunk
    seen, stop, failures = [], threading.Event(), []

    with KVStore(tmp_path / "s", model, chunk_tokens=C, ram_bytes=budget) as store:

        def sample():
            while not stop.is_set():
                seen.append(store.stats()["ram_bytes"])

        def work(seed):
            rng = random.Random(seed)
            try:
                for _ in range(40):
                    i = rng.randrange(len(prompts))
                    if rng.random() < 0.5:
                        store.save(
                            prompts[i], caches[i], kind=rng.choice(["system", "user"])
                        )
                    else:
                        cache, n = store.fetch(prompts[i] + [1])
                        if n:
                            want = compute_cache(model, prompts[i][:n])
                            same = mx.array_equal(
                                cache[0].keys[:, :, :n], want[0].keys[:, :, :n]
                            )
                            assert same.item()
            except Exception as e:  # reported below: a thread's assert is not enough
                failures.append(e)

        sampler = threading.Thread(target=sample)
        workers = [threading.Thread(target=work, args=(i,)) for i in range(4)]
        sampler.start()
        for t in workers:
            t.start()
        for t in workers:
            t.join()
        store.flush()
        stop.set()
        sampler.join()
        stats = store.stats()
        held = sum(e.nbytes for b in store.ram._buckets.values() for e in b.values())

    assert failures == []
    print(f"\nRAM budget: {len(seen)} samples, max {max(seen)} B of {budget} B")
    assert len(seen) > 10 and max(seen) <= budget
    assert 0 < stats["ram_bytes"] == held <= budget
    assert stats["errors"] == stats["writes_failed"] == 0
