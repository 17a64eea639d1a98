"""Restoring through ``mx.load``: node files read into the buffers MLX hands over.

With MLX's CUDA backend an array lives in device memory, and any CPU access to it
(``memoryview``, numpy) first moves its buffer into managed memory; the next GPU
kernel that touches it migrates it back page by page (measured on an H100: the
first forward after such a restore of 32K tokens of an 8B model took 446-605 ms
instead of 55-89 ms). ``mx.load`` is the one way in that avoids this: it reads each
tensor into a host buffer and copies that to device memory once.

So on CUDA a restore loads a safetensors file that exists only in memory
(:class:`RestoreFile`): its header lists the restore's arrays, and each of its
``readinto`` calls reads the matching rows of every node file straight into MLX's
host buffer, on the reader threads. On the CPU backend the same file reads straight
into the arrays (one copy, as :mod:`kvstore.engine.assemble` does).

Consecutive tensors of one dtype and shape are loaded as one stacked tensor (a few
loads instead of one per tensor: each waits for the GIL and for its copy to the
device) and copied apart on the device.

Checksums: a node's checksum covers its file front to back. The restore's tensors
are listed in the node files' order and loaded one group at a time in that order,
so each node file is read, and hashed, in order. A read that comes out of that order
(an MLX that reads differently) is still placed right; its nodes are then verified
by reading them once more before anything is returned.
"""

import os
import threading
import time
from concurrent.futures import Executor
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import mlx.core as mx
import xxhash

from ..disk.blobs import DTYPES, CorruptBlob, OpenFile, TensorEntry
from ..platform import devices, fsutil, mlxsync
from .assemble import VirtualFile

# Node files one RestoreFile reads from: all of them stay open while it loads, so
# longer restores are loaded in segments of at most this many nodes, joined on the
# device (at memory speed there).
SEGMENT_NODES = 64
# And at most this many bytes per tensor (or tensors loaded as one) and segment:
# MLX's host buffer for a tensor comes from malloc, which maps anything over 32 MiB
# afresh (page faults on every byte) but recycles smaller blocks. Measured on an
# H100 host, 32K tokens of an 8B model's KV: 67 MB tensors restored at 2.4 GB/s.
SEGMENT_TENSOR_BYTES = 16 << 20
# Seconds spent in RestoreFile reads, summed (what tools/bench_gpu.py reports).
READ_SECONDS = [0.0]


def default_restore_io() -> str:
    """How restores reach their arrays: ``"load"`` (this module) with MLX's CUDA
    backend, ``"assemble"`` (:mod:`kvstore.engine.assemble`) on the CPU and Metal, where
    the CPU writes an array's memory in place. ``KVSTORE_RESTORE_IO`` overrides it
    (the test suite runs both paths on the CPU)."""
    forced = os.environ.get("KVSTORE_RESTORE_IO", "")
    if forced in ("load", "assemble"):
        return forced
    return "load" if devices.cuda_backend() else "assemble"


class FileSource:
    """A whole node read from its open file, hashed as it is read.

    Args:
        opened: The node's file, its header checked (closed by :meth:`close`).
        checksum: The index's checksum of the whole file.
    """

    def __init__(self, opened: OpenFile, *, checksum: int):
        self.opened = opened
        self.checksum = checksum
        self.digest = xxhash.xxh3_64(opened.head)
        self.pos = len(opened.head)  # the next file offset the digest expects
        self.in_order = True
        self._lock = threading.Lock()  # MLX's CPU backend reads tensors concurrently

    @property
    def tensors(self) -> Mapping[str, TensorEntry]:
        return self.opened.tensors

    def read(self, pieces: Sequence[Tuple[int, memoryview]]) -> None:
        """Read file ranges ``(offset, buffer)`` into their buffers; hashed when
        they continue the file where the last read ended."""
        with self._lock:
            self._read(pieces)

    def _read(self, pieces: Sequence[Tuple[int, memoryview]]) -> None:
        fd = self.opened.fd
        if self.in_order and pieces and pieces[0][0] == self.pos:
            buffers = [buf for _, buf in pieces]
            want = sum(map(len, buffers))
            contiguous = all(
                a[0] + len(a[1]) == b[0] for a, b in zip(pieces, pieces[1:])
            )
            if contiguous:
                if fsutil.preadv(fd, buffers, self.pos, nbytes=want) != want:
                    raise CorruptBlob("file shrank while being read")
                for buf in buffers:
                    self.digest.update(buf)
                self.pos += want
                return
        self.in_order = False
        for offset, buf in pieces:
            if fsutil.preadv(fd, [buf], offset, nbytes=len(buf)) != len(buf):
                raise CorruptBlob("file shrank while being read")

    def verify(self) -> None:
        """Raise CorruptBlob unless the whole file was read and matches its checksum
        (a file read out of order is hashed again from disk)."""
        if not self.in_order or self.pos != self.opened.nbytes:
            self.digest = xxhash.xxh3_64()
            buf = bytearray(min(self.opened.nbytes, 4 << 20))
            pos = 0
            while pos < self.opened.nbytes:
                n = min(len(buf), self.opened.nbytes - pos)
                view = memoryview(buf)[:n]
                if fsutil.preadv(self.opened.fd, [view], pos, nbytes=n) != n:
                    raise CorruptBlob("file shrank while being read")
                self.digest.update(view)
                pos += n
        if self.digest.intdigest() != self.checksum:
            raise CorruptBlob("checksum mismatch")

    def close(self) -> None:
        self.opened.close()


class MemorySource:
    """A node already in memory and verified (the RAM tier's copy, or a node cut
    short that was read whole first).

    Args:
        data: The node file's bytes.
        tensors: Its validated tensor entries (offsets into ``data``).
    """

    def __init__(self, data, tensors: Mapping[str, TensorEntry]):
        self.data = memoryview(data).cast("B")
        self.tensors = tensors

    def read(self, pieces: Sequence[Tuple[int, memoryview]]) -> None:
        for offset, buf in pieces:
            buf[:] = self.data[offset : offset + len(buf)]

    def verify(self) -> None:
        pass

    def close(self) -> None:
        pass


Source = Union[FileSource, MemorySource]


class Failures:
    """Errors of one restore's node reads, by index in its path; thread-safe."""

    def __init__(self, nodes: int):
        self.errors: Dict[int, BaseException] = {}
        self.first = nodes  # the lowest failed index; ``nodes`` while none failed
        self._lock = threading.Lock()

    def add(self, index: int, error: BaseException) -> None:
        with self._lock:
            self.errors.setdefault(index, error)
            self.first = min(self.first, index)


class RestoreFile(VirtualFile):
    """A read-only safetensors file whose data is a restore's arrays, read from nodes.

    Tensor ``i`` is ``names[i]``'s ``(1, heads, rows, width)`` array. Node ``j``
    (``sources[j]``, path index ``first + j``) fills rows ``[offsets[j],
    offsets[j] + takes[j])``; rows past the last node are left unwritten (room for
    the caller's next tokens).

    Args:
        rows: ``name -> (dtype name, heads, width)``, in the node files' order.
        nrows: Rows of every array.
        sources: One per node, in path order.
        offsets, takes: Each node's first row and its rows to place.
        first: The path index of ``sources[0]``, for ``failures``.
        failures: Where a node's read error goes; nodes after the first failed
            one are not read.
        pool: Runs the reads of all but one group of nodes; ``threads`` groups.
        stacked: List the tensors as one ``(len(rows), heads, rows, width)`` tensor
            (every entry of ``rows`` the same): the same bytes, one load.
    """

    def __init__(
        self,
        rows: Mapping[str, Tuple[str, int, int]],
        nrows: int,
        *,
        sources: Sequence[Source],
        offsets: Sequence[int],
        takes: Sequence[int],
        first: int,
        failures: Failures,
        pool: Optional[Executor],
        threads: int,
        stacked: bool = False,
    ):
        specs = [
            (DTYPES[dtype][0], (1, heads, nrows, width))
            for dtype, heads, width in rows.values()
        ]
        if stacked:  # tensors laid out one after another are one stacked tensor
            if len(set(rows.values())) != 1:
                raise ValueError("only tensors of one dtype and shape stack")
            code, (_, heads, _, width) = specs[0]
            specs = [(code, (len(specs), heads, nrows, width))]
        super().__init__(specs)
        self.names = list(rows)
        self.sources, self.offsets, self.takes = sources, offsets, takes
        self.first, self.failures = first, failures
        self.pool, self.threads = pool, max(1, min(threads, len(sources)))
        self.spans = []  # per tensor: (data offset, bytes, heads, head stride, row)
        base = 0
        for dtype, heads, width in rows.values():
            row = width * DTYPES[dtype][1]
            self.spans.append((base, heads * nrows * row, heads, nrows * row, row))
            base += heads * nrows * row

    def fill(self, out: memoryview, start: int) -> None:
        """Read data bytes ``[start, start + len(out))`` from the nodes into ``out``."""
        tic = time.perf_counter()
        try:
            self._read_range(out, start)
        finally:
            READ_SECONDS[0] += time.perf_counter() - tic

    def _read_range(self, out: memoryview, start: int) -> None:
        end = start + len(out)
        # Per node, its (file offset, buffer) pieces of each tensor, in file order.
        jobs: List[List[List[Tuple[int, memoryview]]]] = [[] for _ in self.sources]
        for name, (base, size, heads, stride, row) in zip(self.names, self.spans):
            if base >= end or base + size <= start:
                continue
            for j, (src, offset, take) in enumerate(
                zip(self.sources, self.offsets, self.takes)
            ):
                entry = src.tensors[name]
                node_rows = (entry.end - entry.start) // (heads * row)
                pieces = []
                for hd in range(heads):
                    at = base + hd * stride + offset * row  # in the data section
                    a, z = max(at, start), min(at + take * row, end)
                    if a < z:
                        source = entry.start + hd * node_rows * row + (a - at)
                        pieces.append((source, out[a - start : z - start]))
                if pieces:
                    jobs[j].append(pieces)
        groups = [range(g, len(jobs), self.threads) for g in range(self.threads)]
        run = [lambda g=g: self._read_group(jobs, g) for g in groups if g]
        futures = [self.pool.submit(fn) for fn in run[1:]] if self.pool else []
        if not self.pool:
            for fn in run[1:]:
                fn()
        run[0]()
        for f in futures:
            f.result()

    def _read_group(self, jobs, group: range) -> None:
        for j in group:
            if self.first + j > self.failures.first:
                return
            try:
                for pieces in jobs[j]:
                    self.sources[j].read(pieces)
            except Exception as e:  # the fetch reports the first broken node only
                self.failures.add(self.first + j, e)


def load_arrays(
    rows: Mapping[str, Tuple[str, int, int]],
    nrows: int,
    *,
    offsets: Sequence[int],
    takes: Sequence[int],
    open_source: Callable[[int], Source],
    failures: Failures,
    pool: Optional[Executor],
    threads: int,
) -> Dict[str, mx.array]:
    """The restore's ``name -> (1, heads, rows, width)`` arrays, loaded through
    ``mx.load`` in segments (:func:`_segments`) and joined.

    Node ``i`` of the path (``open_source(i)`` opens it) fills rows
    ``[offsets[i], offsets[i] + takes[i])``. Every node read is verified before this
    returns; a node's error goes to ``failures`` and ends the restore there, so the
    arrays may then have fewer than ``nrows`` rows (but hold every row before the
    failed node). The last segment has room up to ``nrows``.
    """
    total, parts = len(offsets), []
    names = list(rows)
    for lo, hi in _segments(rows, takes):
        segment: List[Source] = []
        try:
            for i in range(lo, hi):
                if i > failures.first:
                    break
                try:
                    segment.append(open_source(i))
                except Exception as e:
                    failures.add(i, e)
            if not segment:
                break
            if not parts:  # the node files' tensor order, the same in every node
                first = segment[0].tensors
                names.sort(key=lambda name: first[name].start)
                rows = {name: rows[name] for name in names}
            end = nrows if hi == total else offsets[hi]
            seg_offsets = [offsets[i] - offsets[lo] for i in range(lo, hi)]
            seg_rows = end - offsets[lo]
            loads = []
            # A file per group of tensors, loaded in the node files' order: MLX reads
            # a file's tensors in an order of its own, and each node's hash needs
            # its file in order. A group is one stacked tensor: each load waits for
            # its reads and its copy to the device, ms apiece under a busy server.
            with mlxsync.python_file_load():
                for group in _groups(rows, seg_rows):
                    file = RestoreFile(
                        {name: rows[name] for name in group},
                        seg_rows,
                        sources=segment,
                        offsets=seg_offsets,
                        takes=takes[lo:hi],
                        first=lo,
                        failures=failures,
                        pool=pool,
                        threads=threads,
                        stacked=len(group) > 1,
                    )
                    loads.append(mx.load(file, format="safetensors")["0"])
                    mx.async_eval(loads[-1])
                mx.eval(loads)
            arrays = [a for stack in loads for a in _unstacked(stack)]
            loads = None
            for j, src in enumerate(segment):
                if lo + j > failures.first:
                    break
                try:
                    src.verify()
                except Exception as e:
                    failures.add(lo + j, e)
        finally:
            for src in segment:
                src.close()
        parts.append(arrays)
        if failures.first < hi:
            break
    if len(parts) <= 1:
        return dict(zip(rows, parts[0])) if parts else {}
    joined = []
    for k in range(len(names)):  # a tensor at a time: the peak is one tensor more
        joined.append(mx.concatenate([part[k] for part in parts], axis=2))
        mx.eval(joined[-1])
        for part in parts:
            part[k] = None
    return dict(zip(rows, joined))


def _unstacked(stack: mx.array) -> List[mx.array]:
    """A loaded ``(tensors, heads, rows, width)`` stack as its tensors, each in a
    buffer of its own (copied on the device), as a cache's arrays are."""
    if stack.shape[0] == 1:
        return [stack]
    own = [devices.device_copy(stack[i : i + 1]) for i in range(stack.shape[0])]
    mx.eval(own)
    return own


def _groups(rows: Mapping[str, Tuple[str, int, int]], nrows: int) -> List[List[str]]:
    """The tensors of ``rows`` (in order) in runs loaded as one: consecutive
    tensors of one dtype and shape, :data:`SEGMENT_TENSOR_BYTES` of ``nrows`` rows
    together at most (one tensor at least)."""
    out: List[List[str]] = []
    size = 0
    for name, spec in rows.items():
        dtype, heads, width = spec
        nbytes = heads * width * DTYPES[dtype][1] * nrows
        if out and rows[out[-1][-1]] == spec and size + nbytes <= SEGMENT_TENSOR_BYTES:
            out[-1].append(name)
            size += nbytes
        else:
            out.append([name])
            size = nbytes
    return out


def _segments(
    rows: Mapping[str, Tuple[str, int, int]], takes: Sequence[int]
) -> List[Tuple[int, int]]:
    """``(first, end)`` node ranges of a restore: :data:`SEGMENT_NODES` nodes and
    :data:`SEGMENT_TENSOR_BYTES` per tensor at most (at least one node)."""
    row = max(heads * width * DTYPES[dtype][1] for dtype, heads, width in rows.values())
    out, lo, tokens = [], 0, 0
    for i, take in enumerate(takes):
        if i > lo and (
            i - lo >= SEGMENT_NODES or (tokens + take) * row > SEGMENT_TENSOR_BYTES
        ):
            out.append((lo, i))
            lo, tokens = i, 0
        tokens += take
    if takes:
        out.append((lo, len(takes)))
    return out
