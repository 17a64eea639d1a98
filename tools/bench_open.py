#!/usr/bin/env python
"""Time to open a store: a model it has seen (known) vs one it has not (new).

Usage::

    python tools/bench_open.py [--model M] [--repeats 7] [--weights-gb 2 8]
                               [--json OUT]

The measuring is :mod:`kvstore.bench.opening` (the same code as ``kvstore bench``'s
``open`` section; its docstring says what each case times). ``--weights-gb`` adds
synthetic llamas of about that many GB of float16 weights (memory: that many GB).

A tool, not a test: pytest never collects tools/. Nothing here asserts a time.
"""

import argparse
import json
import shutil
import sys
import tempfile


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="mlx-lm path or hub id (default: SmolLM2-135M)")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--weights-gb", type=float, nargs="*", default=[], metavar="GB")
    p.add_argument("--json", metavar="OUT")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    return args


def main(argv=None):
    args = parse_args(argv)
    from kvstore.bench import report
    from kvstore.bench.models import load, model_path
    from kvstore.bench.opening import bench_open

    model_name = model_path(args.model)
    model, tok = load(model_name)
    root = tempfile.mkdtemp(prefix="kvstore-bench-open-")
    try:
        res = bench_open(
            model,
            tok,
            model_name=model_name,
            repeats=args.repeats,
            tmp=root,
            weights_gb=args.weights_gb,
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    report.print_open(res)
    report.print_targets(report.restart_targets({"open": res}))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"argv": sys.argv, "open": res}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
