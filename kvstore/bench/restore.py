"""Restore throughput on synthetic KV of the model's shape, up to 100K tokens: kvstore
from disk (same process, after a restart) and from RAM, against mlx-lm's
``load_prompt_cache`` of one file and a raw sequential read of kvstore's own files."""

import os
import shutil
import time
from typing import Dict, List, Sequence

import mlx.core as mx
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache
from tqdm import tqdm

from kvstore.bench import child
from kvstore.bench.measure import (
    add_restore,
    allocated_bytes,
    apparent_bytes,
    files_under,
    kv_layers,
    minor_faults,
    new_case,
    node_pieces,
    raw_read,
    set_page_cache,
    synthetic_cache,
    time_concatenate,
    time_load_prompt_cache,
    timed_fetch,
)
from kvstore.bench.ttft import Prompts, add_child_sample, store_files
from kvstore.store import DEFAULT_RAM_BYTES

from ..store import KVStore

RAW_BUFFER_BYTES = 256 << 20  # reused: a raw read pays no page faults


def _save(store, tokens, layout, n, onefile) -> Dict:
    """Write the same synthetic KV to the store and to one mlx-lm prompt-cache file."""
    src = synthetic_cache(layout, n, seed=n)
    t0 = time.perf_counter()
    store.save(tokens, src)
    t1 = time.perf_counter()
    store.flush()
    t2 = time.perf_counter()
    save_prompt_cache(onefile, src)
    t3 = time.perf_counter()
    del src
    mx.clear_cache()
    return {
        "save_return_s": t1 - t0,
        "save_flush_s": t2 - t1,
        "save_prompt_cache_s": t3 - t2,
    }


def _same_kv(restored, saved, n: int) -> bool:
    """Whether kvstore's restore holds the bytes of the same KV in one mlx-lm file."""
    return all(
        mx.array_equal(a.keys[..., :n, :], b.keys[..., :n, :]).item()
        and mx.array_equal(a.values[..., :n, :], b.values[..., :n, :]).item()
        for a, b in zip(restored, saved)
    )


def bench_one(
    model,
    tokenizer,
    n: int,
    *,
    model_name,
    repeats: int,
    chunk_tokens: int,
    conditions: Sequence[str],
    restart: bool,
    tmp: str,
    prompts: Prompts,
) -> Dict:
    """Every restore case at ``n`` tokens."""
    path = os.path.join(tmp, f"restore-store-{n}")
    onefile = os.path.join(tmp, f"prompt-cache-{n}.safetensors")
    tokens = prompts.new(n)
    query = tokens + prompts.suffix(1, avoid=-1)  # restores all n tokens

    probe = KVStore(path, model, tokenizer, chunk_tokens=chunk_tokens, ram_bytes=0)
    layout = probe.layout
    kv_bytes = n * sum(
        lay.heads * (lay.k_dim + lay.v_dim) * getattr(mx, lay.dtype).size
        for lay in kv_layers(layout)
    )
    # The RAM tier holds the saving process's chunks when they fit its default budget.
    ram_hot = kv_bytes <= DEFAULT_RAM_BYTES
    probe.close()
    store = KVStore(
        path,
        model,
        tokenizer,
        chunk_tokens=chunk_tokens,
        ram_bytes=DEFAULT_RAM_BYTES if ram_hot else 0,
    )
    row = {"tokens": n, "kv_bytes": kv_bytes, "cases": {}}
    row.update(_save(store, tokens, layout, n, onefile))

    if ram_hot:
        case = row["cases"]["ram_hot"] = new_case("kvstore, RAM-hot", None)
        row["concat_s"] = []
        for _ in range(repeats):
            phases, cache = timed_fetch(store, query, expect=n)
            add_restore(case, phases)
            pieces = node_pieces(cache, chunk_tokens)
            del cache
            row["concat_s"].append(time_concatenate(pieces))
            del pieces
    store.close()

    store = KVStore(path, model, tokenizer, chunk_tokens=chunk_tokens, ram_bytes=0)
    files = store_files(path)
    blobs = files_under(os.path.join(path, "blobs"))
    buf = bytearray(min(RAW_BUFFER_BYTES, kv_bytes + (1 << 20)))
    raw_read(blobs[:1], buf)  # faults the buffer in, untimed
    # The first restore at this size, in fresh memory (as after a restart, but warm).
    mx.clear_cache()
    set_page_cache(files, "warm")
    f0 = minor_faults()
    phases, restored = timed_fetch(store, query, expect=n)
    row["first_s"] = phases.total
    row["first_faults"] = minor_faults() - f0
    row["restored_equal"] = _same_kv(restored, load_prompt_cache(onefile), n)
    if not row["restored_equal"]:
        print(f"WARNING: kvstore restored other bytes than were saved, {n} tokens")
    del restored

    for cond in conditions:
        kv = row["cases"][f"disk_{cond}"] = new_case("kvstore, disk", cond)
        lpc = row["cases"][f"load_prompt_cache_{cond}"] = new_case(
            "mlx-lm load_prompt_cache, 1 file", cond
        )
        raw = row["cases"][f"raw_{cond}"] = new_case(
            "raw sequential read, kvstore's files", cond
        )
        cases = [
            (
                kv,
                files,
                lambda: add_restore(kv, timed_fetch(store, query, expect=n)[0]),
            ),
            (
                lpc,
                [onefile],
                lambda: lpc["restore_s"].append(time_load_prompt_cache(onefile)),
            ),
            (raw, blobs, lambda: raw["restore_s"].append(raw_read(blobs, buf))),
        ]
        for r in range(repeats):
            # Rotated order: no case always runs first, or always after the same one.
            for case, paths, run in cases[r % 3 :] + cases[: r % 3]:
                case["resident"].append(set_page_cache(paths, cond))
                run()
    buf = None  # release the raw-read buffer before the restart children
    stats = store.stats()
    store.close()

    if restart:
        for cond in conditions:
            case = row["cases"][f"restart_{cond}"] = new_case(
                "kvstore, after restart (first restore)", cond
            )
            case["resident"].append(set_page_cache(files, cond))
            spec = {
                "model": model_name,
                "store": path,
                "chunk_tokens": chunk_tokens,
                "tokens": query,
                "expect": n,
                "forward": False,
            }
            add_child_sample(case, child.spawn(spec, tmp))

    index_bytes = apparent_bytes(os.path.join(path, "index"))
    row["disk"] = {
        "kv_bytes": kv_bytes,
        "chunk_file_bytes": stats["bytes_on_disk"],
        "index_bytes": index_bytes,
        "ratio": (stats["bytes_on_disk"] + index_bytes) / kv_bytes,
        "store_dir_apparent": apparent_bytes(path),
        "store_dir_allocated": allocated_bytes(path),
        "one_file_bytes": os.path.getsize(onefile),
        "nodes": stats["nodes"],
    }
    shutil.rmtree(path, ignore_errors=True)
    os.unlink(onefile)
    return row


def bench_restore(model, tokenizer, lengths: Sequence[int], **kwargs) -> List[Dict]:
    """:func:`bench_one` at every length (stores removed as they are done: disk)."""
    return [
        bench_one(model, tokenizer, n, **kwargs)
        for n in tqdm(lengths, desc="restore", unit="length", leave=False)
    ]
