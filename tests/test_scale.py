"""How costs grow with the store, in a short form: operation counts and peak memory at
N and 2N nodes, never times (tools/bench_scale.py measures those to a million nodes).

A cost that grows with the store (a RAM-tier insert that sums every entry, a
maintenance command that holds every record) fails here at a few thousand nodes.
"""

import importlib
import os
import random
import struct
import tracemalloc
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache

from kvstore import KVStore, maintenance
from kvstore.bench.models import tiny_model
from kvstore.disk.index import Index, NodeRecord
from kvstore.disk.policy import disk_victims
from kvstore.engine.ram import RamEntry, RamTier
from kvstore.maintenance import common, duetable, lru
from kvstore.platform import fsutil, memutil

pytestmark = pytest.mark.stress

CHUNK = 4
PER_PROMPT = 50  # nodes per saved prompt: chains 50 deep
N = 600  # nodes of the small store; the large one has twice as many


# -- the RAM tier ------------------------------------------------------------------------


@dataclass(frozen=True)
class CountedEntry(RamEntry):
    """A RAM entry that counts how often its size is asked for."""

    @property
    def nbytes(self) -> int:
        READS[0] += 1
        return len(self.data)


READS = [0]
# The module (the package's ``verify`` is the function of that name).
verify_module = importlib.import_module("kvstore.maintenance.verify")


def reads_per_insert(tier: RamTier, start: int, count: int) -> float:
    READS[0] = 0
    for i in range(start, start + count):
        tier.put(i, CountedEntry(b"x" * 10, {}, "user", False))
    return READS[0] / count


@pytest.mark.parametrize("full", [False, True])
def test_ram_tier_insert_does_not_grow_with_its_entries(full):
    """Reads of entry sizes per insert, at 1,000 and at 8,000 entries held, with room
    to spare or with every insert evicting (summing the entries read thousands)."""
    per = {}
    for held in (1000, 8000):
        tier = RamTier(10 * held if full else 1 << 30)
        reads_per_insert(tier, 0, held + (held if full else 0))
        per[held] = reads_per_insert(tier, 2 * held, 200)
        assert len(tier) == (held if full else held + 200)
    assert per[8000] <= per[1000] + 1


# -- maintenance in bounded memory -------------------------------------------------------


def _fill(path, nodes: int, seed: int) -> int:
    """A store of ``nodes`` tiny nodes: chains of PER_PROMPT nodes, each prompt
    branching off an earlier one at a random node (fan-out and depth). Files are not
    fsynced (durability is not what is tested here): a few seconds, not a minute."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fsutil, "fsync", lambda fd, *, device=True: None)
        mp.setattr(fsutil, "fsync_dir", lambda path, *, device=True: None)
        return _save_prompts(path, nodes, seed)


def _save_prompts(path, nodes: int, seed: int) -> int:
    model = tiny_model(layers=1, heads=1, head_dim=8)
    rng = np.random.default_rng(seed)
    kv = mx.array(rng.random((1, 1, 2 * PER_PROMPT * CHUNK, 8), dtype=np.float32))
    kv = kv.astype(mx.float16)
    base = [1] + rng.integers(60, 30000, size=PER_PROMPT * CHUNK - 1).tolist()
    with KVStore(path, model, chunk_tokens=CHUNK, ram_bytes=0) as store:
        i = 0
        while store.stats()["nodes"] < nodes:
            # Every fifth prompt from the root (fan-out there); the others branch off
            # the first at a node, the second at its last (the same depth at any size).
            at = PER_PROMPT - 1 if i == 1 else (i * 17) % PER_PROMPT
            head = [int(rng.integers(2, 60))] if i % 5 == 4 else base[: CHUNK * at]
            tokens = head + rng.integers(60, 30000, size=PER_PROMPT * CHUNK).tolist()
            tokens = (base if i == 0 else tokens)[: PER_PROMPT * CHUNK + len(head)]
            cache = KVCache()
            cache.state = (
                kv[:, :, : len(tokens)],
                kv[:, :, : len(tokens)],
                len(tokens),
            )
            store.save(tokens, [cache])
            store.flush()
            i += 1
        return store.stats()["bytes_on_disk"]


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    root = tmp_path_factory.mktemp("scale")
    out = {}
    for n in (N, 2 * N):
        path = str(root / f"s{n}")
        out[n] = (path, _fill(path, n, seed=n))
    return out


def peak_python_bytes(fn) -> int:
    """Peak bytes of Python objects while ``fn`` runs (the index's mapped pages are
    :func:`test_scans_release_the_index_pages`'s)."""
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.fixture
def small_bounds(monkeypatch):
    """The maintenance code's fixed bounds (records per batch, nodes sorted at once)
    made smaller than the test's stores, so that they are exceeded here as they are
    at a million nodes."""
    monkeypatch.setattr(lru, "EXACT", 128)
    monkeypatch.setattr(lru, "BINS", 64)
    monkeypatch.setattr(lru, "_BATCH", 128)
    monkeypatch.setattr(verify_module, "_FILE_BATCH", 128)
    monkeypatch.setattr(verify_module, "_ORPHAN_BATCH", 128)
    monkeypatch.setattr(common, "_RELEASE_BATCH", 128)
    monkeypatch.setattr(duetable, "_SCAN_BATCH", 128)


@pytest.fixture(params=["table", "walks"])
def eviction(request, monkeypatch):
    """Eviction from a table of every node, or (a store too large for its budget)
    from walks of the trie."""
    if request.param == "walks":
        monkeypatch.setattr(duetable, "TABLE_BYTES", 0)
    return request.param


def test_maintenance_memory_does_not_grow_with_the_store(
    stores, small_bounds, monkeypatch
):
    """Each command's peak at 2N nodes stays within a bound of its peak at N: at most
    128 bytes per extra node (the walks' paths and batches; holding each record
    once took ~3 KB a node, a table of every node for eviction ~400 bytes). gc
    walks the trie here, as it does for a store too large for an eviction table."""
    monkeypatch.setattr(duetable, "TABLE_BYTES", 0)
    peaks = {}
    for n, (path, nbytes) in stores.items():
        peaks[n] = {
            "stats": peak_python_bytes(lambda: maintenance.store_stats(path)),
            "stats_full": peak_python_bytes(
                lambda: maintenance.store_stats(path, full=True)
            ),
            "ls": peak_python_bytes(lambda: maintenance.list_tree(path)),
            "verify": peak_python_bytes(lambda: maintenance.verify(path)),
            # Last: it evicts half the store (leaf-first LRU, walked in bounded memory).
            "gc": peak_python_bytes(
                lambda: maintenance.gc(path, max_bytes=nbytes // 2)
            ),
        }
        assert maintenance.verify(path)["clean"]
    for name in peaks[N]:
        growth = peaks[2 * N][name] - peaks[N][name]
        assert growth <= 128 * N, (name, peaks[N][name], peaks[2 * N][name])


def test_scans_release_the_index_pages(tmp_path):
    """Reading every record of an index keeps only a bounded part of its file's pages
    resident (where the platform can release them; elsewhere only memory differs)."""
    index = Index(str(tmp_path / "index"))
    value = os.urandom(900)
    index.write(
        lambda txn: [
            txn.put(struct.pack(">Q", i), value, db=index.db["meta"])
            for i in range(40000)
        ]
    )

    def resident_file_kb() -> int:
        with open("/proc/self/status") as f:
            return next(
                int(line.split()[1]) for line in f if line.startswith("RssFile")
            )

    def scan(txn, shed: bool):
        before, peak = resident_file_kb(), 0
        for i, _ in enumerate(txn.cursor(db=index.db["meta"])):
            if i % 4096 == 0:
                if shed:
                    index.release_pages()
                peak = max(peak, resident_file_kb() - before)
        return peak

    try:
        if not memutil.release_file_pages(os.path.join(index.path, "data.mdb")):
            # macOS's path: nothing is released, and a scan reads every record.
            assert os.environ.get("KVSTORE_TEST_PLATFORM") == "macos"
            index.release_pages()
            count = index.read(
                lambda txn: sum(1 for _ in txn.cursor(db=index.db["meta"]))
            )
            assert count >= 40000
            return
        index.release_pages()
        kept = index.read(lambda txn: scan(txn, True))
        index.release_pages()
        held = index.read(lambda txn: scan(txn, False))
    finally:
        index.close()
    assert held > 20000  # ~36 MB of records: without release, all stay resident
    assert kept < held / 4


# -- eviction order ----------------------------------------------------------------------


@pytest.mark.parametrize("lost_atimes", [0, 5])
def test_eviction_takes_what_the_in_memory_order_takes(
    stores, tmp_path, lost_atimes, small_bounds, eviction
):
    """:func:`evict_to_budget` (from a table of every node, or from trie walks in
    bounded memory) evicts the very nodes :func:`kvstore.policy.disk_victims` picks
    from the whole store's records, with random access times and some pinned nodes;
    also when some nodes lost their access time (due at 0: outside the window the
    stored times give the first walk, which then walks again)."""
    path = str(tmp_path / "s")
    total = _fill(path, N, seed=7)
    index = Index(os.path.join(path, "index"), create=False)
    try:
        rnd = random.Random(3)

        def shuffle(txn):
            keys = [bytes(k) for k, _ in txn.cursor(db=index.db["atime"])]
            for k in keys:
                txn.put(
                    k, struct.pack("<d", rnd.uniform(1e9, 2e9)), db=index.db["atime"]
                )
            for k in rnd.sample(keys, 10):
                index.set_pinned(txn, k[:16], k[16:], True)
            for k in rnd.sample(keys, lost_atimes):
                txn.delete(k, db=index.db["atime"])

        index.write(shuffle)
        budget = total // 3
        nodes = index.read(lambda txn: common.disk_nodes(index, txn))
        excess = index.total_bytes() - budget
        want = disk_victims(nodes, excess)
        got = []
        blobs = maintenance.common.Blobs(
            os.path.join(path, "blobs"), os.path.join(path, "quarantine")
        )
        done = common.evict_to_budget(index, blobs, budget, on_evict=got.extend)
    finally:
        index.close()
    assert set(got) == set(want) and done.nodes == len(want) > 50
    kinds = {p["kind"] for p in maintenance.verify(path)["problems"]}
    assert kinds <= ({"index"} if lost_atimes else set()), kinds


def test_an_eviction_table_takes_the_memory_it_is_budgeted(stores, small_bounds):
    """A table of N nodes peaks within its stated bytes a node (with room for the
    arrays' growth), so :func:`duetable.fits` keeps it under its budget."""
    path, _ = stores[2 * N]
    index = Index(os.path.join(path, "index"), create=False)
    try:
        nodes = index.read(lambda txn: len(list(index.iter_nodes(txn))))
        peak = peak_python_bytes(
            lambda: duetable.DueTable(index, lift=None, rows=nodes).cut(1)
        )
    finally:
        index.close()
    assert peak <= duetable.BYTES_PER_NODE * nodes + (64 << 10), (peak, nodes)


def test_eviction_among_equal_access_times_stops_once_the_excess_is_met(
    tmp_path, small_bounds, eviction
):
    """Every node accessed at the same moment (one tie): the eviction takes leaves
    first until the excess is met, and not a node more."""
    path = str(tmp_path / "s")
    total = _fill(path, N // 2, seed=11)
    index = Index(os.path.join(path, "index"), create=False)
    try:

        def same_time(txn):
            keys = [bytes(k) for k, _ in txn.cursor(db=index.db["atime"])]
            for k in keys:
                txn.put(k, struct.pack("<d", 1.5e9), db=index.db["atime"])

        index.write(same_time)
        largest = max(
            r.total_bytes
            for r in index.read(
                lambda txn: [
                    NodeRecord.decode(raw) for _, _, raw in index.iter_nodes(txn)
                ]
            )
        )
        budget = total // 2
        blobs = maintenance.common.Blobs(
            os.path.join(path, "blobs"), os.path.join(path, "quarantine")
        )
        done = common.evict_to_budget(index, blobs, budget)
        after = index.total_bytes()
    finally:
        index.close()
    assert after <= budget < after + largest, (after, budget, largest)
    assert done.bytes == total - after
    assert maintenance.verify(path)["clean"]
