"""Every supported cache family: restored == cold, and restored only where it is safe.

Delta layouts (``KVCache``, ``QuantizedKVCache``) restore at any token; layouts with
state layers (sliding windows, recurrent state, chunked attention) restore only at a
checkpoint (a node end where the state was saved), falling back to the longest one.
"""

import os

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from conftest import greedy, next_logits, random_tokens, tiny_llama
from families import WINDOW, build
from mlx_lm.models.cache import ArraysCache, CacheList, KVCache, QuantizedKVCache

import kvstore.engine.restore
from kvstore import KVStore
from kvstore.disk.adapters import STATE, Layout

C = 32  # chunk tokens
SYSTEM = 40  # a message boundary: the "system prompt" ends here
PROMPT = random_tokens(100, seed=11)  # longer than Gemma's window and Llama 4's chunk
FRESH = random_tokens(60, seed=12)

FAMILIES = {
    # name: (model builder, KVStore options)
    "llama-q4": (
        lambda: tiny_llama(0, hidden=128),
        {"kv_bits": 4, "kv_group_size": 32},
    ),
    "llama-q8": (
        lambda: tiny_llama(0, hidden=128),
        {"kv_bits": 8, "kv_group_size": 32},
    ),
    "gemma3": (lambda: build("gemma3_text"), {}),
    "qwen3-next": (lambda: build("qwen3_next"), {}),
    "mamba2": (lambda: build("mamba2"), {}),
    "llama4": (lambda: build("llama4"), {}),
    "falcon-h1": (lambda: build("falcon_h1"), {}),
    "longcat-ngram": (lambda: build("longcat_flash_ngram"), {}),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """A store of one family holding PROMPT, prefilled with a boundary at SYSTEM."""
    make, options = FAMILIES[request.param]
    model = make()
    path = tmp_path_factory.mktemp(request.param) / "store"
    store = KVStore(path, model, chunk_tokens=C, **options)
    result = store.prefill(PROMPT, boundaries=[SYSTEM])
    assert result["computed"] == len(PROMPT)
    store.flush()
    yield request.param, model, store
    store.close()


def cold(model, store, prompt):
    cache = store.new_cache()
    return cache, next_logits(model, cache, prompt)


def assert_same_as_cold(model, store, prompt, expect_n, steps=20):
    cache, n = store.fetch(prompt)
    assert n == expect_n
    warm_logits = next_logits(model, cache, prompt[n:])
    _, cold_logits = cold(model, store, prompt)
    assert mx.allclose(
        warm_logits, cold_logits, atol=1e-4, rtol=1e-3
    ).item(), f"max diff {mx.abs(warm_logits - cold_logits).max().item()}"
    warm = greedy(model, store.fetch(prompt)[0], prompt[n:], steps)
    assert warm == greedy(model, store.new_cache(), prompt, steps)


def expected_n(store, delta_n, checkpoint_n):
    return checkpoint_n if store.layout.has_state else delta_n


@pytest.mark.parametrize(
    "prompt, delta_n, checkpoint_n",
    [
        pytest.param(PROMPT, len(PROMPT) - 1, SYSTEM, id="exact"),
        pytest.param(PROMPT + FRESH[:20], len(PROMPT), len(PROMPT), id="longer"),
        pytest.param(PROMPT[:70] + FRESH[:20], 70, SYSTEM, id="diverge-in-chunk"),
        pytest.param(PROMPT[:SYSTEM] + FRESH, SYSTEM, SYSTEM, id="diverge-on-boundary"),
        pytest.param(PROMPT[:20] + FRESH[:20], 20, 0, id="diverge-in-system"),
        pytest.param(FRESH, 0, 0, id="miss"),
    ],
)
def test_restore_equals_cold(family, prompt, delta_n, checkpoint_n):
    _, model, store = family
    assert_same_as_cold(model, store, prompt, expected_n(store, delta_n, checkpoint_n))


def test_layout_and_namespace_record_the_cache_types(family):
    name, _, store = family
    classes = {leaf.cls for leaf in store.layout.leaves}
    expected = {
        "llama-q4": {"QuantizedKVCache"},
        "llama-q8": {"QuantizedKVCache"},
        "gemma3": {"RotatingKVCache", "KVCache"},
        "qwen3-next": {"ArraysCache", "KVCache"},
        "mamba2": {"ArraysCache"},
        "llama4": {"ChunkedKVCache", "KVCache"},
        "falcon-h1": {"ArraysCache", "KVCache"},
        "longcat-ngram": {"ArraysCache", "KVCache"},
    }[name]
    assert classes == expected
    described = store.description["layout"]["leaves"]
    assert {leaf["cls"] for leaf in described} == expected
    if name == "longcat-ngram":  # the last token ids: a length that grows to n - 1
        assert described[0]["tensors"] == [["0", "int64", [1, -1]]]
        assert Layout.from_json(store.layout.to_json()).leaves == store.layout.leaves
    if name.startswith("llama-q"):
        assert {leaf["params"]["bits"] for leaf in described} == {int(name[-1])}
    if name == "gemma3":
        assert {leaf["params"].get("max_size") for leaf in described} == {WINDOW, None}


def test_checkpoints_only_where_state_was_saved(family):
    """A state layout restores only at the nodes holding a checkpoint."""
    _, _, store = family
    if not store.layout.has_state:
        pytest.skip("delta layout: every node end is restorable")
    nodes = list_nodes(store)
    ends_with_state = sorted(rec.end for rec in nodes if rec.has_state)
    assert ends_with_state == [SYSTEM, len(PROMPT)]
    # Intermediate chunk nodes hold deltas only.
    assert any(not rec.has_state for rec in nodes)


def list_nodes(store):
    def scan(txn):
        from kvstore.disk.index import NodeRecord

        return [
            NodeRecord.decode(raw)
            for _, _, raw in store.index.iter_nodes(txn, store.namespace)
        ]

    return store.index.read(scan)


def test_save_then_fetch_in_a_new_store_object(family, tmp_path):
    """The checkpoint survives a reopen (read from disk, RAM tier off)."""
    name, model, store = family
    options = FAMILIES[name][1]
    with KVStore(store.path, model, chunk_tokens=C, ram_bytes=0, **options) as again:
        assert_same_as_cold(model, again, PROMPT + FRESH[:5], len(PROMPT), steps=5)


def test_unsafe_restore_would_be_caught(tmp_path):
    """Recurrent state cannot be trimmed: using the checkpoint at 100 tokens for a
    prompt that diverges at 70 (what an unsafe store would do) changes the logits,
    so the battery above would fail if the store restored unsafely."""
    model = build("qwen3_next")
    with KVStore(tmp_path / "s", model, chunk_tokens=C) as store:
        store.prefill(PROMPT, boundaries=[SYSTEM])
        store.flush()
        prompt = PROMPT[:70] + FRESH[:20]
        unsafe, n = store.fetch(PROMPT + FRESH[:1])
        assert n == len(PROMPT)
        for c in unsafe:  # trim what can be trimmed: attention layers
            if isinstance(c, KVCache):
                c.trim(len(PROMPT) - 70)
        unsafe_logits = next_logits(model, unsafe, prompt[70:])
        _, cold_logits = cold(model, store, prompt)
        assert not mx.allclose(unsafe_logits, cold_logits, atol=1e-3).item()
        # The store itself falls back to the checkpoint at the system prompt's end.
        assert store.fetch(prompt)[1] == SYSTEM


def test_quantized_kv_is_stored_quantized(tmp_path):
    """Bytes on disk are the quantized KV's bytes (plus headers), not dequantized."""
    model = tiny_llama(0, hidden=128)
    sizes = {}
    for bits in (None, 4, 8):
        with KVStore(
            tmp_path / f"s{bits}", model, chunk_tokens=C, kv_bits=bits, kv_group_size=32
        ) as s:
            s.prefill(PROMPT)
            s.flush()
            cache = s.new_cache()
            model(mx.array(PROMPT)[None], cache=cache)
            kv = sum(
                a[..., : len(PROMPT), :].nbytes
                for c in cache
                for a in ([*c.keys, *c.values] if bits else [c.keys, c.values])
            )
            sizes[bits] = (s.stats()["bytes_on_disk"], kv)
    for bits, (on_disk, kv) in sizes.items():
        headers = 4096  # one safetensors header per node file, a few hundred bytes each
        assert kv <= on_disk <= kv + headers, (bits, on_disk, kv)
    assert sizes[4][0] < 0.3 * sizes[None][0]
    assert sizes[8][0] < 0.45 * sizes[None][0]


def test_state_file_corruption_is_a_fallback_not_wrong_output(tmp_path):
    """A broken checkpoint file: a report, and the next best checkpoint is used."""
    model = build("mamba2")
    with KVStore(tmp_path / "s", model, chunk_tokens=C, ram_bytes=0) as store:
        store.prefill(PROMPT, boundaries=[SYSTEM])
        store.flush()
        state_files = [
            f
            for _, _, files in os.walk(os.path.join(store.path, "blobs"))
            for f in files
            if f.endswith(".state.safetensors")
        ]
        assert len(state_files) == 2  # checkpoints at SYSTEM and at the prompt's end
        target = _state_file_of(store, len(PROMPT))
        with open(target, "r+b") as f:
            f.seek(-3, os.SEEK_END)
            f.write(b"\xff\xff\xff")
        prompt = PROMPT + FRESH[:10]
        assert_same_as_cold(model, store, prompt, SYSTEM, steps=5)
        assert store.stats()["corrupt"] == 1


def _state_file_of(store, end):
    def find(txn):
        for _, h, raw in store.index.iter_nodes(txn, store.namespace):
            from kvstore.disk.index import NodeRecord

            rec = NodeRecord.decode(raw)
            if rec.has_state and rec.end == end:
                return h

    h = store.index.read(find)
    return store.blobs.path(store.namespace, h, ".state")


def test_cache_list_nesting_is_rebuilt(tmp_path):
    model = build("falcon_h1")
    with KVStore(tmp_path / "s", model, chunk_tokens=C) as store:
        store.prefill(PROMPT)
        store.flush()
        cache, n = store.fetch(PROMPT + FRESH[:3])
        assert n == len(PROMPT)
        assert all(type(c) is CacheList for c in cache)
        assert [type(x) for x in cache[0].caches] == [ArraysCache, KVCache]
        assert [leaf.mode for leaf in store.layout.leaves][0] == STATE


def test_wrong_cache_for_the_layout_is_refused(tmp_path, caplog):
    """A cache of other classes than the layout's is not saved, and not an exception
    in the caller's loop: logged and counted. Wrong calls (token counts) raise."""
    model = build("gemma3_text")
    with KVStore(tmp_path / "s", model, chunk_tokens=C) as store:
        plain = [KVCache() for _ in model.layers]
        model(mx.array(PROMPT)[None], cache=plain)
        assert store.save(PROMPT, plain) == 0
        assert store.save_prefix(PROMPT, plain) == 0
        assert "expected RotatingKVCache" in caplog.text
        store.flush()
        assert store.stats()["saves_refused"] == 2
        assert store.stats()["nodes"] == 0
        cache = store.new_cache()
        model(mx.array(PROMPT)[None], cache=cache)
        with pytest.raises(ValueError, match="holds 100 tokens but 90"):
            store.save_prefix(PROMPT[:90], cache)  # a window cannot be cut back
        with pytest.raises(ValueError, match="holds 100 tokens but 90"):
            store.save(PROMPT[:90], cache)
        store.save(PROMPT, cache)
        store.flush()
        assert store.fetch(PROMPT + FRESH[:1])[1] == len(PROMPT)


def test_quantized_store_refuses_plain_cache(tmp_path):
    model = tiny_llama(0, hidden=128)
    with KVStore(
        tmp_path / "s", model, chunk_tokens=C, kv_bits=4, kv_group_size=32
    ) as store:
        cache = [KVCache() for _ in model.layers]
        model(mx.array(PROMPT)[None], cache=cache)
        assert store.save(PROMPT, cache) == 0  # logged and counted, not raised
        assert store.stats()["saves_refused"] == 1
        cache, _ = store.fetch(PROMPT)
        assert all(type(c) is QuantizedKVCache for c in cache)


def test_quantized_restore_has_room_and_writes_in_place(tmp_path, monkeypatch):
    """Like KVCache: the packed parts, scales and biases get room past the restore,
    in buffers of their own (the first update writes in place, copying nothing)."""
    monkeypatch.setattr(kvstore.engine.restore, "ROOM_MIN_BYTES", 0)  # room at any size
    model = tiny_llama(0, hidden=128)
    with KVStore(
        tmp_path / "s", model, chunk_tokens=C, kv_bits=4, kv_group_size=32
    ) as store:
        store.prefill(PROMPT)
        store.flush()
        prompt = PROMPT + FRESH[:20]
        cache, n = store.fetch(prompt)
        assert n == len(PROMPT)
        parts = [[address(a) for a in (*c.keys, *c.values)] for c in cache]
        for c in cache:
            assert all(a.shape[2] > len(prompt) for a in (*c.keys, *c.values))
        model(mx.array(prompt[n:])[None], cache=cache)
        mx.eval([c.state for c in cache])
        for c, before in zip(cache, parts):
            assert c.offset == len(prompt)
            assert [address(a) for a in (*c.keys, *c.values)] == before


def address(a: mx.array) -> int:
    """Where an evaluated array's data is (a copy moves it)."""
    return np.frombuffer(memoryview(a), dtype=np.uint8).ctypes.data


@pytest.mark.parametrize("name", ["gemma3_text", "qwen3_next"])
def test_stream_generate_on_state_layouts(tmp_path, tokenizer, name):
    """kvstore.stream_generate gives mlx-lm's tokens; the second call restores the
    checkpoint at the prompt's last token but one."""
    from mlx_lm import stream_generate as mlx_stream_generate

    import kvstore

    model = build(name)
    prompt = " ".join(f"w{t}" for t in PROMPT if t >= 3)
    want = [
        r.token for r in mlx_stream_generate(model, tokenizer, prompt, max_tokens=8)
    ]
    n_prompt = len(tokenizer.encode(prompt))
    with KVStore(tmp_path / "s", model, tokenizer, chunk_tokens=C) as s:

        def run():
            return [
                r.token
                for r in kvstore.stream_generate(
                    model, tokenizer, prompt, store=s, max_tokens=8
                )
            ]

        first = run()
        s.flush()
        second = run()
        stats = s.stats()
    assert first == want and second == want
    assert stats["hits"] == 1 and stats["tokens_reused"] == n_prompt - 1


def test_server_cache_saves_and_restores_a_hybrid_model(tmp_path, tokenizer):
    """mlx-lm's server inserts caches at message ends (exact) and after generation
    (one token short of its key): both become checkpoints a restart can restore."""
    from types import SimpleNamespace

    from kvstore.server import PersistentPromptCache

    model = build("qwen3_next")
    key = ("hybrid", None, None)
    provider = SimpleNamespace(
        model=model,
        tokenizer=tokenizer,
        model_key=key,
        draft_model=None,
        processor=None,
    )
    system = PROMPT[:SYSTEM]
    pc = PersistentPromptCache(tmp_path / "s", provider)
    store = pc._store_for(key)
    c = store.new_cache()
    model(mx.array(system)[None], cache=c)
    pc.insert_cache(key, system, c, cache_type="system")
    # After generation the cache lacks the last generated token (never fed).
    c2 = store.new_cache()
    model(mx.array(PROMPT)[None], cache=c2)
    pc.insert_cache(key, PROMPT + [7], c2, cache_type="assistant")
    assert pc.stats()["saves"] == 2
    pc.close()

    pc2 = PersistentPromptCache(tmp_path / "s", provider)
    for query, n in [(PROMPT + [7, 9, 9], len(PROMPT)), (system + FRESH[:5], SYSTEM)]:
        got, rest = pc2.fetch_nearest_cache(key, query)
        assert len(rest) == len(query) - n
        logits = next_logits(model, got, rest)
        cold_cache = pc2._store_for(key).new_cache()
        assert mx.allclose(
            logits, next_logits(model, cold_cache, query), atol=1e-4, rtol=1e-3
        ).item()
    pc2.close()


def test_verify_and_gc_know_state_files(tmp_path):
    """verify checks state files like delta files; gc and eviction remove both."""
    from kvstore import maintenance

    model = build("falcon_h1")
    with KVStore(tmp_path / "s", model, chunk_tokens=C) as store:
        store.prefill(PROMPT, boundaries=[SYSTEM])
        store.flush()
        path = store.path
        on_disk = store.stats()["bytes_on_disk"]
        target = _state_file_of(store, SYSTEM)
    report = maintenance.verify(path)
    assert report["clean"], report
    files = [f for _, _, fs in os.walk(os.path.join(path, "blobs")) for f in fs]
    assert sum(os.path.getsize(p) for p in _all_files(path)) == on_disk
    assert sum(f.endswith(".state.safetensors") for f in files) == 2
    os.unlink(target)
    report = maintenance.verify(path)
    assert not report["clean"]
    assert any("state file is missing" in p["detail"] for p in report["problems"])
    maintenance.verify(path, fix=True)
    assert maintenance.verify(path)["clean"]
    assert maintenance.gc(path, max_bytes=0)["bytes_after"] == 0
    assert _all_files(path) == []


def _all_files(path):
    return [
        os.path.join(d, f)
        for d, _, fs in os.walk(os.path.join(path, "blobs"))
        for f in fs
    ]


class _StateModel(nn.Module):
    """A stand-in model with one ArraysCache layer whose entry ``state(seen)`` gives."""

    def __init__(self, state):
        super().__init__()
        self._state = state
        self.w = mx.zeros((2,))

    def make_cache(self):
        return [ArraysCache(1)]

    def __call__(self, x, cache):
        c = cache[0]
        seen = x.shape[1] + (0 if c[0] is None else int(c[0].reshape(-1)[0].item()))
        c[0] = self._state(seen)
        return mx.zeros((1, x.shape[1], 8))


@pytest.mark.parametrize(
    "state, why",
    [
        (
            lambda n: mx.full((1,) * min(n, 3), n),
            r"int32\[1\] after one token but int32\[1, 1, 1\]",
        ),
        (
            lambda n: mx.full((1, 2), n, mx.int32 if n == 1 else mx.float32),
            "dtype or rank depends on the tokens",
        ),
        (
            lambda n: mx.full((1, 2), n, mx.float64),
            "tensor 0 is float64; kvstore stores",
        ),
    ],
    ids=["rank-grows", "dtype-changes", "dtype-unstorable"],
)
def test_state_that_cannot_be_described_is_refused_at_open(tmp_path, state, why):
    from kvstore import UnsupportedCacheError

    with pytest.raises(
        UnsupportedCacheError, match=r"layer 0 \(ArraysCache\): .*" + why
    ):
        KVStore(tmp_path / "s", _StateModel(state), chunk_tokens=C)


def test_state_whose_length_grows_round_trips(tmp_path):
    """An entry of shape (1, min(seen, 3)) is stored with -1 on its last axis."""
    model = _StateModel(lambda n: mx.full((1, min(n, 3)), n, mx.int64))
    with KVStore(tmp_path / "s", model, chunk_tokens=C) as store:
        assert store.layout.leaves[0].tensors == (("0", "int64", (1, -1)),)
        for n in (1, 2, 40):
            cache = store.new_cache()
            model(mx.zeros((1, n), mx.int32), cache)
            store.save(list(range(n)), cache)
        store.flush()
        assert store.stats()["saves_refused"] == 0
        cache, n = store.fetch(list(range(40)) + [7])
    assert n == 40 and cache[0][0].tolist() == [[40, 40, 40]]
