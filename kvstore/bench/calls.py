"""What a caller waits for in the calls that must stay cheap: a fetch that finds
nothing, the hash chain of a long prompt, and ``save`` handing its write to the
background writer.

* ``miss``: ``KVStore.fetch`` of a long prompt that shares nothing with the store (the
  token list validated, the first chunk hashed and looked up, an empty cache made),
  with the parts that do not depend on the store timed alone: ``as_token_array`` and
  mlx-lm's ``make_prompt_cache``.
* ``hash``: ``as_token_array`` + ``split_spans`` + ``chain_hashes`` of a prompt given
  as a Python list, as a fetch or save of that prompt computes them.
* ``save``: the time until ``save`` returns against the time until ``flush`` returns
  after it (the write it queued), in one store with KVStore's default RAM tier, a new
  prompt each repeat; the KV is filled through ``update_and_fetch`` as generate fills
  it.

The KV and the stand-in model have SmolLM2-135M's cache shape (see
:mod:`kvstore.bench.cases`). Used by ``kvstore bench`` (sections ``miss``, ``hash``
and ``save``).
"""

import os
import shutil
import time
from typing import Dict, List

import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from kvstore.bench.cases import STANDIN, standin_model
from kvstore.bench.durable import filled_cache
from kvstore.bench.kvfiles import kv_bytes_per_token
from kvstore.bench.measure import med

from ..disk.chunking import as_token_array, chain_hashes, root_hash, split_spans
from ..store import KVStore

TARGET_MISS_S = 0.002  # a fetch that finds nothing, 32K-token prompt
TARGET_HASH_S = 0.005  # the hash chain of 100K tokens
TARGET_SAVE_RATIO = 0.05  # save() return / (return + flush)


def _prompt(n: int, rng, avoid_first=()) -> List[int]:
    """``n`` random token ids whose first is none of ``avoid_first`` (a new prefix)."""
    tokens = rng.integers(1, STANDIN["vocab"], size=n).tolist()
    while tokens[0] in avoid_first:
        tokens[0] = int(rng.integers(1, STANDIN["vocab"]))
    return tokens


def bench_miss(
    tokens: int, *, calls: int, chunk_tokens: int, tmp: str, dtype: str = "float16"
) -> Dict:
    """Every call's seconds of a fetch that restores nothing, from a store holding one
    other prompt of ``chunk_tokens`` * 2 tokens; then the parts, timed alone."""
    model = standin_model(dtype)
    rng = np.random.default_rng(4)
    path = os.path.join(tmp, "miss-store")
    stored = _prompt(2 * chunk_tokens, rng)
    query = _prompt(tokens, rng, avoid_first={stored[0]})
    store = KVStore(path, model, chunk_tokens=chunk_tokens, ram_bytes=0)
    try:
        store.save(stored, filled_cache(len(stored), dtype, seed=5))
        store.flush()
        times = []
        for i in range(calls + 1):  # the first, untimed: imports and first lookups
            t0 = time.perf_counter()
            _, n = store.fetch(query)
            if i:
                times.append(time.perf_counter() - t0)
            if n != 0:
                raise RuntimeError(f"the miss prompt restored {n} tokens")
    finally:
        store.close()
        shutil.rmtree(path, ignore_errors=True)
    to_array, make_cache = [], []
    for _ in range(calls):
        t0 = time.perf_counter()
        as_token_array(query)
        t1 = time.perf_counter()
        make_prompt_cache(model)
        to_array.append(t1 - t0)
        make_cache.append(time.perf_counter() - t1)
    return {
        "tokens": tokens,
        "calls": calls,
        "fetch_s": times,
        "as_token_array_s": to_array,
        "make_prompt_cache_s": make_cache,
    }


def bench_hash(tokens: int, *, calls: int, chunk_tokens: int) -> Dict:
    """Every call's seconds of the token list's conversion and its hash chain."""
    prompt = np.random.default_rng(6).integers(0, STANDIN["vocab"], size=tokens)
    prompt = prompt.tolist()
    root = root_hash(b"\x00" * 16)
    to_array, chain = [], []
    for _ in range(calls):
        t0 = time.perf_counter()
        arr = as_token_array(prompt)
        t1 = time.perf_counter()
        chain_hashes(root, arr, split_spans(0, tokens, chunk_tokens))
        t2 = time.perf_counter()
        to_array.append(t1 - t0)
        chain.append(t2 - t1)
    return {
        "tokens": tokens,
        "calls": calls,
        "spans": len(split_spans(0, tokens, chunk_tokens)),
        "chunk_tokens": chunk_tokens,
        "as_token_array_s": to_array,
        "chain_hashes_s": chain,
        "total_s": [a + c for a, c in zip(to_array, chain)],
    }


def bench_save(
    tokens: int, *, repeats: int, chunk_tokens: int, tmp: str, dtype: str = "float16"
) -> Dict:
    """Every repeat's seconds until ``save`` returned and until ``flush`` returned
    after it; one untimed warm-up save first."""
    model = standin_model(dtype)
    cache = filled_cache(tokens, dtype, seed=1)
    rng = np.random.default_rng(7)
    path = os.path.join(tmp, "save-store")
    store = KVStore(path, model, chunk_tokens=chunk_tokens)  # default RAM tier
    firsts = set()
    returned, flushed, nodes = [], [], []
    try:
        for i in range(repeats + 1):
            prompt = _prompt(tokens, rng, avoid_first=firsts)
            firsts.add(prompt[0])
            t0 = time.perf_counter()
            added = store.save(prompt, cache)
            t1 = time.perf_counter()
            store.flush()
            t2 = time.perf_counter()
            if i:
                returned.append(t1 - t0)
                flushed.append(t2 - t1)
                nodes.append(added)
        stats = store.stats()
    finally:
        store.close()
        shutil.rmtree(path, ignore_errors=True)
    if stats["writes_failed"] or stats["writes_dropped"]:
        raise RuntimeError(f"saves failed or were dropped: {stats}")
    return {
        "tokens": tokens,
        "dtype": dtype,
        "kv_bytes": tokens * kv_bytes_per_token(dtype),
        "chunk_tokens": chunk_tokens,
        "nodes_per_save": nodes,
        "save_return_s": returned,
        "flush_s": flushed,
    }


def save_ratio(s: Dict) -> float:
    """The share of a save's work that the caller waits for (ratio of the medians)."""
    r = med(s["save_return_s"])
    return r / (r + med(s["flush_s"]))
