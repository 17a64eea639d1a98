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
from typing import Dict, List, Mapping, Sequence, Tuple

import mlx.core as mx
import numpy as np

from .adapters import dtype_name
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

    Every delta tensor is a ``(1, heads, ntokens, width)`` row-major array: head
    ``hd``'s rows for tokens ``[a, b)`` are one contiguous byte range.

    Args:
        rows: ``name -> (dtype name, heads, width)`` of the delta tensors
            (:attr:`kvstore.adapters.Layout.rows`).
        ntokens: Tokens to restore.
    """

    def __init__(self, rows: Mapping[str, Tuple[str, int, int]], ntokens: int):
        self.ntokens = ntokens
        specs, self.rows = [], {}
        for name, (dtype_str, heads, width) in rows.items():
            dtype = getattr(mx, dtype_str)
            specs.append(((1, heads, ntokens, width), dtype))
            self.rows[name] = (width * dtype.size, heads)
        self.arrays = empty_arrays(specs) if specs else []
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

    def delta_arrays(self, ntokens: int) -> Dict[str, mx.array]:
        """``name -> array``, cut to ``ntokens`` when a node failed."""
        out = dict(zip(self.rows, self.arrays))
        if ntokens < self.ntokens:
            out = {name: a[:, :, :ntokens, :] for name, a in out.items()}
        return out
