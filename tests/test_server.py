"""``kvstore serve``: the persistent prompt cache and the real mlx-lm server around it."""

import glob
import os
import re
import signal
import time

import mlx.core as mx
import numpy as np
import pytest
from conftest import compute_cache, next_logits, random_tokens
from mlx_lm.models.cache import LRUPromptCache
from serving import KEY, SYSTEM, Server, answer, chat_body, provider

import kvstore
from kvstore.server import PersistentPromptCache, strip_body

pytestmark = pytest.mark.slow


def keys_of(cache, n):
    return np.array(cache[0].keys[..., :n, :])


# -- PersistentPromptCache ---------------------------------------------------------


def test_restart_restores_from_disk(tmp_path, model, tokenizer):
    tokens = random_tokens(300, seed=1)
    cache = compute_cache(model, tokens)
    pc = PersistentPromptCache(tmp_path / "s", provider(model, tokenizer))
    pc.insert_cache(KEY, tokens, cache, cache_type="system")
    assert pc.stats()["saves"] == 1
    pc.close()

    pc2 = PersistentPromptCache(tmp_path / "s", provider(model, tokenizer))  # a restart
    assert len(pc2) == 0
    got, rest = pc2.fetch_nearest_cache(KEY, tokens + [7, 8, 9])
    assert rest == [7, 8, 9]
    assert got[0].offset == 300
    np.testing.assert_array_equal(keys_of(got, 300), keys_of(cache, 300))
    s = pc2.stats()
    assert (s["disk_hits"], s["ram_hits"], s["misses"]) == (1, 0, 0)
    assert (s["tokens_reused_disk"], s["tokens_computed"]) == (300, 3)
    pc2.close()


def test_ram_or_disk_whichever_is_longer(tmp_path, model, tokenizer):
    tokens = random_tokens(200, seed=2)
    pc = PersistentPromptCache(tmp_path / "s", provider(model, tokenizer))
    pc.insert_cache(KEY, tokens, compute_cache(model, tokens))
    pc.close()

    pc2 = PersistentPromptCache(tmp_path / "s", provider(model, tokenizer))
    # RAM holds a shorter prefix (not written to disk: its save is skipped).
    pc2._lru.insert_cache(KEY, tokens[:40], compute_cache(model, tokens[:40]))
    query = tokens + [1, 2]
    got, rest = pc2.fetch_nearest_cache(KEY, query)
    assert len(rest) == 2 and got[0].offset == 200
    assert pc2.stats()["disk_hits"] == 1

    # Now RAM holds the whole prompt: RAM wins, the store is not even asked.
    pc2.insert_cache(KEY, query, compute_cache(model, query))
    got, rest = pc2.fetch_nearest_cache(KEY, query + [3])
    assert rest == [3] and got[0].offset == len(query)
    s = pc2.stats()
    assert (s["ram_hits"], s["disk_hits"]) == (1, 1)
    # A cache holding fewer tokens than its key: what it holds is saved.
    saves = pc2.stats()["saves"]
    pc2.insert_cache(KEY, tokens + [4, 5, 6], compute_cache(model, tokens))
    assert pc2.stats()["saves"] == saves + 1
    # Not a list of plain KVCache objects: not saved.
    from mlx_lm.models.cache import RotatingKVCache

    pc2.insert_cache(KEY, [1, 2, 3], [RotatingKVCache(max_size=8)])
    assert pc2.stats()["saves_skipped"] == 1
    pc2.close()


def test_ram_copy_extended_by_the_stored_tail(tmp_path, model, tokenizer, monkeypatch):
    """RAM holds most of a stored prompt: only the stored nodes past the RAM copy
    are read, appended to it; or none when prefilling the difference is cheaper."""
    tokens = random_tokens(600, seed=21)
    pc = PersistentPromptCache(tmp_path / "s", provider(model, tokenizer))
    pc.insert_cache(KEY, tokens, compute_cache(model, tokens))
    pc.close()

    pc2 = PersistentPromptCache(tmp_path / "s", provider(model, tokenizer))
    store = pc2.open_store(KEY)
    tails = []
    real = store.fetch_beyond
    monkeypatch.setattr(
        store,
        "fetch_beyond",
        lambda *a, **kw: tails.append(real(*a, **kw)) or tails[-1],
    )
    pc2._lru.insert_cache(KEY, tokens[:270], compute_cache(model, tokens[:270]))
    query = tokens + [1, 2, 3]
    got, rest = pc2.fetch_nearest_cache(KEY, query)
    assert rest == [1, 2, 3] and all(c.offset == 600 for c in got)
    assert (tails[0].start, tails[0].end) == (256, 600)  # nodes [256, 512), [512, 600)
    s = pc2.stats()
    assert (s["disk_hits"], s["tokens_reused_ram"], s["tokens_reused_disk"]) == (
        1,
        256,
        344,
    )
    want = next_logits(model, compute_cache(model, []), query)
    assert mx.allclose(next_logits(model, got, rest), want, atol=1e-4).item()

    # Prefilling 330 tokens is cheaper than reading two nodes: RAM and prefill.
    store.policy.mode = "auto"
    store.policy.rates.prefill = 1e9
    got, rest = pc2.fetch_nearest_cache(KEY, query)
    assert len(rest) == 333 and got[0].offset == 270
    assert pc2.stats()["ram_hits"] == 1 and store.stats()["recomputes_chosen"] == 1
    pc2.close()


def test_rest_tokens_match_lru_prompt_cache(tmp_path, model, tokenizer):
    tokens = random_tokens(120, seed=3)
    cache = compute_cache(model, tokens)
    queries = {
        "exact": tokens,
        "longer": tokens + [11, 12, 13],
        "shorter": tokens[:70],
        "diverging": tokens[:50] + [13, 14, 15],
        "other": [9, 9, 9, 9],
    }
    lru = LRUPromptCache()
    lru.insert_cache(KEY, tokens, cache)
    pc = PersistentPromptCache(tmp_path / "s", provider(model, tokenizer))
    pc.insert_cache(KEY, tokens, cache)
    pc.flush()
    disk_only = PersistentPromptCache(tmp_path / "s", provider(model, tokenizer))
    for name, q in queries.items():
        want_cache, want_rest = lru.fetch_nearest_cache(KEY, list(q))
        got_cache, got_rest = pc.fetch_nearest_cache(KEY, list(q))
        assert got_rest == want_rest, name
        assert (got_cache is None) == (want_cache is None), name
        # From disk alone: the same, except that an exact prompt keeps its last token
        # to compute (the store restores at most len(tokens) - 1 tokens).
        d_cache, d_rest = disk_only.fetch_nearest_cache(KEY, list(q))
        assert d_rest == (q[-1:] if name == "exact" else want_rest), name
        if d_cache is not None:
            n = len(q) - len(d_rest)
            assert d_cache[0].offset == n
            np.testing.assert_array_equal(keys_of(d_cache, n), keys_of(cache, n))
    assert disk_only.stats()["misses"] == 1
    pc.close()
    disk_only.close()


def test_store_errors_never_break_a_request(tmp_path, model, tokenizer, monkeypatch):
    tokens = random_tokens(100, seed=4)
    pc = PersistentPromptCache(tmp_path / "s", provider(model, tokenizer))
    store = pc.open_store(KEY)

    def boom(*a, **kw):
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(store, "lookup", boom)
    monkeypatch.setattr(store, "fetch", boom)
    monkeypatch.setattr(store, "save_prefix", boom)
    assert pc.fetch_nearest_cache(KEY, tokens) == (None, tokens)
    pc.insert_cache(KEY, tokens, compute_cache(model, tokens))  # RAM only
    got, rest = pc.fetch_nearest_cache(KEY, tokens + [5])
    assert rest == [5] and got[0].offset == 100
    assert pc.stats()["store_errors"] == 2
    monkeypatch.undo()
    pc.close()

    # An unusable store directory: RAM only, no exception.
    (tmp_path / "file").write_text("not a store")
    pc = PersistentPromptCache(tmp_path / "file", provider(model, tokenizer))
    assert pc.fetch_nearest_cache(KEY, tokens) == (None, tokens)
    pc.insert_cache(KEY, tokens, compute_cache(model, tokens))
    assert pc.fetch_nearest_cache(KEY, tokens + [5])[1] == [5]
    assert pc.stats()["store_errors"] >= 1
    # Another model than the loaded one: RAM only.
    assert pc.fetch_nearest_cache(("other", None, None), tokens) == (None, tokens)
    pc.close()


def test_nothing_raises_into_the_generation_thread(tmp_path, model, tokenizer):
    """Whatever fails inside the prompt cache (a bad salt, mlx-lm's LRU, the store)
    is a logged miss or a skipped save: mlx-lm's generation thread never sees it."""
    tokens = random_tokens(100, seed=6)
    cache = compute_cache(model, tokens)
    pc = PersistentPromptCache(tmp_path / "s", provider(model, tokenizer))
    for salt in ("x" * 257, "", 5, kvstore.Tenant("t", "x" * 257)):
        assert pc.fetch_nearest_cache(KEY, tokens, salt=salt) == (None, tokens)
        pc.insert_cache(KEY, tokens, cache, salt=salt)
    assert pc.stats()["store_errors"] == 8 and pc.stats()["saves_skipped"] == 4

    class Broken:
        def __getattr__(self, name):
            raise RuntimeError(f"LRU broken: {name}")

    pc._lru = Broken()
    assert pc.fetch_nearest_cache(KEY, tokens) == (None, tokens)
    pc.insert_cache(KEY, tokens, cache)
    assert pc._counters["store_errors"] == 10  # stats() reads the LRU too
    pc.close()


def test_strip_body():
    pats = [re.compile(r"^x-anthropic-billing-header: .*\n?", re.MULTILINE)]
    body = {
        "messages": [
            {
                "role": "system",
                "content": "x-anthropic-billing-header: cc_version=1.2; id=42\nYou are w5.",
            },
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "hi\nx-anthropic-billing-header: a\n"}
                ],
            },
        ],
        "prompt": "x-anthropic-billing-header: z\nw9",
    }
    strip_body(body, pats)
    assert body["messages"][0]["content"] == "You are w5."
    assert body["messages"][1]["content"][0]["text"] == "hi\n"
    assert body["prompt"] == "w9"


# -- end to end: real server processes ---------------------------------------------


def test_serve_persists_across_restarts(tmp_path, tiny_model_dir):
    store = str(tmp_path / "store")
    kv = ["kvstore.server", "--model", tiny_model_dir, "--store", store]
    first = chat_body("w10 w11 w12 w13")
    second = chat_body("w20 w21 w22")

    plain = Server(
        ["mlx_lm", "server", "--model", tiny_model_dir], tmp_path / "plain.log"
    )
    try:
        want_first, want_second = answer(plain.chat(first)), answer(plain.chat(second))
    finally:
        plain.stop()

    s1 = Server(kv, tmp_path / "run1.log")
    try:
        assert answer(s1.chat(first)) == want_first
        stats = s1.stats()
        assert stats["misses"] == 1 and stats["saves"] >= 1
        # The server timed its own prefill of the prompt.
        assert stats["stores"][0]["prefill_tokens_per_s"] > 0
        if hasattr(signal, "SIGUSR1"):  # every thread's stack, and it serves on
            s1.proc.send_signal(signal.SIGUSR1)
            assert answer(s1.chat(first)) == want_first
            assert "kvstore/server.py" in s1.output().split("Thread 0x", 1)[-1]
    finally:
        assert s1.stop() == 0, s1.output()
    assert "stores flushed and closed" in s1.output()

    s2 = Server(kv, tmp_path / "run2.log")  # a restart: nothing in RAM
    try:
        # The rate measured before the restart decides the first fetch.
        assert _settled(s2)["stores"][0]["prefill_tokens_per_s"] > 0
        r = s2.chat(second)
        stats = s2.stats()
    finally:
        assert s2.stop() == 0, s2.output()
    assert answer(r) == want_second
    assert stats["disk_hits"] == 1 and stats["ram_hits"] == 0
    assert stats["tokens_reused_disk"] >= 300  # the whole system prompt, from disk
    assert (
        stats["tokens_computed"] == stats["tokens_requested"] - stats["tokens_reused"]
    )
    assert stats["stores"][0]["hits"] == 1
    assert re.search(r"kvstore: prompt \d+ tokens: reused (\d+) \(disk\)", s2.output())

    # Corrupt every chunk file: the request still succeeds, computed from scratch.
    files = glob.glob(
        os.path.join(store, "blobs", "**", "*.safetensors"), recursive=True
    )
    assert files
    for path in files:
        with open(path, "r+b") as f:
            f.seek(os.path.getsize(path) - 64)
            f.write(b"\xff" * 64)
    s3 = Server(kv, tmp_path / "run3.log")
    try:
        r = s3.chat(second)
        stats = s3.stats()
    finally:
        assert s3.stop() == 0, s3.output()
    assert answer(r) == want_second
    assert stats["stores"][0]["corrupt"] >= 1
    assert stats["disk_hits"] == 0 and stats["misses"] == 1


def _settled(server, timeout=30):
    """The server's stats once its store is open (the model loads after /health)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = server.stats()
        if stats["stores"] or time.monotonic() > deadline:
            return stats
        time.sleep(0.2)


def test_serve_strip_pattern(tmp_path, tiny_model_dir):
    kv = [
        "kvstore.server",
        "--model",
        tiny_model_dir,
        "--store",
        str(tmp_path / "store"),
        "--strip-pattern",
        r"^x-anthropic-billing-header: .*\n?",
    ]
    s = Server(kv, tmp_path / "run.log")
    try:
        a = s.chat(
            chat_body(
                "w30 w31", system="x-anthropic-billing-header: w100 w101\n" + SYSTEM
            )
        )
        b = s.chat(
            chat_body("w30 w31", system="x-anthropic-billing-header: w200\n" + SYSTEM)
        )
        stats = s.stats()
    finally:
        assert s.stop() == 0, s.output()
    assert answer(a) == answer(b)
    # Same tokens once the header is gone: the second prompt is all cached.
    assert a["usage"]["prompt_tokens"] == b["usage"]["prompt_tokens"]
    assert (
        stats["requests"] == 2
        and stats["tokens_reused"] >= a["usage"]["prompt_tokens"] - 1
    )


# -- the prefill rate, from the server's own requests -------------------------------


def test_batch_steps_report_their_prompt_tokens():
    import contextlib
    from types import SimpleNamespace

    from kvstore.serve.timing import timed_batch_generator_class

    class Base:
        def __init__(self):
            self.steps = [(512, 0.25, 0), (0, 0.0, 1), (3, 0.01, 0)]

        @contextlib.contextmanager
        def stats(self):
            window = SimpleNamespace(prompt_tokens=0, prompt_time=0.0)
            yield window
            tokens, seconds, decoded = self.current
            window.prompt_tokens, window.prompt_time = tokens, seconds
            window.generation_steps = decoded

        def next(self):
            self.current = self.steps.pop(0)
            return [], []

    seen = []
    gen = timed_batch_generator_class(Base, lambda t, s: seen.append((t, s)))()
    for _ in range(3):
        assert gen.next() == ([], [])
    assert seen == [(512, 0.25), (3, 0.01)]

    # A failing callback is logged, never raised into the generation loop.
    def boom(tokens, seconds):
        raise RuntimeError("no store")

    gen = timed_batch_generator_class(Base, boom)()
    assert gen.next() == ([], [])


def test_sequential_request_timed_from_lookup_to_first_token():
    import queue

    from kvstore.serve.timing import PrefillClock, timed_response_generator_class

    class Response:
        pass

    clock, seen = PrefillClock(), []

    class Base:
        def _serve_single(self, request, stream):
            rqueue = request[0]
            rqueue.put("ctx")
            clock.looked_up(120)  # the prompt cache's lookup
            rqueue.put((60, 120))  # progress
            rqueue.put(Response())
            rqueue.put(Response())
            rqueue.put(None)

    cls = timed_response_generator_class(
        Base, Response, clock, lambda t, s: seen.append((t, s))
    )
    q = queue.Queue()
    cls()._serve_single((q, "request", "args"), None)
    assert [t for t, _ in seen] == [120] and seen[0][1] >= 0
    assert q.qsize() == 5


def test_prefetch_threads_option():
    from kvstore.server import build_parser

    p = build_parser()
    assert p.parse_known_args(["--prefetch-threads", "4"])[0].prefetch_threads == 4
    assert p.parse_known_args([])[0].prefetch_threads == 2
    with pytest.raises(SystemExit):
        p.parse_known_args(["--prefetch-threads", "0"])


def test_kvstore_log_level_option():
    from kvstore.server import build_parser

    p = build_parser()
    args = p.parse_known_args(["--kvstore-log-level", "DEBUG"])[0]
    assert args.kvstore_log_level == "DEBUG"
    assert p.parse_known_args([])[0].kvstore_log_level is None  # mlx-lm's level
    with pytest.raises(SystemExit):
        p.parse_known_args(["--kvstore-log-level", "LOUD"])
