"""Saving until durable, against what the disk does with the same bytes.

The KV is synthetic, of SmolLM2-135M's cache shape (30 layers, 3 KV heads, head dim
64), filled through ``KVCache.update_and_fetch`` as a generate loop fills it (so the
buffers are longer than the tokens and a node's slices are strided views, as in real
use); a tiny random-weight llama with that layout stands in for the model. Cases,
rotated every repeat, each starting after ``os.sync()`` (so no case pays for the
previous one's dirty pages):

* ``kvstore``: ``save(tokens, cache)`` then ``flush()`` into a fresh store directory:
  every node file written, fsynced, linked, its directory fsynced, and the index
  committed. The time until ``flush`` returns is "save until durable".
* ``one file``: the same number of bytes (the store's chunk files, summed) written
  from memory to one new file with ``os.write``, then one ``fsync``.
* ``per-node files`` (optional): the same bytes as that many files as kvstore
  writes, each fsynced in turn (the cost of one durable file per node, whatever
  the writer).

Used by ``kvstore bench`` (section ``durable``) and ``tools/bench_save.py``.
"""

import os
import shutil
import time
from typing import Dict, List, Tuple

import numpy as np

from kvstore.bench.cases import STANDIN, standin_model
from kvstore.bench.kvfiles import kv_bytes_per_token

from ..platform import fsutil
from ..store import KVStore

TARGET = 0.8  # save until durable >= this x the speed of one file + one fsync
WRITE_PIECE = 8 << 20  # bytes per os.write of the disk cases


def filled_cache(n: int, dtype: str, *, seed: int) -> list:
    """KVCache layers of ``n`` tokens of random KV, filled as generate fills them."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    rng = np.random.default_rng(seed)
    shape = (1, STANDIN["heads"], n, STANDIN["head_dim"])
    pool = [
        mx.array(rng.standard_normal(shape, dtype=np.float32)).astype(
            getattr(mx, dtype)
        )
        for _ in range(4)
    ]
    cache = []
    for i in range(STANDIN["layers"]):
        c = KVCache()
        c.update_and_fetch(pool[(2 * i) % 4], pool[(2 * i + 1) % 4])
        mx.eval(c.keys, c.values)
        cache.append(c)
    return cache


def _time_kvstore(path, model, tokens, cache, *, chunk_tokens, ram_bytes):
    """(seconds until durable, seconds until ``save`` returned, each file's bytes)."""
    shutil.rmtree(path, ignore_errors=True)
    store = KVStore(path, model, chunk_tokens=chunk_tokens, ram_bytes=ram_bytes)
    try:
        os.sync()
        t0 = time.perf_counter()
        store.save(tokens, cache)
        t1 = time.perf_counter()
        store.flush()
        t2 = time.perf_counter()
        stats = store.stats()
    finally:
        store.close()
    if stats["writes_failed"] or stats["nodes_written"] == 0:
        raise RuntimeError(f"the save failed: {stats}")
    sizes = [
        os.path.getsize(os.path.join(d, f))
        for d, _, fs in os.walk(path)
        for f in fs
        if f.endswith(".safetensors")
    ]
    if sum(sizes) != stats["bytes_written"]:
        raise RuntimeError(
            f"{sum(sizes)} bytes in files, {stats['bytes_written']} written"
        )
    shutil.rmtree(path)
    return t2 - t0, t1 - t0, sizes


def _time_files(paths: List[str], sizes: List[int], data: memoryview) -> float:
    """Seconds to write ``sizes`` bytes of ``data`` to each new path, each fsynced."""
    os.sync()
    t0 = time.perf_counter()
    for path, size in zip(paths, sizes):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            for i in range(0, size, WRITE_PIECE):
                view = data[i : min(size, i + WRITE_PIECE)]
                while view:
                    view = view[os.write(fd, view) :]
            fsutil.fsync(fd)
        finally:
            os.close(fd)
    dt = time.perf_counter() - t0
    for path in paths:
        os.unlink(path)
    return dt


def bench_durable(
    tokens: int,
    *,
    repeats: int,
    chunk_tokens: int,
    tmp: str,
    dtype: str = "float16",
    ram_bytes: int = 0,
    per_node_files: bool = True,
    progress: bool = True,
) -> Dict:
    """Every sample of ``save`` + ``flush`` against one file with one fsync (and
    against one fsynced file per node); after one warm-up save, not counted."""
    from tqdm import tqdm

    model = standin_model(dtype)
    cache = filled_cache(tokens, dtype, seed=1)
    prompt = np.random.default_rng(2).integers(1, STANDIN["vocab"], size=tokens)
    prompt = prompt.tolist()
    base = os.path.join(tmp, "durable")
    os.makedirs(base, exist_ok=True)
    store = os.path.join(base, "store")
    kw = {"chunk_tokens": chunk_tokens, "ram_bytes": ram_bytes}
    _, _, sizes = _time_kvstore(store, model, prompt, cache, **kw)  # warm-up
    total = sum(sizes)
    data = memoryview(np.random.default_rng(3).bytes(total))
    out = {
        "tokens": tokens,
        "dtype": dtype,
        "kv_bytes": tokens * kv_bytes_per_token(dtype),
        "chunk_tokens": chunk_tokens,
        "ram_bytes": ram_bytes,
        "files": len(sizes),
        "files_bytes": total,
        "kvstore_s": [],
        "save_returned_s": [],
        "one_file_s": [],
        "per_node_files_s": [],
    }
    order = ["kvstore", "one_file"] + (["per_node_files"] if per_node_files else [])
    for r in tqdm(
        range(repeats), desc="durable saves", leave=False, disable=not progress
    ):
        for case in order[r % len(order) :] + order[: r % len(order)]:
            if case == "kvstore":
                durable, returned, got = _time_kvstore(
                    store, model, prompt, cache, **kw
                )
                if sum(got) != total:
                    raise RuntimeError(f"saves wrote {sum(got)} and {total} bytes")
                out["kvstore_s"].append(durable)
                out["save_returned_s"].append(returned)
            elif case == "one_file":
                one = [os.path.join(base, "one-file")]
                out["one_file_s"].append(_time_files(one, [total], data))
            else:
                paths = [os.path.join(base, f"{i}.bin") for i in range(len(sizes))]
                out["per_node_files_s"].append(_time_files(paths, sizes, data))
    shutil.rmtree(base, ignore_errors=True)
    return out


def speed_ratio(d: Dict) -> Tuple[float, List[float]]:
    """kvstore's speed over one file's (ratio of the medians), and per repeat."""
    import statistics

    ratio = statistics.median(d["one_file_s"]) / statistics.median(d["kvstore_s"])
    return ratio, [o / k for o, k in zip(d["one_file_s"], d["kvstore_s"])]
