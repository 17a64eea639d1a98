"""Assembling a restore: arrays allocated once, chunk files read straight into them.

MLX has no way to allocate an array without writing it: ``mx.zeros`` costs a full
extra pass over the restored bytes (measured: 290-340 ms of a 500 ms 32K-token
restore, most of it page faults taken on one thread). ``mx.load`` does allocate
without writing: it hands each new buffer to the file's ``readinto``. So
:func:`empty_arrays` loads a safetensors file that exists only in memory and whose
data reads write nothing; the restore then fills those buffers from the chunk files,
on several threads, in one copy. One buffer per layer's keys and per layer's values
(not one for everything) keeps allocations small enough for the C allocator to
recycle them, as ``load_prompt_cache``'s are.
"""

import io
import json
import struct
from typing import List, Sequence, Tuple

import mlx.core as mx
import numpy as np

from .adapters import LayerLayout, dtype_name, tensor_names
from .blobs import DTYPES


class _UnwrittenFile(io.RawIOBase):
    """A read-only safetensors file: a real header, and data reads that write nothing."""

    def __init__(self, specs: Sequence[Tuple[Tuple[int, ...], mx.Dtype]]):
        header, offset = {}, 0
        for i, (shape, dtype) in enumerate(specs):
            size = dtype.size
            for d in shape:
                size *= d
            header[str(i)] = {
                "dtype": DTYPES[dtype_name(dtype)][0],
                "shape": list(shape),
                "data_offsets": [offset, offset + size],
            }
            offset += size
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        self._head = struct.pack("<Q", len(raw)) + raw
        self._size = len(self._head) + offset
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}
        self._pos = base[whence] + offset
        return self._pos

    def readinto(self, b) -> int:
        view = memoryview(b).cast("B")
        n = min(len(view), self._size - self._pos)
        if self._pos < len(self._head):
            k = min(n, len(self._head) - self._pos)
            view[:k] = self._head[self._pos : self._pos + k]
        self._pos += n
        return n


def empty_arrays(specs: Sequence[Tuple[Tuple[int, ...], mx.Dtype]]) -> List[mx.array]:
    """Evaluated arrays of the given shapes and dtypes, contents undefined."""
    loaded = mx.load(_UnwrittenFile(specs), format="safetensors")
    arrays = [loaded[str(i)] for i in range(len(specs))]
    mx.eval(arrays)
    return arrays


class AssemblyPlan:
    """The destination arrays of a restore of ``ntokens`` tokens, and where nodes land.

    Layer ``i``'s keys are a ``(1, heads, ntokens, k_dim)`` row-major array: head
    ``hd``'s rows for tokens ``[a, b)`` are one contiguous byte range.
    """

    def __init__(self, layout: Sequence[LayerLayout], ntokens: int):
        self.layout = list(layout)
        self.ntokens = ntokens
        specs, self.rows = [], {}
        for i, lay in enumerate(self.layout):
            dtype = getattr(mx, lay.dtype)
            for name, dim in zip(tensor_names(i), (lay.k_dim, lay.v_dim)):
                specs.append(((1, lay.heads, ntokens, dim), dtype))
                self.rows[name] = (dim * dtype.size, lay.heads)
        self.arrays = empty_arrays(specs)
        # (heads, ntokens, row bytes) byte views: a node's rows are one slice of these.
        self.grids = {
            name: np.frombuffer(memoryview(a).cast("B"), dtype=np.uint8).reshape(
                heads, ntokens, row
            )
            for (name, (row, heads)), a in zip(self.rows.items(), self.arrays)
        }
        self.nbytes = sum(a.nbytes for a in self.arrays)

    def copy_node(
        self, src: memoryview, tensors, *, offset: int, take: int, node_tokens: int
    ) -> None:
        """Copy the first ``take`` tokens of a node file held in ``src`` to row ``offset``.

        ``tensors`` maps names to validated entries (absolute offsets into ``src``).
        numpy copies release the GIL, so several nodes copy in parallel.
        """
        for name, (row, heads) in self.rows.items():
            entry = tensors[name]
            block = np.frombuffer(
                src, dtype=np.uint8, count=entry.end - entry.start, offset=entry.start
            )
            block = block.reshape(heads, node_tokens, row)
            np.copyto(self.grids[name][:, offset : offset + take], block[:, :take])

    def layer_arrays(self, ntokens: int) -> List[Tuple[mx.array, mx.array]]:
        """Per-layer ``(keys, values)``, cut to ``ntokens`` when a node failed."""
        pairs = list(zip(self.arrays[0::2], self.arrays[1::2]))
        if ntokens < self.ntokens:
            pairs = [(k[:, :, :ntokens, :], v[:, :, :ntokens, :]) for k, v in pairs]
        return pairs
