"""Scale: open time and fetch-miss / fetch-hit lookup time against the number of stored
chunks. The index must be opened and walked, never scanned, so these stay flat.

The store is filled fast with a tiny model (one layer, one KV head of 8 dims) and
4-token chunks through ``KVStore.save`` itself: real chunk files and index records,
no model run.
"""

import os
import shutil
import time
from typing import Dict, List, Sequence

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache
from tqdm import tqdm

from kvstore.bench.measure import med, timed_fetch
from kvstore.bench.models import tiny_model

from ..store import KVStore

CHUNK = 4  # tokens per chunk: many nodes from little KV
PER_PROMPT = 100  # chunks per saved prompt (one writer job and LMDB commit each)
HIT_CHUNKS = 10  # a hit restores this many chunks at every scale
CALLS = 200  # lookups per scale, over all rounds
OPENS_PER_ROUND = 3
MISS_TOKEN = 0  # no stored prompt starts with it


def _populate(store, count: int, rng) -> float:
    """Save prompts until the store holds ``count`` chunks; returns the seconds taken."""
    kv = mx.array(rng.random((1, 1, PER_PROMPT * CHUNK, 8), dtype=np.float32))
    kv = kv.astype(mx.float16)
    t0 = time.perf_counter()
    left, i = count, 0
    with tqdm(total=count, desc=f"filling {count:,} chunks", leave=False) as bar:
        while left > 0:
            chunks = min(PER_PROMPT, left)
            ntok = chunks * CHUNK
            tokens = [1 + i] + rng.integers(1, 30000, size=ntok - 1).tolist()
            cache = KVCache()
            cache.state = (kv[:, :, :ntok, :], kv[:, :, :ntok, :], ntok)
            store.save(tokens, [cache])
            left -= chunks
            i += 1
            bar.update(chunks)
            if i % 50 == 0:
                store.flush()  # keep the writer's queue (and memory) short
        store.flush()
    return time.perf_counter() - t0


def _fill(count: int, model, *, tmp: str, seed: int) -> Dict:
    path = os.path.join(tmp, f"scale-{count}")
    store = KVStore(path, model, chunk_tokens=CHUNK, ram_bytes=0)
    fill_s = _populate(store, count, np.random.default_rng(seed))
    nodes = store.stats()["nodes"]
    store.close()
    hit = _hit_query(count, seed)
    return {"path": path, "chunks": nodes, "fill_s": fill_s, "hit": hit}


def _time_open(row: Dict, model) -> None:
    t0 = time.perf_counter()
    store = KVStore(row["path"], model, chunk_tokens=CHUNK, ram_bytes=0)
    row["open_s"].append(time.perf_counter() - t0)
    store.close()


def _time_lookups(row: Dict, model, calls: int) -> None:
    """``calls`` fetch hits and misses, alternating; medians appended to ``row``."""
    store = KVStore(row["path"], model, chunk_tokens=CHUNK, ram_bytes=0)
    hit = row["hit"]
    miss = [MISS_TOKEN] + hit[1:]
    timed_fetch(store, hit, expect=len(hit) - 1)  # untimed warm-up
    totals, lookups, misses = [], [], []
    for _ in range(calls):
        phases, _ = timed_fetch(store, hit, expect=len(hit) - 1)
        totals.append(phases.total)
        lookups.append(phases.lookup)
        misses.append(timed_fetch(store, miss, expect=0)[0].total)
    store.close()
    row["hit_total_s"].append(med(totals))
    row["hit_lookup_s"].append(med(lookups))
    row["miss_s"].append(med(misses))


def _hit_query(count: int, seed: int) -> List[int]:
    """The first HIT_CHUNKS chunks of the first saved prompt plus one new token: the
    same prompt at every scale, since the first prompt's tokens depend only on ``seed``.
    """
    rng = np.random.default_rng(seed)
    rng.random((1, 1, PER_PROMPT * CHUNK, 8), dtype=np.float32)  # as _populate
    ntok = min(PER_PROMPT, count) * CHUNK
    tokens = [1] + rng.integers(1, 30000, size=ntok - 1).tolist()
    return tokens[: HIT_CHUNKS * CHUNK] + [30001]


def bench_scale(counts: Sequence[int], *, repeats: int, tmp: str) -> List[Dict]:
    """Fill one store per count, then time them in rotated rounds: a shared, noisy
    machine drifts, so no scale is timed only at its own moment."""
    model = tiny_model()
    rows = [_fill(c, model, tmp=tmp, seed=7) for c in counts]
    for row in rows:
        row.update(open_s=[], hit_total_s=[], hit_lookup_s=[], miss_s=[])
    rounds = max(3, 2 * repeats + 1)
    for r in tqdm(range(rounds), desc="scale: open, lookups", leave=False):
        order = rows[r % len(rows) :] + rows[: r % len(rows)]
        for row in order:
            for _ in range(OPENS_PER_ROUND):
                _time_open(row, model)
        for row in order:
            _time_lookups(row, model, CALLS // rounds + 1)
    for row in rows:
        shutil.rmtree(row.pop("path"), ignore_errors=True)
        row["hit_tokens"] = len(row.pop("hit")) - 1
    return rows
