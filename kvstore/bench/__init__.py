"""``kvstore bench``: does kvstore beat recomputation and its peers, on this machine?

Cases: cold prefill; RAM-hot; disk-hot in the same process and after a restart (a
fresh process, open time included); nearest prefix; mlx-lm's ``load_prompt_cache`` of
the same KV; a raw sequential read of the same bytes; the write cost of saving while
prefilling; open and lookup times against the number of stored chunks. Then, on KV of
SmolLM2-135M's shape in float16, bfloat16 and float32: the first restore after a
restart (fresh child processes: kvstore, ``load_prompt_cache`` and the floor, the same
bytes read into fresh buffers), repeated restores in one process, the store's open
time for a known and a new model, and saving until durable against one file with one
fsync; the same repeated restores with MLX's freed buffers recycled (the read path
alone); the latency of a fetch that finds nothing, of the hash chain of a long prompt,
and of ``save`` handing its write to the background writer. Prints tables and the targets as PASS/MISS ratios measured in this one run;
``--json`` and ``--plot`` write the numbers and a chart.
"""

import argparse
import json
import shlex
import shutil
import sys
import tempfile
import time
from typing import List, Optional

SECTIONS = (
    "ttft",
    "write",
    "restore",
    "scale",
    "fresh",
    "repeat",
    "recycled",
    "open",
    "durable",
    "miss",
    "hash",
    "save",
)
DTYPES = ("float16", "bfloat16", "float32")
DEFAULTS = {
    "lengths": [128, 512, 2048],
    "restore_lengths": [2048, 8192, 32768, 100000],
    "scale_counts": [10, 1000, 100000],
    "write_tokens": 256,
    "repeats": 3,
    "fresh_lengths": [2048, 8192, 32768],
    "fresh_dtypes": list(DTYPES),
    "repeat_lengths": [512, 4096, 32768],
    "repeat_dtypes": ["float16", "float32"],
    "restore_repeats": 5,
    "durable_tokens": 32768,
    "miss_tokens": 32768,
    "hash_tokens": 100000,
    "save_tokens": 4096,
}
QUICK = {
    "lengths": [32, 128],
    "restore_lengths": [1024, 8192],
    "scale_counts": [10, 100, 1000],
    "write_tokens": 32,
    "repeats": 2,
    "fresh_lengths": [1024],
    "fresh_dtypes": ["float16"],
    "repeat_lengths": [512],
    "repeat_dtypes": ["float16"],
    "restore_repeats": 2,
    "durable_tokens": 1024,
    "miss_tokens": 32768,
    "hash_tokens": 100000,
    "save_tokens": 1024,
}


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvstore bench",
        description="Benchmark kvstore against recomputation, mlx-lm's prompt-cache "
        "files and raw reads; print a table and the targets' ratios.",
    )
    _add_model_options(p.add_argument_group("model and restore sections"))
    _add_restart_options(
        p.add_argument_group("after-a-restart, open and save sections")
    )
    _add_run_options(p.add_argument_group("the run"))
    return p


def _add_model_options(p) -> None:
    p.add_argument(
        "--model",
        default=None,
        help="mlx-lm model path or hub id (default: SmolLM2-135M-Instruct)",
    )
    p.add_argument(
        "--lengths",
        type=_positive,
        nargs="+",
        metavar="N",
        help=f"prompt lengths run through the model (default: {DEFAULTS['lengths']})",
    )
    p.add_argument(
        "--restore-lengths",
        type=_positive,
        nargs="+",
        metavar="N",
        help="tokens of synthetic KV for the restore-only cases "
        f"(default: {DEFAULTS['restore_lengths']})",
    )
    p.add_argument(
        "--scale-counts",
        type=_positive,
        nargs="+",
        metavar="N",
        help=f"stored chunks for the scale case (default: {DEFAULTS['scale_counts']})",
    )
    p.add_argument(
        "--write-tokens",
        type=_positive,
        help=f"prompt length for the write cost (default: {DEFAULTS['write_tokens']})",
    )
    p.add_argument("--repeats", type=_positive, help="default: 3 (2 with --quick)")
    p.add_argument(
        "--suffix-tokens",
        type=_positive,
        default=32,
        help="new tokens after the stored prefix, nearest-prefix case (default: 32)",
    )


def _add_restart_options(p) -> None:
    p.add_argument(
        "--fresh-lengths",
        type=_positive,
        nargs="+",
        metavar="N",
        help="tokens restored in fresh processes (after a restart; default: "
        f"{DEFAULTS['fresh_lengths']})",
    )
    p.add_argument(
        "--fresh-dtypes",
        nargs="+",
        choices=DTYPES,
        help=f"KV dtypes after a restart (default: {DEFAULTS['fresh_dtypes']})",
    )
    p.add_argument(
        "--repeat-lengths",
        type=_positive,
        nargs="+",
        metavar="N",
        help="tokens restored repeatedly in one process (default: "
        f"{DEFAULTS['repeat_lengths']})",
    )
    p.add_argument(
        "--repeat-dtypes",
        nargs="+",
        choices=DTYPES,
        help=f"KV dtypes of repeated restores (default: {DEFAULTS['repeat_dtypes']})",
    )
    p.add_argument(
        "--restore-repeats",
        type=_positive,
        help="samples per case of the fresh, repeat, recycled and open sections "
        "(default: "
        f"{DEFAULTS['restore_repeats']})",
    )
    p.add_argument(
        "--durable-tokens",
        type=_positive,
        help="tokens of float16 KV saved until durable (default: "
        f"{DEFAULTS['durable_tokens']})",
    )
    p.add_argument(
        "--open-weights-gb",
        type=float,
        nargs="*",
        default=[],
        metavar="GB",
        help="open section: also synthetic llamas of about this many GB of float16 "
        "weights (memory: that many GB; default: none)",
    )


def _add_run_options(p) -> None:
    p.add_argument("--chunk-tokens", type=_positive, default=256)
    p.add_argument(
        "--only", nargs="+", choices=SECTIONS, default=list(SECTIONS), metavar="SECTION"
    )
    p.add_argument(
        "--page-cache",
        choices=["auto", "warm"],
        default="auto",
        help="auto: disk cases warm and, where the kernel allows, dropped (default)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help=f"small sizes for a smoke run: {QUICK} unless given",
    )
    p.add_argument("--dir", default=None, help="where the temporary stores go")
    p.add_argument("--json", metavar="OUT", help="write every number to this file")
    p.add_argument("--plot", metavar="OUT.png", help="draw the chart (matplotlib)")
    p.add_argument("--keep", action="store_true", help="keep the temporary directory")
    p.add_argument(
        "--from-json",
        metavar="IN",
        help="measure nothing: print the tables and targets (and --plot) of a saved run",
    )
    p.add_argument(
        "--markdown",
        action="store_true",
        help="with --from-json: print the restart sections as markdown tables",
    )


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    preset = QUICK if args.quick else DEFAULTS
    for key, value in preset.items():  # the miss, hash and save sizes: presets only
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    for key in (
        "lengths",
        "restore_lengths",
        "scale_counts",
        "fresh_lengths",
        "repeat_lengths",
    ):
        setattr(args, key, sorted(set(getattr(args, key))))
    for key in ("fresh_dtypes", "repeat_dtypes"):  # in the order of DTYPES
        setattr(args, key, [d for d in DTYPES if d in getattr(args, key)])
    lengths = (args.lengths, args.restore_lengths, args.fresh_lengths)
    if min(min(x) for x in lengths + (args.repeat_lengths,)) < 2:
        parser.error("lengths must be >= 2 tokens")
    if args.markdown and not args.from_json:
        parser.error("--markdown prints a saved run: give --from-json IN")
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:  # say so now, not after minutes of measuring
            parser.error(
                "--plot needs matplotlib: pip install 'kvstore[plot]' (or matplotlib)"
            )
    return args


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    from kvstore.bench import report

    if args.from_json:
        return _replay(args, report)
    from kvstore.bench.measure import can_drop_page_cache, environment
    from kvstore.bench.models import load, model_path

    model_name = model_path(args.model)
    model, tokenizer = load(model_name)
    tmp = tempfile.mkdtemp(prefix="kvstore-bench-", dir=args.dir)
    conditions = ["warm"]
    if args.page_cache == "auto" and can_drop_page_cache(tmp):
        conditions.append("dropped")
    res = {
        "command": "kvstore bench "
        + shlex.join(sys.argv[1:] if argv is None else argv),
        "environment": environment(),
        "model": args.model or "SmolLM2-135M-Instruct (kvstore.platform.default_model)",
        "settings": {k: getattr(args, k) for k in _SETTINGS},
        "page_cache_conditions": conditions,
        "temp_dir": tmp,
    }
    _print_header(res, tmp, args)
    t0 = time.perf_counter()
    try:
        res.update(
            _run_sections(
                args,
                model,
                tokenizer,
                model_name=model_name,
                conditions=conditions,
                tmp=tmp,
            )
        )
        res["seconds"] = time.perf_counter() - t0
        res["targets"] = report.targets(res)
        report.print_report(res)
        _write_outputs(res, args, report)
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    return 0


# The options a run records in its JSON (its "settings").
_SETTINGS = (
    "lengths",
    "restore_lengths",
    "scale_counts",
    "write_tokens",
    "repeats",
    "suffix_tokens",
    "chunk_tokens",
    "only",
    "fresh_lengths",
    "fresh_dtypes",
    "repeat_lengths",
    "repeat_dtypes",
    "restore_repeats",
    "durable_tokens",
    "open_weights_gb",
    "miss_tokens",
    "hash_tokens",
    "save_tokens",
)


def _run_sections(args, model, tokenizer, *, model_name, conditions, tmp) -> dict:
    """Run the sections ``args.only`` names, in order; their results by name."""
    from kvstore.bench.calls import bench_hash, bench_miss, bench_save
    from kvstore.bench.durable import bench_durable
    from kvstore.bench.fresh import bench_fresh
    from kvstore.bench.opening import bench_open
    from kvstore.bench.repeat import bench_repeat
    from kvstore.bench.restore import bench_restore
    from kvstore.bench.scale import bench_scale
    from kvstore.bench.ttft import Prompts, bench_ttft, bench_write

    res = {}
    prompts = Prompts(model, seed=12345)
    common = {"repeats": args.repeats, "chunk_tokens": args.chunk_tokens, "tmp": tmp}
    if "ttft" in args.only:
        res["ttft"] = bench_ttft(
            model,
            tokenizer,
            model_name=model_name,
            lengths=args.lengths,
            suffix=args.suffix_tokens,
            conditions=conditions,
            prompts=prompts,
            **common,
        )
    if "write" in args.only:
        res["write"] = bench_write(
            model, tokenizer, tokens=args.write_tokens, prompts=prompts, **common
        )
    if "restore" in args.only:
        res["restore"] = bench_restore(
            model,
            tokenizer,
            args.restore_lengths,
            model_name=model_name,
            conditions=conditions,
            restart=True,
            prompts=prompts,
            **common,
        )
    if "scale" in args.only:
        res["scale"] = bench_scale(args.scale_counts, repeats=args.repeats, tmp=tmp)
    restarts = {
        "repeats": args.restore_repeats,
        "chunk_tokens": args.chunk_tokens,
        "tmp": tmp,
    }
    if "fresh" in args.only:
        res["fresh"] = bench_fresh(args.fresh_dtypes, args.fresh_lengths, **restarts)
    if "repeat" in args.only:
        res["repeat"] = bench_repeat(
            args.repeat_dtypes, args.repeat_lengths, **restarts
        )
    if "recycled" in args.only:
        res["recycled"] = bench_repeat(
            args.repeat_dtypes, args.repeat_lengths, recycled=True, **restarts
        )
    if "open" in args.only:
        res["open"] = bench_open(
            model,
            tokenizer,
            model_name=model_name,
            repeats=args.restore_repeats,
            tmp=tmp,
            weights_gb=args.open_weights_gb,
        )
    if "durable" in args.only:
        res["durable"] = bench_durable(
            args.durable_tokens,
            repeats=args.repeats,
            chunk_tokens=args.chunk_tokens,
            tmp=tmp,
        )
    calls = {"chunk_tokens": args.chunk_tokens}
    if "miss" in args.only:
        res["miss"] = bench_miss(args.miss_tokens, calls=200, tmp=tmp, **calls)
    if "hash" in args.only:
        res["hash"] = bench_hash(args.hash_tokens, calls=100, **calls)
    if "save" in args.only:
        res["save"] = bench_save(
            args.save_tokens, repeats=args.repeats, tmp=tmp, **calls
        )
    return res


def _write_outputs(res: dict, args, report) -> None:
    """The JSON and chart files the options ask for."""
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
        print(f"\nJSON written to {args.json}")
    if args.plot:
        report.plot(res, args.plot)
        print(f"chart written to {args.plot}")


def _replay(args, report) -> int:
    """Print (and plot) a saved run, with its targets evaluated by this version."""
    with open(args.from_json) as f:
        res = json.load(f)
    if args.markdown:
        print(report.markdown(res))
        return 0
    print(f"$ {res['command']}  (from {args.from_json})")
    res["targets"] = report.targets(res)
    report.print_report(res)
    if args.plot:
        report.plot(res, args.plot)
        print(f"chart written to {args.plot}")
    return 0


def _print_header(res: dict, tmp: str, args) -> None:
    env = res["environment"]
    print(f"$ {res['command']}")
    print(
        f"mlx {env['mlx']}, mlx-lm {env['mlx_lm']}, python {env['python']}, "
        f"{env['platform']}, {env['cpus']} CPUs, {env['device']}; kvstore git "
        f"{env['kvstore_git']}, source digest {env['kvstore_source_digest']}"
    )
    print(
        f"model: {res['model']}. Prompts: random token ids. Restore-only cases: "
        f"synthetic random KV of the model's cache shape and dtype (no model run)."
    )
    cond = res["page_cache_conditions"]
    print(
        f"chunk_tokens={args.chunk_tokens}; medians of {args.repeats} repeats (cold "
        f"prefill once per length); page cache for disk cases: "
        + (
            "warm (files read just before) and dropped (posix_fadvise DONTNEED per "
            "file, checked with mincore)"
            if "dropped" in cond
            else "warm only (dropping "
            + ("not requested" if args.page_cache == "warm" else "does not work here")
            + ")"
        )
        + f"; temp dir {tmp}",
        flush=True,
    )
