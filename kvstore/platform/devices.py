"""Where MLX keeps arrays, and how kvstore reads them without moving them.

With MLX's CUDA backend, arrays computed on the GPU live in device memory, and the
first CPU access to one (``memoryview``, ``np.asarray``) moves its whole buffer into
managed memory; the next kernel that uses it migrates it back page by page. Done to
a model's weights or a caller's live cache, that slows the model that kvstore
serves (measured on an H100: 0.35-1.36 s to open a store, and 89-187 ms more on the
next forward). So there kvstore copies what it must read on the device first, and
reads the copy. On the CPU and Metal (unified memory), reading in place is free.
"""

import contextlib
from typing import Callable, Dict, Iterable, Optional

import mlx.core as mx
import numpy as np

_UINT = {1: mx.uint8, 2: mx.uint16, 4: mx.uint32, 8: mx.uint64}
_NP_UINT = {mx.uint8: np.uint8, mx.uint16: np.uint16, mx.uint32: np.uint32}
_NP_UINT[mx.uint64] = np.uint64
# Bytes moved to the host at a time (host_copy): MLX moves a device buffer in the
# buffer request of np.asarray, holding Python's GIL, which the generate loop needs
# for every token; 4 MiB take ~2 ms at the 2.4 GB/s measured on an H100.
HOST_SLICE_BYTES = 4 << 20


def cuda_backend() -> bool:
    """Whether MLX runs on its CUDA backend."""
    cuda = getattr(mx, "cuda", None)
    return cuda is not None and cuda.is_available()


def cpu_backend() -> bool:
    """Whether MLX runs on its CPU backend (no Metal, no CUDA): arrays live in
    memory from the C library's ``malloc``."""
    return not (mx.metal.is_available() or cuda_backend())


def host_access_moves_arrays() -> bool:
    """Whether reading an array on the CPU moves it out of device memory."""
    return cuda_backend()


def device_copy(a: mx.array) -> mx.array:
    """A lazy copy of ``a`` into a buffer of its own, bit for bit (an integer op on
    the same bits: no float rounding, NaN payloads kept)."""
    bits = a.view(_UINT[a.dtype.size]) if a.dtype not in _UINT.values() else a
    copy = mx.bitwise_or(bits, mx.array(0, bits.dtype))
    return copy.view(a.dtype) if copy.dtype != a.dtype else copy


def readable_copies(arrays: Dict[str, mx.array]) -> Dict[str, mx.array]:
    """``arrays`` where reading them in place is free, else device copies of them
    (evaluated either way)."""
    if host_access_moves_arrays():
        arrays = {name: device_copy(a) for name, a in arrays.items()}
    mx.eval(list(arrays.values()))
    return arrays


def sample_slices(a: mx.array, sample: int) -> Iterable[mx.array]:
    """``a``'s bytes as 1-D uint8 views: all of them when ``a`` holds at most three
    samples, else ``sample`` bytes at its start, middle and end."""
    flat = a.reshape(-1).view(mx.uint8) if a.size else a.reshape(-1)
    n = flat.size
    if n <= 3 * sample:
        return [flat]
    mid = n // 2
    return [flat[s : s + sample] for s in (0, mid - sample // 2, n - sample)]


def host_copy(
    a: mx.array, *, lock=None, pause: Optional[Callable[[], None]] = None
) -> np.ndarray:
    """An unsigned-int ``(1, heads, tokens, width)`` array on the host.

    Where host access moves arrays (CUDA), in slices of the token axis of at most
    :data:`HOST_SLICE_BYTES`, each copied on the device into a buffer of its own
    first (evaluated without the GIL), so that no single move holds Python's GIL
    for long; ``lock`` (kvstore's MLX lock) is held for one slice at a time, and
    ``pause()`` runs before each (the writer stepping aside for decoding). Elsewhere
    the array is read in place.
    """
    lock = lock if lock is not None else contextlib.nullcontext()
    if not host_access_moves_arrays():
        with lock:
            return np.asarray(a)
    tokens = a.shape[2]
    out = np.empty(a.shape, _NP_UINT[a.dtype])
    row = max(1, a.nbytes // max(tokens, 1))
    step = max(1, HOST_SLICE_BYTES // row)
    for start in range(0, tokens, step):
        end = min(tokens, start + step)
        if pause is not None:
            pause()
        with lock:
            part = device_copy(a[:, :, start:end])
            mx.eval(part)
            out[:, :, start:end] = np.asarray(part)
        del part
    return out
