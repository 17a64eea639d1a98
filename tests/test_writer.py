"""The background writer's byte limit: only saves carrying KV are refused by it.

Access-time updates, pins and quarantines carry no KV bytes: they run even while the
bytes pending exceed ``max_pending_bytes``; ``writes_dropped`` counts refused saves
only, once each. The writer is held on a gate so the pending save stays pending.
"""

import logging
import struct
import threading

import pytest
from conftest import compute_cache, random_tokens

from kvstore import KVStore

C = 32
BIG = random_tokens(200, seed=71)  # 200 tokens x 512 bytes: ~100 KB of KV
OTHER = random_tokens(200, seed=74)
SMALL = random_tokens(40, seed=73)
LIMIT = 50_000  # max_pending_bytes: below one BIG save


@pytest.fixture
def store(tmp_path, model):
    with KVStore(
        tmp_path / "s", model, chunk_tokens=C, ram_bytes=0, max_pending_bytes=LIMIT
    ) as s:
        yield s


def hold_writer(store) -> threading.Event:
    """Queue a job that blocks the writer thread until the returned event is set."""
    gate = threading.Event()
    store.writer.submit(lambda: gate.wait(30))
    return gate


def atime(store, tokens) -> float:
    """The access time the index holds for the last node of stored ``tokens``."""
    path = store.index.read(
        lambda txn: store.parts.reads.trie.walk(
            txn, tokens, limit=len(tokens), full_only=True
        )
    )
    raw = store.index.read(
        lambda txn: txn.get(store.namespace + path[-1].h, db=store.index.db["atime"])
    )
    return struct.unpack("<d", raw)[0] if raw is not None else 0.0


def test_flush_during_a_large_save_drops_nothing(store, model, monkeypatch):
    store.save(SMALL, compute_cache(model, SMALL))
    store.flush()
    before = atime(store, SMALL)
    gate = hold_writer(store)
    store.save(BIG, compute_cache(model, BIG))  # more than the limit: pending
    assert store.writer.pending_bytes > LIMIT
    store.fetch(SMALL + [1, 2])  # an access time for flush() to write
    real_flush = store.writer.flush
    # Open the gate only once flush() has handed its access-time job to the writer.
    monkeypatch.setattr(store.writer, "flush", lambda: (gate.set(), real_flush()))
    store.flush()
    stats = store.stats()
    assert stats["writes_dropped"] == 0
    assert stats["nodes_written"] == 2 + 7  # SMALL, then every node of BIG
    assert store.lookup(BIG + [1]) == len(BIG)
    assert atime(store, SMALL) > before  # the access time was written


def test_second_large_save_while_one_is_pending_is_dropped_once(store, model, caplog):
    gate = hold_writer(store)
    store.save(BIG, compute_cache(model, BIG))
    with caplog.at_level(logging.WARNING, logger="kvstore"):
        assert store.save(OTHER, compute_cache(model, OTHER)) == 0
    gate.set()
    store.flush()
    stats = store.stats()
    assert stats["writes_dropped"] == 1
    assert store.lookup(BIG + [1]) == len(BIG)
    assert store.lookup(OTHER + [1]) == 0
    (line,) = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
    # The line names the prompt: its length and its first node (stored now to read it).
    store.save(OTHER, compute_cache(model, OTHER))
    store.flush()
    first = store.index.read(
        lambda txn: store.parts.reads.trie.walk(
            txn, OTHER, limit=len(OTHER), full_only=True
        )
    )[0].h
    assert "200-token prompt" in line and first.hex()[:12] in line


def test_pin_of_a_stored_prompt_during_a_large_save_takes_effect(store, model):
    store.save(SMALL, compute_cache(model, SMALL))
    store.flush()
    gate = hold_writer(store)
    store.save(BIG, compute_cache(model, BIG))
    assert store.writer.pending_bytes > LIMIT
    assert store.prefill(SMALL, pin=True)["reused"] == len(SMALL)
    gate.set()
    store.flush()
    stats = store.stats()
    assert stats["writes_dropped"] == 0
    assert stats["pinned_bytes"] > 0
    assert len(store.index.pinned(store.namespace)) == 2  # both nodes of SMALL


def test_quarantine_during_a_large_save_is_not_refused(store, model):
    store.save(SMALL, compute_cache(model, SMALL))
    store.flush()
    path = store.index.read(
        lambda txn: store.parts.reads.trie.walk(
            txn, SMALL, limit=len(SMALL), full_only=True
        )
    )
    broken, rec = path[-1].h, path[-1].rec
    gate = hold_writer(store)
    store.save(BIG, compute_cache(model, BIG))
    store.parts.broken.report(broken, "test: checksum mismatch", rec)
    gate.set()
    store.flush()
    assert store.index.get_node(store.namespace, broken) is None  # quarantined
    assert store.stats()["writes_dropped"] == 0
