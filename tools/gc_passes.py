#!/usr/bin/env python
"""Where ``kvstore gc`` spends its time: each of its passes timed (wall and CPU).

Usage::

    python tools/gc_passes.py STORE [STORE ...] [--fraction 0.5] [--no-check-data]
        [--profile PASS] [--evict-batch N] [--json OUT]

For each store: ``gc --max-bytes`` (``--fraction`` of the bytes it holds) on a scratch
copy (chunk files hard-linked, index copied: ``tools/bench_scale.py``'s
``scratch_copy``), in this process, with every pass of
:func:`kvstore.maintenance.gc.gc` timed: dropping namespaces, removing broken nodes
(the check of every record and file), eviction, orphans, temp files.
``--profile _evict`` (or another pass's function name) prints that pass's 25 most
expensive functions (cProfile, by own time). Each eviction commit (its deletions and
the commit) is timed too, reported as the median of each twelfth of them in order, and
the process's peak RSS; ``--evict-batch`` sets the nodes a commit deletes (gc's own
batches grow to 2,048). Stores built by ``tools/bench_scale.py``.
"""

import argparse
import cProfile
import importlib
import json
import os
import pstats
import resource
import shutil
import statistics
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


def timed_gc(
    path: str,
    *,
    fraction: float,
    check_data: bool,
    profile=None,
    evict_batch=None,
) -> dict:
    from bench_scale import scratch_copy

    from kvstore import maintenance
    from kvstore.disk.index import Index
    from kvstore.maintenance import common

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

    commits, write, batch = [], Index.write, common._RELEASE_BATCH

    def timed_write(self, fn, *args, **kwargs):
        tic = time.perf_counter()
        try:
            return write(self, fn, *args, **kwargs)
        finally:
            if kwargs.get("frees"):  # an eviction's (or a removal's) commit
                commits.append(time.perf_counter() - tic)

    totals = maintenance.store_stats(path)["totals"]
    copy = scratch_copy(path, path.rstrip(os.sep) + "-gc-passes")
    try:
        Index.write = timed_write
        if evict_batch:
            common._RELEASE_BATCH = evict_batch
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
        Index.write, common._RELEASE_BATCH = write, batch
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
        "evict_batch": evict_batch or batch,
        "passes": times,
        "commits": len(commits),
        "commit_ms_by_twelfth": _twelfths(commits),
        "max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024,
    }


def _twelfths(seconds: list) -> list:
    """The median of each twelfth of ``seconds`` (in order; fewer parts for fewer
    than 12), in ms."""
    n = len(seconds)
    parts = min(12, n)
    bounds = [n * i // parts for i in range(parts + 1)] if parts else []
    return [
        round(statistics.median(seconds[a:b]) * 1e3, 1)
        for a, b in zip(bounds, bounds[1:])
    ]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("stores", nargs="+")
    p.add_argument("--fraction", type=float, default=0.5, help="budget: of the bytes")
    p.add_argument("--no-check-data", action="store_true", help="gc --no-check-data")
    p.add_argument("--profile", choices=PASSES, help="cProfile this pass")
    p.add_argument(
        "--evict-batch", type=int, metavar="N", help="nodes an eviction commit deletes"
    )
    p.add_argument("--json", metavar="OUT", help="append one line per store")
    args = p.parse_args(argv)
    for path in args.stores:
        result = timed_gc(
            path,
            fraction=args.fraction,
            check_data=not args.no_check_data,
            profile=args.profile,
            evict_batch=args.evict_batch,
        )
        print(json.dumps(result))
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
