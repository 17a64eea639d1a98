"""Saves of ``kvstore serve`` off the generation thread (``kvstore.serve.saves``):
queued at once, merged into a later save that covers them, deferred while the
writer is full rather than dropped, lost only once their prefix left RAM."""

import threading

import pytest
from conftest import compute_cache, random_tokens
from serving import KEY, provider

from kvstore import KVStore
from kvstore.serve.prefetch import Prefetcher
from kvstore.serve.saves import SaveJob, SaveQueue
from kvstore.server import PersistentPromptCache

pytestmark = pytest.mark.slow
C = 32


class Counts(dict):
    def __call__(self, **deltas):
        for k, v in deltas.items():
            self[k] = self.get(k, 0) + v


def job(store, tokens, cache, kind="assistant", salt=None):
    return SaveJob(store, KEY, list(tokens), len(tokens), cache, kind, salt)


def fill_writer(store, gate):
    """Hold the writer with a job carrying more bytes than it lets wait."""
    assert store.writer.submit(gate.wait, store.writer.max_pending_bytes + 1)


def test_queued_save_is_written(tmp_path, model):
    tokens = random_tokens(100, seed=41)
    counts = Counts()
    with KVStore(tmp_path / "s", model, chunk_tokens=C) as store:
        q = SaveQueue(in_ram=lambda j: True, count=counts)
        q.put(job(store, tokens, compute_cache(model, tokens)))
        q.flush()
        store.flush()
        assert store.lookup(tokens + [1]) == 100
        q.close()
    assert counts == {}


def test_save_covered_by_a_later_one_is_merged(tmp_path, model):
    tokens = random_tokens(130, seed=42)
    counts, gate = Counts(), threading.Event()
    with KVStore(tmp_path / "s", model, chunk_tokens=C) as store:
        q = SaveQueue(in_ram=lambda j: True, count=counts)
        fill_writer(store, gate)  # the queue waits: later saves stay queued
        blocker = random_tokens(40, seed=43)
        q.put(job(store, blocker, compute_cache(model, blocker)))
        q.put(job(store, tokens[:70], compute_cache(model, tokens[:70]), "system"))
        q.put(job(store, tokens[:90], compute_cache(model, tokens[:90]), "system"))
        q.put(job(store, tokens, compute_cache(model, tokens), "assistant"))
        # The 70-token save is covered by the 90-token one; the 90-token save is a
        # system prompt, not demoted into the assistant's save.
        assert counts["saves_merged"] == 1
        gate.set()
        q.flush()
        store.flush()
        assert store.lookup(tokens + [1]) == 130
        assert store.lookup(blocker + [1]) == 40
        assert store.stats()["writes_dropped"] == 0
        q.close()


def test_save_waits_for_a_full_writer_instead_of_being_dropped(tmp_path, model):
    tokens = random_tokens(100, seed=44)
    counts, gate = Counts(), threading.Event()
    with KVStore(
        tmp_path / "s", model, chunk_tokens=C, max_pending_bytes=1 << 20
    ) as store:
        q = SaveQueue(in_ram=lambda j: True, count=counts)
        fill_writer(store, gate)
        q.put(job(store, tokens, compute_cache(model, tokens)))
        threading.Timer(0.3, gate.set).start()
        q.flush()
        store.flush()
        assert counts == {"saves_deferred": 1}
        assert store.stats()["writes_dropped"] == 0
        assert store.lookup(tokens + [1]) == 100
        q.close()


def test_deferred_save_whose_prefix_left_ram_is_lost(tmp_path, model):
    tokens = random_tokens(100, seed=45)
    counts, gate, held = Counts(), threading.Event(), [True]
    with KVStore(tmp_path / "s", model, chunk_tokens=C) as store:
        q = SaveQueue(in_ram=lambda j: held[0], count=counts)
        fill_writer(store, gate)
        q.put(job(store, tokens, compute_cache(model, tokens)))
        held[0] = False  # mlx-lm's LRU dropped it
        q.flush()
        gate.set()
        store.flush()
        assert counts == {"saves_deferred": 1, "saves_lost": 1}
        assert store.lookup(tokens + [1]) == 0
        q.close()


def test_prompt_cache_saves_on_its_own_thread(tmp_path, model, tokenizer, monkeypatch):
    tokens = random_tokens(300, seed=46)
    pc = PersistentPromptCache(tmp_path / "s", provider(model, tokenizer))
    assert pc.use_threads(Prefetcher())
    on = []
    store = pc.open_store(KEY)
    real = store.save_prefix
    monkeypatch.setattr(
        store,
        "save_prefix",
        lambda *a, **kw: on.append(threading.current_thread().name) or real(*a, **kw),
    )
    pc.insert_cache(KEY, tokens, compute_cache(model, tokens), salt="t")
    assert pc.stats()["saves"] == 1
    pc.flush()
    assert on == ["kvstore-saves"] and store.lookup(tokens + [1], salt="t") == 300

    # A failing save is counted on that thread, never raised anywhere.
    def boom(*a, **kw):
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(store, "save_prefix", boom)
    pc.insert_cache(KEY, tokens + [1], compute_cache(model, tokens + [1]))
    pc.flush()
    s = pc.stats()
    assert (s["saves_skipped"], s["store_errors"]) == (1, 1)
    pc.close()
    pc.close()
