#!/usr/bin/env python
"""Cost of opening chunk files without following links below the store.

Usage::

    python tools/bench_open_beneath.py [--tokens 4096] [--chunk-tokens 64]
                                       [--repeats 40]

Reads open each node file relative to directory descriptors, every component with
``O_NOFOLLOW`` (``fsutil.open_regular_beneath``: four opens), where one open of the
whole path would follow a symlinked ``blobs/<ns>/`` out of the store. This times
``fetch`` (warm page cache, RAM tier off) both ways, alternating in one process, on
a tiny float16 llama whose nodes are small, so file opens weigh as much as they can:
the worst case. Prints medians, their ratio and every sample; asserts nothing.
"""

import argparse
import os
import statistics
import sys
import tempfile
import time

import mlx.core as mx

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from conftest import compute_cache, random_tokens, tiny_llama  # noqa: E402

from kvstore import KVStore
from kvstore.disk.blobs import Blobs
from kvstore.platform import fsutil


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--chunk-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=40)
    args = p.parse_args()
    model = tiny_llama(0, layers=4, hidden=128, dtype=mx.float16)
    tokens = random_tokens(args.tokens, 1)
    beneath = Blobs.open_file

    def whole_path(self, ns, h, part=""):
        return fsutil.open_regular(self.path(ns, h, part))

    cases = (("beneath", beneath), ("path", whole_path))
    samples = {name: [] for name, _ in cases}
    with tempfile.TemporaryDirectory() as tmp:
        with KVStore(
            os.path.join(tmp, "s"), model, chunk_tokens=args.chunk_tokens, ram_bytes=0
        ) as store:
            store.save(tokens, compute_cache(model, tokens))
            store.flush()
            for i in range(args.repeats + 1):  # the first round warms up
                for name, fn in cases[:: 1 if i % 2 else -1]:
                    Blobs.open_file = fn
                    tic = time.perf_counter()
                    cache, n = store.fetch(tokens + [1])
                    mx.eval([c.state for c in cache])
                    if i:
                        samples[name].append((time.perf_counter() - tic) * 1e3)
                    assert n == len(tokens)
            Blobs.open_file = beneath
    med = {k: statistics.median(v) for k, v in samples.items()}
    nodes = args.tokens // args.chunk_tokens
    print(
        f"fetch of {args.tokens} tokens in {nodes} nodes: beneath {med['beneath']:.3f} "
        f"ms, whole path {med['path']:.3f} ms, ratio {med['beneath'] / med['path']:.3f}"
    )
    for name, values in samples.items():
        print(name, " ".join(f"{v:.2f}" for v in values))


if __name__ == "__main__":
    main()
