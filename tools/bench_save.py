#!/usr/bin/env python
"""Save until durable vs the disk's own speed: the same bytes as one file, one fsync.

Usage::

    python tools/bench_save.py [--tokens 32768] [--repeats 5] [--dtype float16]
                               [--ram-bytes 0] [--per-node-files] [--dir DIR]
                               [--json OUT]

The measuring is :mod:`kvstore.bench.durable` (the same code as ``kvstore bench``'s
``durable`` section; its docstring says what each case times). The ratio is one
file's time / kvstore's (1.0: kvstore saves at the disk's one-file speed), per
repeat and as the ratio of the medians. Nothing here asserts a time; pytest never
collects tools/.
"""

import argparse
import json
import platform
import shutil
import sys
import tempfile


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument(
        "--dtype", choices=["float16", "bfloat16", "float32"], default="float16"
    )
    p.add_argument("--chunk-tokens", type=int, default=256)
    p.add_argument(
        "--ram-bytes",
        type=int,
        default=0,
        help="the store's RAM tier (default 0; KVStore's own default is 512 MiB)",
    )
    p.add_argument(
        "--per-node-files",
        action="store_true",
        help="also time the same bytes as one fsynced file per node",
    )
    p.add_argument("--dir", help="where to write (default: a temp dir under /tmp)")
    p.add_argument("--json", metavar="OUT", help="write every sample to this file")
    args = p.parse_args(argv)
    if args.tokens < 2 or args.repeats < 1 or args.chunk_tokens < 1:
        p.error("--tokens >= 2, --repeats >= 1, --chunk-tokens >= 1")
    return args


def main(argv=None):
    args = parse_args(argv)
    from kvstore.bench import report
    from kvstore.bench.durable import bench_durable

    root = tempfile.mkdtemp(prefix="kvstore-bench-save-", dir=args.dir)
    try:
        d = bench_durable(
            args.tokens,
            repeats=args.repeats,
            chunk_tokens=args.chunk_tokens,
            tmp=root,
            dtype=args.dtype,
            ram_bytes=args.ram_bytes,
            per_node_files=args.per_node_files,
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"on {platform.node()}:", end="")
    report.print_durable(d)
    report.print_targets(report.restart_targets({"durable": d}))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"argv": sys.argv, "durable": d}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
