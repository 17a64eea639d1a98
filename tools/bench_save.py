#!/usr/bin/env python
"""Save until durable vs the disk's own speed: the same bytes as one file, one fsync.

Usage::

    python tools/bench_save.py [--tokens 32768] [--repeats 5] [--dtype float16]
                               [--ram-bytes 0] [--dir DIR] [--json OUT]

The KV is synthetic, of SmolLM2-135M's cache shape (30 layers, 3 KV heads, head dim
64), filled through ``KVCache.update_and_fetch`` as a generate loop fills it (so the
buffers are longer than the tokens and a node's slices are strided views, as in real
use); a tiny random-weight llama with that layout stands in for the model. Cases,
alternating in every repeat, each starting after ``os.sync()`` (so no case pays for
the previous one's dirty pages):

* ``kvstore``: ``store.save(tokens, cache)`` then ``store.flush()`` into a fresh store
  directory: every node file written, fsynced, linked, its directory fsynced, and the
  index committed. The time until ``flush`` returns is "save until durable".
* ``one file``: the same number of bytes (the store's chunk files, summed) written
  from memory to one new file with ``os.write``, then one ``fsync``.

The ratio is one file's time / kvstore's (1.0: kvstore saves at the disk's one-file
speed), per repeat and as the ratio of the medians. Nothing here asserts a time;
pytest never collects tools/.
"""

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache

from kvstore import KVStore, fsutil
from kvstore.bench.models import tiny_model

LAYERS, KV_HEADS, HEAD_DIM = 30, 3, 64  # SmolLM2-135M's KV cache
TARGET = 0.8  # kvstore's save until durable >= this x one file + one fsync


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument(
        "--dtype", choices=["float16", "bfloat16", "float32"], default="float16"
    )
    p.add_argument("--chunk-tokens", type=int, default=256)
    p.add_argument(
        "--ram-bytes",
        type=int,
        default=0,
        help="the store's RAM tier (default 0; KVStore's own default is 512 MiB)",
    )
    p.add_argument("--dir", help="where to write (default: a temp dir under /tmp)")
    p.add_argument("--json", metavar="OUT", help="write every sample to this file")
    args = p.parse_args(argv)
    if args.tokens < 2 or args.repeats < 1 or args.chunk_tokens < 1:
        p.error("--tokens >= 2, --repeats >= 1, --chunk-tokens >= 1")
    return args


def filled_cache(n: int, dtype, seed: int):
    """KVCache layers holding ``n`` tokens of random KV, filled as generate fills them."""
    rng = np.random.default_rng(seed)
    shape = (1, KV_HEADS, n, HEAD_DIM)
    pool = [
        mx.array(rng.standard_normal(shape, dtype=np.float32)).astype(dtype)
        for _ in range(4)
    ]
    cache = []
    for i in range(LAYERS):
        c = KVCache()
        c.update_and_fetch(pool[(2 * i) % 4], pool[(2 * i + 1) % 4])
        mx.eval(c.keys, c.values)
        cache.append(c)
    return cache


def time_kvstore(root, model, tokens, cache, args, sizes):
    path = os.path.join(root, "store")
    shutil.rmtree(path, ignore_errors=True)
    store = KVStore(
        path, model, chunk_tokens=args.chunk_tokens, ram_bytes=args.ram_bytes
    )
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
    sizes.append(stats["bytes_written"])
    return t2 - t0, t1 - t0


def time_one_file(root, data: memoryview):
    path = os.path.join(root, "one-file")
    if os.path.exists(path):
        os.unlink(path)
    os.sync()
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        view = data
        while view:
            view = view[os.write(fd, view) :]
        fsutil.fsync(fd)
    finally:
        os.close(fd)
    dt = time.perf_counter() - t0
    os.unlink(path)
    return dt


def main(argv=None):
    args = parse_args(argv)
    dtype = getattr(mx, args.dtype)
    model = tiny_model(layers=LAYERS, heads=KV_HEADS, head_dim=HEAD_DIM, dtype=dtype)
    cache = filled_cache(args.tokens, dtype, seed=1)
    tokens = np.random.default_rng(2).integers(0, 60, size=args.tokens).tolist()
    root = tempfile.mkdtemp(prefix="kvstore-bench-save-", dir=args.dir)
    try:
        sizes: list = []
        # Warm-up (not counted): learns the file bytes the baseline must write.
        time_kvstore(root, model, tokens, cache, args, sizes)
        nbytes = sizes[0]
        data = memoryview(np.random.default_rng(3).bytes(nbytes))
        time_one_file(root, data)
        samples = {"kvstore": [], "one file": []}
        returns = []
        for r in range(args.repeats):
            order = ["kvstore", "one file"] if r % 2 == 0 else ["one file", "kvstore"]
            for case in order:
                if case == "kvstore":
                    dt, ret = time_kvstore(root, model, tokens, cache, args, sizes)
                    returns.append(ret)
                else:
                    dt = time_one_file(root, data)
                samples[case].append(dt)
        if len(set(sizes)) != 1:
            raise RuntimeError(
                f"saves wrote different byte counts: {sorted(set(sizes))}"
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)

    med = {k: statistics.median(v) for k, v in samples.items()}
    ratio = med["one file"] / med["kvstore"]
    per_repeat = [o / k for o, k in zip(samples["one file"], samples["kvstore"])]
    print(
        f"{args.tokens} tokens of {args.dtype} KV ({LAYERS}x{KV_HEADS}x{HEAD_DIM}), "
        f"{nbytes / 1e6:.1f} MB in chunk files, chunk_tokens={args.chunk_tokens}, "
        f"ram_bytes={args.ram_bytes}, {args.repeats} repeats, on {platform.node()}"
    )
    print(f"{'case':<10} {'median s':>9} {'GB/s':>6}  samples s")
    for case, xs in samples.items():
        print(
            f"{case:<10} {med[case]:9.3f} {nbytes / med[case] / 1e9:6.3f}  "
            f"{[round(x, 3) for x in xs]}"
        )
    print(f"save() returned in (median) {statistics.median(returns) * 1e3:.1f} ms")
    print(
        f"kvstore / one file speed: {ratio:.2f}x (per repeat "
        f"{[round(x, 2) for x in per_repeat]}) target >= {TARGET}: "
        f"{'PASS' if ratio >= TARGET else 'MISS'}"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "argv": sys.argv,
                    "nbytes": nbytes,
                    "samples": samples,
                    "save_returns": returns,
                    "ratio": ratio,
                    "per_repeat": per_repeat,
                },
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
