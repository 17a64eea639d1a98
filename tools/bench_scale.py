#!/usr/bin/env python
"""How cost grows with the store: one store per size, built fast, then measured.

Usage::

    python tools/bench_scale.py --sizes 10000 100000 1000000 --dir bench-out/scale \\
        [--json docs/bench-scale.json] [--plot docs/bench-scale.png] [--reuse]
        [--build-only] [--repeats 5]

**Build.** One process (one long-running writer, the default 512 MiB RAM tier) saves
conversations through ``KVStore.save`` until the store holds N nodes: real chunk files
and index records, no model run (random float16 KV in a tiny llama's layout: 2
layers, 1 KV head of 32 dims, 256 bytes per token; 8-token chunks, files of ~2.4 KB).
The shape is a server's: 50 system prompts (5-25 nodes each, picked Zipf-like), each
with many conversations under it, each conversation growing by one user turn per save
(deep chains, up to ~400 nodes), some branching off another one's earlier turn. The
writer's saves/s is sampled about 50 times over the whole build. The build does not
fsync chunk files (``--durable-build`` does), but starts each one's writeback as a
durable save does: it runs at the speed of kvstore's own work per save, the part
that could grow with the store; LMDB's commits still sync.

**Measure**, every case in fresh processes (``python -m kvstore ...`` for the
commands; time, peak RSS, CPU time and the reads the page cache did not serve (major
faults, file system inputs) from GNU ``time -v``), the cheap ones alternating
between the sizes round by round (so the shared machine's load falls on every size
alike): open (a fresh process opening the store), save + flush of a new conversation
(a fresh process opening the store the last one closed cleanly, then a second save in
that process; and again without the clean mark that close left, as after a crash:
the write waits for the open's full page check), ``kvstore stats`` (kept totals),
``kvstore ls --no-decode`` and the start-up floor (a process importing what the
commands import), each ``--repeats`` times; the first lookups right after a fresh open
without the clean mark (while the open's full page check runs) and when that check
passed; then fetch hit / branch / miss and lookup (a warm
process per size and round, once the check passed, 200 alternating calls each; the
median of every round's) and the stats call's own time in that process. Every query has the same depth at every size: a hit restores exactly
``DEPTH`` nodes (a stored prompt cut at the end of its ``DEPTH``-th node; the build
keeps a uniform sample of the prompts that deep), a branch cuts that node short, a
miss has a first token no prompt has. Then per size ``stats --full``, ``kvstore
verify`` and ``kvstore gc --max-bytes`` half the bytes the store holds, on a copy of
the store (its chunk files hard-linked), so the store can be measured again (the two
scans once on stores of 200,000 nodes or more, gc once); and the index bytes per node.

``--reuse`` measures a store a previous run built (its ``build.json`` says so)
instead of building it again; ``--build-only`` builds and stops; ``--cases`` measures
some cases only, and ``--append`` merges them into what ``--json`` already holds;
``--cold`` drops the page cache before each scan (as root), so that every size reads
its store from the disk rather than the smaller ones from memory. Every sample goes
into the JSON; the table is printed. A tool, not a test: pytest never collects tools/.
Nothing here asserts a time.
"""

import argparse
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import textwrap
import time

CHUNK = 8
LAYOUT = dict(layers=2, heads=1, head_dim=32)  # 256 bytes of float16 KV per token
SYSTEMS = 50
ACTIVE = 200  # conversations in progress at once
MAX_TOKENS = 3200  # a conversation stops growing here
SAMPLES = 50  # saves/s samples over a build
FLUSH_EVERY = 20  # saves between flushes: the writer's queue stays short
QUERIES = 200
DEPTH = 40  # nodes a hit restores (320-350 tokens), the same at every size
CANDIDATES = 600  # prompts of DEPTH nodes or more the build keeps for the queries
BUILD_SEED = 1234


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[10000, 100000])
    p.add_argument("--dir", default="bench-out/scale", help="where the stores go")
    p.add_argument("--json", metavar="OUT")
    p.add_argument("--plot", metavar="PNG")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--reuse", action="store_true", help="measure stores built before")
    p.add_argument("--build-only", action="store_true")
    p.add_argument(
        "--append",
        action="store_true",
        help="keep the other sizes already in --json (a size measured in a later run)",
    )
    p.add_argument(
        "--cases",
        nargs="+",
        choices=CASES,
        default=list(CASES),
        help="what to measure (cheap: open, fetch, lookup, save, stats, ls; gc runs "
        "on a copy of each store)",
    )
    p.add_argument(
        "--durable-build", action="store_true", help="fsync every file while building"
    )
    p.add_argument(
        "--cold",
        action="store_true",
        help="drop the page cache before each scan (stats --full, verify, gc: "
        "recorded as stats_full_cold, verify_cold, gc_cold), so that every size "
        "reads its store from the disk (Linux, as root)",
    )
    args = p.parse_args(argv)
    if args.repeats < 1 or min(args.sizes) < 1000:
        p.error("--repeats must be >= 1 and every size >= 1000")
    return args


# -- building -----------------------------------------------------------------------


def _model():
    import mlx.core as mx

    from kvstore.bench.models import tiny_model

    return tiny_model(**LAYOUT, vocab=32000, dtype=mx.float16)


class Conversations:
    """The saves of a server's traffic: system prompts, then conversations growing by
    one user turn per save under them, some branching off another's earlier turn."""

    def __init__(self, rng):
        self.rng = rng
        self.next_token = 1  # every prompt starts apart: new tokens are fresh ids
        self.systems = [self._fresh(int(rng.integers(40, 200))) for _ in range(SYSTEMS)]
        weights = 1.0 / (1 + self.rng.permutation(SYSTEMS))
        self.weights = weights / weights.sum()
        self.active = []
        for _ in range(ACTIVE):
            self.active.append(self._start())
        # Slots whose first conversation is still going: all started empty together,
        # so until each has ended the prompts are shorter than the traffic's own.
        self.first_cohort = set(range(ACTIVE))

    def _fresh(self, n: int) -> list:
        out = self.rng.integers(100, 32000, size=n).tolist()
        out[0] = self.next_token % 100  # a shared first token: many roots' children
        self.next_token += 1
        return out

    def _start(self) -> dict:
        if self.active and self.rng.random() < 0.2:
            other = self.active[int(self.rng.integers(len(self.active)))]
            cut = int(self.rng.integers(len(other["turns"]) + 1))
            return {"sys": other["sys"], "turns": list(other["turns"][:cut])}
        s = int(self.rng.choice(SYSTEMS, p=self.weights))
        return {"sys": s, "turns": []}

    def tokens(self, conv: dict) -> list:
        out = list(self.systems[conv["sys"]])
        for turn in conv["turns"]:
            out += turn
        return out

    def ends(self, conv: dict) -> list:
        """The boundaries a save of ``conv`` passes: its system prompt's end and
        every user turn's but the last."""
        ends, at = [len(self.systems[conv["sys"]])], len(self.systems[conv["sys"]])
        for turn in conv["turns"]:
            at += len(turn)
            ends.append(at)
        return ends[:-1]

    def step(self):
        """``(tokens, boundaries)`` of the next save."""
        i = int(self.rng.integers(len(self.active)))
        conv = self.active[i]
        conv["turns"].append(self._fresh(int(self.rng.integers(40, 160))))
        toks, ends = self.tokens(conv), self.ends(conv)
        if len(toks) > MAX_TOKENS or self.rng.random() < 0.05:
            self.active[i] = self._start()
            self.first_cohort.discard(i)
        return toks, ends

    @property
    def warm(self) -> bool:
        """Every conversation of the first cohort has ended: prompt lengths are
        those of the traffic, no longer of its start."""
        return not self.first_cohort


def node_ends(n_tokens: int, boundaries: list) -> list:
    """Where the stored nodes of a saved prompt end (the store's own split)."""
    from kvstore.disk.chunking import split_spans

    return [e for _, e in split_spans(0, n_tokens, CHUNK, boundaries)]


def _cache(kv, n: int):
    from mlx_lm.models.cache import KVCache

    out = []
    for _ in range(LAYOUT["layers"]):
        c = KVCache()
        c.state = (kv[:, :, :n, :], kv[:, :, :n, :], n)
        out.append(c)
    return out


def _skip_fsync() -> None:
    """In this (building) process only: no fsync of chunk files and directories. The
    build then runs at the speed of kvstore's own work per save, which is what may
    grow with the store (and 1M nodes take minutes, not hours); the index's LMDB
    commits still sync, and save + flush is measured durable in fresh processes.
    Each file's writeback still starts as it is written (as a durable save starts
    it): left to the page cache, the first ~30 s of a build wrote nothing and the
    rest paid for it in bursts (``vm.dirty_expire_centisecs``), 15-30 saves/s
    against 80-130 before."""
    from kvstore.platform import fsutil

    fsutil.fsync = lambda fd, *, device=True: None
    fsutil.fsync_dir = lambda path, *, device=True: None


def build(path: str, nodes: int, *, durable: bool = False) -> dict:
    """Fill a new store at ``path`` until it holds ``nodes`` nodes; the build record."""
    import mlx.core as mx
    import numpy as np

    from kvstore import KVStore

    if not durable:
        _skip_fsync()

    if os.path.exists(path):
        shutil.rmtree(path)
    rng = np.random.default_rng(BUILD_SEED)
    kv = mx.array(rng.standard_normal((1, 1, MAX_TOKENS + 256, LAYOUT["head_dim"])))
    kv = kv.astype(mx.float16)
    mx.eval(kv)
    conv = Conversations(rng)
    t0 = time.perf_counter()
    store = KVStore(path, _model(), chunk_tokens=CHUNK)
    for toks in conv.systems:
        store.save(toks, _cache(kv, len(toks)), kind="system")
    store.flush()
    samples, saves, queries, deep, warm_saves = [], 0, [], 0, None
    window_tokens = 0
    pick = np.random.default_rng(BUILD_SEED + 1)  # the queries' own: same traffic
    last_t, last_saves = time.perf_counter(), 0
    have = store.stats()["nodes"]
    # About SAMPLES samples over the build (~13 nodes a save), at flushes.
    every = max(1, round(nodes / 13 / SAMPLES / FLUSH_EVERY)) * FLUSH_EVERY
    while have < nodes:
        toks, ends = conv.step()
        store.save(toks, _cache(kv, len(toks)), boundaries=ends)
        saves += 1
        window_tokens += len(toks)
        if warm_saves is None and conv.warm:
            warm_saves = saves
        if saves % FLUSH_EVERY == 0:
            store.flush()
            have = store.stats()["nodes"]  # the index's counters: no scan
        if saves % every == 0:
            now = time.perf_counter()
            samples.append(
                {
                    "saves": saves,
                    "nodes": have,
                    "seconds": now - t0,
                    "saves_per_s": (saves - last_saves) / (now - last_t),
                    "tokens_per_save": window_tokens / (saves - last_saves),
                }
            )
            window_tokens = 0
            last_t, last_saves = now, saves
            print(
                f"  {have:>9,} nodes  {saves:>8,} saves  "
                f"{samples[-1]['saves_per_s']:6.0f} saves/s  {now - t0:7.0f} s",
                flush=True,
            )
        if len(node_ends(len(toks), ends)) >= DEPTH:
            # A uniform sample of the deep prompts saved over the whole build.
            deep += 1
            slot = len(queries) if len(queries) < CANDIDATES else pick.integers(deep)
            if slot < CANDIDATES:
                queries[slot : slot + 1] = [{"tokens": toks, "ends": ends}]
    store.flush()
    # A short build samples few prompts: the conversations in progress are stored too.
    for c in conv.active:
        toks, ends = conv.tokens(c), conv.ends(c)
        if len(queries) < CANDIDATES and len(node_ends(len(toks), ends)) >= DEPTH:
            queries.append({"tokens": toks, "ends": ends})
    stats = store.stats()
    store.close()
    record = {
        "nodes": stats["nodes"],
        "target_nodes": nodes,
        "saves": saves,
        "build_seconds": time.perf_counter() - t0,
        "writes_dropped": stats["writes_dropped"],
        "writes_failed": stats["writes_failed"],
        "bytes_on_disk": stats["bytes_on_disk"],
        "durable": durable,
        "saves_per_s": samples,
        "warm_saves": warm_saves,
        "queries": queries,
        "systems": conv.systems[:10],
    }
    with open(os.path.join(path, "build.json"), "w") as f:
        json.dump(record, f)
    return record


# -- measuring ----------------------------------------------------------------------


TIME = "/usr/bin/time"  # GNU time: the peak RSS of the command alone


def timed_command(argv) -> dict:
    """A kvstore command in a fresh process: wall seconds, and peak RSS from GNU
    ``time -v``. (A child's own ``ru_maxrss`` would start at this process's size:
    Linux counts the memory a child shares with its parent before ``exec``.)
    ``argv`` None: the floor, a process that imports what the commands import."""
    cmd = ["-m", "kvstore", *argv] if argv is not None else ["-c", FLOOR]
    t0 = time.perf_counter()
    proc = subprocess.run(
        [TIME, "-v", sys.executable, *cmd],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    seconds = time.perf_counter() - t0
    if proc.returncode not in (0, 1):  # verify exits 1 when it finds problems
        raise RuntimeError(f"kvstore {argv} exited {proc.returncode}: {proc.stderr}")
    fields = {}
    for line in proc.stderr.splitlines():
        name, _, value = line.strip().rpartition(": ")
        fields[name] = value
    return {
        "seconds": seconds,
        "max_rss_mb": int(fields["Maximum resident set size (kbytes)"]) / 1024,
        "user_s": float(fields["User time (seconds)"]),
        "system_s": float(fields["System time (seconds)"]),
        # Reads the page cache could not serve: a store larger than it is slower.
        "major_faults": int(fields["Major (requiring I/O) page faults"]),
        "fs_inputs": int(fields["File system inputs"]),
        "exit": proc.returncode,
    }


FLOOR = "import kvstore.cli, kvstore.maintenance"

EARLY = 20  # lookups timed right after a fresh open
CHILD = textwrap.dedent("""
    import json, resource, statistics, sys, time
    sys.path.insert(0, {tools!r})
    from bench_scale import _model, _cache, CHUNK, LAYOUT
    import mlx.core as mx
    import numpy as np
    from kvstore import KVStore
    case, path, given = sys.argv[1], sys.argv[2], json.load(open(sys.argv[3]))
    systems = given["systems"]
    model = _model()
    t0 = time.perf_counter()
    store = KVStore(path, model, chunk_tokens=CHUNK)
    out = {{"open_s": time.perf_counter() - t0}}
    audit = store.index._shared.audit  # the open's full page check (pageguard)
    out["checked_by"] = audit.checked_by  # "mark": the last close left a clean mark
    if case == "fetch":
        # A fresh process's first lookups run while the page check does; the rest
        # are timed once it has passed (a warm process).
        early = []
        for q in given["hits"][:{early}]:
            checking = not audit.done.is_set()
            t = time.perf_counter()
            store.lookup(q)
            early.append((time.perf_counter() - t, checking))
        audit.wait()
        out["check_s"] = time.perf_counter() - t0
        out["early_lookups"] = early
        rng = np.random.default_rng(7)
        hits, branches, misses = given["hits"], given["branches"], given["misses"]
        cases = {{"hit": ("fetch", hits), "branch": ("fetch", branches),
                 "miss": ("fetch", misses), "lookup": ("lookup", hits)}}
        times = {{k: [] for k in cases}}
        reused = {{k: [] for k in cases}}
        majflt = {{k: 0 for k in cases}}
        minflt = {{k: 0 for k in cases}}
        names = list(cases)
        for r in range(len(hits)):
            for name in names[r % 4:] + names[: r % 4]:
                how, qs = cases[name]
                q = qs[r]
                before = resource.getrusage(resource.RUSAGE_SELF)
                t = time.perf_counter()
                if how == "fetch":
                    cache, n = store.fetch(q)
                    mx.eval([c.state for c in cache if c.keys is not None])
                else:
                    n = store.lookup(q)
                times[name].append(time.perf_counter() - t)
                reused[name].append(n)
                # Index pages read from disk (major), or new to this process (minor).
                after = resource.getrusage(resource.RUSAGE_SELF)
                majflt[name] += after.ru_majflt - before.ru_majflt
                minflt[name] += after.ru_minflt - before.ru_minflt
        # Each hit looked up once more: its path's index pages are mapped now, as
        # in a server whose users come back (the rows above are often a query's
        # first touch of them in this process).
        again = times["lookup_again"] = []
        majflt["lookup_again"] = minflt["lookup_again"] = 0
        for q in hits:
            before = resource.getrusage(resource.RUSAGE_SELF)
            t = time.perf_counter()
            store.lookup(q)
            again.append(time.perf_counter() - t)
            after = resource.getrusage(resource.RUSAGE_SELF)
            majflt["lookup_again"] += after.ru_majflt - before.ru_majflt
            minflt["lookup_again"] += after.ru_minflt - before.ru_minflt
        reused["lookup_again"] = reused["lookup"]
        out["times"] = times
        out["reused"] = {{k: statistics.median(v) for k, v in reused.items()}}
        out["major_faults"] = majflt
        out["minor_faults"] = minflt
        from kvstore import maintenance
        stats = []
        for _ in range(20):  # the stats command's own work, without start-up
            t = time.perf_counter()
            maintenance.store_stats(path)
            stats.append(time.perf_counter() - t)
        out["stats_in_process"] = stats
    elif case == "save":
        rng = np.random.default_rng(int(sys.argv[4]))
        kv = mx.array(rng.standard_normal((1, 1, 512, LAYOUT["head_dim"])))
        kv = kv.astype(mx.float16)
        mx.eval(kv)
        # A new conversation under a stored system prompt: its first user turn.
        system = systems[int(rng.integers(len(systems)))]
        toks = system + rng.integers(100, 32000, size=40).tolist()
        t = time.perf_counter()
        n = store.save(toks, _cache(kv, len(toks)), boundaries=[len(system)])
        store.flush()  # waits for the open's page check (writes do)
        out["save_flush_s"] = time.perf_counter() - t
        out["new_nodes"] = n
        toks = system + rng.integers(100, 32000, size=40).tolist()
        t = time.perf_counter()
        store.save(toks, _cache(kv, len(toks)), boundaries=[len(system)])
        store.flush()
        out["save_flush_warm_s"] = time.perf_counter() - t
    store.close()
    print(json.dumps(out))
    """)


def fixed_depth(candidates: list) -> dict:
    """QUERIES queries of each kind, every one at the same depth: a hit is a stored
    prompt cut at the end of its DEPTH-th node, then a new token (it restores exactly
    DEPTH nodes at any store size); a branch cuts that node 3 tokens short, then
    other tokens; a miss is the hit with a first token no stored prompt has."""
    deep = []
    for q in candidates:
        ends = node_ends(len(q["tokens"]), q["ends"])
        if len(ends) >= DEPTH:
            deep.append(q["tokens"][: ends[DEPTH - 1]])
    if not deep:
        raise RuntimeError(f"the build kept no prompt of {DEPTH} nodes or more")
    deep = [deep[i % len(deep)] for i in range(QUERIES)]
    return {
        "hits": [q + [5] for q in deep],
        "branches": [q[:-3] + [7, 7, 7, 7] for q in deep],
        "misses": [[31999] + q[1:] + [5] for q in deep],
        "distinct": len(set(map(tuple, deep))),
    }


def in_child(
    case: str, path: str, queries_file: str, *extra, crashed: bool = False
) -> dict:
    """``case`` in a fresh process; ``crashed``: without the clean mark the last
    close left (as after a crash), so its open checks every page again."""
    if crashed:
        from kvstore.disk import cleanmark

        cleanmark.unlink(os.path.join(path, "index"))
    tools = os.path.dirname(os.path.abspath(__file__))
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            CHILD.format(tools=tools, early=EARLY),
            case,
            path,
            queries_file,
        ]
        + [str(x) for x in extra],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{case} child failed: {proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def med(xs):
    return statistics.median(xs)


def _rotated(items: list, r: int) -> list:
    return items[r % len(items) :] + items[: r % len(items)]


CASES = ("cheap", "stats_full", "verify", "gc")


def drop_page_cache() -> None:
    """Write back and drop the page cache (Linux, as root): the next command reads
    the store from the disk, as one that ran after the store's pages were evicted."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError as e:
        raise SystemExit(f"--cold: cannot drop the page cache ({e}); run as root")


def measure(stores: dict, *, repeats: int, cases=CASES, cold: bool = False) -> dict:
    """The ``cases`` at every size (``stores``: size -> (path, build record)).

    The cheap cases alternate between the sizes, one sample of each size per round
    in a rotated order, so the machine's load falls on every size alike; the scans
    (``stats --full``, ``verify``, ``gc``) follow, size after size (``cold``: each
    after the page cache is dropped, recorded under ``<scan>_cold``).
    """
    out, queries = {}, {}
    for size, (path, record) in stores.items():
        queries[size] = os.path.join(path, "queries.json")
        with open(queries[size], "w") as f:
            json.dump(
                {**fixed_depth(record["queries"]), "systems": record["systems"]}, f
            )
        index_bytes = os.path.getsize(os.path.join(path, "index", "data.mdb"))
        out[size] = {
            "nodes": record["nodes"],
            "index_bytes": index_bytes,
            "index_bytes_per_node": index_bytes / record["nodes"],
        }
        if "cheap" in cases:
            for key in ("open", "save", "save_crashed", "save_warm"):
                out[size][key] = []
            for key in ("startup_floor", "stats"):
                out[size][key] = []
            for key in ("ls", "fetch"):
                out[size][key] = []
            out[size]["stats_fetch"] = []
    sizes = list(stores) if "cheap" in cases else []
    for r in range(repeats if sizes else 0):
        print(f"  round {r + 1} of {repeats}", flush=True)
        for size in _rotated(sizes, r):
            path, q, m = stores[size][0], queries[size], out[size]
            # As after a crash: the open checks every page in the background (and
            # closes once it passed, leaving the clean mark the next opens find).
            fetch = in_child("fetch", path, q, crashed=True)
            m["fetch"].append(fetch)
            m["stats_fetch"].append(fetch.pop("stats_in_process"))
            m["open"].append(in_child("open", path, q)["open_s"])
            saved = in_child("save", path, q, 1000 + r)
            m["save"].append(saved["save_flush_s"])
            m["save_warm"].append(saved["save_flush_warm_s"])
            crashed = in_child("save", path, q, 2000 + r, crashed=True)
            m["save_crashed"].append(crashed["save_flush_s"])
            m["startup_floor"].append(timed_command(None))
            m["stats"].append(timed_command(["stats", "--json", "--store", path]))
            m["ls"].append(timed_command(["ls", "--no-decode", "--store", path]))
    for size in sizes:
        m = out[size]
        times = {}
        rounds = m.pop("fetch")
        for fetch in rounds:
            for k, v in fetch["times"].items():
                times.setdefault(k, []).extend(v)
        m["fetch_ms"] = {
            k: {"median": med(v) * 1e3, "samples": [x * 1e3 for x in v]}
            for k, v in times.items()
        }
        for kind in ("major_faults", "minor_faults"):
            m[f"fetch_{kind}"] = {
                k: sum(f.get(kind, {}).get(k, 0) for f in rounds) for k in times
            }
        m["fetch_reused_tokens"] = fetch["reused"]  # the same queries every round
        checks = [f["check_s"] for f in rounds]
        m["page_check_s"] = {"median": med(checks), "samples": checks}
        early = [t * 1e3 for f in rounds for t, checking in f["early_lookups"]]
        during = [
            t * 1e3 for f in rounds for t, checking in f["early_lookups"] if checking
        ]
        m["early_lookup_ms"] = {
            "median": med(early),
            "during_check_median": med(during) if during else None,
            "during_check": len(during),
            "samples": early,
        }
        m["hit_depth_nodes"] = DEPTH
        inproc = [x for f in m.pop("stats_fetch") for x in f]
        m["stats_in_process_ms"] = {
            "median": med(inproc) * 1e3,
            "samples": [x * 1e3 for x in inproc],
        }
    for size in sizes:
        m = out[size]
        m["open_s"] = {"median": med(m["open"]), "samples": m.pop("open")}
        saves = [x * 1e3 for x in m.pop("save")]
        m["save_flush_ms"] = {"median": med(saves), "samples": saves}
        crashed = [x * 1e3 for x in m.pop("save_crashed")]
        m["save_flush_crashed_ms"] = {"median": med(crashed), "samples": crashed}
        warm = [x * 1e3 for x in m.pop("save_warm")]
        m["save_flush_warm_ms"] = {"median": med(warm), "samples": warm}
        for key in ("startup_floor", "stats", "ls"):
            m[key] = _runs(m[key])
    for size, (path, record) in stores.items():
        print(f"  scans of {record['nodes']:,} nodes", flush=True)
        # Commands that read every record run fewer times on a large store.
        heavy = repeats if record["nodes"] < 200_000 else 1
        held = _held(path)
        half = str(held["bytes"] // 2)
        cmds = {
            "stats_full": (["stats", "--json", "--full"], heavy),
            "verify": (["verify"], heavy),
            "gc": (["gc", "--max-bytes", half], 1),  # on a copy: it evicts half
        }
        for name, (argv, times) in cmds.items():
            if name not in cases:
                continue
            runs = []
            for _ in range(times):
                # gc shrinks the store: it runs on a copy, the store stays as built.
                at = scratch_copy(path, path + "-gc") if name == "gc" else path
                if cold:
                    drop_page_cache()  # after the copy, which read the index
                runs.append(timed_command([*argv, "--store", at]))
                if at != path:
                    shutil.rmtree(at)
            key = f"{name}_cold" if cold else name
            out[size][key] = _runs(runs)
            out[size][key]["store_nodes"] = held["nodes"]  # when it ran
            print(
                f"    {key}: {out[size][key]['seconds']:.2f} s, "
                f"{out[size][key]['max_rss_mb']:.0f} MB",
                flush=True,
            )
    return out


def scratch_copy(path: str, to: str) -> str:
    """A copy of the store at ``path`` that gc may shrink, the store itself kept for
    the next run: the chunk files hard-linked (gc only unlinks and renames them),
    the index copied (LMDB writes ``data.mdb`` in place)."""
    if os.path.exists(to):
        shutil.rmtree(to)
    for root, dirs, files in os.walk(path):
        rel = os.path.relpath(root, path)
        os.makedirs(os.path.join(to, rel), exist_ok=True)
        for name in files:
            src, dst = os.path.join(root, name), os.path.join(to, rel, name)
            if rel == "blobs" or rel.startswith("blobs" + os.sep):
                os.link(src, dst)
            else:
                shutil.copy2(src, dst)
    return to


def _held(path: str) -> dict:
    """Nodes and bytes the store holds now (a gc run before shrank it)."""
    from kvstore import maintenance

    totals = maintenance.store_stats(path)["totals"]
    return {"nodes": totals["nodes"], "bytes": totals["bytes"]}


def _runs(runs) -> dict:
    return {
        "seconds": med([r["seconds"] for r in runs]),
        "max_rss_mb": max(r["max_rss_mb"] for r in runs),
        "samples": runs,
    }


def writer_rates(record: dict) -> dict:
    """Saves/s of the writer over the first and the last 10% of its saves, and over
    the first 10% once the traffic was warm (``Conversations.warm``), with the mean
    prompt length of each part."""
    samples = record["saves_per_s"]

    def part(xs):
        tokens = [s["tokens_per_save"] for s in xs if "tokens_per_save" in s]
        return med([s["saves_per_s"] for s in xs]), med(tokens) if tokens else None

    k = max(1, len(samples) // 10)
    (first, first_tokens), (last, last_tokens) = part(samples[:k]), part(samples[-k:])
    out = {
        "first_10pct": first,
        "last_10pct": last,
        "ratio": first / last,
        "first_tokens_per_save": first_tokens,
        "last_tokens_per_save": last_tokens,
    }
    warm = [s for s in samples if s["saves"] > (record.get("warm_saves") or math.inf)]
    if len(warm) >= 2:
        w, w_tokens = part(warm[: max(1, len(warm) // 10)])
        out.update(
            warm_saves=record["warm_saves"],
            warm_first_10pct=w,
            warm_ratio=w / last,
            warm_first_tokens_per_save=w_tokens,
        )
    return out


# -- report -------------------------------------------------------------------------


def _seconds_mb(key: str):
    """A table row's getter: the command ``key``'s median seconds and peak MB."""
    return lambda m: (m[key]["seconds"], m[key]["max_rss_mb"])


ROWS = [
    ("open, fresh process (ms)", lambda m: m["open_s"]["median"] * 1e3),
    (
        "open's full page check passed after, no clean mark (s)",
        lambda m: m["page_check_s"]["median"],
    ),
    (
        "lookup while that check runs (ms) / lookups timed",
        lambda m: _during_check(m["early_lookup_ms"]),
    ),
    ("fetch hit (ms)", lambda m: m["fetch_ms"]["hit"]["median"]),
    ("fetch branch (ms)", lambda m: m["fetch_ms"]["branch"]["median"]),
    ("fetch miss (ms)", lambda m: m["fetch_ms"]["miss"]["median"]),
    ("nodes a hit restores", lambda m: m["hit_depth_nodes"]),
    ("tokens a hit restores (median)", lambda m: m["fetch_reused_tokens"]["hit"]),
    ("lookup (ms)", lambda m: m["fetch_ms"]["lookup"]["median"]),
    (
        "lookup of a query looked up before (ms)",
        lambda m: m["fetch_ms"].get("lookup_again", {}).get("median"),
    ),
    ("page faults per lookup: minor / major", lambda m: _lookup_faults(m)),
    ("save + flush, fresh process (ms)", lambda m: m["save_flush_ms"]["median"]),
    (
        "save + flush, fresh process, no clean mark (ms)",
        lambda m: m["save_flush_crashed_ms"]["median"],
    ),
    ("save + flush, warm process (ms)", lambda m: m["save_flush_warm_ms"]["median"]),
    ("writer saves/s, first 10% of build", lambda m: m["writer"]["first_10pct"]),
    ("writer saves/s, last 10% of build", lambda m: m["writer"]["last_10pct"]),
    (
        "prompt tokens a save, first / last 10%",
        lambda m: "{:.0f} / {:.0f}".format(
            m["writer"]["first_tokens_per_save"], m["writer"]["last_tokens_per_save"]
        ),
    ),
    ("saves until the traffic was warm", lambda m: m["writer"]["warm_saves"]),
    (
        "writer saves/s, first 10% once warm",
        lambda m: m["writer"]["warm_first_10pct"],
    ),
    ("start-up floor: import only (s / MB)", _seconds_mb("startup_floor")),
    ("`stats` (s / MB)", _seconds_mb("stats")),
    (
        "`stats`' own work, in process (ms)",
        lambda m: m["stats_in_process_ms"]["median"],
    ),
    ("`stats --full` (s / MB)", _seconds_mb("stats_full")),
    ("`ls --no-decode` (s / MB)", _seconds_mb("ls")),
    ("`verify` (s / MB)", _seconds_mb("verify")),
    (
        "nodes when gc ran",
        lambda m: m["gc"]["store_nodes"],
    ),
    ("`gc --max-bytes` half (s / MB)", _seconds_mb("gc")),
    ("`verify` CPU (s) / major faults", lambda m: _cpu_faults(m["verify"])),
    ("`gc` CPU (s) / major faults", lambda m: _cpu_faults(m["gc"])),
    (
        "`stats --full`, page cache dropped first (s / MB)",
        _seconds_mb("stats_full_cold"),
    ),
    ("`verify`, page cache dropped first (s / MB)", _seconds_mb("verify_cold")),
    (
        "`gc --max-bytes` half, page cache dropped first (s / MB)",
        _seconds_mb("gc_cold"),
    ),
    (
        "`verify` / `gc` CPU (s), page cache dropped first",
        lambda m: "{:.1f} / {:.1f}".format(
            _cpu_s(_median_run(m["verify_cold"])), _cpu_s(_median_run(m["gc_cold"]))
        ),
    ),
    ("index bytes per node", lambda m: m["index_bytes_per_node"]),
    ("build (s)", lambda m: m["build_seconds"]),
]


def _during_check(early: dict) -> str:
    """The median lookup right after a fresh open while the page check still ran."""
    if not early["during_check"]:
        return "- / 0 (it had passed)"
    return f"{early['during_check_median']:.3g} / {early['during_check']}"


def _lookup_faults(m: dict) -> str:
    """Minor and major page faults per lookup ("-" where a run did not count them)."""
    n = len(m["fetch_ms"]["lookup"]["samples"])
    return " / ".join(
        f"{m[key]['lookup'] / n:.2f}" if key in m else "-"
        for key in ("fetch_minor_faults", "fetch_major_faults")
    )


def _median_run(runs: dict) -> dict:
    """The sample of a command's runs nearest their median time."""
    return min(runs["samples"], key=lambda r: abs(r["seconds"] - runs["seconds"]))


def _cpu_s(run: dict) -> float:
    """A run's CPU seconds (KeyError for older runs, which did not record them)."""
    return run["user_s"] + run["system_s"]


def _cpu_faults(runs: dict) -> str:
    """CPU seconds and major faults of a command's median run (older runs: none)."""
    run = _median_run(runs)
    if "user_s" not in run:
        return None
    return f"{_cpu_s(run):.1f} / {run['major_faults']:,}"


def _value(get, m):
    try:
        return get(m)
    except (KeyError, TypeError):  # not measured (``--cases``, an older build)
        return None


def _cell(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, str):
        return v
    if isinstance(v, tuple):
        return f"{v[0]:.2f} s / {v[1]:.0f} MB"
    return f"{v:.3g}" if v < 100 else f"{v:,.0f}"


def table(results: list) -> str:
    head = (
        "| operation | " + " | ".join(f"{r['nodes']:,} nodes" for r in results) + " |"
    )
    lines = [head, "|---" * (len(results) + 1) + "|"]
    for name, get in ROWS:
        lines.append(
            f"| {name} | " + " | ".join(_cell(_value(get, r)) for r in results) + " |"
        )
    return "\n".join(lines)


def plot(results: list, out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = [r["nodes"] for r in results]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for name, get in [
        ("open", lambda m: m["open_s"]["median"] * 1e3),
        ("fetch hit", lambda m: m["fetch_ms"]["hit"]["median"]),
        ("lookup", lambda m: m["fetch_ms"]["lookup"]["median"]),
        ("save + flush, fresh process", lambda m: m["save_flush_ms"]["median"]),
        (
            "save + flush, fresh, no clean mark",
            lambda m: m["save_flush_crashed_ms"]["median"],
        ),
        ("save + flush, warm", lambda m: m["save_flush_warm_ms"]["median"]),
        ("stats", lambda m: m["stats"]["seconds"] * 1e3),
        ("ls", lambda m: m["ls"]["seconds"] * 1e3),
        ("verify", lambda m: m["verify"]["seconds"] * 1e3),
        ("gc", lambda m: m["gc"]["seconds"] * 1e3 if "gc" in m else float("nan")),
    ]:
        ys = [_value(get, r) for r in results]
        a.plot(
            n, [float("nan") if y is None else y for y in ys], marker="o", label=name
        )
    a.set(xscale="log", yscale="log", xlabel="nodes in the store", ylabel="ms")
    a.set_title("time")
    a.legend(fontsize=7)
    for name in ("stats", "stats_full", "ls", "verify", "gc"):
        b.plot(
            n,
            [r[name]["max_rss_mb"] if name in r else float("nan") for r in results],
            marker="o",
            label=name,
        )
    b.set(xscale="log", xlabel="nodes in the store", ylabel="peak RSS (MB)")
    b.set_title("peak memory of each command (own process)")
    b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def machine() -> str:
    return f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}"


def main(argv=None):
    args = parse_args(argv)
    os.makedirs(args.dir, exist_ok=True)
    stores = {}
    for size in args.sizes:
        path = os.path.join(args.dir, f"store-{size}")
        record_file = os.path.join(path, "build.json")
        if args.reuse and os.path.exists(record_file):
            with open(record_file) as f:
                record = json.load(f)
            print(f"reusing {path}: {record['nodes']:,} nodes", flush=True)
        else:
            print(f"building {path} ({size:,} nodes)", flush=True)
            record = build(path, size, durable=args.durable_build)
            print(f"  built in {record['build_seconds']:.0f} s", flush=True)
        stores[size] = (path, record)
    if args.build_only:
        return 0
    measured = measure(stores, repeats=args.repeats, cases=args.cases, cold=args.cold)
    results = []
    for size, (path, record) in stores.items():
        m = measured[size]
        m.update(
            target_nodes=size,
            build_seconds=record["build_seconds"],
            saves=record["saves"],
            writer=writer_rates(record),
            writer_samples=record["saves_per_s"],
            writes_dropped=record["writes_dropped"],
            writes_failed=record["writes_failed"],
        )
        results.append(m)
    print(table(results), flush=True)
    if not results:
        return 0
    doc = {
        "argv": [sys.argv],
        "machine": machine(),
        "chunk_tokens": CHUNK,
        "layout": LAYOUT,
        "results": results,
    }
    if args.append and args.json and os.path.exists(args.json):
        with open(args.json) as f:
            old = json.load(f)  # what an earlier run measured stays, unless measured
        merged = {r["target_nodes"]: r for r in old["results"]}
        for r in results:
            merged[r["target_nodes"]] = {**merged.get(r["target_nodes"], {}), **r}
        doc["results"] = sorted(merged.values(), key=lambda r: r["nodes"])
        doc["argv"] = old["argv"] + doc["argv"]
        results = doc["results"]
        print(table(results), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    if args.plot:
        plot(results, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
