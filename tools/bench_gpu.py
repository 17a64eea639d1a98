"""Time to first token after a restart on a GPU: kvstore against recomputing the
prompt and against mlx-lm's ``load_prompt_cache``, and decode speed with and
without kvstore's open, save and restore.

Random weights of a real model's shape (mlx-lm's own classes, bf16, built in each
process: speed does not depend on weight values). Every case runs in a fresh
child process after the same warm-up (one short forward, as a server does before
its first request); the cases' order is a Latin square over the repeats
(``case_order``: with as many repeats as cases, every case runs once in every
position at each length):

- ``cold``: the whole prompt prefilled (``generate_step``, 2,048-token steps) to
  the first token, then 64 tokens decoded;
- ``cold+save``: the same after opening an empty store, saving the prompt's KV in
  the background after the first token (decode runs while it is written);
- ``kvstore`` / ``kvstore-room0`` / ``kvstore-8threads``: open the store, ``fetch``
  the stored prompt (``restore="always"``; its default room / ``restore_room=0`` /
  eight reader threads), the rest of the prompt and the first token, then 64 tokens
  decoded;
- ``kvstore-auto``: the same with ``restore="auto"``: the store decides by the
  rates kept in it (the set-up's prefill rate, earlier children's restores);
- ``load_prompt_cache``: mlx-lm's one-file cache of the same prompt.

Usage (on the GPU machine; see docs/gpu.md)::

    python tools/bench_gpu.py --shape llama-8b --lengths 2048 8192 32768 \\
        --repeats 3 --dir /tmp/bench-gpu --json OUT.json

``--shape tiny`` runs the same on the CPU in seconds (a check of the script).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

SHAPES = {
    "llama-8b": dict(
        model_type="llama",
        hidden_size=4096,
        num_hidden_layers=32,
        intermediate_size=14336,
        num_attention_heads=32,
        num_key_value_heads=8,
        rms_norm_eps=1e-5,
        vocab_size=128256,
        rope_theta=500000.0,
        max_position_embeddings=131072,
        tie_word_embeddings=False,
    ),
    "qwen3-0.6b": dict(
        model_type="qwen3",
        hidden_size=1024,
        num_hidden_layers=28,
        intermediate_size=3072,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        rms_norm_eps=1e-6,
        vocab_size=151936,
        rope_theta=1000000.0,
        max_position_embeddings=40960,
        tie_word_embeddings=True,
    ),
    "tiny": dict(
        model_type="llama",
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=512,
        max_position_embeddings=65536,
        tie_word_embeddings=False,
    ),
}
CASES = [
    "cold",
    "cold+save",
    "kvstore",
    "kvstore-room0",
    "kvstore-8threads",
    "kvstore-auto",
    "load_prompt_cache",
]
DECODE = 64
STEP = 2048


def _imports():
    sys.modules.setdefault("torch", None)  # transformers would import it: 10+ s
    import mlx.core as mx
    import mlx_lm  # noqa: F401

    return mx


def build(shape: str):
    """The model of ``shape`` with random bf16 weights (seeded)."""
    mx = _imports()
    import importlib

    args = dict(SHAPES[shape])
    module = importlib.import_module(f"mlx_lm.models.{args['model_type']}")
    mx.random.seed(0)
    model = module.Model(module.ModelArgs.from_dict(args))
    model.set_dtype(mx.bfloat16)
    mx.eval(model.parameters())
    return model


def prompt(shape: str, length: int):
    import numpy as np

    vocab = SHAPES[shape]["vocab_size"]
    return np.random.default_rng(length).integers(10, vocab, size=length).tolist()


def generate(model, tokens, cache, *, decode: int):
    """Times of the first token and of each decoded one (``generate_step``)."""
    mx = _imports()
    from mlx_lm.generate import generate_step

    times, first = [], None
    for token, _ in generate_step(
        mx.array(tokens),
        model,
        prompt_cache=cache,
        max_tokens=decode + 1,
        prefill_step_size=STEP,
    ):
        times.append(time.perf_counter())
        first = token if first is None else first
    return times, first


def prefill(model, tokens, cache) -> None:
    """Run ``tokens`` through ``model`` into ``cache``, ``STEP`` at a time."""
    mx = _imports()
    for i in range(0, len(tokens), STEP):
        model(mx.array(tokens[i : i + STEP])[None], cache=cache)
        mx.eval([c.state for c in cache])


def warm_up(model):
    """One short request through a scratch cache, as a server answers its first."""
    from mlx_lm.models.cache import make_prompt_cache

    generate(model, list(range(10, 42)), make_prompt_cache(model), decode=2)


def child(spec: dict) -> dict:
    """One case in this (fresh) process."""
    t_start = time.perf_counter()
    mx = _imports()
    from mlx_lm.models.cache import load_prompt_cache, make_prompt_cache

    from kvstore import KVStore  # kvstore imports its modules lazily: not in open_s

    t_import = time.perf_counter()
    model = build(spec["shape"])
    t_model = time.perf_counter()
    warm_up(model)
    tokens = prompt(spec["shape"], spec["length"])
    case, out = spec["case"], {"import_s": t_import - t_start}
    out["model_s"] = t_model - t_import
    store = None
    t0 = time.perf_counter()
    if case.startswith("kvstore") or case == "cold+save":
        room = {"kvstore-room0": 0}.get(case, 2048)
        threads = {"kvstore-8threads": 8}.get(case, 2)
        path = spec["store"] if case != "cold+save" else spec["scratch"]
        out["store_module_imported"] = "kvstore.store" in sys.modules
        store = KVStore(
            path,
            model,
            ram_bytes=0,
            restore_room=room,
            read_threads=threads,
            restore="auto" if case == "kvstore-auto" else "always",
        )
        out["read_threads"] = store.read_threads
        out["open_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    n = 0
    if case in ("cold", "cold+save"):
        cache = make_prompt_cache(model)
    elif case == "load_prompt_cache":
        cache = load_prompt_cache(spec["lpc"])
        n = len(tokens) - 1
    else:
        from kvstore.engine import loadpath

        cache, n = store.fetch(tokens)
        out["fetch_s"] = time.perf_counter() - t0
        out["fetch_read_s"] = loadpath.READ_SECONDS[0]
        out["restore_io"] = store.restore_io
    out["restored"] = n
    if case == "cold+save":
        times, saved, first = [], False, None
        from mlx_lm.generate import generate_step

        for token, _ in generate_step(
            mx.array(tokens),
            model,
            prompt_cache=cache,
            max_tokens=DECODE + 1,
            prefill_step_size=STEP,
        ):
            times.append(time.perf_counter())
            first = token if first is None else first
            if not saved:
                t_save = time.perf_counter()
                store.save_prefix(tokens, cache)
                out["save_call_s"] = time.perf_counter() - t_save
                saved = True
                times[-1] = time.perf_counter()  # decode is timed from here
    else:
        times, first = generate(model, tokens[n:], cache, decode=DECODE)
    out["first_token_s"] = times[0] - t0
    out["decode_tok_s"] = (len(times) - 1) / (times[-1] - times[0])
    if store is not None:
        t_flush = time.perf_counter()
        store.flush()
        out["flush_s"] = time.perf_counter() - t_flush
        stats = store.stats()
        for key in ("corrupt", "writes_failed", "restores_chosen", "recomputes_chosen"):
            out[key] = stats[key]
    # Decode again once every write is done: what kvstore leaves behind.
    later, _ = generate(model, [first], cache, decode=DECODE // 2)
    out["decode_after_tok_s"] = (len(later) - 1) / (later[-1] - later[0])
    if store is not None:
        store.close()
    out["first_token"] = first
    return out


def setup(spec: dict) -> dict:
    """Store every prompt (kvstore and mlx-lm's file); record each first token."""
    mx = _imports()
    from mlx_lm.models.cache import make_prompt_cache, save_prompt_cache

    import kvstore

    model = build(spec["shape"])
    out = {}
    with kvstore.KVStore(spec["store"], model, ram_bytes=0) as store:
        for length in spec["lengths"]:
            tokens = prompt(spec["shape"], length)
            cache = make_prompt_cache(model)
            warm_up(model)
            t_prefill = time.perf_counter()
            prefill(model, tokens[:-1], cache)
            t_prefill = time.perf_counter() - t_prefill
            # The rate a generate loop would have told the store (restore="auto").
            store.note_prefill(length - 1, t_prefill)
            store.save(tokens[:-1], cache)
            store.flush()
            save_prompt_cache(
                os.path.join(spec["dir"], f"lpc-{length}.safetensors"), cache
            )
            kv = sum(c.nbytes for c in cache)
            out[str(length)] = {"kv_bytes": kv, "prefill_s": t_prefill}
            del cache
            mx.clear_cache()
        out["stats"] = {
            k: store.stats()[k] for k in ("nodes", "bytes_on_disk", "writes_failed")
        }
    return out


def case_order(cases: list, row: int) -> list:
    """Row ``row`` (mod the number of cases) of a Latin square of ``cases``: over as
    many repeats as cases, every case runs once in every position at each length
    (rows start one further on per length, so no case opens every length of a
    repeat). The first row is Williams' (0, 1, n-1, 2, n-2, ...): for an even number
    of cases each case also follows every other once."""
    n = len(cases)
    first, lo, hi = [0], 1, n - 1
    while len(first) < n:
        first.append(lo)
        lo += 1
        if len(first) < n:
            first.append(hi)
            hi -= 1
    return [cases[(i + row) % n] for i in first]


def spawn(spec: dict, *, script: str = __file__) -> dict:
    """``script --child SPEC`` in a fresh process (this tool's children, or a probe's
    built on it): its last line of output, as JSON."""
    proc = subprocess.run(
        [sys.executable, script, "--child", json.dumps(spec)],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"child {spec.get('case')} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def drop_page_cache() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama-8b")
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192, 32768])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--cases", nargs="+", choices=CASES, default=CASES)
    p.add_argument("--dir", help="scratch directory (stores, files)")
    p.add_argument("--json", help="write every sample here")
    p.add_argument(
        "--cold-disk",
        action="store_true",
        help="drop the page cache before each case (root, Linux)",
    )
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        spec = json.loads(args.child)
        result = setup(spec) if spec.get("setup") else child(spec)
        print(json.dumps(result))
        return 0
    if not args.dir:
        p.error("--dir is required")
    os.makedirs(args.dir, exist_ok=True)
    store = os.path.join(args.dir, "store")
    t0 = time.perf_counter()
    info = spawn(
        {
            "setup": True,
            "shape": args.shape,
            "lengths": args.lengths,
            "store": store,
            "dir": args.dir,
        }
    )
    print(f"setup {time.perf_counter() - t0:.1f} s: {json.dumps(info)}", flush=True)
    samples = []
    if args.repeats < len(args.cases):
        print(
            f"note: {args.repeats} repeats of {len(args.cases)} cases: not every case "
            f"runs in every position (that takes {len(args.cases)} repeats)",
            flush=True,
        )
    for rep in range(args.repeats):
        for li, length in enumerate(args.lengths):
            order = case_order(args.cases, rep + li)
            for position, case in enumerate(order):
                scratch = os.path.join(args.dir, f"scratch-{length}-{rep}")
                spec = {
                    "shape": args.shape,
                    "length": length,
                    "case": case,
                    "store": store,
                    "scratch": scratch,
                    "lpc": os.path.join(args.dir, f"lpc-{length}.safetensors"),
                }
                if args.cold_disk:
                    spec["page_cache_dropped"] = drop_page_cache()
                r = spawn(spec)
                r.update(case=case, length=length, repeat=rep, position=position)
                if args.cold_disk:
                    r["page_cache_dropped"] = spec["page_cache_dropped"]
                samples.append(r)
                print(json.dumps(r), flush=True)
                if case == "cold+save":
                    subprocess.run(["rm", "-rf", scratch])
    report(samples, args.lengths, args.cases)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"args": vars(args), "setup": info, "samples": samples}, f, indent=1
            )
    return 0


def report(samples, lengths, cases) -> None:
    def med(case, length, key):
        xs = [s[key] for s in samples if s["case"] == case and s["length"] == length]
        xs = [x for x in xs if x is not None]
        return statistics.median(xs) if xs else float("nan")

    print(
        "\nfirst token after a restart, ms; decode tokens/s at once / after every "
        "write is done (medians)"
    )
    print("| case | " + " | ".join(f"{n} tokens" for n in lengths) + " |")
    print("|---|" + "---|" * len(lengths))
    for case in cases:
        cells = [
            f"{1000 * med(case, n, 'first_token_s'):.0f} ms, "
            f"{med(case, n, 'decode_tok_s'):.1f} / "
            f"{med(case, n, 'decode_after_tok_s'):.1f} tok/s"
            for n in lengths
        ]
        print(f"| {case} | " + " | ".join(cells) + " |")
    for n in lengths:
        tokens = {s["first_token"] for s in samples if s["length"] == n}
        print(f"{n}: first tokens seen {sorted(tokens)} (one value: every case agrees)")
        cold = med("cold", n, "first_token_s")
        for case in cases:
            if case.startswith("kvstore") or case == "load_prompt_cache":
                print(
                    f"{n}: {case} first token {cold / med(case, n, 'first_token_s'):.2f}x"
                    f" cold; decode {med(case, n, 'decode_tok_s') / med('cold', n, 'decode_tok_s'):.3f}x cold"
                )
        for case in cases:
            after = med(case, n, "decode_after_tok_s") / med(
                "cold", n, "decode_after_tok_s"
            )
            print(f"{n}: {case} decode after writes {after:.3f}x cold")
        if "cold+save" in cases:
            print(
                f"{n}: decode while saving {med('cold+save', n, 'decode_tok_s') / med('cold', n, 'decode_tok_s'):.3f}x cold"
            )


if __name__ == "__main__":
    sys.exit(main())
