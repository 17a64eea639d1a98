#!/usr/bin/env python
"""Decode speed right after a kvstore restore, against after a cold prefill.

Usage::

    python tools/probe_restore_decode.py [--shape llama-8b] [--lengths 8192 32768]
                                         [--repeats 3] [--json OUT]

One store holds each prompt (saved once, from a cold prefill). Then each case runs in
a fresh process, the cases rotated over the repeats so none always goes first:

- ``cold``: prefill the prompt, then decode;
- ``restore``: ``KVStore.fetch`` the prompt, prefill the one token past it, decode;
- ``restore-copy``: the same, with every restored array copied into a fresh device
  array before decoding (tells apart the restored arrays' own layout from the rest).

Each decodes 64 tokens (``a``), then 32 more through a second ``generate_step``
(``b``). The model has random weights of a real model's shape (``tools/bench_gpu.py``'s
shapes); run it on the GPU, or at ``--shape tiny`` on any machine.

A tool, not a test: pytest never collects tools/. Nothing here asserts a time.
"""

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_gpu  # noqa: E402  (the shapes, model builder and generate loop)

CASES = ("cold", "restore", "restore-copy")
DECODE_A, DECODE_B = 64, 32


def _rates(times):
    gaps = [b - a for a, b in zip(times, times[1:])]
    return {"tok_s": len(gaps) / sum(gaps), "median_ms": 1000 * statistics.median(gaps)}


def child(spec: dict) -> dict:
    """One case in this (fresh) process."""
    mx = bench_gpu._imports()
    from mlx_lm.models.cache import make_prompt_cache

    import kvstore

    model = bench_gpu.build(spec["shape"])
    bench_gpu.warm_up(model)
    tokens = bench_gpu.prompt(spec["shape"], spec["length"])
    store, n = None, 0
    if spec["case"] == "cold":
        cache = make_prompt_cache(model)
    else:
        store = kvstore.KVStore(spec["store"], model, ram_bytes=0)
        cache, n = store.fetch(tokens)
        if spec["case"] == "restore-copy":
            for c in cache:
                c.keys, c.values = c.keys * 1, c.values * 1
            mx.eval([c.state for c in cache])
    times, first = bench_gpu.generate(model, tokens[n:], cache, decode=DECODE_A)
    later, _ = bench_gpu.generate(model, [first], cache, decode=DECODE_B)
    if store is not None:
        store.close()
    return {"restored": n, "a": _rates(times), "b": _rates(later)}


def setup(shape: str, lengths, store: str) -> None:
    """Store each prompt's KV from a cold prefill."""
    bench_gpu._imports()
    from mlx_lm.models.cache import make_prompt_cache

    import kvstore

    model = bench_gpu.build(shape)
    with kvstore.KVStore(store, model, ram_bytes=0) as s:
        for length in lengths:
            tokens = bench_gpu.prompt(shape, length)
            cache = make_prompt_cache(model)
            bench_gpu.prefill(model, tokens[:-1], cache)
            s.save(tokens[:-1], cache)
            s.flush()


def run(args) -> dict:
    os.makedirs(args.dir, exist_ok=True)
    store = os.path.join(args.dir, "store")
    setup(args.shape, args.lengths, store)
    samples = {str(n): {c: [] for c in CASES} for n in args.lengths}
    for r in range(args.repeats):
        for length in args.lengths:
            for i in range(len(CASES)):
                case = CASES[(i + r) % len(CASES)]
                spec = dict(shape=args.shape, length=length, case=case, store=store)
                out = bench_gpu.spawn(spec, script=os.path.abspath(__file__))
                samples[str(length)][case].append(out)
                print(
                    f"r{r} {length:>6} {case:13s} decode "
                    f"{out['a']['tok_s']:6.1f} / {out['b']['tok_s']:6.1f} tok/s",
                    flush=True,
                )
    medians = {
        n: {
            c: {
                part: statistics.median(s[part]["tok_s"] for s in rows)
                for part in ("a", "b")
            }
            for c, rows in cases.items()
        }
        for n, cases in samples.items()
    }
    return {
        "tool": "probe_restore_decode",
        "args": vars(args),
        "samples": samples,
        "medians": medians,
    }


def main(argv=None):
    if argv is None and sys.argv[1:2] == ["--child"]:
        print(json.dumps(child(json.loads(sys.argv[2]))))
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(bench_gpu.SHAPES), default="llama-8b")
    p.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", default="bench-out/restore-decode")
    p.add_argument("--json", metavar="OUT")
    args = p.parse_args(argv)
    data = run(args)
    print("\ndecode tok/s, medians (first 64 tokens / 32 more); (x) = of cold")
    for n, cases in data["medians"].items():
        cold = cases["cold"]
        row = [
            f"{c} {m['a']:.1f} ({m['a'] / cold['a']:.2f}x) / "
            f"{m['b']:.1f} ({m['b'] / cold['b']:.2f}x)"
            for c, m in cases.items()
        ]
        print(f"{n:>6} tokens: " + "; ".join(row))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(data, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
