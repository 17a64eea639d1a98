"""Keeping MLX's stream synchronizations from deadlocking kvstore's loads.

``mx.load`` of a Python file object (kvstore allocates restores this way, and loads
them so on CUDA) reads the file on MLX's I/O threads, and each read takes the GIL.
On MLX's CPU backend ``mx.clear_cache()``, ``mx.synchronize()`` and
``mx.set_cache_limit()`` wait for every pending CPU-stream task while holding the
GIL. So one of them called on another thread while such a load is in flight waits
for a read that waits for the GIL: the whole process hangs. mlx-lm's generation loop
calls ``mx.clear_cache()`` after every prefill step, so a server that restored while
it prefilled stopped answering, ``/health`` included (MLX 0.32, Linux CPU).

kvstore's Python-file loads therefore share :data:`LOADS` (:func:`python_file_load`),
and :func:`install` wraps those three functions of ``mlx.core`` to take it alone: they
wait, without the GIL, until no such load is in flight. Only with the CPU backend's
allocator: with Metal and CUDA ``clear_cache`` only frees cached buffers, and a
caller's generation loop should not wait for a restore there.
"""

import functools
import threading
from typing import ContextManager

import mlx.core as mx

from . import devices
from .gate import Gate

LOADS = Gate(nested="an MLX stream synchronization inside a Python-file load")
# mlx.core functions that wait for the CPU streams holding the GIL (MLX's bindings)
GUARDED = ("clear_cache", "synchronize", "set_cache_limit")

_install_lock = threading.Lock()


def python_file_load() -> ContextManager[None]:
    """Hold around an ``mx.load`` of a Python file object (nests)."""
    return LOADS.shared()


def installed() -> bool:
    """Whether ``mlx.core``'s synchronizations wait for kvstore's loads."""
    return all(hasattr(getattr(mx, name), "__wrapped__") for name in GUARDED)


def install() -> bool:
    """Wrap :data:`GUARDED` in ``mlx.core`` to wait for kvstore's Python-file loads,
    once per process, where MLX runs on its CPU backend. Returns whether they are
    wrapped."""
    if not devices.cpu_backend():
        return False
    with _install_lock:
        for name in GUARDED:
            fn = getattr(mx, name)
            if not hasattr(fn, "__wrapped__"):
                setattr(mx, name, _waits_for_loads(fn))
    return True


def _waits_for_loads(fn):
    """``fn`` run once no Python-file load is in flight."""

    @functools.wraps(fn)
    def call(*args, **kwargs):
        # Inside a load block of this thread its own load has been evaluated, and
        # waiting would wait for itself; kvstore makes no such call there.
        if LOADS.depth():
            return fn(*args, **kwargs)
        return LOADS.alone(lambda: fn(*args, **kwargs))

    return call
