#!/usr/bin/env python
"""Where ``kvstore gc`` spends its time: each of its passes timed (wall and CPU).

Usage::

    python tools/gc_passes.py STORE [STORE ...] [--fraction 0.5] [--no-check-data]
        [--profile PASS] [--json OUT]

For each store: ``gc --max-bytes`` (``--fraction`` of the bytes it holds) on a scratch
copy (chunk files hard-linked, index copied: ``tools/bench_scale.py``'s
``scratch_copy``), in this process, with every pass of
:func:`kvstore.maintenance.gc.gc` timed: dropping namespaces, removing broken nodes
(the check of every record and file), eviction, orphans, temp files.
``--profile _evict`` (or another pass's function name) prints that pass's 25 most
expensive functions (cProfile, by own time). Stores built by ``tools/bench_scale.py``.
"""

import argparse
import cProfile
import importlib
import json
import os
import pstats
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PASSES = (
    "_drop_namespaces",
    "_remove_broken",
    "_evict",
    "_remove_orphans",
    "_remove_temp_files",
)


def timed_gc(path: str, *, fraction: float, check_data: bool, profile=None) -> dict:
    from bench_scale import scratch_copy

    from kvstore import maintenance

    gcmod = importlib.import_module("kvstore.maintenance.gc")
    times, prof = {}, cProfile.Profile() if profile else None
    originals = {name: getattr(gcmod, name) for name in PASSES}

    def timed(name, fn):
        def run(*args, **kwargs):
            wall, cpu = time.perf_counter(), time.process_time()
            if name == profile:
                prof.enable()
            try:
                return fn(*args, **kwargs)
            finally:
                if name == profile:
                    prof.disable()
                times[name] = {
                    "wall_s": round(time.perf_counter() - wall, 3),
                    "cpu_s": round(time.process_time() - cpu, 3),
                }

        return run

    totals = maintenance.store_stats(path)["totals"]
    copy = scratch_copy(path, path.rstrip(os.sep) + "-gc-passes")
    try:
        for name, fn in originals.items():
            setattr(gcmod, name, timed(name, fn))
        wall, cpu = time.perf_counter(), time.process_time()
        report = gcmod.gc(
            copy, max_bytes=int(totals["bytes"] * fraction), check_data=check_data
        )
        times["total"] = {
            "wall_s": round(time.perf_counter() - wall, 3),
            "cpu_s": round(time.process_time() - cpu, 3),
        }
    finally:
        for name, fn in originals.items():
            setattr(gcmod, name, fn)
        shutil.rmtree(copy, ignore_errors=True)
    if prof is not None:
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    return {
        "store": path,
        "nodes": totals["nodes"],
        "evicted_nodes": report["evicted_nodes"],
        "check_data": check_data,
        "passes": times,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("stores", nargs="+")
    p.add_argument("--fraction", type=float, default=0.5, help="budget: of the bytes")
    p.add_argument("--no-check-data", action="store_true", help="gc --no-check-data")
    p.add_argument("--profile", choices=PASSES, help="cProfile this pass")
    p.add_argument("--json", metavar="OUT", help="append one line per store")
    args = p.parse_args(argv)
    for path in args.stores:
        result = timed_gc(
            path,
            fraction=args.fraction,
            check_data=not args.no_check_data,
            profile=args.profile,
        )
        print(json.dumps(result))
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
