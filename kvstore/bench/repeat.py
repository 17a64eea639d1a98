"""Repeated restores in one process: kvstore's ``fetch`` against mlx-lm's
``load_prompt_cache`` of one file of the same KV (SmolLM2-135M's shape), and the
floor (the same bytes as kvstore's node files read with plain ``readinto`` into
fresh buffers), alternating in one process, page cache warm, RAM tier off, memory
freed between restores as a server frees it. Also the cost of the checksum alone:
xxh3 of the same bytes, in memory, as a pass of its own.
"""

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List, Sequence

import mlx.core as mx
import xxhash
from tqdm import tqdm

from kvstore import KVStore
from kvstore.bench.cases import read_floor, standin_model
from kvstore.bench.kvfiles import make_kv_files
from kvstore.bench.measure import (
    run_interleaved,
    time_load_prompt_cache,
    timed_fetch,
    warm_page_cache,
)

LABELS = {
    "kvstore": "kvstore fetch",
    "load_prompt_cache": "mlx-lm load_prompt_cache, 1 file",
    "floor": "floor: readinto fresh buffers",  # allocated on a thread of their own
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
) -> List[Dict]:
    """One row per (dtype, length): every case's samples, faults and CPU time."""
    rows = []
    todo = [(d, n) for d in dtypes for n in lengths]
    for dtype, n in tqdm(todo, desc="repeated restores", unit="size", leave=False):
        kv = make_kv_files(tmp, dtype, n, chunk_tokens=chunk_tokens, seed=n)
        floor_thread = ThreadPoolExecutor(1)
        store = KVStore(
            kv.store, standin_model(dtype), chunk_tokens=chunk_tokens, ram_bytes=0
        )
        try:
            warm_page_cache(kv.files())
            phases = []

            def fetch() -> float:
                p, cache = timed_fetch(store, kv.query, expect=kv.tokens)
                phases.append(p)
                return p.total

            def floor() -> float:
                # On a thread of its own, as kvstore allocates: glibc gives memory
                # freed on the main thread back to the OS, and the floor would pay
                # page faults that are not the copy's.
                t0 = time.perf_counter()
                floor_thread.submit(read_floor, kv.node_files).result()
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
            hash_s = [_hash_alone(read_floor(kv.node_files)) for _ in range(3)]
            rows.append(
                {
                    "dtype": dtype,
                    "tokens": n,
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
            floor_thread.shutdown()
            store.close()
            kv.remove()
            mx.clear_cache()
    return rows
