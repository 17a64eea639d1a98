"""kvstore serve's linear walk of mlx-lm's RAM prompt trie gives what mlx-lm's own
``LRUPromptCache.fetch_nearest_cache`` gives, without its quadratic search."""

import random
from types import SimpleNamespace

import mlx.core as mx
import pytest
from mlx_lm.models.cache import (
    KVCache,
    LRUPromptCache,
    RotatingKVCache,
    can_trim_prompt_cache,
    trim_prompt_cache,
)

from kvstore.serve import ramtrie


def _cache(n: int, *, rotating: bool = False):
    c = RotatingKVCache(max_size=8) if rotating else KVCache()
    if n:
        kv = mx.arange(n, dtype=mx.float32).reshape(1, 1, n, 1)
        c.update_and_fetch(kv, kv)
    return [c]


def _prompts(rng: random.Random, count: int):
    """Prompts that share prefixes of many lengths (a few system prompts, turns
    after them, some cut short), with one token in common at most by chance."""
    systems = [
        [rng.randrange(50) for _ in range(rng.randrange(1, 30))] for _ in range(3)
    ]
    out = []
    for _ in range(count):
        p = list(rng.choice(systems))
        p += [rng.randrange(50) for _ in range(rng.randrange(0, 40))]
        if out and rng.random() < 0.3:
            p = list(rng.choice(out))[: rng.randrange(1, 40)]
        out.append(p)
    return out


@pytest.mark.parametrize("seed", range(12))
def test_the_walk_gives_what_mlx_lms_lookup_gives(seed):
    rng = random.Random(seed)
    rotating = seed % 4 == 3  # a cache type that cannot always be trimmed
    lru = LRUPromptCache(max_size=1000)
    cached = _prompts(rng, 25) + [[7], [7, 8, 9]]  # one-token prompts too
    for p in cached:
        lru.insert_cache("m", p, _cache(len(p), rotating=rotating))
    assert ramtrie.walkable(lru._trie)
    searched = SimpleNamespace(search=lru._trie.search, get=lru._trie.get)
    assert not ramtrie.walkable(searched)
    queries = _prompts(rng, 60) + [[], [999], [999, 1], [7], [7, 8], [7, 5]]
    # Cached prompts cut short, and cut short then going elsewhere.
    queries += [p[: rng.randrange(1, len(p) + 1)] for p in cached]
    queries += [p[: rng.randrange(1, len(p) + 1)] + [998] for p in cached]
    for q in queries:
        want_cache, want_rest = lru.fetch_nearest_cache("m", q)
        got_cache, got_rest = ramtrie.fetch_nearest(
            lru._trie, "m", q, can_trim_prompt_cache, trim_prompt_cache
        )
        assert got_rest == want_rest, q
        held = len(q) - len(want_rest) if want_cache is not None else 0
        assert ramtrie.nearest(lru._trie, "m", q, can_trim_prompt_cache).held == held
        # A trie of another shape is asked through its own search: the same answer.
        assert ramtrie.nearest(searched, "m", q, can_trim_prompt_cache).held == held
        if want_cache is None:
            assert got_cache is None
            continue
        assert got_cache[0].offset == want_cache[0].offset
        k, w = got_cache[0].state[0], want_cache[0].state[0]
        n = min(got_cache[0].offset, k.shape[2])
        assert mx.array_equal(k[..., :n, :], w[..., :n, :]).item()
    assert ramtrie.nearest(lru._trie, "other model", [1, 2], can_trim_prompt_cache) == (
        None,
        0,
        0,
    )


def test_the_walk_never_runs_mlx_lms_search(monkeypatch):
    """The quadratic search is not called: the walk reads the trie itself (a prompt
    of 3,000 tokens that leaves the trie after 5, beside cached ones of 3,000)."""
    lru = LRUPromptCache(max_size=10)
    base = list(range(5))
    for i in range(4):
        p = base + [100 + i] + list(range(1000, 3994))
        lru.insert_cache("m", p, _cache(len(p)))

    def refuse(*args, **kwargs):
        raise AssertionError("PromptTrie.search called")

    monkeypatch.setattr(type(lru._trie), "search", refuse)
    q = base + [7] * 2995
    cache, rest = ramtrie.fetch_nearest(
        lru._trie, "m", q, can_trim_prompt_cache, trim_prompt_cache
    )
    assert len(rest) == len(q) - 5 and cache[0].offset == 5
    assert ramtrie.nearest(lru._trie, "m", q, can_trim_prompt_cache).held == 5
    found = ramtrie.match(lru._trie, "m", q)
    assert not found.exact and found.common == 5 and found.longer is not None


@pytest.mark.parametrize("seed", range(6))
def test_match_reports_what_mlx_lms_search_reports(seed):
    """What a deferred save reads of the trie (the prompt itself cached, else how
    far it follows the trie and whether a cached prompt lies below there) is the
    same walked as searched."""
    rng = random.Random(100 + seed)
    lru = LRUPromptCache(max_size=1000)
    cached = _prompts(rng, 25)
    for p in cached:
        lru.insert_cache("m", p, _cache(len(p)))
    trie = lru._trie
    queries = _prompts(rng, 40) + [p[: rng.randrange(1, len(p) + 1)] for p in cached]
    queries += cached
    for q in queries:
        got = ramtrie.match(trie, "m", q)
        want = trie.search("m", q)
        assert got.exact == (want.exact is not None), q
        if got.exact:
            assert got.value is trie.get("m", want.exact)
            continue
        assert got.common == want.common_prefix, q
        assert (got.longer is None) == (want.longer is None), q
        if got.longer is not None:
            assert got.longer_len == len(want.longer), q
