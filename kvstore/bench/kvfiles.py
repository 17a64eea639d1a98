"""The same synthetic KV twice on disk: in a kvstore store and in one mlx-lm
``save_prompt_cache`` file, for the restore comparisons (SmolLM2-135M's KV shape in
any dtype, no model run)."""

import os
import shutil
from dataclasses import dataclass
from typing import List

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import save_prompt_cache

from kvstore.bench.cases import STANDIN, standin_model
from kvstore.bench.measure import files_under, synthetic_cache

from ..store import KVStore


@dataclass
class KVFiles:
    """Where one size and dtype of synthetic KV is stored, and how to restore it."""

    dtype: str
    tokens: int
    kv_bytes: int
    store: str  # the store's directory
    one_file: str  # the same KV as one save_prompt_cache file
    node_files: List[str]  # the store's chunk files (the bytes a restore reads)
    query: List[int]  # the stored tokens plus one: restores all of them

    def files(self) -> List[str]:
        """Every file a case reads, for warming the page cache."""
        return (
            self.node_files
            + files_under(os.path.join(self.store, "index"))
            + [self.one_file]
        )

    def remove(self) -> None:
        shutil.rmtree(self.store, ignore_errors=True)
        if os.path.exists(self.one_file):
            os.unlink(self.one_file)


def kv_bytes_per_token(dtype: str) -> int:
    return (
        2
        * STANDIN["layers"]
        * STANDIN["heads"]
        * STANDIN["head_dim"]
        * (getattr(mx, dtype).size)
    )


def make_kv_files(
    tmp: str, dtype: str, n: int, *, chunk_tokens: int, seed: int
) -> KVFiles:
    """Write ``n`` tokens of random KV of the stand-in model's shape, in ``dtype``,
    to a new store under ``tmp`` and to one mlx-lm file."""
    model = standin_model(dtype)
    path = os.path.join(tmp, f"kv-{dtype}-{n}")
    one_file = os.path.join(tmp, f"kv-{dtype}-{n}.safetensors")
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, STANDIN["vocab"], size=n).tolist()
    with KVStore(path, model, chunk_tokens=chunk_tokens, ram_bytes=0) as store:
        src = synthetic_cache(store.layout, n, seed=seed)
        store.save(tokens, src)
        store.flush()
    save_prompt_cache(one_file, src)
    del src
    mx.clear_cache()
    return KVFiles(
        dtype=dtype,
        tokens=n,
        kv_bytes=n * kv_bytes_per_token(dtype),
        store=path,
        one_file=one_file,
        node_files=files_under(os.path.join(path, "blobs")),
        query=tokens + [int(rng.integers(1, STANDIN["vocab"]))],
    )
