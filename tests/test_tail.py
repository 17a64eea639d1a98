"""Restoring only the stored tokens past a caller's own copy (``fetch_beyond``) and
appending them to it (``join_tail``), through both restore paths."""

import mlx.core as mx
import pytest
from conftest import compute_cache, greedy, next_logits, random_tokens, tiny_llama
from families import build

from kvstore import KVStore
from kvstore.disk.adapters import LayoutMismatch
from kvstore.engine.payoff import EXPLORE_EVERY

C = 32  # tokens per node


@pytest.fixture(params=["assemble", "load"])
def io_path(request, monkeypatch):
    """Both restore paths: ``load`` is the one CUDA takes (forced on the CPU)."""
    monkeypatch.setenv("KVSTORE_RESTORE_IO", request.param)
    return request.param


def _same_as_cold(model, cache, prompt, n):
    warm = next_logits(model, cache, prompt[n:])
    cold = next_logits(model, compute_cache(model, []), prompt)
    assert mx.allclose(warm, cold, atol=1e-4, rtol=1e-4).item()


@pytest.mark.parametrize("held", [1, 31, 32, 100, 250])
def test_tail_appended_to_ram_copy_equals_cold(tmp_path, model, io_path, held):
    stored = random_tokens(300, seed=11)
    prompt = stored + random_tokens(9, seed=12)
    with KVStore(tmp_path / "s", model, chunk_tokens=C) as store:
        store.save(stored, compute_cache(model, stored))
        store.flush()
        assert store.restore_io == io_path
        tail = store.fetch_beyond(prompt, held)
        assert tail.end == 300
        assert tail.start == held // C * C  # the node holding the first missing token
        assert all(c.offset == 300 - tail.start for c in tail.cache)
        head = compute_cache(model, prompt[:held])  # what RAM holds
        cache = store.join_tail(head, tail, query=len(prompt))
        assert all(c.offset == 300 for c in cache)
        _same_as_cold(model, cache, prompt, 300)
        again = store.join_tail(compute_cache(model, prompt[:held]), tail, query=0)
        want = greedy(model, compute_cache(model, []), prompt, 10)
        assert greedy(model, again, prompt[300:], 10) == want


def test_tail_reads_only_the_nodes_past_the_copy(tmp_path, model, io_path):
    stored = random_tokens(320, seed=13)
    with KVStore(tmp_path / "s", model, chunk_tokens=C, ram_bytes=0) as store:
        store.save(stored, compute_cache(model, stored))
        store.flush()
        read = []
        real = store.parts.reads.read_costs

        def costs(path):
            read.append(len(path))
            return real(path)

        store.parts.reads.read_costs = costs
        tail = store.fetch_beyond(stored + [1], 290)
        assert read == [1] and (tail.start, tail.end) == (288, 320)
        assert store.stats()["tokens_reused"] == 30
        # Nothing stored past the copy: nothing read.
        assert store.fetch_beyond(stored + [1], 320) is None
        assert store.fetch_beyond(random_tokens(50, seed=14), 10) is None
        # A copy inside the first node: the whole prefix, a cache of its own.
        whole = store.fetch_beyond(stored + [1], 5)
        assert (whole.start, whole.end) == (0, 320)
        _same_as_cold(model, whole.cache, stored + [1, 2], 320)
        with pytest.raises(ValueError, match="held"):
            store.fetch_beyond(stored, -1)


def test_tail_weighed_against_prefilling_the_difference(tmp_path, model, monkeypatch):
    monkeypatch.setenv("KVSTORE_RESTORE", "auto")
    stored = random_tokens(320, seed=15)
    with KVStore(tmp_path / "s", model, chunk_tokens=C, ram_bytes=0) as store:
        store.save(stored, compute_cache(model, stored))
        store.flush()
        path = store.index.read(
            lambda txn: store.parts.reads.trie.walk(txn, store_arr(stored), limit=319)
        )
        node_bytes = store.parts.reads.read_costs(path)[0]
        # Reading a node takes 1 s, prefilling 20 tokens 1 s: the 10 tokens past a
        # copy of 310 are cheaper to prefill than their node is to read; the whole
        # prompt (10 nodes to read, 16 s to prefill) is not.
        store.policy.rates.restore = float(node_bytes)
        store.policy.rates.prefill = 20.0
        assert store.fetch_beyond(stored + [1], 310) is None
        assert store.stats()["recomputes_chosen"] == 1
        assert store.fetch_beyond(stored + [1], 0) is not None
        # Never restored just to measure the rate (whole prefixes are, 1 in 16).
        tails = [
            store.fetch_beyond(stored + [1], 310) for _ in range(2 * EXPLORE_EVERY)
        ]
        assert tails == [None] * (2 * EXPLORE_EVERY)
        # Weighed by the caller (a server against its queue): read all the same.
        tail = store.fetch_beyond(stored + [1], 310, weigh=False)
        assert (tail.start, tail.end) == (310 // C * C, 320)
        store.policy.mode = "never"  # but never against the user's restore="never"
        assert store.fetch_beyond(stored + [1], 0, weigh=False) is None


def store_arr(tokens):
    import numpy as np

    return np.array(tokens, dtype=np.uint32)


def test_broken_tail_node_is_a_miss_and_reported(tmp_path, model, io_path):
    stored = random_tokens(320, seed=16)
    with KVStore(tmp_path / "s", model, chunk_tokens=C, ram_bytes=0) as store:
        store.save(stored, compute_cache(model, stored))
        store.flush()
        path = store.index.read(
            lambda txn: store.parts.reads.trie.walk(txn, store_arr(stored), limit=320)
        )
        victim = path[-2].h  # tokens [256, 288)
        f = store.blobs.path(store.namespace, victim)
        with open(f, "r+b") as fh:
            fh.seek(-8, 2)
            fh.write(b"\xff" * 8)
        tail = store.fetch_beyond(stored + [1], 200)
        assert (tail.start, tail.end) == (192, 256)  # up to the broken node
        assert store.stats()["corrupt"] == 1
        assert store.fetch_beyond(stored + [1], 256) is None


def test_join_refuses_another_layout(tmp_path, io_path):
    model = tiny_llama(0, hidden=128)
    stored = random_tokens(100, seed=17)
    with KVStore(
        tmp_path / "s", model, chunk_tokens=C, kv_bits=8, kv_group_size=32
    ) as store:
        store.prefill(stored)
        store.flush()
        tail = store.fetch_beyond(stored + [1], 40)
        assert tail.start == 32
        # mlx-lm's RAM copy below --quantized-kv-start: plain KVCache layers.
        with pytest.raises(LayoutMismatch):
            store.join_tail(compute_cache(model, stored[:40]), tail, query=101)
        head = store.fetch(stored[:41])[0]  # a quantized copy of 40 tokens
        joined = store.join_tail(head, tail, query=101)
        assert all(c.offset == 100 for c in joined)
        whole = store.fetch(stored + [1])[0]
        for a, b in zip(joined, whole):
            for x, y in zip((*a.keys, *a.values), (*b.keys, *b.values)):
                assert mx.array_equal(x[..., :100, :], y[..., :100, :]).item()


def test_state_layout_restores_all_or_nothing(tmp_path, io_path):
    model = build("gemma3_text")
    stored = random_tokens(96, seed=18)
    with KVStore(tmp_path / "s", model, chunk_tokens=C) as store:
        store.save(stored, compute_cache(model, stored), boundaries=[64])
        store.flush()
        tail = store.fetch_beyond(stored + [1], 70)
        assert (tail.start, tail.end) == (0, 96)
        _same_as_cold(model, tail.cache, stored + [1, 2], 96)
        with pytest.raises(ValueError, match="state"):
            store.join_tail(compute_cache(model, stored[:70]), tail, query=97)


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_restore_on_another_thread_is_usable_here(tmp_path, io_path, family):
    """MLX's streams belong to their thread: a restore made on a prefetch thread
    is evaluated there, so the generation thread can use it."""
    import threading

    model = tiny_llama(0) if family == "llama" else build(family)
    stored = random_tokens(96, seed=19)
    with KVStore(tmp_path / "s", model, chunk_tokens=C) as store:
        store.save(stored, compute_cache(model, stored), boundaries=[64])
        store.flush()
        got = {}
        for held in (0, 40):
            t = threading.Thread(
                target=lambda h=held: got.update(
                    {h: store.fetch_beyond(stored + [1], h)}
                )
            )
            t.start()
            t.join()
        _same_as_cold(model, got[0].cache, stored + [1, 2], 96)
        tail = got[40]
        if tail.start:
            tail.cache = store.join_tail(
                compute_cache(model, stored[:40]), tail, query=97
            )
        _same_as_cold(model, tail.cache, stored + [1, 2], 96)
