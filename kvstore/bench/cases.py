"""What a benchmark child process times: one case, measured from inside a fresh process.

:func:`run` is called by ``python -m kvstore.bench.child SPEC.json`` when the spec
names a ``case``. Every case first imports and builds what it needs (untimed), then
times only its own work and reports the wall time, the page faults and the CPU time
of the whole process (every thread) over that work:

- ``kvstore``: ``KVStore.fetch`` up to ``mx.eval`` of every restored array, then
  optionally the first forward pass over one more token (the room case);
- ``load_prompt_cache``: mlx-lm's ``load_prompt_cache`` of one file up to ``mx.eval``
  of every array, then optionally the same forward pass;
- ``floor``: the same bytes as kvstore's node files, each read with one plain
  ``readinto`` into a freshly allocated buffer, on :data:`FLOOR_THREADS` threads:
  what any reader of those bytes pays;
- ``open``: ``KVStore(...)`` on a store (the model's load is not timed).

To profile a case: ``mkfifo ctl ack; KVSTORE_PERF_FIFOS=ctl,ack perf record -g -D -1
--control fifo:ctl,ack -- python -m kvstore.bench.child SPEC.json`` records the timed
work only.
"""

import os
import resource
import time
from typing import Callable, Dict, List

# The KV shape of SmolLM2-135M (30 layers x 3 KV heads x 64 dims), for cases measured
# on synthetic KV in any dtype: a tiny random llama with that cache stands in.
STANDIN = {"layers": 30, "heads": 3, "head_dim": 64, "vocab": 1000}


def standin_model(dtype: str):
    """A random-weight llama whose KV cache has SmolLM2-135M's shape in ``dtype``;
    seeded, so every process builds the same weights (hence the same namespace)."""
    import mlx.core as mx

    from kvstore.bench.models import tiny_model

    return tiny_model(**STANDIN, dtype=getattr(mx, dtype))


def _usage() -> resource.struct_rusage:
    return resource.getrusage(resource.RUSAGE_SELF)


class _PerfControl:
    """Profiles only the timed work: with ``KVSTORE_PERF_FIFOS=CTL,ACK`` (the fifos of
    ``perf record -D -1 --control fifo:CTL,ACK``) the child enables perf around it."""

    def __init__(self):
        fifos = os.environ.get("KVSTORE_PERF_FIFOS")
        self.ctl = self.ack = None
        if fifos:
            ctl, ack = fifos.split(",")
            self.ctl, self.ack = open(ctl, "w"), open(ack)

    def send(self, command: str) -> None:
        if self.ctl is not None:
            self.ctl.write(command + "\n")
            self.ctl.flush()
            self.ack.readline()


def measure(work: Callable[[], None]) -> Dict[str, float]:
    """Wall seconds, minor page faults and CPU seconds (user, system) of ``work``."""
    perf = _PerfControl()
    perf.send("enable")
    r0 = _usage()
    t0 = time.perf_counter()
    work()
    wall = time.perf_counter() - t0
    r1 = _usage()
    perf.send("disable")
    return {
        "wall_s": wall,
        "faults": r1.ru_minflt - r0.ru_minflt,
        "user_s": r1.ru_utime - r0.ru_utime,
        "sys_s": r1.ru_stime - r0.ru_stime,
    }


def _forward(model, cache, token: int) -> float:
    """Seconds of the first forward pass over ``token`` (its logits and the cache
    evaluated): where an exactly full cache copies every layer to grow."""
    import mlx.core as mx

    t0 = time.perf_counter()
    logits = model(mx.array([[token]]), cache=cache)
    mx.eval(logits, [c.state for c in cache])
    return time.perf_counter() - t0


def _kvstore(spec: dict) -> dict:
    from kvstore.bench.measure import timed_fetch

    from ..store import KVStore

    model = standin_model(spec["dtype"])
    if spec.get("prefault") is False:  # measure without prefaulting fresh rows
        from ..platform import memutil

        memutil.disable_prefault()
    store = KVStore(
        spec["store"],
        model,
        chunk_tokens=spec["chunk_tokens"],
        ram_bytes=0,
        restore_room=spec["restore_room"],
        read_threads=spec.get("read_threads", 2),
    )
    tokens = spec["tokens"]
    got = {}

    def work():
        got["phases"], got["cache"] = timed_fetch(store, tokens, expect=spec["expect"])

    out = measure(work)
    phases = got["phases"]
    out.update(lookup_s=phases.lookup, read_s=phases.read, assemble_s=phases.assemble)
    cache = got.pop("cache")
    out["capacity"] = cache[0].keys.shape[2]
    if spec.get("forward"):
        out["forward_s"] = _forward(model, cache, tokens[-1])
    store.close()
    return out


def _load_prompt_cache(spec: dict) -> dict:
    from mlx_lm.models.cache import load_prompt_cache

    from kvstore.bench.measure import eval_cache

    model = standin_model(spec["dtype"]) if spec.get("forward") else None
    got = {}

    def work():
        got["cache"] = load_prompt_cache(spec["file"])
        eval_cache(got["cache"])

    out = measure(work)
    out["capacity"] = got["cache"][0].keys.shape[2]
    if model is not None:
        out["forward_s"] = _forward(model, got["cache"], spec["token"])
    return out


# The floor reads on as many threads as a fetch does (``KVStore``'s default
# ``read_threads``): what any reader of these bytes pays on this machine.
FLOOR_THREADS = 2


def read_floor(paths: List[str], *, fresh_pages: bool = False, pool=None) -> list:
    """Every file read with one plain ``readinto`` into a new buffer of its own: on
    this thread, or split between the ``pool``'s :data:`FLOOR_THREADS` threads.

    ``fresh_pages``: buffers mapped anew from the OS (as a fresh process's allocator
    gets them: every page faults in on first write); otherwise from ``malloc``
    (through numpy), which a warm process recycles.
    """
    import mmap

    import numpy as np

    def read(path: str):
        with open(path, "rb", buffering=0) as f:
            size = f.seek(0, 2)
            f.seek(0)
            # Not np.empty when fresh: numpy asks for huge pages on large buffers,
            # which MLX's allocator does not.
            buf = (
                mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
                if fresh_pages  # private, as malloc's: not MAP_SHARED (shmem)
                else np.empty(size, np.uint8)
            )
            if f.readinto(memoryview(buf)) != size:
                raise RuntimeError(f"{path}: short read")
        return buf

    out = [None] * len(paths)

    def part(k: int, step: int) -> None:
        out[k::step] = [read(path) for path in paths[k::step]]

    _split(part, pool)
    return out


def read_into(paths: List[str], buffers: list, *, pool=None) -> None:
    """Every file read with one plain ``readinto`` into its buffer (already
    faulted): on this thread, or split between the ``pool``'s threads."""

    def part(k: int, step: int) -> None:
        for path, buf in zip(paths[k::step], buffers[k::step]):
            with open(path, "rb", buffering=0) as f:
                if f.readinto(memoryview(buf)) != len(buf):
                    raise RuntimeError(f"{path}: short read")

    _split(part, pool)


def _split(part: Callable[[int, int], None], pool) -> None:
    """``part(k, FLOOR_THREADS)`` for every k on ``pool``, or ``part(0, 1)`` here."""
    if pool is None:
        return part(0, 1)
    for job in [pool.submit(part, k, FLOOR_THREADS) for k in range(FLOOR_THREADS)]:
        job.result()


def _floor(spec: dict) -> dict:
    import mmap  # noqa: F401  (imported before timing)
    from concurrent.futures import ThreadPoolExecutor

    import numpy  # noqa: F401

    held = []
    with ThreadPoolExecutor(FLOOR_THREADS) as pool:
        pool.map(int, range(FLOOR_THREADS))  # threads started before timing
        return measure(
            lambda: held.append(read_floor(spec["files"], fresh_pages=True, pool=pool))
        )


def _open(spec: dict) -> dict:
    from kvstore.bench.models import load

    from ..store import KVStore

    model, tokenizer = load(spec["model"])
    got = {}

    def work():
        got["store"] = KVStore(spec["store"], model, tokenizer, ram_bytes=0)

    out = measure(work)
    got["store"].close()
    return out


CASES = {
    "kvstore": _kvstore,
    "load_prompt_cache": _load_prompt_cache,
    "floor": _floor,
    "open": _open,
}


def run(spec: dict) -> dict:
    """Run the case ``spec["case"]``; returns its measurements."""
    return CASES[spec["case"]](spec)
