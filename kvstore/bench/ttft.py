"""Time to first token on the real model: cold, RAM-hot, disk-hot (same process and
after a restart), nearest prefix; and the write cost of saving while prefilling."""

import os
import time
from typing import Dict, List, Sequence

import numpy as np
from mlx_lm.models.cache import make_prompt_cache
from tqdm import tqdm

from kvstore.bench import child
from kvstore.bench.measure import (
    add_restore,
    files_under,
    med,
    new_case,
    node_pieces,
    set_page_cache,
    time_concatenate,
    timed_fetch,
)
from kvstore.bench.models import first_token, prefill, vocab_size
from kvstore.store import DEFAULT_RAM_BYTES

from ..store import KVStore


class Prompts:
    """Random token prompts within the model's vocabulary, no two starting alike
    (so that no prompt is a prefix of another one's store content)."""

    def __init__(self, model, seed: int):
        self.rng = np.random.default_rng(seed)
        self.high = vocab_size(model)
        self.low = min(100, self.high // 4)  # clear of most special tokens
        self.firsts = set()

    def new(self, n: int) -> List[int]:
        toks = self.rng.integers(self.low, self.high, size=n).tolist()
        while toks[0] in self.firsts:
            toks[0] = int(self.rng.integers(self.low, self.high))
        self.firsts.add(toks[0])
        return toks

    def suffix(self, n: int, *, avoid: int) -> List[int]:
        """New tokens to append; the first differs from ``avoid`` (the stored token)."""
        toks = self.rng.integers(self.low, self.high, size=n).tolist()
        while toks[0] == avoid:
            toks[0] = int(self.rng.integers(self.low, self.high))
        return toks


def cold_ttft(model, tokens: Sequence[int]):
    """Full prefill without a store: ``(seconds, cache)``."""
    cache = make_prompt_cache(model)
    t0 = time.perf_counter()
    first_token(model, cache, tokens)
    return time.perf_counter() - t0, cache


def hot_ttft(store, model, query: Sequence[int], expect: int, case: dict) -> None:
    """Restore the stored prefix of ``query``, run the rest, append to ``case``."""
    phases, cache = timed_fetch(store, query, expect=expect)
    t0 = time.perf_counter()
    first_token(model, cache, query[phases.tokens :])
    add_restore(case, phases, model_s=time.perf_counter() - t0)


def store_files(path: str) -> List[str]:
    return files_under(os.path.join(path, "blobs")) + files_under(
        os.path.join(path, "index")
    )


def bench_ttft(
    model,
    tokenizer,
    *,
    model_name,
    lengths: Sequence[int],
    repeats: int,
    suffix: int,
    chunk_tokens: int,
    conditions: Sequence[str],
    tmp: str,
    prompts: Prompts,
) -> List[Dict]:
    """Cases 1-5 at every length; returns one record per length."""
    first_token(model, make_prompt_cache(model), prompts.new(8))  # warm-up, untimed
    path = os.path.join(tmp, "ttft-store")
    rows = []
    kv_total = 0
    store = KVStore(
        path, model, tokenizer, chunk_tokens=chunk_tokens, ram_bytes=DEFAULT_RAM_BYTES
    )
    for n in tqdm(lengths, desc="cold prefill", unit="length", leave=False):
        tokens = prompts.new(n)
        seconds, cache = cold_ttft(model, tokens)
        kv_bytes = sum(
            c.keys[..., :n, :].nbytes + c.values[..., :n, :].nbytes for c in cache
        )
        kv_total += kv_bytes
        store.save(tokens, cache, kind="system")
        store.flush()  # not timed: the write cost case measures saving
        rows.append(
            {"tokens": n, "kv_bytes": kv_bytes, "prompt": tokens, "cold_s": seconds}
        )
    # The RAM tier holds what this process saved, while it fits its budget.
    in_ram = kv_total <= store.ram.max_bytes

    for row in rows:
        row["cases"] = {
            "ram_hot": new_case("RAM-hot, exact prefix", None),
            "disk_warm": new_case("disk-hot, same process", "warm"),
        }
        row["concat_s"] = []
    for _ in tqdm(range(repeats), desc="RAM-hot", leave=False):
        for row in rows:
            tokens = row["prompt"]
            case = row["cases"]["ram_hot"]
            hot_ttft(store, model, tokens, len(tokens) - 1, case)
            phases, cache = timed_fetch(store, tokens, expect=len(tokens) - 1)
            pieces = node_pieces(cache, chunk_tokens)
            del cache
            row["concat_s"].append(time_concatenate(pieces))
            row.setdefault("ram_assemble_s", []).append(phases.total - phases.lookup)
    for row in rows:
        row["cases"]["ram_hot"]["in_ram"] = in_ram
    store.close()

    # The same store reopened with no RAM tier: every chunk comes from its file.
    store = KVStore(path, model, tokenizer, chunk_tokens=chunk_tokens, ram_bytes=0)
    files = store_files(path)
    for cond in conditions:
        for row in rows:
            row["cases"][f"disk_{cond}"] = new_case("disk-hot, same process", cond)
            row["cases"][f"nearest_{cond}"] = new_case(
                f"nearest prefix (+{min(suffix, row['tokens'] // 2)} new)", cond
            )
        for _ in tqdm(range(repeats), desc=f"disk-hot ({cond})", leave=False):
            for row in rows:
                tokens, n = row["prompt"], row["tokens"]
                case = row["cases"][f"disk_{cond}"]
                case["resident"].append(set_page_cache(files, cond))
                hot_ttft(store, model, tokens, n - 1, case)
                s = min(suffix, n // 2)
                query = tokens[: n - s] + prompts.suffix(s, avoid=tokens[n - s])
                case = row["cases"][f"nearest_{cond}"]
                case["resident"].append(set_page_cache(files, cond))
                hot_ttft(store, model, query, n - s, case)
    store.close()

    # After a restart: a fresh process per sample (it loads the model, opens the store).
    for cond in conditions:
        for row in rows:
            row["cases"][f"restart_{cond}"] = new_case("disk-hot after restart", cond)
        for _ in tqdm(range(repeats), desc=f"restart ({cond})", leave=False):
            for row in rows:
                case = row["cases"][f"restart_{cond}"]
                spec = {
                    "model": model_name,
                    "store": path,
                    "chunk_tokens": chunk_tokens,
                    "tokens": row["prompt"],
                    "expect": row["tokens"] - 1,
                    "forward": True,
                }
                case["resident"].append(set_page_cache(files, cond))
                add_child_sample(case, child.spawn(spec, tmp))
    for row in rows:
        del row["prompt"]
    return rows


def add_child_sample(case: dict, out: dict) -> None:
    """Append a restart child's result to ``case`` (TTFT includes the store's open)."""
    from kvstore.bench.measure import Phases

    fetch = dict(out["fetch"])
    phases = Phases(**fetch)
    add_restore(case, phases, model_s=out["forward_s"] or 0.0, open_s=out["open_s"])
    for key in ("model_load_s", "import_s", "process_wall_s", "fetch_faults"):
        case.setdefault(key, []).append(out[key])


def bench_write(
    model,
    tokenizer,
    *,
    tokens: int,
    repeats: int,
    chunk_tokens: int,
    tmp: str,
    prompts: Prompts,
) -> Dict:
    """Case 8: prefill throughput with the store saving (write-behind) vs. without.

    Each repeat runs one fresh prompt each way back to back (order alternating), so
    the background write of a saved prompt overlaps the next prefill, as in a server.
    """
    store = KVStore(
        os.path.join(tmp, "write-store"), model, tokenizer, chunk_tokens=chunk_tokens
    )
    plain, saving = [], []

    def run_plain():
        cache = make_prompt_cache(model)
        t0 = time.perf_counter()
        prefill(model, cache, prompts.new(tokens))
        plain.append(time.perf_counter() - t0)

    def run_saving():
        t0 = time.perf_counter()
        store.prefill(prompts.new(tokens), kind="user")
        saving.append(time.perf_counter() - t0)

    for r in tqdm(range(repeats), desc="write cost", leave=False):
        for run in (run_plain, run_saving) if r % 2 == 0 else (run_saving, run_plain):
            run()
    t0 = time.perf_counter()
    store.flush()
    flush_s = time.perf_counter() - t0
    stats = store.stats()
    store.close()
    return {
        "tokens": tokens,
        "plain_s": plain,
        "saving_s": saving,
        "final_flush_s": flush_s,
        "ratio": med(plain) / med(saving),
        "nodes_written": stats["nodes_written"],
        "writes_dropped": stats["writes_dropped"],
        "writes_failed": stats["writes_failed"],
    }
