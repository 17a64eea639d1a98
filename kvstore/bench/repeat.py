"""Repeated restores in one process: kvstore's ``fetch`` against mlx-lm's
``load_prompt_cache`` of one file of the same KV (SmolLM2-135M's shape), and the
floor (the same bytes as kvstore's node files read with plain ``readinto`` into
buffers read into before, on as many threads as a fetch reads with: the copy alone,
which no reader of these bytes can beat), alternating in one process, page cache
warm, RAM tier off, memory freed between restores as a server frees it. Also the
cost of the checksum alone: xxh3 of the same bytes, in memory, as a pass of its own.

``recycled``: the same cases with MLX's buffer cache raised above the KV size, so
freed arrays are reused and no restore pays page faults for new memory: what is left
is the cost of the read path itself (section ``recycled``).
"""

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List, Sequence

import mlx.core as mx
import xxhash
from tqdm import tqdm

from kvstore.bench.cases import FLOOR_THREADS, read_floor, read_into, standin_model
from kvstore.bench.kvfiles import make_kv_files
from kvstore.bench.measure import (
    run_interleaved,
    time_load_prompt_cache,
    timed_fetch,
    warm_page_cache,
)

from ..store import KVStore

LABELS = {
    "kvstore": "kvstore fetch",
    "load_prompt_cache": "mlx-lm load_prompt_cache, 1 file",
    "floor": f"floor: readinto reused buffers, {FLOOR_THREADS} threads",
}


def _hash_alone(buffers, piece: int = 512 << 10) -> float:
    """Seconds to xxh3 ``buffers`` (already in memory), in cache-sized pieces."""
    t0 = time.perf_counter()
    for buf in buffers:
        view = memoryview(buf)
        h = xxhash.xxh3_64()
        for i in range(0, len(view), piece):
            h.update(view[i : i + piece])
        h.intdigest()
    return time.perf_counter() - t0


def bench_repeat(
    dtypes: Sequence[str],
    lengths: Sequence[int],
    *,
    repeats: int,
    chunk_tokens: int,
    tmp: str,
    recycled: bool = False,
) -> List[Dict]:
    """One row per (dtype, length): every case's samples, faults and CPU time."""
    rows = []
    todo = [(d, n) for d in dtypes for n in lengths]
    desc = "recycled restores" if recycled else "repeated restores"
    for dtype, n in tqdm(todo, desc=desc, unit="size", leave=False):
        kv = make_kv_files(tmp, dtype, n, chunk_tokens=chunk_tokens, seed=n)
        floor_pool = ThreadPoolExecutor(FLOOR_THREADS)
        store = KVStore(
            kv.store, standin_model(dtype), chunk_tokens=chunk_tokens, ram_bytes=0
        )
        limit, raised = None, 4 * kv.kv_bytes + (256 << 20)
        try:
            if recycled:  # room for every case's freed arrays
                limit = mx.set_cache_limit(raised)
            warm_page_cache(kv.files())
            phases = []

            def fetch() -> float:
                p, cache = timed_fetch(store, kv.query, expect=kv.tokens)
                phases.append(p)
                return p.total

            # The same buffers every time: no new memory, only the copy. What any
            # reader of these bytes pays at least, whatever its allocator recycles.
            reused = read_floor(kv.node_files)

            def floor() -> float:
                t0 = time.perf_counter()
                read_into(kv.node_files, reused, pool=floor_pool)
                return time.perf_counter() - t0

            cases = {
                "kvstore": fetch,
                "load_prompt_cache": lambda: time_load_prompt_cache(kv.one_file),
                "floor": floor,
            }
            for run in cases.values():  # untimed: the first of each allocates anew
                run()
            phases.clear()
            runs = run_interleaved(cases, repeats)
            hash_s = [_hash_alone(reused) for _ in range(3)]  # the files' bytes
            rows.append(
                {
                    "dtype": dtype,
                    "tokens": n,
                    "memory": "recycled" if recycled else "freed",
                    "mlx_cache_limit": raised if recycled else None,
                    "kv_bytes": kv.kv_bytes,
                    "node_files": len(kv.node_files),
                    "hash_alone_s": hash_s,
                    "cases": {
                        name: {
                            "label": LABELS[name],
                            "restore_s": runs.times[name],
                            "faults": runs.faults[name],
                            "user_s": runs.user[name],
                            "sys_s": runs.system[name],
                        }
                        for name in cases
                    },
                    "kvstore_phases": {
                        "lookup_s": [p.lookup for p in phases],
                        "read_s": [p.read for p in phases],
                        "assemble_s": [p.assemble for p in phases],
                    },
                }
            )
        finally:
            floor_pool.shutdown()
            store.close()
            kv.remove()
            if limit is not None:
                mx.set_cache_limit(limit)
            mx.clear_cache()
    return rows
