"""Opening a store: ``KVStore(path, model, tokenizer)`` for a model the store has seen
before (known) and for one it has not (new: the layout is probed, one forward pass).

Each sample is a fresh child process that loads the model (not timed) and then times
the open, as a restarted server does; known and new alternate. The split of a known
open (weights digest, model key, index, the rest) is measured in this process. Big
models: synthetic llamas of about that many GB of float16 weights (zeros: hashing
speed does not depend on the values), their weights digest and known/new open timed
in this process (memory: that many GB).

Used by ``kvstore bench`` (section ``open``) and ``tools/bench_open.py``.
"""

import collections
import os
import shutil
import time
from typing import Dict, Sequence

from kvstore.bench import child

from ..store import KVStore

TARGET_S = 0.050  # opening for a known model
LABELS = {"known": "model seen before", "new": "model never seen (new store)"}


def bench_open(
    model,
    tokenizer,
    *,
    model_name,
    repeats: int,
    tmp: str,
    weights_gb: Sequence[float] = (),
    progress: bool = True,
) -> Dict:
    """Every child's open time (and CPU) for the known and the new model, the split
    of a known open, and the big models' cases."""
    from tqdm import tqdm

    known = os.path.join(tmp, "open-known")
    KVStore(known, model, tokenizer, ram_bytes=0).close()  # the model is now seen
    cases = {name: {"label": label, "samples": []} for name, label in LABELS.items()}
    names = list(cases)
    for r in tqdm(range(repeats), desc="store open", leave=False, disable=not progress):
        for name in names[r % 2 :] + names[: r % 2]:
            path = known if name == "known" else os.path.join(tmp, f"open-new-{r}")
            spec = {"case": "open", "model": model_name, "store": path}
            cases[name]["samples"].append(child.spawn(spec, tmp))
            if name == "new":
                shutil.rmtree(path, ignore_errors=True)
    split = split_known_open(known, model, tokenizer)
    shutil.rmtree(known, ignore_errors=True)
    big = [big_model_case(gb, tmp) for gb in weights_gb]
    return {"model": model_name, "cases": cases, "split_ms": split, "big": big}


def split_known_open(store: str, model, tok) -> dict:
    """Where a known model's open goes (in this process, after one warm-up open)."""
    from kvstore import store as store_module

    from ..disk import index, namespace, reservations

    times = collections.Counter()
    patched = []

    def wrap(obj, name, label):
        real = getattr(obj, name)

        def f(*a, **k):
            t0 = time.perf_counter()
            try:
                return real(*a, **k)
            finally:
                times[label] += time.perf_counter() - t0

        setattr(obj, name, f)
        patched.append((obj, name, real))

    KVStore(store, model, tok).close()
    wrap(namespace, "weights_digest", "weights digest")
    wrap(namespace, "model_key", "model key")
    wrap(namespace, "_known", "namespace record + layout")
    wrap(index.Index, "__init__", "index (LMDB) open")
    wrap(reservations, "drop_stale", "stale reservations")
    wrap(store_module, "open_namespace", "open_namespace")
    try:
        t0 = time.perf_counter()
        KVStore(store, model, tok).close()
        total = time.perf_counter() - t0
    finally:
        for obj, name, real in patched:
            setattr(obj, name, real)
    out = {k: round(v * 1e3, 2) for k, v in times.items()}
    out["total"] = round(total * 1e3, 2)
    return out


def synthetic_llama(gb: float):
    """A llama with about ``gb`` GB of float16 weights, all zeros."""
    import mlx.core as mx
    from mlx.utils import tree_map
    from mlx_lm.models import llama

    per_layer = 2 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336)
    embed = 2 * 2 * 32000 * 4096
    layers = max(1, round((gb * 1e9 - embed) / per_layer))
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=4096,
        num_hidden_layers=layers,
        intermediate_size=14336,
        num_attention_heads=32,
        num_key_value_heads=8,
        rms_norm_eps=1e-5,
        vocab_size=32000,
        tie_word_embeddings=False,
    )
    model = llama.Model(args)  # lazy: its random init is never evaluated
    model.update(tree_map(lambda p: mx.zeros(p.shape, mx.float16), model.parameters()))
    mx.eval(model.parameters())
    return model


def big_model_case(gb: float, root: str) -> dict:
    """Weights digest, new and known open of a synthetic llama of about ``gb`` GB."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from ..disk import namespace

    model = synthetic_llama(gb)
    params = tree_flatten(model.parameters())
    nbytes = sum(p.nbytes for _, p in params)
    digests = []
    for _ in range(3):
        t0 = time.perf_counter()
        namespace.weights_digest(model)
        digests.append(time.perf_counter() - t0)
    store = os.path.join(root, f"big-{gb}")
    t0 = time.perf_counter()
    KVStore(store, model).close()  # new: probed (one token through every layer)
    new = time.perf_counter() - t0
    known = []
    for _ in range(3):
        t0 = time.perf_counter()
        KVStore(store, model).close()
        known.append(time.perf_counter() - t0)
    full = nbytes <= namespace.FULL_HASH_LIMIT  # above it, samples of each tensor
    shutil.rmtree(store, ignore_errors=True)
    out = {
        "gb": gb,
        "weights_bytes": nbytes,
        "tensors": len(params),
        "all_hashed": full,
        "weights_digest_s": digests,
        "new_open_s": new,
        "known_open_s": known,
    }
    del model, params
    mx.clear_cache()
    return out
