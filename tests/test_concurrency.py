"""Several processes on one store: 4 writers prefilling overlapping prompts and 2
readers fetching and checking every restore against recomputation, for a bounded time.

``KVSTORE_CONCURRENCY_SECONDS`` sets the run time (default 6 s).
"""

import multiprocessing as mp
import os
import random
import time

import mlx.core as mx
import pytest
from conftest import compute_cache, random_tokens, tiny_llama

from kvstore import KVStore, maintenance

pytestmark = pytest.mark.slow

C = 32
PREFIXES = [random_tokens(80, 7000 + g) for g in range(4)]
PROMPTS = [
    p + random_tokens(20 + 8 * i, 7100 + 10 * g + i)
    for g, p in enumerate(PREFIXES)
    for i in range(4)
]


def _writer(path: str, seed: int, seconds: float, out) -> None:
    rng = random.Random(seed)
    model = tiny_llama(0)
    done = 0
    with KVStore(path, model, chunk_tokens=C) as store:
        deadline = time.time() + seconds
        while time.time() < deadline:
            store.prefill(rng.choice(PROMPTS), kind=rng.choice(["system", "user"]))
            store.flush()
            done += 1
        stats = store.stats()
    out.put(
        (
            "writer",
            done,
            0,
            stats["errors"] + stats["writes_failed"],
            stats["corrupt"],
            0.0,
        )
    )


def _reader(path: str, seed: int, seconds: float, out) -> None:
    rng = random.Random(seed)
    model = tiny_llama(0)
    done = wrong = 0
    slowest = 0.0
    with KVStore(path, model, chunk_tokens=C, ram_bytes=0) as store:
        deadline = time.time() + seconds
        while time.time() < deadline:
            tokens = rng.choice(PROMPTS) + [1]
            tic = time.perf_counter()
            cache, n = store.fetch(tokens)
            slowest = max(slowest, time.perf_counter() - tic)
            done += 1
            if n:
                ref = compute_cache(model, tokens[:n])
                for got, want in zip(cache, ref):
                    same = mx.array_equal(
                        got.keys[:, :, :n], want.keys[:, :, :n]
                    ).item()
                    same = (
                        same
                        and mx.array_equal(
                            got.values[:, :, :n], want.values[:, :, :n]
                        ).item()
                    )
                    wrong += not same
        stats = store.stats()
    out.put(("reader", done, wrong, stats["errors"], stats["corrupt"], slowest))


def test_four_writers_two_readers_one_store(tmp_path):
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["mlx.core", "mlx_lm", "kvstore", "conftest"])
    path = str(tmp_path / "store")
    seconds = float(os.environ.get("KVSTORE_CONCURRENCY_SECONDS", "6"))
    out = ctx.Queue()
    procs = [
        ctx.Process(target=_writer, args=(path, i, seconds, out)) for i in range(4)
    ]
    procs += [
        ctx.Process(target=_reader, args=(path, 100 + i, seconds, out))
        for i in range(2)
    ]
    for p in procs:
        p.start()
    results = [out.get(timeout=seconds + 120) for _ in procs]
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    writes = sum(r[1] for r in results if r[0] == "writer")
    reads = sum(r[1] for r in results if r[0] == "reader")
    assert writes > 0 and reads > 0
    assert sum(r[2] for r in results) == 0, "a restore differed from recomputation"
    assert sum(r[3] for r in results) == 0, "errors in some process"
    assert sum(r[4] for r in results) == 0, "corrupt files seen"
    # Readers never waited on writers for long (LMDB readers do not block).
    assert max(r[5] for r in results if r[0] == "reader") < 5.0

    report = maintenance.verify(path)
    assert report["clean"] and report["orphans"] == 0, report["problems"]
    with KVStore(path, tiny_llama(0), chunk_tokens=C) as store:
        stored = [store.fetch(p + [1])[1] for p in PROMPTS]
    assert all(n >= 80 for n in stored)  # every shared prefix is there
