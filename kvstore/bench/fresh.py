"""After a restart: the first restore in a fresh process.

For each dtype and length, the same synthetic KV (SmolLM2-135M's shape) is restored
in fresh child processes, one case per process, the cases' order rotated every
repeat: kvstore's ``fetch``, mlx-lm's ``load_prompt_cache`` of one file, and the
floor (kvstore's node files read with plain ``readinto`` into fresh buffers, on as
many threads as a fetch reads with). Page cache warm. Where the KV is large enough
for room, kvstore with ``restore_room=0`` runs too, and every restore case also
times the first forward pass over one more token: the trade of allocating room
against growing an exactly full cache. At the largest length, kvstore without
prefaulting its rows runs too.
"""

from typing import Dict, List, Sequence

from tqdm import tqdm

from kvstore.bench import child
from kvstore.bench.cases import FLOOR_THREADS
from kvstore.bench.kvfiles import KVFiles, make_kv_files
from kvstore.bench.measure import set_page_cache

from ..engine.restore import ROOM_MIN_BYTES
from ..platform.memutil import prefault_supported

DEFAULT_ROOM = 2048  # KVStore's default restore_room


def _specs(kv: KVFiles, chunk_tokens: int, largest: bool) -> Dict[str, dict]:
    """The child specs of every case at this size (``largest``: of the run)."""
    store = {
        "case": "kvstore",
        "store": kv.store,
        "dtype": kv.dtype,
        "chunk_tokens": chunk_tokens,
        "tokens": kv.query,
        "expect": kv.tokens,
        "restore_room": DEFAULT_ROOM,
        "forward": True,
    }
    specs = {
        "kvstore": store,
        "load_prompt_cache": {
            "case": "load_prompt_cache",
            "file": kv.one_file,
            "dtype": kv.dtype,
            "token": kv.query[-1],
            "forward": True,
        },
        "floor": {"case": "floor", "files": kv.node_files},
    }
    if kv.kv_bytes >= ROOM_MIN_BYTES:  # below it kvstore restores without room
        specs["kvstore_room0"] = dict(store, restore_room=0)
    if largest and prefault_supported():  # what prefaulting the rows is worth
        specs["kvstore_no_prefault"] = dict(store, prefault=False)
    return specs


LABELS = {
    "kvstore": "kvstore fetch (restore_room=2048)",
    "kvstore_room0": "kvstore fetch (restore_room=0)",
    "kvstore_no_prefault": "kvstore fetch, rows not prefaulted",
    "load_prompt_cache": "mlx-lm load_prompt_cache, 1 file",
    "floor": f"floor: readinto fresh buffers, {FLOOR_THREADS} threads",
}


def bench_fresh(
    dtypes: Sequence[str],
    lengths: Sequence[int],
    *,
    repeats: int,
    chunk_tokens: int,
    tmp: str,
) -> List[Dict]:
    """Every case at every dtype and length; one row per (dtype, length)."""
    rows = []
    todo = [(d, n) for d in dtypes for n in lengths]
    for dtype, n in tqdm(todo, desc="after a restart", unit="size", leave=False):
        kv = make_kv_files(tmp, dtype, n, chunk_tokens=chunk_tokens, seed=n)
        try:
            specs = _specs(kv, chunk_tokens, n == max(lengths))
            names = list(specs)
            cases = {name: {"label": LABELS[name], "samples": []} for name in names}
            for r in range(repeats):
                for name in names[r % len(names) :] + names[: r % len(names)]:
                    set_page_cache(kv.files(), "warm")
                    cases[name]["samples"].append(child.spawn(specs[name], tmp))
            rows.append(
                {
                    "dtype": dtype,
                    "tokens": n,
                    "kv_bytes": kv.kv_bytes,
                    "node_files": len(kv.node_files),
                    "cases": cases,
                }
            )
        finally:
            kv.remove()
    return rows
