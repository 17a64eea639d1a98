"""Assembling a restore: arrays allocated once, chunk files read straight into them.

MLX has no way to allocate an array without writing it: ``mx.zeros`` costs a full
extra pass over the restored bytes (measured: 290-340 ms of a 500 ms 32K-token
restore, most of it page faults taken on one thread). ``mx.load`` does allocate
without writing: it hands each new buffer to the file's ``readinto``. So
:func:`empty_arrays` loads a safetensors file that exists only in memory and whose
data reads write nothing; the restore then reads the chunk files straight into those
buffers, on several threads, in one copy.

Allocation granularity: ``mx.load`` of a file object costs ~0.1-0.2 ms per tensor
(measured: 6-8 ms for a 60-layer cache at any size), so rows of one shape are stacked
into buffers of up to :data:`STACK_BYTES` and each cache array is a view of one. The
cap keeps every buffer under glibc's largest mmap threshold (32 MiB), so freed
restores are recycled by the C allocator, as ``load_prompt_cache``'s are, instead of
being faulted in again.

Which thread allocates matters too (:class:`PlanAllocator`): with MLX's CPU backend
the buffers come from the C library's ``malloc``, and glibc returns the top of the
main thread's heap to the OS once more than its trim threshold (twice the largest
freed buffer) is free there, so the next restore on the main thread faulted tens of
MiB in again (13,900 page faults and 2x the time of a 4K-token float16 restore, in
a process whose MLX buffer cache held other sizes). A thread of its own has an arena
of 64 MiB heaps of which only the newest is ever trimmed: freed restores are reused.
"""

import io
import json
import math
import operator
import struct
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Dict, List, Mapping, Sequence, Tuple, TypeVar

import mlx.core as mx
import numpy as np

from ..disk.adapters import dtype_name
from ..disk.blobs import CODE_SIZES, DATA_ALIGN, DTYPES, TensorEntry
from ..platform import devices, memutil, mlxsync

STACK_BYTES = 30 << 20  # per allocation: see the module docstring

_T = TypeVar("_T")


class VirtualFile(io.RawIOBase):
    """A read-only safetensors file made in memory: a real header for tensors of
    ``(safetensors dtype code, shape)``, laid out one after another, and data reads
    that :meth:`fill` answers (here: nothing is written).

    The position is kept per thread: MLX's CPU backend seeks and reads a file from
    several threads at once.
    """

    def __init__(self, specs: Sequence[Tuple[str, Tuple[int, ...]]]):
        header, offset, self.tensor_offsets = {}, 0, []
        for i, (code, shape) in enumerate(specs):
            size = math.prod(shape) * CODE_SIZES[code]
            header[str(i)] = {
                "dtype": code,
                "shape": list(shape),
                "data_offsets": [offset, offset + size],
            }
            self.tensor_offsets.append(offset)
            offset += size
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        self._head = struct.pack("<Q", len(raw)) + raw
        self._size = len(self._head) + offset
        self._local = threading.local()

    @property
    def _pos(self) -> int:
        return getattr(self._local, "pos", 0)

    @_pos.setter
    def _pos(self, value: int) -> None:
        self._local.pos = value

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
        n = max(0, min(len(view), self._size - self._pos))
        lo, hi, head = self._pos, self._pos + n, len(self._head)
        if lo < head:
            k = min(hi, head) - lo
            view[:k] = self._head[lo : lo + k]
        if hi > head:
            self.fill(view[max(0, head - lo) : n], max(lo, head) - head)
        self._pos = hi
        return n

    def fill(self, out: memoryview, start: int) -> None:
        """Fill ``out`` with data bytes ``[start, start + len(out))``."""


def empty_arrays(specs: Sequence[Tuple[Tuple[int, ...], mx.Dtype]]) -> List[mx.array]:
    """Evaluated arrays of the given shapes and dtypes, contents undefined."""
    file = VirtualFile([(DTYPES[dtype_name(d)][0], shape) for shape, d in specs])
    with mlxsync.python_file_load():
        loaded = mx.load(file, format="safetensors")
        arrays = [loaded[str(i)] for i in range(len(specs))]
        mx.eval(arrays)
    return arrays


def aligned_empty_arrays(
    specs: Sequence[Tuple[Tuple[int, ...], mx.Dtype]],
) -> List[mx.array]:
    """:func:`empty_arrays` whose data starts at a multiple of ``DATA_ALIGN`` bytes.

    Node files' data is aligned the same way, so reads into these arrays copy
    between equally aligned addresses (see :data:`kvstore.disk.blobs.DATA_ALIGN`).
    """
    sizes = [math.prod(shape) * dtype.size for shape, dtype in specs]
    flats = empty_arrays([((n + DATA_ALIGN,), mx.uint8) for n in sizes])
    out = []
    for flat, n, (shape, dtype) in zip(flats, sizes, specs):
        skip = -np.frombuffer(memoryview(flat), np.uint8).ctypes.data % DATA_ALIGN
        out.append(flat[skip : skip + n].view(dtype).reshape(shape))  # views
    mx.eval(out)
    return out


class AssemblyPlan:
    """The destination arrays of a restore of ``ntokens`` tokens, and where nodes land.

    Every delta tensor is a ``(1, heads, capacity, width)`` row-major array: head
    ``hd``'s rows for tokens ``[a, b)`` are one contiguous byte range. Rows past
    ``ntokens`` are room for the tokens the caller processes next: mlx-lm's caches
    write them in place instead of copying every layer to grow it.

    Args:
        rows: ``name -> (dtype name, heads, width)`` of the delta tensors
            (``rows`` of a :class:`kvstore.disk.adapters.Layout`).
        ntokens: Tokens to restore.
        capacity: Rows to allocate (at least ``ntokens``; default ``ntokens``).
    """

    def __init__(
        self,
        rows: Mapping[str, Tuple[str, int, int]],
        ntokens: int,
        *,
        capacity: int = 0,
    ):
        self.capacity = max(ntokens, capacity)
        self.ntokens = ntokens
        self.rows = {}
        shapes: Dict[Tuple[str, int, int], List[str]] = {}  # names of one row shape
        for name, (dtype_str, heads, width) in rows.items():
            self.rows[name] = (width * getattr(mx, dtype_str).size, heads)
            shapes.setdefault((dtype_str, heads, width), []).append(name)
        # Room is only usable in place by an array that owns its buffer (MLX copies
        # a shared one on the first update): one buffer per tensor then.
        stack_bytes = STACK_BYTES if self.capacity == ntokens else 0
        specs, members = [], []
        for (dtype_str, heads, width), names in shapes.items():
            dtype = getattr(mx, dtype_str)
            row_bytes = heads * self.capacity * width * dtype.size
            per = max(1, min(len(names), stack_bytes // max(1, row_bytes)))
            for i in range(0, len(names), per):
                group = names[i : i + per]
                specs.append(((len(group), heads, self.capacity, width), dtype))
                members.append(group)
        by_name = {}
        stacks = aligned_empty_arrays(specs) if specs else []
        for stack, group in zip(stacks, members):
            if len(group) == 1:
                by_name[group[0]] = stack
                continue
            for j, name in enumerate(group):
                by_name[name] = stack[j : j + 1]  # a view: no copy
        self.arrays = [by_name[name] for name in rows]
        mx.eval(self.arrays)
        self.views = {
            name: memoryview(a).cast("B") for name, a in zip(rows, self.arrays)
        }
        self.nbytes = sum(a.nbytes for a in self.arrays)
        self._bases = None  # name -> address of the array's first byte
        self._grids = None
        self._pieces: Dict[Tuple[int, int], tuple] = {}
        self._keep: list = []

    @property
    def grids(self) -> Dict[str, np.ndarray]:
        """``(heads, capacity, row bytes)`` byte views: a node's rows are one slice."""
        if self._grids is None:
            self._grids = {
                name: np.frombuffer(self.views[name], dtype=np.uint8).reshape(
                    heads, self.capacity, row
                )
                for name, (row, heads) in self.rows.items()
            }
        return self._grids

    def fresh(self) -> bool:
        """Whether the arrays are fresh memory that :meth:`prefault` makes present
        faster than the copies into it would fault it in (the last row's page is
        checked: the first ones hold the allocator's own headers)."""
        if not memutil.prefault_supported():
            return False
        (address, length), *_ = self.row_ranges(self.ntokens - 1, self.ntokens)
        return memutil.resident(address + length - 1) is False

    def row_bytes(self) -> int:
        """Bytes of one token's row of one head, in the tensor with the shortest rows."""
        return min(row for row, _ in self.rows.values())

    def prefault(self, lo: int, hi: int) -> None:
        """Make rows ``[lo, hi)`` of every array present before they are written
        (see :mod:`kvstore.platform.memutil`; nothing where the platform cannot)."""
        memutil.prefault(self.row_ranges(lo, hi))

    def row_ranges(self, lo: int, hi: int) -> List[Tuple[int, int]]:
        """``(address, length)`` of rows ``[lo, hi)`` of every head of every array."""
        if self._bases is None:
            self._bases = {
                name: np.frombuffer(view, dtype=np.uint8).ctypes.data
                for name, view in self.views.items()
            }
        out = []
        for name, (row, heads) in self.rows.items():
            base, stride = self._bases[name], self.capacity * row
            out += [
                (base + hd * stride + lo * row, (hi - lo) * row) for hd in range(heads)
            ]
        return out

    def node_targets(
        self, tensors: Mapping[str, TensorEntry], *, offset: int, node_tokens: int
    ) -> List[memoryview]:
        """Where a whole node's file data lands, in file order: one slice per head.

        For :meth:`kvstore.disk.blobs.Blobs.read_into`: the node's tokens go to rows
        ``[offset, offset + node_tokens)`` (``tensors`` are validated against the
        layout, so every name is one of the plan's).
        """
        key = (id(tensors), node_tokens)
        known = self._pieces.get(key)
        if known is None:
            # Per (tensor, head) in file order: a view of all its rows. Nodes of one
            # size share a parsed header (Blobs caches it): built once per plan.
            heads_views, rows = [], []
            for name, _ in sorted(tensors.items(), key=lambda kv: kv[1].start):
                row, heads = self.rows[name]
                stride = self.capacity * row
                view = self.views[name]
                heads_views += [
                    view[hd * stride : (hd + 1) * stride] for hd in range(heads)
                ]
                rows += [row] * heads
            one_row = rows[0] if len(set(rows)) == 1 else None
            known = self._pieces[key] = (heads_views, rows, one_row)
            self._keep.append(tensors)  # keeps the id unique while the plan lives
        heads_views, rows, row = known
        if row is not None:  # one row size, as in every KVCache: slice in a C loop
            cut = operator.itemgetter(slice(offset * row, (offset + node_tokens) * row))
            return list(map(cut, heads_views))
        return [
            view[offset * r : (offset + node_tokens) * r]
            for view, r in zip(heads_views, rows)
        ]

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

    def delta_arrays(self) -> Dict[str, mx.array]:
        """``name -> array`` (``capacity`` rows: the cache's offset says how many hold
        tokens, so a restore cut short by a broken node needs no other arrays)."""
        return dict(zip(self.rows, self.arrays))


class PlanAllocator:
    """Runs a restore's allocation on one long-lived thread of its own (see the
    module docstring: the main thread's heap gives freed restores back to the OS).

    Only with MLX's CPU backend; with Metal or CUDA, MLX's own allocator recycles
    buffers whatever the thread, and the work runs on the calling thread.
    """

    def __init__(self, *, enabled: bool = True):
        self._pool = (
            ThreadPoolExecutor(1, thread_name_prefix="kvstore-alloc")
            if enabled and devices.cpu_backend()
            else None
        )

    def run(self, fn: Callable[[], _T], meanwhile: Callable[[], None]) -> _T:
        """``fn()`` on the allocating thread, ``meanwhile()`` on this one at the same
        time; returns ``fn()``'s result once both are done (or raises its error)."""
        if self._pool is None:
            result = fn()
            meanwhile()
            return result
        job = self._pool.submit(fn)
        try:
            meanwhile()
        finally:
            job.exception()  # wait: fn may still use what the caller frees next
        return job.result()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
