"""``kvstore bench``: does kvstore beat recomputation and its peers, on this machine?

Cases: cold prefill; RAM-hot; disk-hot in the same process and after a
restart (a fresh process, open time included); nearest prefix; mlx-lm's
``load_prompt_cache`` of the same KV; a raw sequential read of the same bytes; the
write cost of saving while prefilling; open and lookup times against the number of
stored chunks. Prints a table and the project's targets as PASS/MISS ratios measured in
this one run; ``--json`` and ``--plot`` write the numbers and a chart.
"""

import argparse
import json
import shlex
import shutil
import sys
import tempfile
import time
from typing import List, Optional

SECTIONS = ("ttft", "write", "restore", "scale")
DEFAULTS = {
    "lengths": [128, 512, 2048],
    "restore_lengths": [2048, 8192, 32768, 100000],
    "scale_counts": [10, 1000, 100000],
    "write_tokens": 256,
    "repeats": 3,
}
QUICK = {
    "lengths": [32, 128],
    "restore_lengths": [1024, 8192],
    "scale_counts": [10, 100, 1000],
    "write_tokens": 32,
    "repeats": 2,
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
    return p


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    preset = QUICK if args.quick else DEFAULTS
    for key, value in preset.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    for key in ("lengths", "restore_lengths", "scale_counts"):
        setattr(args, key, sorted(set(getattr(args, key))))
    if min(args.lengths) < 2 or min(args.restore_lengths) < 2:
        parser.error("lengths must be >= 2 tokens")
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
    from kvstore.bench.models import load
    from kvstore.bench.restore import bench_restore
    from kvstore.bench.scale import bench_scale
    from kvstore.bench.ttft import Prompts, bench_ttft, bench_write

    model_name = args.model
    if model_name is None:
        from kvstore.default_model import ensure_default_model

        model_name = ensure_default_model()
    model, tokenizer = load(model_name)
    tmp = tempfile.mkdtemp(prefix="kvstore-bench-", dir=args.dir)
    conditions = ["warm"]
    if args.page_cache == "auto" and can_drop_page_cache(tmp):
        conditions.append("dropped")
    env = environment()
    res = {
        "command": "kvstore bench "
        + shlex.join(sys.argv[1:] if argv is None else argv),
        "environment": env,
        "model": args.model or "SmolLM2-135M-Instruct (kvstore.default_model)",
        "settings": {
            k: getattr(args, k)
            for k in (
                "lengths",
                "restore_lengths",
                "scale_counts",
                "write_tokens",
                "repeats",
                "suffix_tokens",
                "chunk_tokens",
                "only",
            )
        },
        "page_cache_conditions": conditions,
        "temp_dir": tmp,
    }
    _print_header(res, tmp, args)
    prompts = Prompts(model, seed=12345)
    common = {"repeats": args.repeats, "chunk_tokens": args.chunk_tokens, "tmp": tmp}
    t0 = time.perf_counter()
    try:
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
        res["seconds"] = time.perf_counter() - t0
        res["targets"] = report.targets(res)
        report.print_report(res)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(res, f, indent=1)
            print(f"\nJSON written to {args.json}")
        if args.plot:
            report.plot(res, args.plot)
            print(f"chart written to {args.plot}")
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    return 0


def _replay(args, report) -> int:
    """Print (and plot) a saved run, with its targets evaluated by this version."""
    with open(args.from_json) as f:
        res = json.load(f)
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
