#!/usr/bin/env python
"""Time to open a store: a model it has seen (known) vs one it has not (new).

Usage::

    python tools/bench_open.py [--model M] [--repeats 7] [--weights-gb 2 8]
                               [--json OUT]

Each sample is a fresh child process that loads the model (not timed) and then
times ``KVStore(path, model, tokenizer)``, as a restarted server does; the cases
alternate. ``known``: a store that has this model's namespace (and model key).
``new``: a store it has never seen (the layout is probed: one forward pass). The
split of a known open (weights digest, model key, index, the rest) is measured in
this process. ``--weights-gb`` adds synthetic llamas of about that many GB of
float16 weights (zeros: hashing speed does not depend on the values) and times
their weights digest and known-model open in this process (memory: that many GB).

A tool, not a test: pytest never collects tools/. Nothing here asserts a time.
"""

import argparse
import collections
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

TARGET_MS = 50.0  # opening for a known model


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="mlx-lm path or hub id (default: SmolLM2-135M)")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--weights-gb", type=float, nargs="*", default=[], metavar="GB")
    p.add_argument("--json", metavar="OUT")
    p.add_argument(
        "--child", nargs=2, metavar=("STORE", "MODEL"), help=argparse.SUPPRESS
    )
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    return args


def child(store: str, model_name: str) -> None:
    from kvstore import KVStore
    from kvstore.bench.models import load

    model, tok = load(model_name or None)
    t0 = time.perf_counter()
    s = KVStore(store, model, tok)
    dt = time.perf_counter() - t0
    s.close()
    print(json.dumps({"seconds": dt}))


def run_child(store: str, model_name: str) -> float:
    out = subprocess.run(
        [sys.executable, __file__, "--child", store, model_name or ""],
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])["seconds"]


def split_known_open(store: str, model, tok) -> dict:
    """Where a known model's open goes (in this process, after one warm-up open)."""
    from kvstore import KVStore, index, namespace, reservations
    from kvstore import store as store_module

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
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from kvstore import KVStore, namespace

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
    full = nbytes <= namespace.FULL_HASH_LIMIT
    hashed = (
        nbytes if full else sum(min(p.nbytes, 3 * namespace._SAMPLE) for _, p in params)
    )
    out = {
        "weights_bytes": nbytes,
        "tensors": len(params),
        "hashed_bytes": hashed,
        "weights_digest_s": digests,
        "new_open_s": new,
        "known_open_s": known,
    }
    del model, params
    mx.clear_cache()
    return out


def main(argv=None):
    args = parse_args(argv)
    if args.child:
        child(*args.child)
        return 0
    from kvstore import KVStore
    from kvstore.bench.models import load

    root = tempfile.mkdtemp(prefix="kvstore-bench-open-")
    try:
        model, tok = load(args.model)
        known_store = os.path.join(root, "known")
        KVStore(known_store, model, tok).close()
        samples = {"known": [], "new": []}
        for r in range(args.repeats):
            order = ["known", "new"] if r % 2 == 0 else ["new", "known"]
            for case in order:
                store = known_store
                if case == "new":
                    store = os.path.join(root, f"new-{r}")
                samples[case].append(run_child(store, args.model or ""))
        split = split_known_open(known_store, model, tok)
        big = {gb: big_model_case(gb, root) for gb in args.weights_gb}
    finally:
        shutil.rmtree(root, ignore_errors=True)

    med = {k: statistics.median(v) for k, v in samples.items()}
    print(
        f"open a store, {args.model or 'SmolLM2-135M-Instruct'}, fresh child process "
        f"per sample (model load not timed), {args.repeats} alternating repeats"
    )
    for case, xs in samples.items():
        print(
            f"  {case:<6} median {med[case] * 1e3:7.1f} ms  samples "
            f"{[round(x * 1e3, 1) for x in xs]}"
        )
    ok = med["known"] * 1e3 <= TARGET_MS
    print(
        f"  known model <= {TARGET_MS:.0f} ms: {'PASS' if ok else 'MISS'}; "
        f"new / known: {med['new'] / med['known']:.1f}x"
    )
    print(f"  split of a known open (this process, ms): {split}")
    for gb, case in big.items():
        print(
            f"  {case['weights_bytes'] / 1e9:.2f} GB of weights "
            f"({'all' if case['hashed_bytes'] == case['weights_bytes'] else 'samples:'}"
            f" {case['hashed_bytes'] / 1e9:.2f} GB hashed): weights digest "
            f"{[round(x * 1e3, 1) for x in case['weights_digest_s']]} ms, known open "
            f"{[round(x * 1e3, 1) for x in case['known_open_s']]} ms, new open "
            f"{case['new_open_s'] * 1e3:.0f} ms"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"argv": sys.argv, "samples": samples, "split_ms": split, "big": big},
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
