#!/usr/bin/env python
"""Time to first token after a disk restore, with and without room in the arrays.

Usage::

    python tools/bench_room.py [--model PATH|default] [--tokens 2048 8192]
                               [--repeats 5]

A restore whose arrays hold exactly the restored tokens makes mlx-lm's ``KVCache``
copy every layer into a larger buffer on the first forward pass; with
``KVStore(restore_room=...)`` (default 2048) the pass writes in place. For each
length, a store holds synthetic KV of the model's shape for the prompt; each case is
``fetch`` of the prompt plus one token (page cache warm, RAM tier off) and the
model's forward pass over that token, both evaluated. The cases alternate on one
store; medians are printed, nothing is asserted. ``--model default`` is
SmolLM2-135M-Instruct (the default when the model is installed under KVSTORE_HOME).
This is a tool, not a test: pytest never collects it
(``tests/test_store.py`` checks the room and that the first pass writes in place).
"""

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import mlx.core as mx
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from kvstore import KVStore  # noqa: E402
from kvstore.bench.measure import synthetic_cache  # noqa: E402
from kvstore.bench.models import load  # noqa: E402


def first_token(store, model, query):
    """``(restore ms, first forward pass ms)`` for ``query``, all but its last token
    restored."""
    t0 = time.perf_counter()
    cache, n = store.fetch(query)
    mx.eval([c.state for c in cache])
    t1 = time.perf_counter()
    if n != len(query) - 1:
        raise RuntimeError(f"restored {n} tokens, expected {len(query) - 1}")
    mx.eval(model(mx.array(query[n:])[None], cache=cache))
    return (t1 - t0) * 1e3, (time.perf_counter() - t1) * 1e3


def bench(model, tokenizer, n, repeats, tmp):
    """``room -> [(restore ms, first pass ms)]``: one store, its room set per case."""
    tokens = np.random.default_rng(n).integers(10, 10_000, n).tolist()
    query = tokens + [42]
    rooms = (0, 2048)
    times = {room: [] for room in rooms}
    path = os.path.join(tmp, f"store-{n}")
    with KVStore(path, model, tokenizer, ram_bytes=0) as store:
        store.save(tokens, synthetic_cache(store.layout, n, seed=n))
        store.flush()
        for r in range(repeats):
            for room in rooms if r % 2 else rooms[::-1]:
                store.restore_room = room
                times[room].append(first_token(store, model, query))
    shutil.rmtree(path)
    return times


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default", help="mlx-lm model path or 'default'")
    p.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192])
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    model, tokenizer = load(None if args.model == "default" else args.model)
    print(
        f"model {args.model}; medians of {args.repeats}; page cache warm, RAM tier off"
    )
    print(
        f"{'tokens':>7}  {'restore_room':>12}  {'restore ms':>10}  "
        f"{'first pass ms':>13}  {'TTFT ms':>8}  {'TTFT ratio':>10}"
    )
    with tempfile.TemporaryDirectory(prefix="kvstore-room-") as tmp:
        for n in args.tokens:
            times = bench(model, tokenizer, n, args.repeats, tmp)
            ttft = {
                room: statistics.median(a + b for a, b in t)
                for room, t in times.items()
            }
            for room, t in times.items():
                print(
                    f"{n:>7}  {room:>12}  {statistics.median(a for a, _ in t):>10.1f}  "
                    f"{statistics.median(b for _, b in t):>13.1f}  {ttft[room]:>8.1f}  "
                    f"{ttft[room] / ttft[0]:>10.2f}"
                )


if __name__ == "__main__":
    main()
