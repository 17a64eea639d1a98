"""Saving until durable, against what the disk does with the same bytes.

kvstore: ``save`` of a prompt's synthetic KV (SmolLM2-135M's shape, float16) plus
``flush`` (every node file written, fsynced, linked and indexed), into a new store
each repeat. The disk, in the same run and alternating with it: the same number of
bytes written as one file with one ``fsync``, and as that many files as kvstore
writes, each fsynced (the cost of one durable file per node, whatever the writer).
GB/s are bytes written over seconds; all files are removed after each repeat.
"""

import os
import shutil
import time
from typing import Dict

import numpy as np
from tqdm import tqdm

from kvstore import KVStore
from kvstore.bench.cases import STANDIN, standin_model
from kvstore.bench.kvfiles import kv_bytes_per_token
from kvstore.bench.measure import files_under, synthetic_cache
from kvstore.fsutil import fsync

WRITE_PIECE = 8 << 20  # bytes per os.write of the disk cases


def _write_files(paths, sizes, data: memoryview) -> float:
    """Seconds to write ``sizes`` bytes of ``data`` to each path, each fsynced."""
    t0 = time.perf_counter()
    for path, size in zip(paths, sizes):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            for i in range(0, size, WRITE_PIECE):
                view = data[i : min(size, i + WRITE_PIECE)]
                while view:
                    view = view[os.write(fd, view) :]
            fsync(fd)
        finally:
            os.close(fd)
    return time.perf_counter() - t0


def bench_durable(
    tokens: int, *, repeats: int, chunk_tokens: int, tmp: str, dtype: str = "float16"
) -> Dict:
    """``save`` + ``flush`` against one file with one fsync, and against one fsynced
    file per node; every sample and the bytes written."""
    model = standin_model(dtype)
    rng = np.random.default_rng(tokens)
    base = os.path.join(tmp, "durable")
    os.makedirs(base, exist_ok=True)
    probe = KVStore(os.path.join(base, "probe"), model, chunk_tokens=chunk_tokens)
    src = synthetic_cache(probe.layout, tokens, seed=tokens)
    probe.close()
    shutil.rmtree(os.path.join(base, "probe"))
    out = {
        "tokens": tokens,
        "dtype": dtype,
        "kv_bytes": tokens * kv_bytes_per_token(dtype),
        "kvstore_s": [],
        "one_file_s": [],
        "per_node_files_s": [],
        "files_bytes": None,
        "files": None,
    }
    sizes, data = None, None
    for r in tqdm(range(repeats), desc="durable saves", leave=False):
        order = ["kvstore", "one_file", "per_node_files"]
        for case in order[r % 3 :] + order[: r % 3]:
            if case == "kvstore":  # first in the first repeat: it sets the sizes
                path = os.path.join(base, f"store-{r}")
                prompt = rng.integers(1, STANDIN["vocab"], size=tokens).tolist()
                with KVStore(path, model, chunk_tokens=chunk_tokens, ram_bytes=0) as s:
                    t0 = time.perf_counter()
                    s.save(prompt, src)
                    s.flush()
                    out["kvstore_s"].append(time.perf_counter() - t0)
                sizes = [
                    os.path.getsize(p)
                    for p in files_under(path)
                    if p.endswith(".safetensors")
                ]
                out["files"], out["files_bytes"] = len(sizes), sum(sizes)
                continue
            total = sum(sizes)
            if data is None:
                data = memoryview(np.random.default_rng(1).bytes(total))
            if case == "one_file":
                dest = [os.path.join(base, f"one-{r}.bin")]
                out["one_file_s"].append(_write_files(dest, [total], data))
            else:
                d = os.path.join(base, f"files-{r}")
                os.makedirs(d)
                dest = [os.path.join(d, f"{i}.bin") for i in range(len(sizes))]
                out["per_node_files_s"].append(_write_files(dest, sizes, data))
        for name in os.listdir(base):  # the disk holds one repeat's files at a time
            p = os.path.join(base, name)
            shutil.rmtree(p) if os.path.isdir(p) else os.unlink(p)
    shutil.rmtree(base, ignore_errors=True)
    return out
