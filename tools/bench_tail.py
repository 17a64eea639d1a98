"""A short tail past a RAM copy: restore it from the store, or prefill it.

What ``kvstore serve`` weighs for a returning user whose history mlx-lm's RAM cache
holds but for the last few hundred tokens. In one warm process, alternating, the
same prompt of ``--head`` + ``--tail`` tokens:

* plain: a deep copy of the RAM copy (mlx-lm's LRU fetch), then a forward over the
  tail and the new token (what plain ``mlx_lm.server`` does);
* kvstore: the same copy, ``KVStore.fetch_beyond`` (the nodes past the RAM copy),
  ``KVStore.join_tail`` and a forward over what is left (the new token);
* batch8: eight RAM copies' tails prefilled as one batch of eight (a busy server's
  batch), whose time over eight is one request's share.

Prints one JSON object: the medians of each case (and the kvstore case's parts) and
every sample. Random weights of a real model's shape (``tools/bench_gpu.py``).

    python tools/bench_tail.py --shape llama-8b --head 6500 --tail 250 --json out.json
"""

import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tools.bench_gpu import SHAPES, build, prompt  # noqa: E402

BATCH = 8


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama-8b")
    ap.add_argument("--head", type=int, default=6500, help="tokens the RAM copy holds")
    ap.add_argument("--tail", type=int, default=250, help="tokens stored past it")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--chunk-tokens", type=int, default=256)
    ap.add_argument("--dir", help="the store (default: a temporary directory)")
    ap.add_argument("--json", help="also write the result here")
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        result = measure(a, a.dir or os.path.join(tmp, "store"))
    text = json.dumps(result)
    print(text)
    if a.json:
        with open(a.json, "w") as f:
            f.write(text)
    return 0


def measure(a, store_dir: str) -> dict:
    sys.modules.setdefault("torch", None)  # mlx-lm's import of transformers: 10+ s
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache, make_prompt_cache

    from kvstore import KVStore

    model = build(a.shape)
    toks = prompt(a.shape, a.head + a.tail + 1)
    head, stored = a.head, a.head + a.tail

    def forward(tokens, cache):
        for s in range(0, len(tokens), 2048):
            out = model(mx.array(tokens[s : s + 2048])[None], cache=cache)
            mx.eval(out, [c.state for c in cache])
        return out

    full = make_prompt_cache(model)
    forward(toks[:stored], full)
    store = KVStore(store_dir, model, chunk_tokens=a.chunk_tokens, restore="always")
    store.save(toks[:stored], full)
    store.flush()
    del full
    ram = make_prompt_cache(model)
    forward(toks[:head], ram)

    def plain():
        t = time.perf_counter()
        forward(toks[head:], copy.deepcopy(ram))
        return {"total": time.perf_counter() - t}

    def kvstore():
        t0 = time.perf_counter()
        c = copy.deepcopy(ram)
        mx.eval([x.state for x in c])
        t1 = time.perf_counter()
        tail = store.fetch_beyond(toks, head)
        t2 = time.perf_counter()
        joined = store.join_tail(c, tail, query=len(toks))
        mx.eval([x.state for x in joined])
        t3 = time.perf_counter()
        forward(toks[tail.end :], joined)
        t4 = time.perf_counter()
        return {
            "total": t4 - t0,
            "copy": t1 - t0,
            "fetch_beyond": t2 - t1,
            "join": t3 - t2,
            "forward_rest": t4 - t3,
            "restored_tokens": tail.end - tail.start,
        }

    def batch8():
        t0 = time.perf_counter()
        caches = []
        for layer in ram:
            c = KVCache()
            keys = layer.keys[..., : layer.offset, :]
            values = layer.values[..., : layer.offset, :]
            c.update_and_fetch(
                mx.repeat(keys, BATCH, axis=0), mx.repeat(values, BATCH, axis=0)
            )
            caches.append(c)
        mx.eval([c.state for c in caches])
        t1 = time.perf_counter()
        out = model(mx.array([toks[head:]] * BATCH), cache=caches)
        mx.eval(out[:, -1])
        t2 = time.perf_counter()
        return {"total": t2 - t0, "copy": t1 - t0, "forward": t2 - t1}

    cases = {"plain": plain, "kvstore": kvstore, "batch8": batch8}
    for fn in cases.values():  # kernels compiled, files in the page cache
        fn()
    samples = {name: [] for name in cases}
    names = list(cases)
    for r in range(a.repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            samples[name].append(cases[name]())
    store.close()
    medians = {
        name: {k: statistics.median(row[k] for row in rows) for k in rows[0]}
        for name, rows in samples.items()
    }
    return {
        "shape": a.shape,
        "head": head,
        "tail": a.tail,
        "device": str(mx.default_device()),
        "medians": medians,
        "samples": samples,
    }


if __name__ == "__main__":
    sys.exit(main())
