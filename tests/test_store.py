"""KVStore against the cold path, with tiny random-weight llama models."""

import os
import threading

import mlx.core as mx
import numpy as np
import pytest
from conftest import (
    assert_same_as_cold,
    compute_cache,
    greedy,
    next_logits,
    random_tokens,
    tiny_llama,
)
from mlx_lm.models import llama
from mlx_lm.models.cache import ConcatenateKVCache, KVCache

import kvstore
import kvstore.platform.memutil
from kvstore import KVStore, StoreError, UnsupportedCacheError

C = 64  # chunk tokens in these tests
STORED = random_tokens(300, seed=1)  # 4 full chunks and a 44-token tail
FRESH = random_tokens(200, seed=2)


@pytest.fixture
def store(tmp_path, model):
    with KVStore(tmp_path / "store", model, chunk_tokens=C) as s:
        s.save(STORED, compute_cache(model, STORED))
        s.flush()
        yield s


@pytest.mark.parametrize(
    "prompt, expect_n",
    [
        pytest.param(STORED, len(STORED) - 1, id="exact-fit-leaves-one-token"),
        pytest.param(STORED + FRESH[:50], len(STORED), id="longer"),
        pytest.param(STORED[:100] + FRESH[:30], 100, id="diverge-inside-chunk"),
        pytest.param(STORED[:280] + FRESH[:30], 280, id="diverge-inside-tail"),
        pytest.param(STORED[:128] + FRESH[:30], 128, id="diverge-on-boundary"),
        pytest.param(STORED[:1] + FRESH[:5], 1, id="one-token-shared"),
        pytest.param(FRESH[:40], 0, id="miss"),
    ],
)
def test_restore_equals_cold(model, store, prompt, expect_n):
    assert_same_as_cold(model, store, prompt, expect_n)


@pytest.mark.parametrize(
    "prompt, expect_n",
    [
        pytest.param(STORED, len(STORED) - 1, id="exact-fit"),
        pytest.param(STORED + FRESH[:50], len(STORED), id="longer"),
        pytest.param(STORED[:128] + FRESH[:30], 128, id="diverge-on-boundary"),
    ],
)
def test_restored_cache_has_room_for_the_rest_of_the_prompt(
    model, store, prompt, expect_n, monkeypatch
):
    """The next forward pass writes in place: no layer is copied to grow, and none is
    copied because its buffer is shared (MLX copies an array whose buffer is not its
    own on the first update, as it did when restored rows shared stacked buffers)."""
    monkeypatch.setattr(kvstore.engine.restore, "ROOM_MIN_BYTES", 0)  # room at any size
    cache, n = store.fetch(prompt)
    assert n == expect_n
    step = KVCache.step
    for c in cache:
        assert c.offset == n
        assert c.keys.shape[2] % step == 0 and c.keys.shape[2] > len(prompt)
        assert c.keys.shape[2] - len(prompt) <= step
    buffers = [(data_address(c.keys), data_address(c.values)) for c in cache]
    next_logits(model, cache, prompt[n:])
    for c, (keys, values) in zip(cache, buffers):
        assert c.offset == len(prompt)
        assert (data_address(c.keys), data_address(c.values)) == (keys, values)


def _whole_steps(n: int) -> int:
    """``n`` rows rounded up to whole cache steps (restores on CUDA)."""
    return -(-n // KVCache.step) * KVCache.step


def data_address(a: mx.array) -> int:
    """Where an evaluated array's data is (a copy moves it)."""
    return np.frombuffer(memoryview(a), dtype=np.uint8).ctypes.data


@pytest.mark.parametrize("prefault", ["always", "never"])
def test_restore_with_and_without_prefaulting(model, store, monkeypatch, prefault):
    """Prefaulting the rows ahead of the readers (forced here: the arrays look fresh)
    and its fallback (no MADV_POPULATE_WRITE) restore the same exact KV."""
    if prefault == "always":
        monkeypatch.setattr(kvstore.platform.memutil, "resident", lambda address: False)
    else:
        monkeypatch.setattr(kvstore.platform.memutil._LIBC, "populate", False)
    assert_same_as_cold(model, store, STORED + FRESH[:30], len(STORED), steps=5)
    assert_same_as_cold(model, store, STORED[:100] + FRESH[:10], 100, steps=5)


def test_small_restores_are_exactly_full(model, store):
    """Below ROOM_MIN_BYTES of KV the arrays get no room (growing them on the first
    forward pass copies less than the room's buffers cost), and stay exact."""
    n_bytes = len(STORED) * store.parts.shapes.token_bytes
    assert n_bytes < kvstore.engine.restore.ROOM_MIN_BYTES
    cache, n = store.fetch(STORED + FRESH[:50])
    rows = _whole_steps(n) if store.parts.reads.whole_steps else n  # CUDA: steps
    assert [c.keys.shape[2] for c in cache] == [rows] * len(cache)
    assert_same_as_cold(model, store, STORED + FRESH[:30], len(STORED), steps=5)


@pytest.mark.parametrize("room", [0, 64, 2048])
def test_room_after_a_restore_is_bounded(tmp_path, model, room, monkeypatch):
    """A long prompt sharing a short prefix gets ``restore_room`` rows of room, not
    the whole prompt's; 0 restores exactly full arrays (and the results stay exact)."""
    monkeypatch.setattr(kvstore.engine.restore, "ROOM_MIN_BYTES", 0)  # room at any size
    long_prompt = STORED[:100] + random_tokens(3000, seed=9)
    with KVStore(tmp_path / "s", model, chunk_tokens=C, restore_room=room) as store:
        store.save(STORED, compute_cache(model, STORED))
        store.flush()
        cache, n = store.fetch(long_prompt)
        assert n == 100
        rows = cache[0].keys.shape[2]
        if room:
            assert n + room < rows <= n + room + KVCache.step
        else:
            assert rows == (_whole_steps(n) if store.parts.reads.whole_steps else n)
        assert_same_as_cold(model, store, STORED[:100] + FRESH[:30], 100, steps=5)


@pytest.mark.parametrize("io_path", ["assemble", "load"])
@pytest.mark.parametrize("room", [0, 2048])
def test_whole_cache_steps_where_the_backend_decodes_faster_over_them(
    tmp_path, model, monkeypatch, io_path, room
):
    """Where restores hold whole cache steps (MLX's CUDA backend: its fast decode
    needs a KV buffer of whole 256-row steps), every restore and join does, with no
    room or too little KV for room; mlx-lm's cache then grows in whole steps, and
    the results stay exact. Elsewhere a restore without room is exactly full."""
    monkeypatch.setenv("KVSTORE_RESTORE_IO", io_path)
    monkeypatch.setenv("KVSTORE_WHOLE_STEPS", "1")
    step = KVCache.step
    prompt = STORED + FRESH[:30]
    with KVStore(tmp_path / "s", model, chunk_tokens=C, restore_room=room) as store:
        assert store.parts.reads.whole_steps
        store.save(STORED, compute_cache(model, STORED))
        store.flush()
        cache, n = store.fetch(prompt)
        assert n == len(STORED)  # less KV than ROOM_MIN_BYTES: no room, whole steps
        assert {c.keys.shape[2] for c in cache} == {_whole_steps(n)}
        next_logits(model, cache, prompt[n:] + FRESH[30 : 30 + step])  # grows
        assert all(c.keys.shape[2] % step == 0 for c in cache)
        head, _ = store.fetch(STORED[:100] + [1])
        tail = store.fetch_beyond(prompt, 100)
        joined = store.join_tail(head, tail, query=len(prompt))
        assert {c.keys.shape[2] for c in joined} == {_whole_steps(tail.end)}
        assert_same_as_cold(model, store, prompt, n, steps=5)
    monkeypatch.setenv("KVSTORE_WHOLE_STEPS", "0")
    with KVStore(tmp_path / "s", model, chunk_tokens=C, restore_room=room) as store:
        cache, n = store.fetch(prompt)
        assert {c.keys.shape[2] for c in cache} == {n}


def test_prompt_shorter_than_one_chunk(tmp_path, model):
    short = STORED[:40]
    with KVStore(tmp_path / "s", model, chunk_tokens=C) as store:
        store.save(short, compute_cache(model, short))
        store.flush()
        assert store.stats()["nodes"] == 1
        assert_same_as_cold(model, store, short + FRESH[:10], 40)
        assert_same_as_cold(model, store, short[:30] + FRESH[:10], 30)
        assert_same_as_cold(model, store, short, 39)


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_half_precision_kv(tmp_path, dtype):
    model = tiny_llama(3, dtype=dtype)
    with KVStore(tmp_path / "s", model, chunk_tokens=C) as store:
        assert store.layout.leaves[0].tensors[0][1] == str(dtype).rsplit(".", 1)[-1]
        store.save(STORED, compute_cache(model, STORED))
        store.flush()
        cache, n = store.fetch(STORED + FRESH[:5])
        assert n == len(STORED)
        ref = compute_cache(model, STORED)
        for got, want in zip(cache, ref):
            assert got.keys.dtype == dtype
            assert mx.array_equal(got.keys[:, :, :n], want.keys[:, :, :n]).item()
            assert mx.array_equal(got.values[:, :, :n], want.values[:, :, :n]).item()
        assert greedy(model, cache, FRESH[:5], 10) == greedy(
            model, compute_cache(model, []), STORED + FRESH[:5], 10
        )


def test_restored_kv_is_bit_identical(model, store):
    cache, n = store.fetch(STORED + [1])
    ref = compute_cache(model, STORED)
    for got, want in zip(cache, ref):
        assert mx.array_equal(got.keys[:, :, :n], want.keys[:, :, :n]).item()
        assert mx.array_equal(got.values[:, :, :n], want.values[:, :, :n]).item()


def test_ram_and_disk_paths_agree(tmp_path, model):
    path = tmp_path / "s"
    with KVStore(path, model, chunk_tokens=C) as s:
        s.save(STORED, compute_cache(model, STORED))
        s.flush()
        assert s.stats()["ram_entries"] == 5
        from_ram, n = s.fetch(STORED + [1])
    with KVStore(path, model, chunk_tokens=C, ram_bytes=0) as s:
        from_disk, m = s.fetch(STORED + [1])
        assert s.stats()["ram_entries"] == 0
    assert n == m == len(STORED)
    for a, b in zip(from_ram, from_disk):
        assert mx.array_equal(a.keys[:, :, :n], b.keys[:, :, :n]).item()


def test_save_captures_the_cache_at_call_time(tmp_path, model):
    """The caller may keep generating into the cache before the write happens."""
    cache = compute_cache(model, STORED)
    with KVStore(tmp_path / "s", model, chunk_tokens=C) as s:
        s.save(STORED, cache)
        for c in cache:  # overwrite the stored span in place, then extend
            c.trim(100)
        model(mx.array(FRESH[:150])[None], cache=cache)
        mx.eval([c.state for c in cache])
        s.flush()
        restored, n = s.fetch(STORED + [1])
    ref = compute_cache(model, STORED)
    for got, want in zip(restored, ref):
        assert mx.array_equal(got.keys[:, :, :n], want.keys[:, :, :n]).item()


def test_prefix_sharing_stores_the_prefix_once(tmp_path, model):
    prefix = random_tokens(1000, seed=5)
    a, b = prefix + random_tokens(100, 6), prefix + random_tokens(100, 7)
    with KVStore(tmp_path / "s", model, chunk_tokens=C) as s:
        per_token = sum(h * w * 4 for _, h, w in s.layout.rows.values())
        s.save(a, compute_cache(model, a), boundaries=[1000])
        s.flush()
        before = s.stats()
        s.save(b, compute_cache(model, b), boundaries=[1000])
        s.flush()
        after = s.stats()
        grown = after["bytes_on_disk"] - before["bytes_on_disk"]
        new_nodes = after["nodes"] - before["nodes"]
        assert after["stored_tokens"] - before["stored_tokens"] == 100
        assert new_nodes == 2  # 64 + 36 tokens
        header_room = 4096 * new_nodes
        assert 100 * per_token <= grown <= 100 * per_token + header_room
        assert_same_as_cold(model, s, b + [3], len(b))


def test_without_boundaries_sharing_is_chunk_granular(tmp_path, model):
    prefix = random_tokens(1000, seed=5)
    a, b = prefix + random_tokens(100, 6), prefix + random_tokens(100, 7)
    with KVStore(tmp_path / "s", model, chunk_tokens=C) as s:
        s.save(a, compute_cache(model, a))
        s.flush()
        before = s.stats()["stored_tokens"]
        s.save(b, compute_cache(model, b))
        s.flush()
        # b shares the 15 full chunks (960 tokens) of the prefix.
        assert s.stats()["stored_tokens"] - before == len(b) - 960
        cache, n = s.fetch(b[:1000] + [1, 2])
        assert n == 1000


def test_other_model_never_gets_the_first_models_kv(tmp_path, model, other_model):
    path = tmp_path / "s"
    with KVStore(path, model, chunk_tokens=C) as s:
        s.save(STORED, compute_cache(model, STORED))
        s.flush()
        ns = s.namespace
    with KVStore(path, other_model, chunk_tokens=C) as s:
        assert s.namespace != ns
        cache, n = s.fetch(STORED + [1])
        assert n == 0 and all(c.offset == 0 for c in cache)
        assert s.stats()["namespaces"] == 2
    bigger = tiny_llama(0, layers=3)
    with KVStore(path, bigger, chunk_tokens=C) as s:
        assert s.fetch(STORED + [1])[1] == 0
    with KVStore(path, model, chunk_tokens=C * 2) as s:  # chunk size is part of the key
        assert s.fetch(STORED + [1])[1] == 0
    with KVStore(path, model, chunk_tokens=C) as s:
        assert s.fetch(STORED + [1])[1] == len(STORED)


def test_bad_tokens_are_rejected_clearly(store):
    with pytest.raises(TypeError, match="list of ints"):
        store.fetch("hello")
    with pytest.raises(TypeError, match=r"tokens\[1\]"):
        store.fetch([1, "a", 3])
    with pytest.raises(TypeError, match=r"tokens\[0\]"):
        store.fetch([1.5])
    with pytest.raises(ValueError, match="negative"):
        store.fetch([3, -1])
    with pytest.raises(ValueError, match="empty"):
        store.save([], [])
    with pytest.raises(ValueError, match="kind"):
        store.save(STORED, [], kind="robot")


def test_empty_and_single_token_fetch_is_a_miss(store):
    assert store.fetch([])[1] == 0
    assert store.fetch(STORED[:1])[1] == 0


def test_cache_that_does_not_match_tokens(model, store):
    cache = compute_cache(model, STORED[:20])
    with pytest.raises(ValueError, match="holds 20 tokens but 10"):
        store.save(STORED[:10], cache)
    with pytest.raises(ValueError, match="layers"):
        store.save(STORED[:20], cache[:1])
    with pytest.raises(TypeError, match="list of cache objects"):
        store.save(STORED[:20], "cache")


def test_directory_that_is_not_a_store(tmp_path, model):
    (tmp_path / "photos").mkdir()
    (tmp_path / "photos" / "cat.jpg").write_bytes(b"meow")
    with pytest.raises(StoreError, match="not a kvstore"):
        KVStore(tmp_path / "photos", model)
    (tmp_path / "file").write_text("x")
    with pytest.raises(StoreError, match="not a directory"):
        KVStore(tmp_path / "file", model)


def test_bad_constructor_arguments(tmp_path, model):
    with pytest.raises(ValueError, match="chunk_tokens"):
        KVStore(tmp_path / "a", model, chunk_tokens=0)
    with pytest.raises(ValueError, match="ram_bytes"):
        KVStore(tmp_path / "a", model, ram_bytes=-1)
    with pytest.raises(TypeError, match="disk_bytes"):
        KVStore(tmp_path / "a", model, disk_bytes="1G")


def test_unsupported_layout_is_refused_at_open(tmp_path):
    class MyCache(KVCache):  # a subclass is not the allow-listed class
        pass

    class OddLlama(llama.Model):
        def make_cache(self):
            return [KVCache(), ConcatenateKVCache()] + [
                MyCache() for _ in self.layers[2:]
            ]

    args = tiny_llama(0, layers=3).args
    with pytest.raises(UnsupportedCacheError, match="layer 1 uses ConcatenateKVCache"):
        KVStore(tmp_path / "s", OddLlama(args))


def _blob_files(path):
    out = []
    for dirpath, _, files in os.walk(os.path.join(path, "blobs")):
        out += [os.path.join(dirpath, f) for f in files if f.endswith(".safetensors")]
    return out


@pytest.mark.parametrize("damage", ["flip-data", "flip-header", "truncate", "delete"])
def test_broken_file_is_a_miss_and_a_report(tmp_path, model, damage):
    path = tmp_path / "s"
    with KVStore(path, model, chunk_tokens=C) as s:
        s.save(STORED, compute_cache(model, STORED))
    # Damage the file of the third node (tokens 128..192).
    with KVStore(path, model, chunk_tokens=C, ram_bytes=0) as s:
        cache, n = s.fetch(STORED[:200] + [1])
        victim = s.blobs.path(s.namespace, _node_at(s, STORED, 128))
    with open(victim, "r+b") as f:
        data = bytearray(f.read())
        if damage == "flip-data":
            data[-10] ^= 0xFF
        elif damage == "flip-header":
            data[20] ^= 0x01
        elif damage == "truncate":
            data = data[: len(data) // 2]
        f.seek(0)
        f.truncate()
        f.write(data)
    if damage == "delete":
        os.unlink(victim)
    with KVStore(path, model, chunk_tokens=C, ram_bytes=0) as s:
        cache, n = s.fetch(STORED + [1])
        assert n == 128  # everything before the broken node, nothing after
        assert_same_as_cold(model, s, STORED + [1], 128)
        s.flush()
        stats = s.stats()
        assert stats["corrupt"] == 1 and stats["errors"] == 0
        if damage != "delete":
            assert len(stats["quarantined"]) == 1
        # The broken node and its descendants left the index; saving again heals it.
        assert s.stats()["nodes"] == 2
        s.save(STORED, compute_cache(model, STORED))
        s.flush()
        assert s.fetch(STORED + [1])[1] == len(STORED)


def _node_at(store, tokens, start):
    path = store.index.read(
        lambda txn: store.parts.reads.trie.walk(
            txn, np.array(tokens, dtype=np.int32), limit=len(tokens)
        )
    )
    return next(step.h for step in path if step.rec.start == start)


def test_file_from_another_node_is_rejected(tmp_path, model):
    path = tmp_path / "s"
    with KVStore(path, model, chunk_tokens=C, ram_bytes=0) as s:
        s.save(STORED, compute_cache(model, STORED))
        s.flush()
        first, second = _node_at(s, STORED, 0), _node_at(s, STORED, 64)
        with open(s.blobs.path(s.namespace, first), "rb") as f:
            data = f.read()
        with open(s.blobs.path(s.namespace, second), "wb") as f:
            f.write(data)  # same size and shapes, wrong content
        cache, n = s.fetch(STORED + [1])
        assert n == 64
        assert s.stats()["corrupt"] == 1


def test_disk_budget_evicts_least_recently_used_leaves(tmp_path, model):
    prompts = [random_tokens(128, seed=100 + i) for i in range(6)]
    with KVStore(tmp_path / "s", model, chunk_tokens=C) as s:
        per_prompt = None
        for p in prompts[:2]:
            s.save(p, compute_cache(model, p))
            s.flush()
            per_prompt = s.stats()["bytes_on_disk"] // (prompts.index(p) + 1)
        s.disk_bytes = per_prompt * 3 + per_prompt // 4
        s.fetch(prompts[0] + [1])  # prompts[0] is now more recent than prompts[1]
        s.flush()
        for p in prompts[2:4]:
            s.save(p, compute_cache(model, p), pin=p is prompts[2])
            s.flush()
            assert s.stats()["bytes_on_disk"] <= s.disk_bytes
        stats = s.stats()
        assert stats["nodes_evicted"] >= 2
        assert s.fetch(prompts[1] + [1])[1] == 0  # least recently used went first
        assert s.fetch(prompts[0] + [1])[1] == 128
        for p in prompts[4:]:
            s.save(p, compute_cache(model, p))
            s.flush()
            assert s.stats()["bytes_on_disk"] <= s.disk_bytes
        assert s.fetch(prompts[2] + [1])[1] == 128  # pinned survives
        assert len(_blob_files(s.path)) == s.stats()["nodes"]


def test_pinned_prefixes_are_loaded_into_ram_at_open(tmp_path, model):
    path = tmp_path / "s"
    with KVStore(path, model, chunk_tokens=C) as s:
        s.save(STORED, compute_cache(model, STORED), kind="system", pin=True)
        s.save(FRESH, compute_cache(model, FRESH))
        s.flush()
        assert s.stats()["pinned_bytes"] > 0
    with KVStore(path, model, chunk_tokens=C) as s:
        stats = s.stats()
        assert stats["ram_entries"] == 5  # the pinned prompt's nodes only
        assert stats["ram_bytes"] == stats["pinned_bytes"]


def test_ram_tier_stays_within_budget(tmp_path, model):
    with KVStore(tmp_path / "s", model, chunk_tokens=C, ram_bytes=100_000) as s:
        for i in range(4):
            p = random_tokens(200, seed=50 + i)
            s.save(p, compute_cache(model, p))
            s.flush()
            assert 0 < s.stats()["ram_bytes"] <= 100_000
        assert s.fetch(p + [1])[1] == 200


def test_prefill_computes_only_what_is_missing(tmp_path, model):
    with KVStore(tmp_path / "s", model, chunk_tokens=C) as s:
        assert s.prefill(STORED) == {"tokens": 300, "computed": 300, "reused": 0}
        s.flush()
        assert s.prefill(STORED)["computed"] == 0
        longer = STORED + FRESH[:100]
        assert s.prefill(longer, step_tokens=37) == {
            "tokens": 400,
            "computed": 100,
            "reused": 300,
        }
        s.flush()
        assert_same_as_cold(model, s, longer + [7], len(longer))


def test_exact_prompt_superseding_tail(tmp_path, model):
    """A longer save replaces a shorter leaf tail it covers, without losing restores."""
    with KVStore(tmp_path / "s", model, chunk_tokens=C) as s:
        s.save(STORED, compute_cache(model, STORED))  # tail node of 44 tokens
        s.flush()
        longer = STORED + FRESH[:40]
        s.save(longer, compute_cache(model, longer))  # full chunk 256..320 + tail
        s.flush()
        assert s.stats()["stored_tokens"] == len(longer)
        assert len(_blob_files(s.path)) == s.stats()["nodes"]
        assert_same_as_cold(model, s, STORED + [5], len(STORED))


def test_stream_generate_matches_mlx_lm(tmp_path, model, tokenizer):
    from mlx_lm import stream_generate as mlx_stream_generate

    prompt = " ".join(f"w{t}" for t in STORED[:150] if t >= 3)
    want = [
        r.token for r in mlx_stream_generate(model, tokenizer, prompt, max_tokens=12)
    ]
    n_prompt = len(tokenizer.encode(prompt))
    with KVStore(tmp_path / "s", model, tokenizer, chunk_tokens=C) as s:
        run = lambda: [  # noqa: E731
            r.token
            for r in kvstore.stream_generate(
                model, tokenizer, prompt, store=s, max_tokens=12
            )
        ]
        first = run()
        s.flush()
        second = run()
        stats = s.stats()
    assert first == want and second == want
    assert stats["hits"] == 1 and stats["tokens_reused"] == n_prompt - 1


def test_threads_fetch_while_saving(tmp_path, model):
    prompts = [random_tokens(200, seed=300 + i) for i in range(6)]
    caches = [compute_cache(model, p) for p in prompts]
    # Compared with numpy: MLX graph evaluation is not meant to run on several threads.
    refs = {
        i: [np.array(c.keys[:, :, :199]) for c in caches[i]]
        for i in range(len(prompts))
    }
    errors = []
    with KVStore(tmp_path / "s", model, chunk_tokens=C) as s:

        def reader():
            try:
                for _ in range(20):
                    for i, p in enumerate(prompts):
                        cache, n = s.fetch(p)
                        if n:
                            for got, want in zip(cache, refs[i]):
                                assert np.array_equal(
                                    np.asarray(got.keys[:, :, :n]), want[:, :, :n]
                                )
            except Exception as e:  # pragma: no cover - reported below
                errors.append(e)

        threads = [threading.Thread(target=reader) for _ in range(3)]
        for t in threads:
            t.start()
        for p, c in zip(prompts, caches):
            s.save(p, c)
        for t in threads:
            t.join()
        s.flush()
        assert not errors
        assert s.stats()["errors"] == 0
        assert all(s.fetch(p)[1] == 199 for p in prompts)


def test_closed_store_refuses_use(tmp_path, model):
    s = KVStore(tmp_path / "s", model, chunk_tokens=C)
    s.close()
    s.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        s.fetch([1, 2, 3])


def test_two_models_share_one_store_in_one_process(tmp_path, model, other_model):
    with (
        KVStore(tmp_path / "s", model, chunk_tokens=C) as a,
        KVStore(tmp_path / "s", other_model, chunk_tokens=C) as b,
    ):
        a.save(STORED, compute_cache(model, STORED))
        b.save(FRESH, compute_cache(other_model, FRESH))
        a.flush()
        b.flush()
        assert a.fetch(STORED + [1])[1] == len(STORED) and b.fetch(STORED + [1])[1] == 0
        assert b.fetch(FRESH + [1])[1] == len(FRESH) and a.fetch(FRESH + [1])[1] == 0
        assert a.stats()["store_bytes_on_disk"] == b.stats()["store_bytes_on_disk"]


def test_pin_and_unpin_a_stored_prompt(tmp_path, model):
    with KVStore(tmp_path / "s", model, chunk_tokens=C) as s:
        s.save(STORED, compute_cache(model, STORED))
        assert s.pin(STORED) == 5
        assert s.stats()["pinned_bytes"] == s.stats()["bytes_on_disk"]
        assert s.pin(FRESH) == 0  # nothing stored: nothing to pin
        assert s.pin(STORED, pinned=False) == 5
        assert s.stats()["pinned_bytes"] == 0


def test_deleted_index_directory_is_a_miss_not_a_crash(tmp_path, model):
    import shutil

    from kvstore import maintenance

    path = tmp_path / "s"
    with KVStore(path, model, chunk_tokens=C) as s:
        s.save(STORED, compute_cache(model, STORED))
    shutil.rmtree(path / "index")
    with KVStore(path, model, chunk_tokens=C) as s:
        assert s.fetch(STORED + [1])[1] == 0
        assert s.stats()["errors"] == 0
    report = maintenance.verify(str(path))
    assert report["clean"] and report["orphans"] == 5
    maintenance.gc(str(path))
    assert maintenance.verify(str(path))["orphans"] == 0
    with KVStore(path, model, chunk_tokens=C) as s:  # and the store works again
        s.save(STORED, compute_cache(model, STORED))
        s.flush()
        assert s.fetch(STORED + [1])[1] == len(STORED)


def test_store_used_in_a_forked_child_raises_a_clear_error(tmp_path, model):
    import multiprocessing as mp

    with KVStore(tmp_path / "s", model, chunk_tokens=C) as s:
        s.save(STORED, compute_cache(model, STORED))
        s.flush()
        ctx = mp.get_context("fork")
        out = ctx.Queue()

        def child():
            try:
                s.fetch(STORED + [1])
                out.put("no error")
            except RuntimeError as e:
                out.put(str(e))
            finally:
                s.close()  # a no-op in the child: the parent owns the writer

        proc = ctx.Process(target=child)
        proc.start()
        message = out.get(timeout=60)
        proc.join(60)
        assert "fork" in message and "open a new KVStore" in message
        assert s.fetch(STORED + [1])[1] == len(STORED)  # the parent is unaffected


def test_walk_goes_on_below_a_prefix_node_that_siblings_go_past(tmp_path, model):
    """Saves that race their commits leave a system prompt's node beside siblings
    holding it plus a user turn. Prompts saved later go below the system node, and
    must be found there whole wherever the siblings sort (a walk that took a sibling
    on a tie, or never saw the system node, served the system prompt only)."""
    system = random_tokens(20, seed=40)
    user = {v: [v, v + 1, v + 2, 7, 8] for v in (100, 200, 300, 400, 250)}
    with KVStore(tmp_path / "s", model, chunk_tokens=256) as s:
        held = threading.Event()
        s.writer.submit(held.wait)  # no commit until the saves below have walked
        s.save(system, compute_cache(model, system), kind="system")
        for v in (100, 200, 300):  # walked before the system node's commit: siblings
            s.save(system + user[v], compute_cache(model, system + user[v]))
        held.set()
        s.flush()
        for v in (400, 250):  # 400 sorts next to the system node, 250 among siblings
            prompt = system + user[v]
            s.save(prompt, compute_cache(model, prompt))
            s.flush()
            got, n = s.fetch(prompt + [1])
            assert n == len(prompt) == s.lookup(prompt + [1]), v
            np.testing.assert_array_equal(
                np.array(got[0].keys[..., :n, :]),
                np.array(compute_cache(model, prompt)[0].keys[..., :n, :]),
            )
        starts = sorted(rec.start for _, rec in _records(s))
        assert starts == [0, 0, 0, 0, 20, 20]  # system, 3 siblings; 400, 250 below


def test_walk_takes_a_whole_node_with_more_below_over_a_longer_partial_sibling(
    tmp_path, model
):
    """A system prompt's node (with the rest of the prompt below it) beside a sibling
    that shares a few more tokens and then differs: the fetch goes down the system
    node for the whole prompt, not the sibling's longer partial match."""
    system = random_tokens(20, seed=41)
    prompt = system + random_tokens(60, seed=42)
    sibling = prompt[:24] + random_tokens(30, seed=43)
    with KVStore(tmp_path / "s", model, chunk_tokens=256) as s:
        s.save(sibling, compute_cache(model, sibling))
        s.flush()
        s.save(prompt, compute_cache(model, prompt), boundaries=(len(system),))
        s.flush()
        starts = sorted((rec.start, rec.ntokens) for _, rec in _records(s))
        assert starts == [(0, 20), (0, 54), (20, 60)]
        assert s.lookup(prompt + [1]) == len(prompt)
        assert_same_as_cold(model, s, prompt + [1], len(prompt))
        # A prompt that goes on along the sibling still takes the sibling.
        assert s.lookup(sibling + [1]) == len(sibling)


def _records(store):
    from kvstore.disk.index import NodeRecord

    return store.index.read(
        lambda txn: [
            (h, NodeRecord.decode(raw)) for _, h, raw in store.index.iter_nodes(txn)
        ]
    )
