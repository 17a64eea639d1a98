"""Crash safety: prefilling processes SIGKILLed at random moments and at chosen points.

After every kill the store must open, ``verify`` may report orphan or temp files but
nothing else, and every prompt ``fetch`` returns must restore exactly the recomputed
KV. Children come from a forkserver that has already imported mlx, so a kill costs
tens of milliseconds instead of an interpreter start. ``KVSTORE_CRASH_KILLS`` sets
the number of random kills (default 40, plus 18 at chosen points: in the middle of a
file, between the steps of a save's grouped publication, between files and commit).
"""

import multiprocessing as mp
import os
import random
import signal
import time

import mlx.core as mx
import pytest
from conftest import compute_cache, random_tokens, tiny_llama

from kvstore import KVStore, maintenance

pytestmark = pytest.mark.stress

C = 32
PROMPTS = [random_tokens(96 + 16 * (i % 4), 5000 + i) for i in range(24)]


def _child(path: str, start: int, fault: str, forever: bool = True) -> None:
    """Prefill prompts in order from ``start``, then (``forever``) fresh ones until killed;
    optionally SIGKILL itself at a fault point."""
    from kvstore.disk import index, publish

    def die():
        # Mark that the fault point was reached: a child failing before it would
        # otherwise be killed by the parent's timeout and look the same.
        open(os.path.join(path, f"fired-{os.getpid()}"), "w").close()
        os.kill(os.getpid(), signal.SIGKILL)

    if fault == "mid-file-write":
        real_write = os.write

        def half_write(fd, data):  # write half of the first chunk file, then die
            real_write(fd, bytes(data)[: len(data) // 2])
            die()

        def half_writev(fd, buffers):
            real_write(
                fd, b"".join(bytes(b) for b in buffers)[: sum(map(len, buffers)) // 2]
            )
            die()

        def add(self, *args, **kw):
            os.write, os.writev = half_write, half_writev
            return real_add(self, *args, **kw)

        real_add = publish.WriteBatch.add
        publish.WriteBatch.add = add
    elif fault == "mid-batch":  # the second file of a save is being written
        real_add = publish.WriteBatch.add

        def add(self, *args, **kw):
            if self.staged:
                die()
            return real_add(self, *args, **kw)

        publish.WriteBatch.add = add
    elif fault == "synced-before-link":  # every file of the save durable, none linked

        def link(self, staged):
            die()

        publish.WriteBatch._link = link
    elif fault == "linked-before-dir-sync":  # final names given, directories not synced
        real_publish_link = publish.WriteBatch._link

        def link(self, staged):
            if staged is self.staged[-1]:
                real_publish_link(self, staged)
                die()
            return real_publish_link(self, staged)

        publish.WriteBatch._link = link
    elif fault == "after-file-before-commit":
        real_index_write = index.Index.write

        def write(self, fn):
            if getattr(fn, "__name__", "") == "commit":
                die()
            return real_index_write(self, fn)

        index.Index.write = write

    model = tiny_llama(0)
    with KVStore(path, model, chunk_tokens=C) as store:
        for i in range(start, len(PROMPTS)):
            store.prefill(PROMPTS[i])
            store.flush()
        seed = 10_000 * (start + 1) + os.getpid()
        while (
            forever
        ):  # new prompts sharing a stored prefix, so there is always a write
            seed += 1
            store.prefill(PROMPTS[seed % len(PROMPTS)][:64] + random_tokens(40, seed))
            store.flush()


def _check_store(path: str, model) -> int:
    """Verify, then compare every restorable prompt with recomputation. Returns hits."""
    if not os.path.isdir(os.path.join(path, "index")):
        return 0  # killed before it made the store: there is none to check
    report = maintenance.verify(path)
    assert report["clean"], [
        p for p in report["problems"] if p["kind"] not in ("orphan", "temp")
    ]
    hits = 0
    with KVStore(path, model, chunk_tokens=C) as store:
        for tokens in PROMPTS:
            cache, n = store.fetch(tokens + [1])
            if n == 0:
                continue
            hits += 1
            ref = compute_cache(model, tokens[:n])
            for got, want in zip(cache, ref):
                assert mx.array_equal(got.keys[:, :, :n], want.keys[:, :, :n]).item()
                assert mx.array_equal(
                    got.values[:, :, :n], want.values[:, :, :n]
                ).item()
        assert store.stats()["corrupt"] == 0
    return hits


def test_sigkill_at_random_moments_and_at_chosen_points(tmp_path):
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["mlx.core", "mlx_lm", "kvstore", "conftest"])
    path = str(tmp_path / "store")
    model = tiny_llama(0)
    rng = random.Random(7)
    kills = int(os.environ.get("KVSTORE_CRASH_KILLS", "40"))
    faults = ["mid-file-write", "after-file-before-commit"] * 6
    # Between the steps of a save's grouped publication.
    faults += ["mid-batch", "synced-before-link", "linked-before-dir-sync"] * 2
    plan = [("random", None)] * kills + [("fault", f) for f in faults]
    rng.shuffle(plan)
    killed = 0
    for step, (how, fault) in enumerate(plan):
        start = rng.randrange(len(PROMPTS))
        child = ctx.Process(target=_child, args=(path, start, fault or ""))
        child.start()
        if how == "random":
            time.sleep(rng.uniform(0.05, 0.5))
        else:
            child.join(30)  # the fault point kills it
        if child.is_alive():
            os.kill(child.pid, signal.SIGKILL)
        child.join(60)
        assert child.exitcode is not None, "child hung"
        killed += child.exitcode == -signal.SIGKILL
        if fault:
            marker = os.path.join(path, f"fired-{child.pid}")
            assert os.path.exists(marker), f"fault point {fault} never fired"
            os.unlink(marker)
        if step % 8 == 0 or fault:
            _check_store(path, model)
    assert killed == len(plan), f"only {killed} of {len(plan)} children died by SIGKILL"

    # Orphans (from kills between file and commit) are collected; the store stays clean.
    maintenance.gc(path, temp_age_seconds=0)
    report = maintenance.verify(path)
    assert report["clean"] and report["orphans"] == 0 and report["temp_files"] == 0

    # A rerun completes the work: every prompt is then fully restorable.
    child = ctx.Process(target=_child, args=(path, 0, "", False))
    child.start()
    child.join(300)
    assert child.exitcode == 0
    assert _check_store(path, model) == len(PROMPTS)


def test_store_killed_before_its_first_commit_is_an_empty_store(tmp_path, model):
    """LMDB's files made, no transaction committed (a kill in between): verify and
    stats see an empty store, and the next open initializes it."""
    import lmdb

    path = tmp_path / "store"
    (path / "index").mkdir(parents=True)
    lmdb.open(str(path / "index"), max_dbs=16).close()
    report = maintenance.verify(str(path))
    assert report["clean"] and report["nodes"] == 0
    with KVStore(str(path), model, chunk_tokens=C) as store:
        store.save(PROMPTS[0], compute_cache(model, PROMPTS[0]))
        store.flush()
        assert store.stats()["nodes"] > 0
