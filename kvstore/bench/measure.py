"""Measuring helpers of ``kvstore bench`` (and the tools in tools/ that run its sections).

Pitfalls these helpers exist for (see docs/benchmarks.md):

- ``mx.load`` is lazy: a restore is timed up to ``mx.eval`` of every array it produced.
- A fresh process's first evaluation of new arrays pays page faults: restarts are
  measured in a real subprocess.
- The machines are shared and noisy: cases are compared as ratios within one run,
  medians of repeats, in rotated order.
"""

import ctypes
import mmap
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache, load_prompt_cache

from ..platform import fsutil

GB = 1e9
MB = 1e6


def med(xs: Sequence[float]) -> float:
    return statistics.median(xs)


def minor_faults() -> int:
    """Minor page faults of this process so far (all threads)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / GB if seconds > 0 else float("inf")


def eval_cache(cache) -> None:
    """Evaluate every array of a list of cache objects (empty layers skipped)."""
    mx.eval([(c.keys, c.values) for c in cache if c.keys is not None])


class Interleaved(NamedTuple):
    """Per case, one entry per call: wall seconds, minor faults, CPU user and system
    seconds (process-wide: MLX's and kvstore's threads included)."""

    times: Dict[str, List[float]]
    faults: Dict[str, List[int]]
    user: Dict[str, List[float]]
    system: Dict[str, List[float]]


def run_interleaved(cases: Dict[str, Callable[[], float]], repeats: int) -> Interleaved:
    """Run every case once per repeat, rotating the order."""
    names = list(cases)
    out = Interleaved(*({k: [] for k in names} for _ in range(4)))
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            r0 = resource.getrusage(resource.RUSAGE_SELF)
            out.times[name].append(cases[name]())
            r1 = resource.getrusage(resource.RUSAGE_SELF)
            out.faults[name].append(r1.ru_minflt - r0.ru_minflt)
            out.user[name].append(r1.ru_utime - r0.ru_utime)
            out.system[name].append(r1.ru_stime - r0.ru_stime)
    return out


# -- files and the page cache -------------------------------------------------------


def files_under(path: str) -> List[str]:
    if os.path.isfile(path):
        return [path]
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs)


def apparent_bytes(path: str) -> int:
    return sum(os.stat(p).st_size for p in files_under(path))


def allocated_bytes(path: str) -> int:
    return sum(os.stat(p).st_blocks * 512 for p in files_under(path))


def warm_page_cache(paths: Sequence[str]) -> None:
    """Read every file once with plain reads, so that later reads hit the page cache."""
    buf = bytearray(8 << 20)
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass


def drop_page_cache(paths: Sequence[str]) -> bool:
    """Ask the kernel to drop the files' pages (no root needed). True if it was asked.

    Dirty pages cannot be dropped, so each file is synced first. Whether the pages
    really went is for :func:`resident_fraction` to say (tmpfs keeps them, say).
    """
    if not hasattr(os, "posix_fadvise"):
        return False
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return True


_LIBC = None


def resident_fraction(paths: Sequence[str]) -> Optional[float]:
    """Fraction of the files' pages in the page cache (``mincore``), None if unknown."""
    global _LIBC
    if sys.platform != "linux":
        return None
    if _LIBC is None:
        _LIBC = ctypes.CDLL(None, use_errno=True)
        _LIBC.mincore.argtypes = [
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.POINTER(ctypes.c_ubyte),
        ]
    page, resident, total = mmap.PAGESIZE, 0, 0
    for p in paths:
        size = os.path.getsize(p)
        if size == 0:
            continue
        pages = (size + page - 1) // page
        vec = (ctypes.c_ubyte * pages)()
        with open(p, "rb") as f, mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) as m:
            view = np.frombuffer(m, dtype=np.uint8)
            ok = _LIBC.mincore(ctypes.c_void_p(view.ctypes.data), size, vec) == 0
            del view  # the mmap cannot close while a view is alive
        if not ok:
            return None
        resident += int(np.frombuffer(vec, dtype=np.uint8).__and__(1).sum())
        total += pages
    return resident / total if total else 1.0


def set_page_cache(paths: Sequence[str], state: str) -> Optional[float]:
    """Put the files' pages in ``state`` ("warm" or "dropped"); returns the resident
    fraction measured afterwards (None where it cannot be measured)."""
    if state == "warm":
        warm_page_cache(paths)
    else:
        drop_page_cache(paths)
    return resident_fraction(paths)


def can_drop_page_cache(directory: str) -> bool:
    """Whether dropping pages works for files in ``directory`` (checked with mincore)."""
    probe = os.path.join(directory, ".page-cache-probe")
    with open(probe, "wb") as f:
        f.write(os.urandom(1 << 20))
    try:
        if not drop_page_cache([probe]):
            return False
        resident = resident_fraction([probe])
        return resident is not None and resident < 0.1
    finally:
        os.unlink(probe)


# -- environment ----------------------------------------------------------------------


def git_describe() -> Optional[str]:
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        rev = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=here,
            capture_output=True,
            text=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "kvstore"],
            cwd=here,
            capture_output=True,
            text=True,
        ).stdout.strip()
    except OSError:
        return None
    return (rev + (" (kvstore/ has uncommitted changes)" if dirty else "")) or None


def source_digest() -> str:
    """xxh3 of kvstore's source files as measured (other people edit them)."""
    import xxhash

    import kvstore

    h = xxhash.xxh3_64()
    root = os.path.dirname(kvstore.__file__)
    for d, _, names in sorted(os.walk(root)):
        for name in sorted(names):
            if name.endswith(".py"):
                with open(os.path.join(d, name), "rb") as f:
                    h.update(name.encode() + b"\0" + f.read())
    return h.hexdigest()


def mlx_default_cache_limit() -> int:
    prev = mx.set_cache_limit(1 << 30)
    mx.set_cache_limit(prev)
    return prev


def environment() -> dict:
    import mlx_lm

    return {
        "mlx": mx.__version__,
        "mlx_lm": mlx_lm.__version__,
        "python": platform.python_version(),
        "platform": f"{platform.system()} {platform.machine()}",
        "cpus": os.cpu_count(),
        "device": str(mx.default_device()),
        "mlx_cache_limit": mlx_default_cache_limit(),
        "kvstore_git": git_describe(),
        "kvstore_source_digest": source_digest(),
    }


# -- synthetic KV and baselines ----------------------------------------------------------


def kv_layers(layout) -> List[SimpleNamespace]:
    """``heads, k_dim, v_dim, dtype`` of every layer of an all-``KVCache`` layout (the
    restore cases measure such models: synthetic KV is made of these shapes)."""
    out = []
    for leaf in layout.leaves:
        if leaf.cls != "KVCache":
            raise ValueError(
                f"restore cases need a KVCache model; layer {leaf.name} is {leaf.cls}"
            )
        (_, dtype, (heads, k_dim)), (_, _, (_, v_dim)) = leaf.tensors
        out.append(SimpleNamespace(heads=heads, k_dim=k_dim, v_dim=v_dim, dtype=dtype))
    return out


def synthetic_cache(layout, n: int, *, seed: int, pool: int = 4) -> List[KVCache]:
    """KVCache objects holding ``n`` tokens of random KV in the store's ``layout``.

    Layers share a pool of ``pool`` random arrays per shape: speed does not depend on
    the values, memory does (100K tokens of SmolLM2's float32 KV is 4.6 GB).
    """
    rng = np.random.default_rng(seed)
    arrays: Dict[tuple, List[mx.array]] = {}
    cache = []
    for i, lay in enumerate(kv_layers(layout)):
        got = []
        for dim, j in ((lay.k_dim, 2 * i), (lay.v_dim, 2 * i + 1)):
            key = (lay.heads, dim, lay.dtype)
            if key not in arrays:
                shape = (1, lay.heads, n, dim)
                arrays[key] = [
                    mx.array(rng.random(shape, dtype=np.float32)).astype(
                        getattr(mx, lay.dtype)
                    )
                    for _ in range(pool)
                ]
                mx.eval(arrays[key])
            got.append(arrays[key][j % pool])
        c = KVCache()
        c.state = (got[0], got[1], n)
        cache.append(c)
    return cache


def time_load_prompt_cache(path: str) -> float:
    t0 = time.perf_counter()
    cache = load_prompt_cache(path)
    eval_cache(cache)
    return time.perf_counter() - t0


def raw_read(paths: Sequence[str], buf: bytearray) -> float:
    """Time reading every byte of ``paths`` in order into ``buf`` (reused, pre-faulted)."""
    view = memoryview(buf)
    t0 = time.perf_counter()
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            pos = 0
            while True:
                got = fsutil.preadv(fd, [view], pos, nbytes=len(view))
                pos += got
                if got < len(view):
                    break
        finally:
            os.close(fd)
    return time.perf_counter() - t0


def time_concatenate(pieces: Dict[str, List[mx.array]]) -> float:
    """Time one ``mx.concatenate`` per tensor of already evaluated node arrays."""
    t0 = time.perf_counter()
    out = [mx.concatenate(parts, axis=2) for parts in pieces.values()]
    mx.eval(out)
    return time.perf_counter() - t0


def node_pieces(cache, chunk_tokens: int) -> Dict[str, List[mx.array]]:
    """A restored cache cut back into per-node arrays (evaluated copies), per tensor."""
    pieces = {}
    for i, c in enumerate(cache):
        n = c.offset
        for name, arr in (("keys", c.keys), ("values", c.values)):
            parts = [
                mx.contiguous(arr[:, :, s : min(s + chunk_tokens, n), :])
                for s in range(0, n, chunk_tokens)
            ]
            pieces[f"{i}.{name}"] = parts
    mx.eval(list(pieces.values()))
    return pieces


# -- a fetch split into phases -------------------------------------------------------------


@dataclass
class Phases:
    """Seconds spent in the phases of one ``KVStore.fetch``.

    ``lookup`` is wall time on the calling thread (the trie walk). ``read`` (chunk
    files read and checked, or RAM-tier lookups) and ``assemble`` (destination arrays
    allocated, rows copied, cache objects built) are summed over the store's reader
    threads, which read and copy in parallel: they can add up to more than
    ``total - lookup``. None where the store's internals are not where the probe
    expects them.
    """

    total: float = 0.0
    lookup: Optional[float] = None
    read: Optional[float] = None
    assemble: Optional[float] = None
    tokens: int = 0
    parts: Dict[str, List[float]] = field(default_factory=dict)


class FetchProbe:
    """Times the phases of ``KVStore.fetch`` by wrapping the store's parts while active.

    This reaches into KVStore's internals (its index, chunk files, RAM tier and
    assembly plan) without changing them; a part that has moved is simply not timed.
    """

    _PHASE = {
        "index.read": "lookup",
        "blobs.read_staged": "read",
        "blobs.read_into": "read",  # whole nodes: read straight into the caches' arrays
        "ram.get": "read",
        "AssemblyPlan.__init__": "assemble",
        "AssemblyPlan.copy_node": "assemble",
        "layout.build": "assemble",
    }

    def __init__(self, store):
        from ..engine import assemble

        self._targets = [
            (store.index, "read", "index.read", True),
            (store.blobs, "read_staged", "blobs.read_staged", True),
            (store.blobs, "read_into", "blobs.read_into", True),
            (store.ram, "get", "ram.get", True),
            (
                getattr(assemble, "AssemblyPlan", None),
                "__init__",
                "AssemblyPlan.__init__",
                False,
            ),
            (
                getattr(assemble, "AssemblyPlan", None),
                "copy_node",
                "AssemblyPlan.copy_node",
                False,
            ),
            (store.layout, "build", "layout.build", True),
        ]
        self.times: Dict[str, List[float]] = {}
        self._undo = []

    def _wrap(self, fn, label):
        times = self.times.setdefault(label, [])

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                times.append(time.perf_counter() - t0)  # list.append is thread-safe

        return timed

    def __enter__(self):
        for obj, attr, label, instance in self._targets:
            fn = getattr(obj, attr, None) if obj is not None else None
            if fn is None:
                continue
            if instance:  # shadow the bound method on this object only
                setattr(obj, attr, self._wrap(fn, label))
                self._undo.append(lambda o=obj, a=attr: delattr(o, a))
            else:
                original = obj.__dict__[attr]
                setattr(obj, attr, self._wrap(original, label))
                self._undo.append(lambda o=obj, a=attr, f=original: setattr(o, a, f))
        return self

    def __exit__(self, *exc):
        for undo in reversed(self._undo):
            undo()
        self._undo = []

    def phases(self, total: float, tokens: int) -> Phases:
        out = Phases(total=total, tokens=tokens, parts=dict(self.times))
        for label, phase in self._PHASE.items():
            if label in self.times:
                value = getattr(out, phase) or 0.0
                setattr(out, phase, value + sum(self.times[label]))
        return out


def timed_fetch(store, tokens, *, expect: Optional[int] = None):
    """``store.fetch(tokens)`` timed up to ``mx.eval`` of every restored array.

    Returns:
        ``(phases, cache)``.

    Raises:
        RuntimeError: the fetch restored another number of tokens than ``expect``.
    """
    probe = FetchProbe(store)
    with probe:
        t0 = time.perf_counter()
        cache, n = store.fetch(tokens)
        eval_cache(cache)
        total = time.perf_counter() - t0
    if expect is not None and n != expect:
        raise RuntimeError(f"fetch restored {n} tokens, expected {expect}")
    return probe.phases(total, n), cache


# -- case records (plain dicts: they go to JSON as they are) ---------------------------------


def new_case(label: str, page_cache: Optional[str]) -> dict:
    """An empty record of one case: lists of per-repeat seconds."""
    keys = ("ttft_s", "restore_s", "lookup_s", "read_s", "assemble_s", "model_s")
    case = {"label": label, "page_cache": page_cache, "reused": None}
    case.update({k: [] for k in keys})
    case["resident"] = []
    return case


def add_restore(case: dict, phases: Phases, *, model_s: float = 0.0, open_s=None):
    """Append one restore (and the model's first-token time) to ``case``."""
    case["reused"] = phases.tokens
    case["restore_s"].append(phases.total)
    for name in ("lookup", "read", "assemble"):
        case[f"{name}_s"].append(getattr(phases, name))
    case["model_s"].append(model_s)
    ttft = phases.total + model_s
    if open_s is not None:
        case.setdefault("open_s", []).append(open_s)
        ttft += open_s
    case["ttft_s"].append(ttft)
