"""What the page checks of an index cost when a store opens (kvstore/mdbcheck.py).

Builds indexes of N node records (records only: the check reads no chunk file), then
times, each in a fresh child process so nothing is warm but the page cache: opening
the index as the library does (``Index(...)``: the bounded check of meta pages and
roots, and LMDB's own open), as the maintenance commands and ``kvstore serve``'s
start do (``Index(..., check="full")``: every page), and the full page check alone;
median of the runs with every sample. The floor beside them is opening the same
index with no page check.

    python tools/bench_index_check.py --nodes 1000 10000 100000 --runs 5
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

_CHILD = r"""
import json, os, sys, time
from kvstore.disk import storecheck
from kvstore.disk.index import Index
path, mode = sys.argv[1], sys.argv[2]
if mode == "skip":
    storecheck._check_pages = lambda env, data, store, full=True: 0
tic = time.perf_counter()
if mode == "check":
    import lmdb
    from kvstore.disk import mdbcheck
    fd = os.open(os.path.join(path, "data.mdb"), os.O_RDONLY)
    metas = mdbcheck.read_meta_pages(fd)
    meta = max(metas, key=lambda m: m.txnid)
    pages = mdbcheck.check_file(fd, meta, os.fstat(fd).st_size)
else:
    check = "full" if mode == "full" else "roots"
    Index(path, create=False, readonly=True, check=check).close()
    pages = None
print(json.dumps([time.perf_counter() - tic, pages]))
"""


def build(path: str, nodes: int, chunk_tokens: int) -> int:
    """An index of ``nodes`` records in chains of 16; returns data.mdb's size."""
    from kvstore.disk.chunking import chain_hash, root_hash
    from kvstore.disk.index import Index, NodeRecord

    ns = bytes(range(16))
    index = Index(path, create=True)
    rng = np.random.default_rng(0)
    try:
        done = 0
        while done < nodes:

            def write(txn, done=done):
                parent, start = root_hash(ns), 0
                for i in range(min(4096, nodes - done)):
                    if i % 16 == 0:
                        parent, start = root_hash(ns), 0
                    tokens = rng.integers(0, 50000, chunk_tokens).astype(np.int32)
                    h = chain_hash(parent, tokens)
                    rec = NodeRecord(parent, start, tokens, 1000, 1, created=1.0)
                    index.put_node(txn, ns, h, rec)
                    parent, start = h, start + chunk_tokens

            index.write(write)
            done += 4096
    finally:
        index.close()
    return os.path.getsize(os.path.join(path, "data.mdb"))


def child(path: str, mode: str) -> float:
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, path, mode],
        capture_output=True,
        text=True,
    )
    if out.returncode:
        raise SystemExit(f"the {mode} child failed: {out.stderr.strip()[-2000:]}")
    return json.loads(out.stdout)  # [seconds, pages checked or None]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, nargs="+", default=[1000, 10000, 100000])
    ap.add_argument("--chunk-tokens", type=int, default=256)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    for n in args.nodes:
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "index")
            tic = time.perf_counter()
            size = build(path, n, args.chunk_tokens)
            built = time.perf_counter() - tic
            samples = {"open": [], "skip": [], "full": [], "check": []}
            live = 0
            for _ in range(args.runs):  # alternating, each in a fresh process
                for mode in samples:
                    seconds, checked = child(path, mode)
                    samples[mode].append(seconds)
                    live = checked or live
            med = {m: statistics.median(v) for m, v in samples.items()}
            print(
                f"{n} nodes of {args.chunk_tokens} tokens, data.mdb {size / 2**20:.1f} "
                f"MiB (built in {built:.1f} s): open {med['open'] * 1e3:.1f} ms, "
                f"open without a check {med['skip'] * 1e3:.1f} ms, open with the full "
                f"check {med['full'] * 1e3:.1f} ms, the full check alone "
                f"{med['check'] * 1e3:.1f} ms ({live} pages checked, "
                f"{med['check'] / live * 1e6:.1f} us a page)"
            )
            print("  samples (s):", json.dumps(samples))


if __name__ == "__main__":
    main()
