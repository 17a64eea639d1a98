"""Several restores at once, as a restarted server meets its returning users: how
long each takes and how many bytes a second they read together, by how many run at
once and how many reader threads the store has.

A store holds ``--prompts`` prompts of ``--length`` tokens, each pair sharing a
system prompt of ``--system`` tokens, with random KV in a model's layout (saved
without running the model). Each case is a fresh child process (cases alternated
over ``--repeats``) that opens the store and fetches every prompt
(``restore="always"``, no RAM tier) on ``threads`` threads at once (``serial``: the
same threads taking turns; ``per-tensor``: one load per tensor instead of
tensors stacked); the floor beside it reads the same files into fresh buffers on as
many threads.

Usage (on the GPU machine; ``--shape tiny`` checks the script on the CPU)::

    python tools/probe_concurrent_restores.py --shape llama-8b --dir /tmp/pcr \\
        --threads 1 2 4 8 --read-threads 2 4 --repeats 2 --json OUT.json
"""

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_gpu import SHAPES, build  # noqa: E402


def _prompts(shape: str, *, prompts: int, length: int, system: int):
    import numpy as np

    vocab = SHAPES[shape]["vocab_size"]
    rng = np.random.default_rng(0)
    out = []
    for i in range(prompts):
        if i % 2 == 0:
            head = rng.integers(10, vocab, size=system).tolist()
        out.append(head + rng.integers(10, vocab, size=length - system).tolist())
    return out


def make_store(args) -> dict:
    """Save every prompt with random KV of the model's layout; the bytes stored."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    import kvstore

    model = build(args.shape)
    prompts = _prompts(
        args.shape, prompts=args.prompts, length=args.length, system=args.system
    )
    heads = model.args.num_key_value_heads
    width = getattr(model.args, "head_dim", None) or (
        model.args.hidden_size // model.args.num_attention_heads
    )
    with kvstore.KVStore(args.dir + "/store", model, ram_bytes=0) as store:
        for tokens in prompts:
            cache = make_prompt_cache(model)
            shape = (1, heads, len(tokens), width)
            for layer in cache:
                k = mx.random.normal(shape).astype(mx.bfloat16)
                v = mx.random.normal(shape).astype(mx.bfloat16)
                layer.update_and_fetch(k, v)
            mx.eval([c.state for c in cache])
            store.save(tokens, cache)
            store.flush()
        return {"store_bytes": store.stats()["store_bytes_on_disk"]}


def child(spec: dict) -> dict:
    """One case in this (fresh) process."""
    from concurrent.futures import ThreadPoolExecutor

    import mlx.core as mx

    import kvstore

    model = build(spec["shape"])
    prompts = _prompts(
        spec["shape"],
        prompts=spec["prompts"],
        length=spec["length"],
        system=spec["system"],
    )
    threads = spec["threads"]
    if spec["case"] == "floor":
        return _floor(model, prompts, spec)
    if spec["case"] == "per-tensor":  # one load per tensor, as before stacking
        from kvstore.engine import loadpath

        loadpath._groups = lambda rows, nrows: [[name] for name in rows]
    store = kvstore.KVStore(
        spec["dir"] + "/store",
        model,
        ram_bytes=0,
        read_threads=spec["read_threads"],
        restore="always",
    )

    # "serial": the restores take turns (one lock around each), as one reading
    # thread would have them.
    turns = threading.Lock() if spec["case"] == "serial" else contextlib.nullcontext()

    def restore(tokens):
        tic = time.perf_counter()
        with turns:
            cache, n = store.fetch(tokens + [1])
        mx.eval([c.state for c in cache])
        row = sum(a.nbytes // a.shape[2] for c in cache for a in (c.keys, c.values))
        return time.perf_counter() - tic, n, n * row

    store.fetch(prompts[0][:300] + [1])  # warm-up: first use of the load path
    tic = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        got = list(pool.map(restore, prompts))
    wall = time.perf_counter() - tic
    store.close()
    return {
        "wall_s": wall,
        "each_s": [s for s, _, _ in got],
        "tokens": sum(n for _, n, _ in got),
        "bytes": sum(b for _, _, b in got),
    }


def _floor(model, prompts, spec) -> dict:
    """Each prompt's node files (the path a restore reads) read whole into fresh
    buffers, ``threads`` prompts at once."""
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    import kvstore

    with kvstore.KVStore(spec["dir"] + "/store", model, ram_bytes=0) as store:
        paths = []
        for tokens in prompts:
            arr = np.array(tokens + [1], np.int32)
            steps = store.index.read(
                lambda txn: store.parts.reads.trie.walk(txn, arr, limit=len(arr))
            )
            paths.append([store.blobs.path(store.namespace, s.h) for s in steps])

    def read(files):
        tic, n = time.perf_counter(), 0
        for path in files:
            with open(path, "rb") as f:
                buf = bytearray(os.fstat(f.fileno()).st_size)
                n += f.readinto(buf)
        return time.perf_counter() - tic, n

    tic = time.perf_counter()
    with ThreadPoolExecutor(spec["threads"]) as pool:
        got = list(pool.map(read, paths))
    return {
        "wall_s": time.perf_counter() - tic,
        "each_s": [s for s, _ in got],
        "bytes": sum(n for _, n in got),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama-8b")
    p.add_argument("--dir", help="scratch directory (the store)")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--length", type=int, default=2514)
    p.add_argument("--system", type=int, default=2000)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--read-threads", type=int, nargs="+", default=[2])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--json")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return
    if not args.dir:
        p.error("--dir is required")
    sys.modules.setdefault("torch", None)
    os.makedirs(args.dir, exist_ok=True)
    if not os.path.exists(args.dir + "/store"):
        print("store:", make_store(args), flush=True)
    base = dict(
        shape=args.shape,
        dir=args.dir,
        prompts=args.prompts,
        length=args.length,
        system=args.system,
    )
    cases = [("floor", t, 0) for t in args.threads] + [
        ("restore", t, r) for t in args.threads for r in args.read_threads
    ]
    cases += [("serial", t, args.read_threads[0]) for t in args.threads if t > 1]
    cases += [("per-tensor", t, args.read_threads[0]) for t in args.threads]
    samples = []
    for rep in range(args.repeats):
        order = cases if rep % 2 == 0 else cases[::-1]
        for case, threads, readers in order:
            spec = dict(base, case=case, threads=threads, read_threads=readers)
            run = subprocess.run(
                [sys.executable, __file__, "--child", json.dumps(spec)],
                capture_output=True,
                text=True,
            )
            if run.returncode:
                print(run.stderr[-2000:], file=sys.stderr)
                raise SystemExit(f"case {spec} failed")
            out = json.loads(run.stdout.strip().splitlines()[-1])
            samples.append(dict(spec, repeat=rep, **out))
            each = out.get("each_s") or [0]
            print(
                f"{case:8s} threads {threads} readers {readers}: "
                f"{out['wall_s'] * 1000:7.1f} ms  "
                f"{out['bytes'] / out['wall_s'] / 1e9:5.2f} GB/s  "
                f"each median {statistics.median(each) * 1000:6.1f} ms",
                flush=True,
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"samples": samples}, f, indent=1)


if __name__ == "__main__":
    main()
