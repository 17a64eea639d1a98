#!/usr/bin/env python
"""The prompt step of a returning chat round, by what happened to its cache before.

Usage::

    python tools/probe_round_step.py [--shape llama-8b] [--users 8] [--system 6000]
                                     [--repeats 3] [--json OUT]

Why: in ``tools/bench_serve_gpu.py``'s load on an H200, round 2's prompt step (8 users,
~210 new tokens each over ~6.8K cached ones) took 20-45 ms longer in every kvstore
phase than in plain ``mlx_lm.server``, and round 3's did not. This takes the server
away: mlx-lm's ``BatchGenerator`` runs round 1 (``--users`` prompts of a shared
``--system``-token system prompt, two users each, and a ``--question``-token first
question; ``--decode`` tokens out), then round 2 (each chat's tokens so far plus
``--new`` tokens) over round 1's caches, each step timed. Each case in a fresh
process, rotated over ``--repeats``:

* ``plain``: nothing between the rounds;
* ``saved``: between the rounds every chat is saved to a kvstore store (``save``,
  then ``flush``: the device copies, the writer's host reads, the buffer cache cleared
  after each save), as a fresh store's server does when the loop rests;
* ``restored``: round 1's prompts come from the store (``fetch``, saved by a setup
  process) instead of a prefill, as after a restart;
* ``restored-clear``: as ``restored``, with ``mx.clear_cache()`` after the fetches;
* ``plain-clear``, ``plain-eval``, ``plain-idle`` (not run unless named): ``plain``
  with, between the rounds, ``mx.clear_cache()``; an ``mx.eval`` of the finished
  caches; the device idle for 2.3 s; ``plain-async``: each finished cache started with
  ``mx.async_eval`` as it finishes. Every case then waits ``--gap`` seconds (the next turns' trip to the
  server) without waiting for the device.

Prints each sample's round-2 steps and writes every sample as JSON. A tool for the
GPU machine (``--shape tiny`` checks it on the CPU in seconds); pytest does not
collect it, and nothing here asserts a time.
"""

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_gpu  # noqa: E402  (the shapes and the model builder)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CASES = ("plain", "saved", "restored", "restored-clear")
# Between the rounds, each alone: what a save does beside writing.
PLAIN_VARIANTS = ("plain-clear", "plain-eval", "plain-idle", "plain-async")


def start_evaluating(caches) -> None:
    """Start computing caches on the device without waiting (``mx.async_eval``)."""
    import mlx.core as mx

    mx.async_eval(
        [
            a
            for cache in caches
            for c in cache
            for a in c.state
            if isinstance(a, mx.array)
        ]
    )


def chats(spec: dict):
    """Each user's round-1 prompt and the tokens round 2 adds after the answer."""
    import numpy as np

    vocab = bench_gpu.SHAPES[spec["shape"]]["vocab_size"]
    rng = np.random.default_rng(0)
    systems = [
        rng.integers(10, vocab, size=spec["system"]).tolist()
        for _ in range((spec["users"] + 1) // 2)
    ]
    first = [
        systems[u // 2] + rng.integers(10, vocab, size=spec["question"]).tolist()
        for u in range(spec["users"])
    ]
    later = [rng.integers(10, vocab, size=spec["new"]).tolist() for _ in first]
    return first, later


def run_round(gen, prompts, caches, *, decode: int, start=None):
    """Insert the prompts, step until every one has ``decode`` tokens; returns the
    steps (start relative to the insert, seconds, prompt / generation responses),
    seconds to the last first token, and each uid's finished cache and tokens."""
    t0 = time.perf_counter()
    uids = gen.insert(prompts, max_tokens=[decode] * len(prompts), caches=caches)
    steps, first, done = [], {}, {}
    while len(done) < len(uids):
        tic = time.perf_counter()
        prompt_out, gen_out = gen.next()
        steps.append(
            dict(
                t=round(tic - t0, 4),
                dur=round(time.perf_counter() - tic, 4),
                prompts=len(prompt_out),
                tokens=len(gen_out),
            )
        )
        for r in gen_out:
            first.setdefault(r.uid, time.perf_counter() - t0)
            if r.finish_reason is not None:
                done[r.uid] = (r.prompt_cache, r.all_tokens[:])
                if start is not None:
                    start([r.prompt_cache])
    return dict(steps=steps, ttft=max(first.values())), [done[u] for u in uids]


def child(spec: dict) -> dict:
    """One case in this (fresh) process."""
    mx = bench_gpu._imports()
    import importlib

    import kvstore

    BatchGenerator = importlib.import_module("mlx_lm.generate").BatchGenerator
    model = bench_gpu.build(spec["shape"])
    bench_gpu.warm_up(model)
    first, later = chats(spec)
    case, out = spec["case"], {"case": spec["case"]}
    store = None
    caches, prompts = None, first
    if case.startswith("restored"):
        # The room kvstore serve leaves past a restore (--restore-room's default).
        store = kvstore.KVStore(spec["store"], model, ram_bytes=0, restore_room=2048)
        t = time.perf_counter()
        fetched = [store.fetch(p) for p in first]
        mx.eval([c.state for cache, _ in fetched for c in cache])
        out["fetch_s"] = time.perf_counter() - t
        out["restored"] = [n for _, n in fetched]
        caches = [cache for cache, _ in fetched]
        prompts = [p[n:] for p, (_, n) in zip(first, fetched)]
        if case == "restored-clear":
            mx.clear_cache()
    gen = BatchGenerator(model, prefill_step_size=bench_gpu.STEP)
    out["round1"], finished = run_round(
        gen,
        prompts,
        caches,
        decode=spec["decode"],
        start=start_evaluating if case == "plain-async" else None,
    )
    if case == "saved":
        store = kvstore.KVStore(spec["store"], model, ram_bytes=0)
        t = time.perf_counter()
        for cache, tokens in finished:
            store.save(tokens, cache)
        store.flush()
        out["save_s"] = time.perf_counter() - t
    if case == "plain-clear":
        mx.clear_cache()
    elif case == "plain-eval":
        mx.eval([c.state for cache, _ in finished for c in cache])
    elif case == "plain-idle":
        mx.synchronize()
        time.sleep(2.3)
    time.sleep(spec["gap"])  # the next turns' trip to the server (device not waited)
    out["memory_before_round2"] = dict(
        active=mx.get_active_memory(), cache=mx.get_cache_memory()
    )
    prompts2 = [x for x in later]
    caches2 = [cache for cache, _ in finished]
    out["round2"], _ = run_round(gen, prompts2, caches2, decode=2)
    gen.close()
    if store is not None:
        store.close()
    return out


def setup(spec: dict) -> None:
    """Store every round-1 prompt but its last token (a cold prefill's KV)."""
    mx = bench_gpu._imports()
    from mlx_lm.models.cache import make_prompt_cache

    import kvstore

    model = bench_gpu.build(spec["shape"])
    first, _ = chats(spec)
    with kvstore.KVStore(spec["store"], model, ram_bytes=0) as s:
        for p in first:
            cache = make_prompt_cache(model)
            bench_gpu.prefill(model, p[:-1], cache)
            s.save(p[:-1], cache)
            s.flush()
            del cache
            mx.clear_cache()


def _prompt_steps(r: dict) -> str:
    return " ".join(f"{s['dur'] * 1e3:.0f}" for s in r["steps"] if s["prompts"])


def main(argv=None) -> int:
    if argv is None and sys.argv[1:2] == ["--child"]:
        print(json.dumps(child(json.loads(sys.argv[2]))))
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(bench_gpu.SHAPES), default="llama-8b")
    p.add_argument("--users", type=int, default=8)
    p.add_argument("--system", type=int, default=6000)
    p.add_argument("--question", type=int, default=500)
    p.add_argument("--new", type=int, default=210)
    p.add_argument("--decode", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--gap", type=float, default=0.15, help="seconds between the rounds")
    p.add_argument(
        "--cases", nargs="+", choices=CASES + PLAIN_VARIANTS, default=list(CASES)
    )
    p.add_argument("--dir", default="bench-out/round-step")
    p.add_argument("--json", metavar="OUT")
    args = p.parse_args(argv)
    os.makedirs(args.dir, exist_ok=True)
    base = dict(
        shape=args.shape,
        users=args.users,
        system=args.system,
        question=args.question,
        new=args.new,
        decode=args.decode,
        gap=args.gap,
    )
    setup(dict(base, store=os.path.join(args.dir, "setup-store")))
    samples = {c: [] for c in args.cases}
    for r in range(args.repeats):
        for i in range(len(args.cases)):
            case = args.cases[(i + r) % len(args.cases)]
            store = os.path.join(args.dir, "setup-store")
            if case == "saved":  # an empty store each time
                store = os.path.join(args.dir, f"saved-{r}")
            spec = dict(base, case=case, store=store)
            out = bench_gpu.spawn(spec, script=os.path.abspath(__file__))
            samples[case].append(out)
            print(
                f"r{r} {case:15s} round 1 {out['round1']['ttft']:.3f} s, "
                f"round 2 {out['round2']['ttft']:.3f} s; round-2 prompt steps (ms): "
                f"{_prompt_steps(out['round2'])}",
                flush=True,
            )
    medians = {
        c: {
            k: statistics.median(s[k]["ttft"] for s in rows)
            for k in ("round1", "round2")
        }
        for c, rows in samples.items()
        if rows
    }
    for c, m in medians.items():
        print(
            f"median {c:15s} round 1 {m['round1']:.3f} s, round 2 {m['round2']:.3f} s"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args=vars(args), samples=samples, medians=medians), f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
