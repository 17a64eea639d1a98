#!/usr/bin/env python
"""Core kvstore benchmark: restore throughput, miss latency, hash chain, save, disk overhead.

Usage::

    python tools/bench_core.py [--tokens 4096 32768] [--repeats 5]
                               [--dtype float16|float32] [--json out.json] [--keep]

The KV is synthetic (random values) with the shape of SmolLM2-135M's cache (30 layers,
3 KV heads, head dim 64): a tiny random-weight mlx-lm llama with that cache layout stands
in for the model, so no model is run for each size. Every comparison is a ratio of cases
measured in this one run (medians of ``--repeats`` repeats, cases interleaved in each
repeat); nothing here asserts an absolute time. See /work/shared/NOTES-model.md,
"Measuring restore speed honestly".

This is a tool, not a test: it lives under tools/ so pytest never collects it.
"""

import argparse
import json
import os
import platform
import shlex
import shutil
import sys
import tempfile
import time

import mlx.core as mx
import mlx_lm
import numpy as np
from mlx_lm.models.cache import (
    KVCache,
    make_prompt_cache,
    save_prompt_cache,
)

from kvstore import KVStore
from kvstore.bench.measure import (
    allocated_bytes,
    apparent_bytes,
    eval_cache,
    files_under,
    gbps,
    git_describe,
    med,
    minor_faults,
    mlx_default_cache_limit,
    run_interleaved,
    source_digest,
    time_load_prompt_cache,
    warm_page_cache,
)
from kvstore.bench.models import tiny_model
from kvstore.chunking import as_token_array, chain_hashes, root_hash, split_spans

# SmolLM2-135M's KV cache shape.
LAYERS, KV_HEADS, HEAD_DIM = 30, 3, 64
VOCAB = 1000
CHUNK_TOKENS = 256  # KVStore's default
READ_THREADS = 2  # KVStore's default
MISS_TOKENS = 32768
MISS_CALLS = 200
HASH_TOKENS = 100_000
HASH_CALLS = 100
SAVE_TOKENS = 4096

TARGET_RESTORE_VS_LOAD = 0.9  # kvstore GB/s / load_prompt_cache GB/s >= this
TARGET_MISS_MS = 2.0
TARGET_HASH_MS = 5.0
TARGET_SAVE_RATIO = 0.05
TARGET_DISK_RATIO = 1.01

GB = 1e9
MB = 1e6


# -- setup ------------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[4096, 32768], metavar="N")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--dtype", choices=["float16", "float32"], default="float16")
    p.add_argument("--json", metavar="OUT", help="write every number to this JSON file")
    p.add_argument("--keep", action="store_true", help="keep the temporary directory")
    p.add_argument(
        "--chunk-tokens",
        type=int,
        default=CHUNK_TOKENS,
        help=f"the stores' chunk_tokens (default {CHUNK_TOKENS}, KVStore's default)",
    )
    args = p.parse_args(argv)
    if args.chunk_tokens < 1:
        p.error("--chunk-tokens must be >= 1")
    if any(n < 2 for n in args.tokens):
        p.error("--tokens must be >= 2")
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    return args


def stand_in_model(dtype):
    """A tiny random-weight llama whose KV cache has SmolLM2-135M's layout."""
    return tiny_model(
        layers=LAYERS, heads=KV_HEADS, head_dim=HEAD_DIM, vocab=VOCAB, dtype=dtype
    )


def synthetic_cache(n, dtype, seed):
    """KVCache objects holding ``n`` tokens of random KV, filled via ``update_and_fetch``."""
    rng = np.random.default_rng(seed)
    np_dtype = np.float16 if dtype == mx.float16 else np.float32
    shape = (1, KV_HEADS, n, HEAD_DIM)
    cache = []
    for _ in range(LAYERS):
        c = KVCache()
        k, v = (
            mx.array(rng.standard_normal(shape, dtype=np.float32).astype(np_dtype))
            for _ in range(2)
        )
        c.update_and_fetch(k, v)
        mx.eval(c.keys, c.values)
        cache.append(c)
    return cache


def exact_cache(cache):
    """The cache itself when its buffers hold exactly ``offset`` tokens, else trimmed copies
    (so that the one-file baseline stores the same bytes as kvstore)."""
    if all(c.keys.shape[2] == c.offset for c in cache):
        return cache
    out = []
    for c in cache:
        t = KVCache()
        k = mx.contiguous(c.keys[..., : c.offset, :])
        v = mx.contiguous(c.values[..., : c.offset, :])
        t.state = (k, v, c.offset)
        out.append(t)
    mx.eval([(c.keys, c.values) for c in out])
    return out


def random_tokens(n, rng, avoid_first=()):
    toks = rng.integers(0, VOCAB, size=n).tolist()
    while toks[0] in avoid_first:
        toks[0] = int(rng.integers(0, VOCAB))
    return toks


def same_bytes(a, b):
    view = mx.uint16 if a.dtype.size == 2 else mx.uint32
    return np.array_equal(np.asarray(a.view(view)), np.asarray(b.view(view)))


# -- timed cases ---------------------------------------------------------------------------


def time_kvstore_fetch(store, query, expect):
    t0 = time.perf_counter()
    cache, n = store.fetch(query)
    eval_cache(cache)
    dt = time.perf_counter() - t0
    if n != expect:
        raise RuntimeError(f"kvstore fetch restored {n} tokens, expected {expect}")
    return dt, cache


def time_raw_read(path, view):
    t0 = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    try:
        got = os.preadv(fd, [view], 0)
    finally:
        os.close(fd)
    dt = time.perf_counter() - t0
    if got != len(view):
        raise RuntimeError(f"raw read got {got} bytes, expected {len(view)}")
    return dt


# -- sections ----------------------------------------------------------------------------


def bench_restore(model, dtype, n, repeats, tmp, rng, per_token, miss):
    """Section 1 for one size (and section 2 / 5 on its store)."""
    kv_bytes = n * per_token
    out = {"tokens": n, "kv_bytes": kv_bytes}
    src = synthetic_cache(n, dtype, seed=n)
    tokens = random_tokens(n, rng)
    query = tokens + [int(rng.integers(0, VOCAB))]

    store_dir = os.path.join(tmp, f"store-{n}")
    store = KVStore(
        store_dir,
        model,
        ram_bytes=0,
        chunk_tokens=CHUNK_TOKENS,
        read_threads=READ_THREADS,
    )
    t0 = time.perf_counter()
    store.save(tokens, src)
    t1 = time.perf_counter()
    store.flush()
    t2 = time.perf_counter()
    out["initial_save_return_s"] = t1 - t0
    out["initial_save_flush_s"] = t2 - t1

    onefile = os.path.join(tmp, f"prompt-cache-{n}.safetensors")
    t0 = time.perf_counter()
    save_prompt_cache(onefile, exact_cache(src))
    out["save_prompt_cache_s"] = time.perf_counter() - t0
    out["one_file_bytes"] = os.path.getsize(onefile)

    warm_page_cache(files_under(store_dir))
    warm_page_cache([onefile])

    # First fetch at this size, with MLX's buffer cache emptied so that the destination
    # arrays come fresh from the OS (page faults), as in a new process.
    mx.clear_cache()
    f0 = minor_faults()
    first, restored = time_kvstore_fetch(store, query, n)
    out["kvstore_first_s"] = first
    out["kvstore_first_faults"] = minor_faults() - f0
    out["restored_equal"] = all(
        same_bytes(a.keys[..., :n, :], b.keys[..., :n, :])
        and same_bytes(a.values[..., :n, :], b.values[..., :n, :])
        for a, b in zip(restored, src)
    )
    if not out["restored_equal"]:
        print(f"WARNING: kvstore restored different bytes for {n} tokens", flush=True)
    del restored, src

    buf = bytearray(kv_bytes)
    view = memoryview(buf)
    time_raw_read(onefile, view)  # untimed: faults the buffer in
    time_load_prompt_cache(onefile)  # untimed warm-up, like kvstore's first fetch

    cases = {
        "kvstore": lambda: time_kvstore_fetch(store, query, n)[0],
        "load_prompt_cache": lambda: time_load_prompt_cache(onefile),
        "raw_read": lambda: time_raw_read(onefile, view),
    }
    # As configured by default: MLX keeps few freed buffers, so every restore's arrays are
    # new memory (page faults) for kvstore and load_prompt_cache alike.
    runs = run_interleaved(cases, repeats)
    out["times_s"], out["faults"] = runs.times, runs.faults
    out["cpu_user_s"], out["cpu_system_s"] = runs.user, runs.system

    # Variant: MLX's buffer cache raised above the KV size, so freed arrays are recycled
    # and no case pays page faults; isolates the cost of the read path itself.
    prev = mx.set_cache_limit(4 * kv_bytes + (256 << 20))
    for case in cases.values():
        case()  # untimed: fills the buffer cache
    runs = run_interleaved(cases, repeats)
    out["recycled_times_s"], out["recycled_faults"] = runs.times, runs.faults
    out["recycled_cpu_user_s"] = runs.user
    out["recycled_cpu_system_s"] = runs.system
    mx.set_cache_limit(prev)
    mx.clear_cache()
    view.release()
    del buf

    # Section 5: bytes on disk for this store.
    st = store.stats()
    index_bytes = apparent_bytes(os.path.join(store_dir, "index"))
    out["disk"] = {
        "kv_bytes": kv_bytes,
        "bytes_on_disk": st["bytes_on_disk"],
        "index_dir_bytes": index_bytes,
        "ratio": (st["bytes_on_disk"] + index_bytes) / kv_bytes,
        "blobs_dir_bytes_apparent": apparent_bytes(os.path.join(store_dir, "blobs")),
        "store_dir_bytes_allocated": allocated_bytes(store_dir),
        "nodes": st["nodes"],
    }

    if miss:
        out_miss = bench_miss(store, rng, avoid_first={tokens[0]})
    store.close()

    # The RAM tier, warm: a second store object on the same directory (the disk-only one is
    # closed: LMDB must not be opened twice in one process).
    ram = KVStore(
        store_dir,
        model,
        ram_bytes=2 * kv_bytes + (64 << 20),
        chunk_tokens=CHUNK_TOKENS,
        read_threads=READ_THREADS,
    )
    fill, _ = time_kvstore_fetch(ram, query, n)
    out["ram_fill_s"] = fill
    runs = run_interleaved(
        {"kvstore": lambda: time_kvstore_fetch(ram, query, n)[0]}, repeats
    )
    out["ram_warm_times_s"] = runs.times["kvstore"]
    out["ram_warm_faults"] = runs.faults["kvstore"]
    out["ram_entries"] = ram.stats()["ram_entries"]
    ram.close()
    mx.clear_cache()
    return out, (out_miss if miss else None)


def bench_miss(store, rng, avoid_first):
    """Section 2: fetch of a 32K-token prompt sharing nothing with the store."""
    query = random_tokens(MISS_TOKENS, rng, avoid_first=avoid_first)
    cache, n = store.fetch(query)
    if n != 0:
        raise RuntimeError(f"the miss prompt restored {n} tokens")
    times = []
    for _ in range(MISS_CALLS):
        t0 = time.perf_counter()
        cache, n = store.fetch(query)
        times.append(time.perf_counter() - t0)
    # Parts of the miss path, for the record: validation and the empty cache.
    t_arr, t_mk = [], []
    for _ in range(MISS_CALLS):
        t0 = time.perf_counter()
        as_token_array(query)
        t1 = time.perf_counter()
        make_prompt_cache(store.model)
        t_arr.append(t1 - t0)
        t_mk.append(time.perf_counter() - t1)
    return {
        "tokens": MISS_TOKENS,
        "calls": MISS_CALLS,
        "times_s": times,
        "as_token_array_median_s": med(t_arr),
        "make_prompt_cache_median_s": med(t_mk),
    }


def bench_hash(rng):
    """Section 3: as_token_array + chain_hashes for 100K tokens."""
    tokens = rng.integers(0, VOCAB, size=HASH_TOKENS).tolist()
    root = root_hash(b"\x00" * 16)
    t_arr, t_chain = [], []
    for _ in range(HASH_CALLS):
        t0 = time.perf_counter()
        arr = as_token_array(tokens)
        t1 = time.perf_counter()
        chain_hashes(root, arr, split_spans(0, HASH_TOKENS, CHUNK_TOKENS))
        t2 = time.perf_counter()
        t_arr.append(t1 - t0)
        t_chain.append(t2 - t1)
    total = [a + b for a, b in zip(t_arr, t_chain)]
    return {
        "tokens": HASH_TOKENS,
        "calls": HASH_CALLS,
        "spans": len(split_spans(0, HASH_TOKENS, CHUNK_TOKENS)),
        "as_token_array_s": t_arr,
        "chain_hashes_s": t_chain,
        "total_s": total,
    }


def bench_save(model, dtype, repeats, tmp, rng, per_token):
    """Section 4: save() return time vs the write it queues (default store settings)."""
    src = synthetic_cache(SAVE_TOKENS, dtype, seed=1)
    store_dir = os.path.join(tmp, "store-save")
    store = KVStore(
        store_dir, model, chunk_tokens=CHUNK_TOKENS, read_threads=READ_THREADS
    )
    firsts = set()

    def fresh():
        toks = random_tokens(SAVE_TOKENS, rng, avoid_first=firsts)
        firsts.add(toks[0])
        return toks

    store.save(fresh(), src)  # untimed warm-up
    store.flush()
    ret, flush, nodes = [], [], []
    for _ in range(repeats):
        toks = fresh()
        t0 = time.perf_counter()
        nodes.append(store.save(toks, src))
        t1 = time.perf_counter()
        store.flush()
        t2 = time.perf_counter()
        ret.append(t1 - t0)
        flush.append(t2 - t1)
    st = store.stats()
    store.close()
    return {
        "tokens": SAVE_TOKENS,
        "kv_bytes": SAVE_TOKENS * per_token,
        "nodes_per_save": nodes,
        "save_return_s": ret,
        "flush_s": flush,
        "ratio": med(ret) / (med(ret) + med(flush)),
        "writes_dropped": st["writes_dropped"],
        "writes_failed": st["writes_failed"],
    }


# -- report --------------------------------------------------------------------------------


def fmt_ms(s):
    return f"{s * 1e3:9.2f}"


def print_report(res):
    print()
    print(
        "1. Restore from disk, RAM tier disabled (ram_bytes=0), page cache: warm\n"
        "   kvstore: store.fetch(tokens + [1 extra token]) + mx.eval of every restored "
        "keys/values array\n"
        "   load_prompt_cache: mlx-lm load_prompt_cache(one file) + mx.eval of every array\n"
        "   raw read: os.preadv of the same number of bytes from that one file into a "
        "preallocated bytearray\n"
        "   faults: minor page faults per call (process-wide, median)\n"
        "   user / sys: CPU ms per call in user space / in the kernel (process-wide, "
        "all threads, median): the kernel's share is mostly the copy from the page cache"
    )
    hdr = (
        f"{'tokens':>7} {'KV MB':>7}  {'case':<44} {'median ms':>9} {'GB/s':>6} "
        f"{'min ms':>9} {'max ms':>9} {'faults':>7} {'user':>6} {'sys':>6}"
    )
    print(hdr)
    print("-" * len(hdr))
    for r in res["restore"]:
        n, kvb = r["tokens"], r["kv_bytes"]
        t, f, rt, rf = (
            r["times_s"],
            r["faults"],
            r["recycled_times_s"],
            r["recycled_faults"],
        )

        def cpu(prefix, case):
            return r[f"{prefix}cpu_user_s"][case], r[f"{prefix}cpu_system_s"][case]

        rows = [
            ("MLX defaults (new memory for every restore)", None, None),
            (
                "kvstore fetch, steady state",
                t["kvstore"],
                f["kvstore"],
                cpu("", "kvstore"),
            ),
            (
                "kvstore fetch, first (fresh memory)",
                [r["kvstore_first_s"]],
                [r["kvstore_first_faults"]],
            ),
            (
                "mlx-lm load_prompt_cache, 1 file",
                t["load_prompt_cache"],
                f["load_prompt_cache"],
                cpu("", "load_prompt_cache"),
            ),
            ("raw preadv, 1 file", t["raw_read"], f["raw_read"], cpu("", "raw_read")),
            (
                "kvstore fetch, RAM tier warm",
                r["ram_warm_times_s"],
                r["ram_warm_faults"],
            ),
            ("kvstore fetch, RAM tier filling (1 call)", [r["ram_fill_s"]], None),
            ("MLX buffer cache raised (memory recycled)", None, None),
            (
                "kvstore fetch, steady state",
                rt["kvstore"],
                rf["kvstore"],
                cpu("recycled_", "kvstore"),
            ),
            (
                "mlx-lm load_prompt_cache, 1 file",
                rt["load_prompt_cache"],
                rf["load_prompt_cache"],
                cpu("recycled_", "load_prompt_cache"),
            ),
            (
                "raw preadv, 1 file",
                rt["raw_read"],
                rf["raw_read"],
                cpu("recycled_", "raw_read"),
            ),
        ]
        print(f"{n:>7} {kvb / MB:>7.1f}")
        for name, ts, fs, *cpu_s in rows:
            if ts is None:
                print(f"{'':16}  {name}:")
                continue
            m = med(ts)
            faults = f"{med(fs):>7.0f}" if fs else f"{'':>7}"
            used = (
                f" {med(cpu_s[0][0]) * 1e3:>6.1f} {med(cpu_s[0][1]) * 1e3:>6.1f}"
                if cpu_s
                else ""
            )
            print(
                f"{'':16}    {name:<42} {fmt_ms(m)} {gbps(kvb, m):>6.2f} "
                f"{fmt_ms(min(ts))} {fmt_ms(max(ts))} {faults}{used}"
            )
        k, lp, raw = (med(t[c]) for c in ("kvstore", "load_prompt_cache", "raw_read"))
        rk, rlp, rraw = (
            med(rt[c]) for c in ("kvstore", "load_prompt_cache", "raw_read")
        )
        print(
            f"{'':16}  ratios of GB/s, MLX defaults: kvstore/load_prompt_cache = "
            f"{lp / k:.2f}, kvstore/raw read = {raw / k:.2f}; first/steady time = "
            f"{r['kvstore_first_s'] / k:.2f}; RAM-warm/disk = {k / med(r['ram_warm_times_s']):.2f}"
        )
        print(
            f"{'':16}  ratios of GB/s, memory recycled: kvstore/load_prompt_cache = "
            f"{rlp / rk:.2f}, kvstore/raw read = {rraw / rk:.2f}"
        )
        print(
            f"{'':16}  setup: save() returned in {r['initial_save_return_s'] * 1e3:.0f} ms, "
            f"flush {r['initial_save_flush_s'] * 1e3:.0f} ms "
            f"({gbps(kvb, r['initial_save_return_s'] + r['initial_save_flush_s']):.2f} GB/s); "
            f"save_prompt_cache {r['save_prompt_cache_s'] * 1e3:.0f} ms "
            f"({gbps(kvb, r['save_prompt_cache_s']):.2f} GB/s); "
            f"restored bytes equal: {r['restored_equal']}"
        )
    print(
        "   'MLX defaults': MLX keeps at most "
        f"{res['mlx_default_cache_limit'] / 2**20:.0f} MiB of freed buffers here, so each "
        "restore's arrays\n"
        "   are new pages from the OS (see the faults column). 'first (fresh memory)': the first\n"
        "   fetch at this size, after mx.clear_cache() (the first size's is also the process's\n"
        "   first). 'RAM tier warm': a store opened with ram_bytes > the KV, filled by one fetch\n"
        "   (timed on its own), then --repeats fetches. 'memory recycled': the same three cases\n"
        "   again, interleaved, after mx.set_cache_limit(> KV size), so freed arrays are reused."
    )

    m = res["miss"]
    print()
    print(
        f"2. Fetch miss, {m['tokens']}-token prompt sharing nothing with the store "
        f"({m['calls']} calls; includes make_prompt_cache of the empty cache)"
    )
    ts = m["times_s"]
    print(
        f"   median {med(ts) * 1e3:.3f} ms  (min {min(ts) * 1e3:.3f}, "
        f"p90 {np.percentile(ts, 90) * 1e3:.3f}, max {max(ts) * 1e3:.3f}); parts: "
        f"as_token_array {m['as_token_array_median_s'] * 1e3:.3f} ms, "
        f"make_prompt_cache {m['make_prompt_cache_median_s'] * 1e3:.3f} ms"
    )

    h = res["hash"]
    print()
    print(
        f"3. Hash chain, {h['tokens']} tokens as a Python list, {h['spans']} spans of "
        f"{CHUNK_TOKENS} (median of {h['calls']})"
    )
    print(
        f"   as_token_array {med(h['as_token_array_s']) * 1e3:.3f} ms + split_spans/chain_hashes "
        f"{med(h['chain_hashes_s']) * 1e3:.3f} ms = {med(h['total_s']) * 1e3:.3f} ms "
        f"(median of per-call totals)"
    )

    s = res["save"]
    print()
    print(
        f"4. save() of a new {s['tokens']}-token prompt ({s['kv_bytes'] / MB:.1f} MB KV, "
        f"{s['nodes_per_save'][0]} nodes; default ram_bytes; fresh tokens each repeat)"
    )
    r_, f_ = med(s["save_return_s"]), med(s["flush_s"])
    print(
        f"   save() returns in {r_ * 1e3:.2f} ms (min {min(s['save_return_s']) * 1e3:.2f}, "
        f"max {max(s['save_return_s']) * 1e3:.2f}); flush() then waits "
        f"{f_ * 1e3:.1f} ms (min {min(s['flush_s']) * 1e3:.1f}, "
        f"max {max(s['flush_s']) * 1e3:.1f}); "
        f"write {gbps(s['kv_bytes'], r_ + f_):.2f} GB/s incl. fsync"
    )
    print(f"   save_return / (save_return + flush) = {s['ratio']:.4f}")

    print()
    print(
        "5. Bytes on disk vs KV bytes stored (restore stores; index dir = apparent file sizes)"
    )
    for r in res["restore"]:
        d = r["disk"]
        print(
            f"   {r['tokens']:>7} tokens: KV {d['kv_bytes']:,} B; bytes_on_disk "
            f"{d['bytes_on_disk']:,} + index/ {d['index_dir_bytes']:,} = ratio {d['ratio']:.4f} "
            f"({d['nodes']} nodes; store dir allocated {d['store_dir_bytes_allocated']:,} B; "
            f"one-file baseline {r['one_file_bytes'] / d['kv_bytes']:.4f})"
        )

    print()
    print("TARGETS (ratios and latencies from this run; reported, never asserted)")
    for t in res["targets"]:
        status = "info" if t["ok"] is None else "PASS" if t["ok"] else "MISS"
        print(f"   [{status}] {t['what']}: {t['value']} ({t['target']})")


def targets(res):
    out = []

    def add(what, value, target, ok):
        out.append({"what": what, "value": value, "target": target, "ok": ok})

    for r in res["restore"]:
        k = med(r["times_s"]["kvstore"])
        ratio = med(r["times_s"]["load_prompt_cache"]) / k
        add(
            f"restore {r['tokens']} tokens, kvstore / load_prompt_cache GB/s",
            f"{ratio:.2f}",
            f">= {TARGET_RESTORE_VS_LOAD}",
            ratio >= TARGET_RESTORE_VS_LOAD,
        )
        rk = med(r["recycled_times_s"]["kvstore"])
        add(
            "  same, memory recycled (MLX buffer cache raised)",
            f"{med(r['recycled_times_s']['load_prompt_cache']) / rk:.2f}",
            "info; target above applies to MLX defaults",
            None,
        )
        add(
            "  kvstore / raw read GB/s (MLX defaults; memory recycled)",
            f"{med(r['times_s']['raw_read']) / k:.2f}; "
            f"{med(r['recycled_times_s']['raw_read']) / rk:.2f}",
            "info",
            None,
        )
    m = med(res["miss"]["times_s"]) * 1e3
    add(
        f"fetch miss, {MISS_TOKENS} tokens",
        f"{m:.3f} ms",
        f"< {TARGET_MISS_MS} ms",
        m < TARGET_MISS_MS,
    )
    h = med(res["hash"]["total_s"]) * 1e3
    add(
        f"hash chain, {HASH_TOKENS} tokens",
        f"{h:.3f} ms",
        f"< {TARGET_HASH_MS} ms",
        h < TARGET_HASH_MS,
    )
    s = res["save"]["ratio"]
    add(
        f"save() return / (return + flush), {SAVE_TOKENS} tokens",
        f"{s:.4f}",
        f"< {TARGET_SAVE_RATIO}",
        s < TARGET_SAVE_RATIO,
    )
    for r in res["restore"]:
        d = r["disk"]["ratio"]
        add(
            f"bytes on disk / KV bytes, {r['tokens']} tokens",
            f"{d:.4f}",
            f"<= {TARGET_DISK_RATIO}",
            d <= TARGET_DISK_RATIO,
        )
    return out


# -- main ------------------------------------------------------------------------------------


def main(argv=None):
    global CHUNK_TOKENS  # read by every section
    args = parse_args(argv)
    CHUNK_TOKENS = args.chunk_tokens
    dtype = getattr(mx, args.dtype)
    per_token = LAYERS * 2 * KV_HEADS * HEAD_DIM * dtype.size
    sizes = list(dict.fromkeys(args.tokens))
    cache_limit = mlx_default_cache_limit()

    print("$ python " + shlex.join(sys.argv))
    print(
        f"mlx {mx.__version__}, mlx-lm {mlx_lm.__version__}, python {platform.python_version()} "
        f"({sys.executable}), {platform.system()} {platform.machine()}, {os.cpu_count()} CPUs, "
        f"mlx device {mx.default_device()}, MLX buffer cache limit {cache_limit:,} B; "
        f"kvstore at git {git_describe()}, source digest {source_digest()}"
    )
    print(
        f"KV: synthetic (random values), of SmolLM2-135M's shape: {LAYERS} layers x "
        f"{KV_HEADS} KV heads x head dim {HEAD_DIM}, {args.dtype} = {per_token:,} bytes/token; "
        f"stand-in model: random-weight mlx-lm llama with that cache layout"
    )
    print(
        f"KVStore: chunk_tokens={CHUNK_TOKENS}, read_threads={READ_THREADS}. Medians of "
        f"{args.repeats} repeats, cases interleaved (rotated order) within each repeat. "
        f"GB = 1e9 bytes. Page cache: warm for all disk cases (files just written, then read "
        f"once)."
    )

    tmp = tempfile.mkdtemp(prefix="kvstore-bench-", dir="/tmp")
    print(
        f"temp dir: {tmp}{' (kept)' if args.keep else ' (removed at the end)'}",
        flush=True,
    )
    res = {
        "command": ["python"] + sys.argv,
        "python_executable": sys.executable,
        "mlx_default_cache_limit": cache_limit,
        "mlx": mx.__version__,
        "mlx_lm": mlx_lm.__version__,
        "python": platform.python_version(),
        "platform": f"{platform.system()} {platform.machine()}",
        "cpus": os.cpu_count(),
        "kvstore_git": git_describe(),
        "kvstore_source_digest": source_digest(),
        "kv": "synthetic random KV of SmolLM2-135M's shape",
        "layers": LAYERS,
        "kv_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "dtype": args.dtype,
        "bytes_per_token": per_token,
        "chunk_tokens": CHUNK_TOKENS,
        "read_threads": READ_THREADS,
        "repeats": args.repeats,
        "page_cache": "warm",
        "restore": [],
    }
    rng = np.random.default_rng(12345)
    try:
        model = stand_in_model(dtype)
        largest = max(sizes)
        for n in sizes:
            t0 = time.perf_counter()
            r, miss = bench_restore(
                model, dtype, n, args.repeats, tmp, rng, per_token, miss=n == largest
            )
            res["restore"].append(r)
            if miss is not None:
                res["miss"] = miss
            print(
                f"  ... {n} tokens done in {time.perf_counter() - t0:.0f} s", flush=True
            )
        res["hash"] = bench_hash(rng)
        res["save"] = bench_save(model, dtype, args.repeats, tmp, rng, per_token)
        res["targets"] = targets(res)
        print_report(res)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(res, f, indent=2)
            print(f"\nJSON written to {args.json}")
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
