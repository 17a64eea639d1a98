"""Restores started when a request arrives (``kvstore.serve.prefetch``): taken by
the lookup of that very request only, and the lookup restores as before whenever
a prefetch cannot tell (none, failed, not started, another salt, RAM changed)."""

import threading
import time

import mlx.core as mx
import pytest
from conftest import compute_cache, next_logits, random_tokens
from serving import KEY, provider

from kvstore.serve.prefetch import Prefetcher
from kvstore.server import PersistentPromptCache

pytestmark = pytest.mark.slow


class Request:
    """Stands in for mlx-lm's CompletionRequest (weak references allowed)."""


@pytest.fixture
def stored(tmp_path, model, tokenizer):
    """A store holding a 600-token prompt (unsalted) and, under salt "a", another."""
    tokens = random_tokens(600, seed=31)
    salted = random_tokens(600, seed=32)
    pc = PersistentPromptCache(tmp_path / "s", provider(model, tokenizer))
    pc.insert_cache(KEY, tokens, compute_cache(model, tokens))
    pc.insert_cache(KEY, salted, compute_cache(model, salted), salt="a")
    pc.close()
    return tmp_path / "s", tokens, salted


def restarted(path, model, tokenizer):
    pc = PersistentPromptCache(path, provider(model, tokenizer))
    pc.open_store(KEY)
    pc.prefetcher = Prefetcher()
    assert pc.can_prefetch()
    return pc


def arrive(pc, tokens, salt=None):
    """A request arriving: its prefetch is submitted (as the HTTP handler does),
    and has run by the time this returns (one not started yet would be cancelled
    by the lookup: a test of its own)."""
    request = Request()
    pc.prefetcher.submit(request, lambda: pc.prefetch(KEY, tokens, salt))
    request.kvstore_prefetch.future.exception()  # waits
    return request


def look_up(pc, request, tokens, salt=None):
    pc.prefetcher.looking_up(request)  # the generation thread's _tokenize
    return pc.fetch_nearest_cache(KEY, tokens, salt=salt)


def same_as_cold(model, cache, query, rest):
    want = next_logits(model, compute_cache(model, []), query)
    assert mx.allclose(next_logits(model, cache, rest), want, atol=1e-4).item()


def test_prefetched_restore_is_taken_by_its_lookup(stored, model, tokenizer):
    path, tokens, _ = stored
    pc = restarted(path, model, tokenizer)
    queries = [tokens + [i, 7] for i in range(4)]
    requests = [arrive(pc, q) for q in queries]  # four users arrive at once
    for request, q in zip(requests, queries):
        cache, rest = look_up(pc, request, q)
        assert len(rest) == 2 and cache[0].offset == 600
        same_as_cold(model, cache, q, rest)
    s = pc.stats()
    assert (s["disk_hits"], s["restores_prefetched"]) == (4, 4)
    assert pc.prefetcher._waiting == 0
    pc.close()


def test_prefetch_restores_only_past_the_ram_copy(stored, model, tokenizer):
    path, tokens, _ = stored
    pc = restarted(path, model, tokenizer)
    pc.insert_cache(KEY, tokens[:270], compute_cache(model, tokens[:270]))
    query = tokens + [3]
    request = arrive(pc, query)
    pre = request.kvstore_prefetch.future.result()
    assert pre.held == 270 and (pre.tail.start, pre.tail.end) == (256, 600)
    cache, rest = look_up(pc, request, query)
    assert rest == [3] and cache[0].offset == 600
    same_as_cold(model, cache, query, rest)
    s = pc.stats()
    assert (s["restores_prefetched"], s["tokens_reused_ram"]) == (1, 256)

    # RAM lost its copy meanwhile: the tail alone is no use, the lookup restores.
    request = arrive(pc, query)
    pc.trim_to(n_sequences=0)
    cache, rest = look_up(pc, request, query)
    assert rest == [3] and cache[0].offset == 600
    same_as_cold(model, cache, query, rest)
    assert pc.stats()["restores_prefetched"] == 1
    pc.close()


def test_prefetch_never_crosses_salts(stored, model, tokenizer):
    path, tokens, salted = stored
    pc = restarted(path, model, tokenizer)
    # A prefetch made under salt "a" is not taken by a lookup under "b".
    request = arrive(pc, salted + [1], salt="a")
    assert request.kvstore_prefetch.future.result().tail is not None
    cache, rest = look_up(pc, request, salted + [1], salt="b")
    assert cache is None and len(rest) == 601
    # Nor by an unsalted one; under its own salt it is.
    request = arrive(pc, salted + [1], salt="a")
    assert look_up(pc, request, salted + [1])[0] is None
    request = arrive(pc, salted + [1], salt="a")
    cache, rest = look_up(pc, request, salted + [1], salt="a")
    assert rest == [1] and cache[0].offset == 600
    s = pc.stats()
    assert (s["misses"], s["disk_hits"], s["restores_prefetched"]) == (2, 1, 1)
    # A prefetch for other tokens is not taken either.
    request = arrive(pc, tokens + [1])
    cache, rest = look_up(pc, request, tokens + [2])
    assert rest == [2] and pc.stats()["restores_prefetched"] == 1
    pc.close()


def test_failed_or_unstarted_prefetch_restores_at_lookup(stored, model, tokenizer):
    path, tokens, _ = stored
    pc = restarted(path, model, tokenizer)
    query = tokens + [5]

    def boom():
        raise RuntimeError("disk on fire")

    request = Request()
    pc.prefetcher.submit(request, boom)
    cache, rest = look_up(pc, request, query)
    assert rest == [5] and pc.stats()["restores_prefetched"] == 0

    # A prefetch still queued behind a slow one is cancelled; the lookup restores.
    gate = threading.Event()
    slow = [Request() for _ in range(2)]
    for r in slow:
        pc.prefetcher.submit(r, gate.wait)
    request = Request()
    pc.prefetcher.submit(request, lambda: pc.prefetch(KEY, query, None))
    cache, rest = look_up(pc, request, query)
    assert rest == [5] and request.kvstore_prefetch is None
    assert pc.stats()["restores_prefetched"] == 0
    gate.set()
    for r in slow:
        look_up(pc, r, [1, 2, 3])
    assert pc.prefetcher._waiting == 0
    pc.close()


def test_waiting_prefetches_are_bounded(stored, model, tokenizer):
    path, tokens, _ = stored
    pc = PersistentPromptCache(path, provider(model, tokenizer))
    pc.prefetcher = Prefetcher(max_waiting=2)
    requests = [Request() for _ in range(3)]
    for r in requests:
        pc.prefetcher.submit(r, lambda: None)
    assert [hasattr(r, "kvstore_prefetch") for r in requests] == [True, True, False]
    # A request that goes without being looked up frees its place.
    del requests[0]
    deadline = time.monotonic() + 5
    while pc.prefetcher._waiting != 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pc.prefetcher._waiting == 1
    pc.close()
