#!/usr/bin/env python
"""Decode speed right after a kvstore restore, against after a cold prefill.

Usage::

    python tools/probe_restore_decode.py [--shape llama-8b] [--lengths 8192 32768]
                                         [--repeats 3] [--cases ...] [--more 512]
                                         [--json OUT]

One store holds each prompt (saved once, from a cold prefill), and one
``save_prompt_cache`` file too. Then each case runs in a fresh process, the cases
rotated over the repeats so none always goes first:

- ``cold``: prefill the prompt, then decode;
- ``restore``: ``KVStore.fetch`` the prompt, prefill the one token past it, decode;
- ``restore-copy``: the same, with every restored array copied into a fresh device
  array before decoding (tells apart the restored arrays' own layout from the rest);
- ``restore-room0`` / ``restore-room0-copy``: both with ``restore_room=0`` (no room:
  whole cache steps of rows on CUDA, exactly the prompt's elsewhere);
- ``restore-room0-exact``: ``restore_room=0`` with ``KVSTORE_WHOLE_STEPS=0``: arrays
  exactly as long as the prompt on any backend, which mlx-lm's cache grows at the
  first new token to an odd row count;
- ``load_prompt_cache``: mlx-lm's file of the same prompt (its arrays keep the room
  the prefill left them, whole cache steps);
- ``cold-saved``: ``cold``, then the prompt and its answer saved into a scratch
  store before the later parts (as a server with an empty store saves a first turn:
  its device-to-host copies run in this process);
- ``cold-saved-clear``: the same, then ``mx.clear_cache()`` (MLX's cached buffers,
  which the save's host copies leave some of in managed memory, freed);
- ``cold-saved-kept``: ``cold-saved`` with ``mx.clear_cache`` made a no-op in this
  process (the save's own clearing of MLX's buffer cache skipped);
- ``cold-clear``: ``cold``, then ``mx.clear_cache()`` and no save;
- ``cold-sequence``: ``cold``, then in one process (no process-to-process spread)
  user turns alternating with what may slow the next one: ``plain`` (nothing),
  ``saved`` (a save into a scratch store), ``cleared`` (``mx.clear_cache()``);
  ``sequence`` gives each turn's seconds.

Each decodes 64 tokens (``a``), then 32 more through a second ``generate_step``
(``b``), then ``--more`` tokens (``c``, 0 by default): past the room a restore leaves
(at most a cache step here), so that mlx-lm's cache grows its arrays as it does in a
long answer. Each part records the cache's rows after it. With ``--turns N``, N
user turns of ``--turn-tokens`` new tokens follow, each timed from its prompt to
its first token (``turns``: seconds), as a chat's next round is in a server, and
then 64 tokens are decoded (``d``). The model has random
weights of a real model's shape (``tools/bench_gpu.py``'s shapes); run it on the GPU,
or at ``--shape tiny`` on any machine.

A tool, not a test: pytest never collects tools/. Nothing here asserts a time.
"""

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_gpu  # noqa: E402  (the shapes, model builder and generate loop)

CASES = (
    "cold",
    "restore",
    "restore-copy",
    "restore-room0",
    "restore-room0-copy",
    "restore-room0-exact",
    "load_prompt_cache",
    "cold-saved",
    "cold-saved-clear",
    "cold-saved-kept",
    "cold-clear",
    "cold-sequence",
)
SEQUENCE = ("plain", "plain", "saved", "plain", "cleared", "plain", "saved", "plain")
DECODE_A, DECODE_B = 64, 32


def _rates(times):
    gaps = [b - a for a, b in zip(times, times[1:])]
    return {"tok_s": len(gaps) / sum(gaps), "median_ms": 1000 * statistics.median(gaps)}


def child(spec: dict) -> dict:
    """One case in this (fresh) process."""
    mx = bench_gpu._imports()
    from mlx_lm.models.cache import load_prompt_cache, make_prompt_cache

    import kvstore

    model = bench_gpu.build(spec["shape"])
    bench_gpu.warm_up(model)
    tokens = bench_gpu.prompt(spec["shape"], spec["length"])
    case, store, n = spec["case"], None, 0
    if case.startswith("cold"):
        cache = make_prompt_cache(model)
    elif case == "load_prompt_cache":
        cache, n = load_prompt_cache(spec["lpc"]), len(tokens) - 1
    else:
        if case == "restore-room0-exact":
            os.environ["KVSTORE_WHOLE_STEPS"] = "0"
        room = {"restore_room": 0} if "room0" in case else {}
        store = kvstore.KVStore(spec["store"], model, ram_bytes=0, **room)
        cache, n = store.fetch(tokens)
        if case.endswith("-copy"):
            for c in cache:
                c.keys, c.values = c.keys * 1, c.values * 1
            mx.eval([c.state for c in cache])
    out = {"restored": n, "rows_before": _rows(cache)}
    times, first = bench_gpu.generate(model, tokens[n:], cache, decode=DECODE_A)
    out.update(a=_rates(times), rows_a=_rows(cache))
    later, _ = bench_gpu.generate(model, [first], cache, decode=DECODE_B)
    out.update(b=_rates(later), rows_b=_rows(cache))
    if spec.get("more"):
        more, _ = bench_gpu.generate(model, [first], cache, decode=spec["more"])
        out.update(c=_rates(more), rows_c=_rows(cache))
    if case == "cold-saved-kept":
        mx.clear_cache = lambda: None  # this process only: the save's clearing
    if "-saved" in case:
        out["saved"] = _save_into_scratch(spec, model, tokens, first, cache)
    if case.endswith("-clear"):
        mx.clear_cache()
    if case == "cold-sequence":
        out["sequence"] = []
        for i, before in enumerate(SEQUENCE):
            if before == "saved":
                _save_into_scratch(spec, model, tokens, first, cache)
            elif before == "cleared":
                mx.clear_cache()
            out["sequence"].append([before, _turn(model, cache, spec, i)])
    if spec.get("turns"):
        out["turns"] = [_turn(model, cache, spec, i) for i in range(spec["turns"])]
        after, _ = bench_gpu.generate(model, [first], cache, decode=DECODE_A)
        out.update(d=_rates(after), rows_d=_rows(cache))
    if store is not None:
        store.close()
    return out


def _save_into_scratch(spec: dict, model, tokens, first: int, cache) -> int:
    """Save the cache's tokens (the prompt, then what was decoded, stood in for by
    ``first`` repeated: a save does not read the tokens' values) into a scratch
    store, wait for it to be written, and return the tokens it holds."""
    import shutil

    import kvstore

    scratch = f"{spec['store']}-scratch-{os.getpid()}"
    held = cache[0].offset
    saved = list(tokens) + [first] * (held - len(tokens))
    with kvstore.KVStore(scratch, model, ram_bytes=0) as s:
        s.save(saved, cache)
        s.flush()
        stored = s.lookup(saved)
    shutil.rmtree(scratch, ignore_errors=True)
    return stored


def _turn(model, cache, spec: dict, i: int) -> float:
    """Seconds from user turn ``i``'s prompt to its first token."""
    import time

    vocab = bench_gpu.SHAPES[spec["shape"]]["vocab_size"]
    turn = [
        10 + (7919 * (i * 1000 + j)) % (vocab - 10) for j in range(spec["turn_tokens"])
    ]
    t0 = time.perf_counter()
    times, _ = bench_gpu.generate(model, turn, cache, decode=0)
    return times[0] - t0


def _medians(rows) -> dict:
    """Median decode tok/s of each part, and each turn's median seconds."""
    out = {
        part: statistics.median(s[part]["tok_s"] for s in rows)
        for part in ("a", "b", "c", "d")
        if part in rows[0]
    }
    for i in range(len(rows[0].get("turns", []))):
        out[f"turn{i + 1}_s"] = statistics.median(s["turns"][i] for s in rows)
    return out


def _rows(cache) -> int:
    """The rows the first layer's arrays hold (room included)."""
    keys = getattr(cache[0], "keys", None)
    return int(keys.shape[2]) if keys is not None else 0


def setup(shape: str, lengths, store: str, lpc: str) -> None:
    """Store each prompt's KV from a cold prefill, and write it as mlx-lm's file."""
    bench_gpu._imports()
    from mlx_lm.models.cache import make_prompt_cache, save_prompt_cache

    import kvstore

    model = bench_gpu.build(shape)
    with kvstore.KVStore(store, model, ram_bytes=0) as s:
        for length in lengths:
            tokens = bench_gpu.prompt(shape, length)
            cache = make_prompt_cache(model)
            bench_gpu.prefill(model, tokens[:-1], cache)
            s.save(tokens[:-1], cache)
            s.flush()
            save_prompt_cache(lpc.format(length), cache)


def run(args) -> dict:
    os.makedirs(args.dir, exist_ok=True)
    store = os.path.join(args.dir, "store")
    lpc = os.path.join(args.dir, "lpc-{}.safetensors")
    setup(args.shape, args.lengths, store, lpc)
    cases = args.cases
    samples = {str(n): {c: [] for c in cases} for n in args.lengths}
    for r in range(args.repeats):
        for length in args.lengths:
            for i in range(len(cases)):
                case = cases[(i + r) % len(cases)]
                spec = dict(
                    shape=args.shape,
                    length=length,
                    case=case,
                    store=store,
                    lpc=lpc.format(length),
                    more=args.more,
                    turns=args.turns,
                    turn_tokens=args.turn_tokens,
                )
                out = bench_gpu.spawn(spec, script=os.path.abspath(__file__))
                samples[str(length)][case].append(out)
                parts = [out[p]["tok_s"] for p in ("a", "b", "c", "d") if p in out]
                turns = " ".join(
                    f"{1000 * t:.1f}"
                    for t in out.get("turns", [])
                    + [t for _, t in out.get("sequence", [])]
                )
                print(
                    f"r{r} {length:>6} {case:18s} decode "
                    + " / ".join(f"{x:6.1f}" for x in parts)
                    + " tok/s"
                    + (f"; turns {turns} ms" if turns else ""),
                    flush=True,
                )
    medians = {
        n: {c: _medians(rows) for c, rows in cases.items()}
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
    p.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    p.add_argument(
        "--more", type=int, default=0, help="tokens decoded past the first 96 (c)"
    )
    p.add_argument(
        "--turns", type=int, default=0, help="user turns timed after the decode"
    )
    p.add_argument("--turn-tokens", type=int, default=210)
    p.add_argument("--dir", default="bench-out/restore-decode")
    p.add_argument("--json", metavar="OUT")
    args = p.parse_args(argv)
    data = run(args)
    print(
        "\ndecode tok/s, medians (first 64 tokens / 32 more / --more past them),"
        " then each turn's seconds; (x) = of the first case"
    )
    for n, cases in data["medians"].items():
        base = next(iter(cases.values()))
        row = [
            f"{c} " + " / ".join(f"{m[p]:.3g} ({m[p] / base[p]:.2f}x)" for p in m)
            for c, m in cases.items()
        ]
        print(f"{n:>6} tokens: " + "; ".join(row))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(data, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
