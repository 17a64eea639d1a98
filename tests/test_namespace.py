"""Opening a store for a model it has seen: the namespace found by the model key and
the layout taken from the namespace record (no forward pass); models whose cache
layout differs never get another model's layout; namespaces are the ones earlier
versions computed; broken records fall back to probing."""

import dataclasses
import json
import logging
import os
import shutil

import mlx.core as mx
import pytest
import xxhash
from conftest import compute_cache, random_tokens, tiny_llama, tiny_tokenizer
from families import build
from mlx.utils import tree_flatten
from mlx_lm.models import llama
from mlx_lm.models.cache import ChunkedKVCache, KVCache, RotatingKVCache

import kvstore.disk.namespace as namespace
from kvstore import KVStore, maintenance
from kvstore.disk import adapters
from kvstore.disk.index import MODEL_KEY_PREFIX

C = 16


@pytest.fixture
def probes(monkeypatch):
    """Counts forward passes run to learn a layout."""
    calls = []
    real = namespace.probe_layout

    def probe(model, make_cache=None):
        calls.append(type(model).__name__)
        return real(model, make_cache)

    monkeypatch.setattr(namespace, "probe_layout", probe)
    return calls


def open_store(path, model, tokenizer=None, **kw):
    return KVStore(path, model, tokenizer, chunk_tokens=C, **kw)


def test_a_known_model_opens_without_running_it(tmp_path, model, probes):
    tokens = random_tokens(3 * C, seed=1)
    with open_store(tmp_path / "s", model) as s:
        first = (s.namespace, s.layout.to_json(), s.description)
        s.save(tokens, compute_cache(model, tokens))
    assert len(probes) == 1
    for _ in range(2):
        with open_store(tmp_path / "s", model) as s:
            assert (s.namespace, s.layout.to_json(), s.description) == first
            cache, n = s.fetch(tokens + [1])
            assert n == len(tokens)
            want = compute_cache(model, tokens)
            assert all(
                mx.array_equal(c.keys[:, :, :n], w.keys[:, :, :n]).item()
                for c, w in zip(cache, want)
            )
            assert type(s.new_cache()[0]) is KVCache  # the layout builds caches
    assert len(probes) == 1


# -- namespaces are what earlier versions computed ----------------------------------------


def reference_fingerprint(model, tokenizer, layout, chunk_tokens):
    """The namespace as kvstore computed it before the model key (a copy of that code):
    stores made then must keep their namespace."""
    params = tree_flatten(model.parameters())
    headers, content = xxhash.xxh3_128(), xxhash.xxh3_128()
    for name, p in params:
        headers.update(f"{name}:{p.dtype}:{tuple(p.shape)};".encode())
        if p.size:
            content.update(memoryview(mx.contiguous(p)).cast("B"))
    vocab = None
    if tokenizer is not None:
        h = xxhash.xxh3_128()
        for tok, i in sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1]):
            h.update(f"{i}\x00{tok}\x01".encode("utf-8", "surrogatepass"))
        vocab = h.hexdigest()
    config = json.loads(
        json.dumps(dataclasses.asdict(model.args), sort_keys=True, default=str)
    )
    description = {
        "format_version": 1,  # as stores made then recorded it
        "model_type": config.get("model_type"),
        "config": config,
        "weight_headers": headers.hexdigest(),
        "weights": content.hexdigest(),
        "vocab": vocab,
        "layout": layout.to_json(),
        "chunk_tokens": chunk_tokens,
    }
    canonical = json.dumps(description, sort_keys=True).encode()
    return xxhash.xxh3_128_digest(canonical)


@pytest.mark.parametrize("with_tokenizer", [False, True])
def test_namespaces_are_unchanged(tmp_path, model, with_tokenizer):
    tok = tiny_tokenizer() if with_tokenizer else None
    for _ in range(2):  # probed, then known
        with open_store(tmp_path / "s", model, tok) as s:
            assert s.namespace == reference_fingerprint(model, tok, s.layout, C)


def test_weights_digest_samples_large_models_as_before(monkeypatch):
    """Above FULL_HASH_LIMIT: 1 MiB at the start, middle and end of large tensors."""
    model = tiny_llama(0, hidden=256)
    monkeypatch.setattr(namespace, "FULL_HASH_LIMIT", 1 << 16)
    monkeypatch.setattr(namespace, "_SAMPLE", 1 << 12)
    content = xxhash.xxh3_128()
    for _, p in tree_flatten(model.parameters()):
        raw = memoryview(mx.contiguous(p)).cast("B")
        if len(raw) <= 3 << 12:
            content.update(raw)
        else:
            mid = len(raw) // 2
            for s in (0, mid - (1 << 11), len(raw) - (1 << 12)):
                content.update(raw[s : s + (1 << 12)])
    assert namespace.weights_digest(model)[1] == content.hexdigest()


# -- what changes the layout changes the key -------------------------------------------------


class WindowedLlama(llama.Model):
    """Llama whose cache is a sliding window of ``max_kv_size`` tokens (an instance
    setting, not in the config: as ``make_prompt_cache(model, max_kv_size)`` makes)."""

    max_kv_size = None

    def make_cache(self):
        if self.max_kv_size is None:
            return [KVCache() for _ in self.layers]
        return [RotatingKVCache(max_size=self.max_kv_size) for _ in self.layers]


class OtherCodeLlama(llama.Model):
    """Llama from another source file (this one): other code may mean other KV."""

    def __call__(self, *args, **kw):
        return super().__call__(*args, **kw)


def windowed(size, seed=0):
    base = tiny_llama(seed)
    model = WindowedLlama(base.args)
    model.update(base.parameters())
    model.max_kv_size = size
    return model


def gemma(window):
    from families import CONFIGS

    old = CONFIGS["gemma3_text"]["sliding_window"]
    CONFIGS["gemma3_text"]["sliding_window"] = window
    try:
        return build("gemma3_text")
    finally:
        CONFIGS["gemma3_text"]["sliding_window"] = old


def with_make_cache(model, make):
    """The same model object's weights, with a cache built by ``make``."""
    other = llama.Model(model.args)
    other.update(model.parameters())
    other.make_cache = lambda: make(other)
    return other


G32 = {"kv_group_size": 32}


def wide(seed=0):
    """A tiny llama with 64-dim heads (quantized KV needs groups of 32 or more)."""
    return tiny_llama(seed, hidden=256)


PAIRS = {
    # same weights and config shapes, another sliding window in the config
    "sliding-window": lambda: (gemma(16), gemma(32), {}, {}),
    # same class, config and weights; the window is an instance setting
    "max_kv_size": lambda: (windowed(64), windowed(128), {}, {}),
    "window-vs-none": lambda: (windowed(None), windowed(64), {}, {}),
    "kv_bits": lambda: (wide(), wide(), {}, {"kv_bits": 4, **G32}),
    "kv_bits-4-vs-8": lambda: (
        wide(),
        wide(),
        {"kv_bits": 8, **G32},
        {"kv_bits": 4, **G32},
    ),
    "kv_group_size": lambda: (
        wide(),
        wide(),
        {"kv_bits": 4, "kv_group_size": 32},
        {"kv_bits": 4, "kv_group_size": 64},
    ),
    "kv-heads": lambda: (
        tiny_llama(0),
        llama.Model(dataclasses.replace(tiny_llama(0).args, num_key_value_heads=4)),
        {},
        {},
    ),
    "cache-type-via-make_cache": lambda: (
        tiny_llama(0),
        with_make_cache(tiny_llama(0), lambda m: [ChunkedKVCache(8) for _ in m.layers]),
        {},
        {},
    ),
    "float16-weights": lambda: (tiny_llama(0), tiny_llama(0, dtype=mx.float16), {}, {}),
}


@pytest.mark.parametrize("pair", list(PAIRS))
def test_models_differing_in_layout_never_share_one(tmp_path, probes, pair):
    """Each pair differs only in what changes the cache layout: the second, opened
    after the first in the same store, is probed, gets its own layout and namespace,
    and both keep theirs when opened again (not probed)."""
    a, b, kw_a, kw_b = PAIRS[pair]()
    mx.eval(a.parameters(), b.parameters())
    opened = []
    for model, kw in ((a, kw_a), (b, kw_b)):
        with open_store(tmp_path / "s", model, **kw) as s:
            opened.append((s.namespace, s.layout.to_json()))
            assert (
                s.layout.to_json()
                == adapters.probe_layout(model, s.layout.make_cache).to_json()
            )
    assert len(probes) == 2
    assert opened[0][0] != opened[1][0]
    assert opened[0][1] != opened[1][1]
    for (model, kw), want in zip(((a, kw_a), (b, kw_b)), opened):
        with open_store(tmp_path / "s", model, **kw) as s:
            assert (s.namespace, s.layout.to_json()) == want
    assert len(probes) == 2


def test_a_code_change_is_another_key(tmp_path, probes, monkeypatch):
    """Same config and weights, the model's class from another source file: probed."""
    a = tiny_llama(0)
    b = OtherCodeLlama(a.args)
    b.update(a.parameters())
    with open_store(tmp_path / "s", a):
        pass
    with open_store(tmp_path / "s", b):
        pass
    assert len(probes) == 2
    # Edited source of the same module (mtime and bytes): another key too.
    empty = a.make_cache()
    weights = namespace.weights_digest(a)
    key = namespace.model_key(a, None, empty, chunk_tokens=C, weights=weights)
    real_digest = namespace._source_digest
    monkeypatch.setattr(
        namespace, "_source_digest", lambda names: real_digest(names) + "edited"
    )
    assert namespace.model_key(a, None, empty, chunk_tokens=C, weights=weights) != key


def test_a_class_without_source_is_always_probed(tmp_path, probes):
    """A model class with no readable source file (defined in ``__main__`` or a
    notebook): its code cannot be told apart, so its layout is never reused."""
    cls = type("NotebookLlama", (llama.Model,), {"__module__": "__not_a_module__"})
    base = tiny_llama(0)
    model = cls(base.args)
    model.update(base.parameters())
    for _ in range(2):
        with open_store(tmp_path / "s", model):
            pass
    assert len(probes) == 2


def rope(theta):
    base = tiny_llama(0)
    model = llama.Model(dataclasses.replace(base.args, rope_theta=theta))
    model.update(base.parameters())
    return model


@pytest.mark.parametrize(
    "pair",
    [
        pytest.param(lambda: (tiny_llama(0), tiny_llama(1)), id="other-weights"),
        pytest.param(lambda: (rope(10000.0), rope(500000.0)), id="other-rope-config"),
    ],
)
def test_same_layout_other_kv_is_another_namespace(tmp_path, probes, pair):
    """Same layout, other KV (weights, or a config value such as RoPE's base): each
    model keeps its own namespace, first and every later open, and never restores
    the other's KV."""
    models = pair()
    tokens = random_tokens(2 * C, seed=3)
    names = []
    for m in models:
        with open_store(tmp_path / "s", m) as s:
            names.append(s.namespace)
            s.save(tokens, compute_cache(m, tokens))
    assert names[0] != names[1] and len(probes) == 2
    for m, ns in zip(models, names):
        with open_store(tmp_path / "s", m) as s:
            assert s.namespace == ns
            cache, n = s.fetch(tokens + [1])
            want = compute_cache(m, tokens)
            assert n == len(tokens) and all(
                mx.array_equal(c.keys[:, :, :n], w.keys[:, :, :n]).item()
                for c, w in zip(cache, want)
            )
    assert len(probes) == 2


# -- tokenizers ------------------------------------------------------------------------------


def test_tokenizer_files_identify_the_vocabulary(tmp_path, model, probes):
    tok_dir = tmp_path / "tok"
    tiny_tokenizer().save_pretrained(tok_dir)
    from transformers import AutoTokenizer

    def load():
        return AutoTokenizer.from_pretrained(str(tok_dir))

    ident = namespace.tokenizer_identity(load())
    assert ident[0] == "files" and "tokenizer.json" in [f[0] for f in ident[-1]]
    with open_store(tmp_path / "s", model, load()) as s:
        ns = s.namespace
    with open_store(tmp_path / "s", model, load()) as s:
        assert s.namespace == ns
    assert len(probes) == 1
    # A rewritten tokenizer file is another key (probed again); same vocabulary,
    # so the same namespace.
    (tok_dir / "tokenizer.json").write_bytes((tok_dir / "tokenizer.json").read_bytes())
    os.utime(tok_dir / "tokenizer.json", ns=(1, 1))
    with open_store(tmp_path / "s", model, load()) as s:
        assert s.namespace == ns
    assert len(probes) == 2
    # A tokenizer with another vocabulary is another namespace.
    shutil.rmtree(tok_dir)
    other = tiny_tokenizer()
    other.add_tokens(["brandnew"])
    other.save_pretrained(tok_dir)
    with open_store(tmp_path / "s", model, load()) as s:
        assert s.namespace != ns
    # Tokens added in memory change its size: another key.
    tok = load()
    before = namespace.tokenizer_identity(tok)
    tok.add_tokens(["another"])
    assert namespace.tokenizer_identity(tok) != before


def test_a_tokenizer_without_files_is_identified_by_its_vocabulary(model):
    tok = tiny_tokenizer()  # built in memory
    assert namespace.tokenizer_identity(tok) == ["vocab", namespace.vocab_digest(tok)]


# -- broken records ---------------------------------------------------------------------------


def key_of(store, model):
    return namespace.model_key(
        model,
        None,
        store.layout.make_cache(),
        chunk_tokens=C,
        weights=namespace.weights_digest(model),
    )


@pytest.mark.parametrize(
    "damage", ["layout-unknown-class", "not-json", "other-namespace", "dropped"]
)
def test_a_broken_record_means_probing_again(tmp_path, model, probes, caplog, damage):
    caplog.set_level(logging.WARNING, logger="kvstore")
    tokens = random_tokens(2 * C, seed=2)
    with open_store(tmp_path / "s", model) as s:
        ns, layout = s.namespace, s.layout.to_json()
        s.save(tokens, compute_cache(model, tokens))
        key = key_of(s, model)
        db = s.index.db

        def damage_it(txn):
            raw = json.loads(bytes(txn.get(ns, db=db["namespaces"])))
            if damage == "layout-unknown-class":
                raw["layout"]["leaves"][0]["cls"] = "os.system"
                txn.put(ns, json.dumps(raw).encode(), db=db["namespaces"])
            elif damage == "not-json":
                txn.put(ns, b"{nope", db=db["namespaces"])
            elif damage == "other-namespace":
                txn.put(MODEL_KEY_PREFIX + key, b"\x01" * 16, db=db["meta"])
            else:
                txn.delete(ns, db=db["namespaces"])

        s.index.write(damage_it)
    with open_store(tmp_path / "s", model) as s:
        assert (s.namespace, s.layout.to_json()) == (ns, layout)
        assert s.fetch(tokens + [1])[1] == len(tokens)
    assert len(probes) == 2
    if damage == "layout-unknown-class":
        assert "cannot be reused" in caplog.text
    with open_store(tmp_path / "s", model) as s:  # the mapping is whole again
        assert s.namespace == ns
    assert len(probes) == 2


def test_dropping_a_namespace_drops_its_model_keys(tmp_path, model, other_model):
    with open_store(tmp_path / "s", model) as s:
        ns = s.namespace
    with open_store(tmp_path / "s", other_model) as s:
        keep = s.namespace
    maintenance.gc(str(tmp_path / "s"), drop_namespaces=[ns.hex()])
    with open_store(tmp_path / "s", other_model) as s:
        models = s.index.read(
            lambda txn: [
                bytes(v)
                for k, v in txn.cursor(db=s.index.db["meta"])
                if bytes(k).startswith(MODEL_KEY_PREFIX)
            ]
        )
    assert models == [keep]
