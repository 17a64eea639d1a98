"""What the page checks of an index cost when a store opens (kvstore/disk/mdbcheck.py,
kvstore/disk/pageguard.py).

Builds indexes of N node records (records only: the check reads no chunk file), then
times, each in a fresh child process so nothing is warm but the page cache:

* ``open``: opening the index as the library does (``Index(...)``: the bounded check
  of meta pages, roots and small trees, LMDB's own open, and starting the full check
  in the background), then closing it (which stops that check);
* ``skip``: the floor, the same open with no page check at all, and ``thread``:
  that with a thread started and joined, as ``open`` starts and stops its check's;
* ``full``: opening as the maintenance commands and ``kvstore serve``'s start do
  (``Index(..., check="full")``: every page before the open returns);
* ``check``: the full page check alone;
* ``audit``: a library open until its background check has passed (from then on
  the read path checks nothing);
* ``busy``: the 90th percentile of another thread's steps (a little Python and a
  ``pread``) while the background check runs, against ``busy-floor`` without it;
* ``lookup``: one children lookup (``Index.children`` of a random node: a cursor
  range) while the background check has not passed, so its range is checked first,
  and ``lookup-floor``: the same lookups with no check (medians over the lookups of
  one process, 200 of them).

With ``--compare SRC`` (a kvstore source tree, e.g. an older commit's ``git
archive``), ``open`` also runs with that code (``open@SRC``) in the same rounds.

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
import json, os, random, statistics, sys, time
from kvstore.disk import storecheck
from kvstore.disk.index import Index
path, mode = sys.argv[1], sys.argv[2]
pages = None
if mode in ("skip", "thread", "lookup-floor", "lookup", "busy-floor"):
    storecheck._check_pages = lambda env, data, store, full=True: 0
    try:
        from kvstore.disk import pageguard
    except ImportError:
        pageguard = None
    if pageguard is not None:
        pageguard.PageAudit.start = lambda *a, **kw: None  # the check never passes
        if mode != "lookup":
            Index.cover = lambda self, txn, name, prefix=b"": True
tic = time.perf_counter()
if mode == "check":
    from kvstore.disk import mdbcheck
    fd = os.open(os.path.join(path, "data.mdb"), os.O_RDONLY)
    metas = mdbcheck.read_meta_pages(fd)
    meta = max(metas, key=lambda m: m.txnid)
    pages = mdbcheck.check_file(fd, meta, os.fstat(fd).st_size)
elif mode.startswith("lookup"):
    index = Index(path, create=False, readonly=True)
    ns = bytes(range(16))
    cover, Index.cover = Index.cover, lambda self, txn, name, prefix=b"": True
    listing = index.read(lambda t: list(index.iter_nodes(t, ns)), guarded=True)
    parents = [h for _, h, _ in listing]
    Index.cover = cover  # a no-op again for lookup-floor
    random.seed(0)
    times = []
    for h in random.sample(parents, min(200, len(parents))):
        t0 = time.perf_counter()
        index.children(ns, h)
        times.append(time.perf_counter() - t0)
    index.close()
    print(json.dumps([statistics.median(times), None]))
    sys.exit(0)
elif mode.startswith("busy"):
    # Another thread's steps while the background check runs: each a little Python
    # and a call that lets go of the interpreter (as a generate loop's are).
    index = Index(path, create=False, readonly=True)
    fd = os.open(os.path.join(path, "data.mdb"), os.O_RDONLY)
    steps = []
    while len(steps) < 2000 and not index._shared.audit.done.is_set():
        t0 = time.perf_counter()
        sum(range(300))
        os.pread(fd, 4096, 0)
        steps.append(time.perf_counter() - t0)
    index.close()
    steps.sort()
    print(json.dumps([steps[int(len(steps) * 0.9)], None]))
    sys.exit(0)
elif mode == "audit":
    index = Index(path, create=False, readonly=True)
    index._shared.audit.wait()
    assert index._shared.audit.passed
    index.close()
elif mode == "thread":  # the floor with a thread started and joined, as open's
    import threading
    index = Index(path, create=False, readonly=True)
    thread = threading.Thread(target=time.sleep, args=(0.0002,), daemon=True)
    thread.start()
    index.close()
    thread.join()
else:
    check = "full" if mode == "full" else "roots"
    Index(path, create=False, readonly=True, check=check).close()
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


def child(path: str, mode: str, src: str = None) -> list:
    env = dict(os.environ)
    if src is not None:
        env["PYTHONPATH"] = os.path.abspath(src)
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, path, mode],
        capture_output=True,
        text=True,
        env=env,
        cwd=src or None,
    )
    if out.returncode:
        raise SystemExit(f"the {mode} child failed: {out.stderr.strip()[-2000:]}")
    return json.loads(out.stdout)  # [seconds, pages checked or None]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, nargs="+", default=[1000, 10000, 100000])
    ap.add_argument("--chunk-tokens", type=int, default=256)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument(
        "--compare",
        metavar="SRC",
        help="a source tree (the folder holding its kvstore/ package) to open with too",
    )
    ap.add_argument("--index", metavar="DIR", help="an index built before (one size)")
    args = ap.parse_args()
    if args.compare and not os.path.isfile(
        os.path.join(args.compare, "kvstore", "__init__.py")
    ):  # else Python imports this tree's kvstore, and both columns measure it
        ap.error(f"--compare {args.compare}: no kvstore/__init__.py in that folder")
    modes = ["open", "skip", "thread", "full", "check", "audit", "lookup"]
    modes += ["lookup-floor"]
    modes += ["busy", "busy-floor"]
    if args.compare:
        modes.insert(1, "open@")
    for n in args.nodes:
        with tempfile.TemporaryDirectory() as tmp:
            path = args.index or os.path.join(tmp, "index")
            tic = time.perf_counter()
            if not args.index:
                build(path, n, args.chunk_tokens)
            size = os.path.getsize(os.path.join(path, "data.mdb"))
            built = time.perf_counter() - tic
            samples = {m: [] for m in modes}
            live = 0
            for _ in range(args.runs):  # alternating, each in a fresh process
                for mode in modes:
                    if mode == "open@":
                        seconds, _ = child(path, "open", args.compare)
                    else:
                        seconds, checked = child(path, mode)
                        live = checked or live
                    samples[mode].append(seconds)
            med = {m: statistics.median(v) for m, v in samples.items()}
            ms = {m: f"{v * 1e3:.1f} ms" for m, v in med.items()}
            print(
                f"{n} nodes of {args.chunk_tokens} tokens, data.mdb {size / 2**20:.1f} "
                f"MiB (built in {built:.1f} s), {live} pages: open {ms['open']}"
                + (f" (with {args.compare}: {ms['open@']})" if args.compare else "")
                + f", open without a check {ms['skip']} ({ms['thread']} with a thread "
                "started and joined), open with the full check "
                f"{ms['full']}, the full check alone {ms['check']} "
                f"({med['check'] / live * 1e6:.1f} us a page), open until the "
                f"background check passed {ms['audit']}; a children lookup while it "
                f"runs {med['lookup'] * 1e6:.0f} us, without any check "
                f"{med['lookup-floor'] * 1e6:.0f} us; another thread's step (p90) "
                f"{med['busy'] * 1e6:.0f} us while it runs, {med['busy-floor'] * 1e6:.0f}"
                " us without"
            )
            print("  samples (s):", json.dumps(samples))


if __name__ == "__main__":
    main()
