"""Chunk files: one immutable safetensors file per trie node.

This module owns bytes on disk only: atomic writes, strict header validation,
checksums, and reading a file's tensors straight into caller-provided buffers.
It knows nothing about LMDB or eviction policy.
"""

import bisect
import collections
import errno
import functools
import itertools
import json
import math
import os
import shutil
import struct
import time
from dataclasses import dataclass
from typing import (
    Any,
    Callable,
    Dict,
    Iterator,
    List,
    Mapping,
    Optional,
    Sequence,
    Tuple,
)

import numpy as np
import xxhash
from safetensors import TensorSpec, serialize

from ..platform import fsutil

MAX_HEADER_BYTES = 1 << 20
# Buffers per preadv call (the kernel refuses more: EINVAL).
_IOV_MAX = fsutil.iov_max()
# Read, then hashed while still in the CPU cache: hashing 94 MB after reading it in
# batches of 512 KiB took 3.2-3.4 ms, of 1 MiB 4.4-4.7 ms, of 4 MiB 7.5-7.8 ms (the
# 2-core VM's 4 MiB L2; batches of 32-128 KiB cost more calls).
HASH_BATCH_BYTES = 512 << 10
# Node files' data starts at a multiple of this: the kernel copies into a restore's
# (equally aligned) arrays 20-50% faster when source and destination share their
# offset within a cache line (measured on 32 KiB slices).
DATA_ALIGN = 64

# mlx dtype name -> (safetensors header code, item size)
DTYPES: Dict[str, Tuple[str, int]] = {
    "float32": ("F32", 4),
    "float16": ("F16", 2),
    "bfloat16": ("BF16", 2),
    "uint32": ("U32", 4),
    "int32": ("I32", 4),
    "int64": ("I64", 8),  # an n-gram model's token context (ArraysCache)
    "uint8": ("U8", 1),
    "int8": ("I8", 1),
}
CODE_SIZES = {code: size for code, size in DTYPES.values()}


FILE_FORMAT = "KVSTORE"  # the metadata "format" of every chunk file


def node_metadata(ns: bytes) -> Dict[str, str]:
    """The metadata written into a node file of namespace ``ns``.

    No node id: equal headers for equal sizes let readers reuse one parsed header;
    the index's checksum tells files apart.
    """
    return {"format": FILE_FORMAT, "namespace": ns.hex()}


def metadata_matches(meta: Mapping[str, str], ns: bytes) -> bool:
    """Whether a file's metadata says it is a node file of namespace ``ns``."""
    return meta.get("format") == FILE_FORMAT and meta.get("namespace") == ns.hex()


class CorruptBlob(Exception):
    """A chunk file is missing, truncated, or does not match what the index expects."""


@dataclass(frozen=True)
class Published:
    """The file at a node's path after a publish (:mod:`kvstore.disk.publish`)."""

    nbytes: int
    checksum: int
    inode: int
    ours: bool  # False: another writer's file was there first and was adopted


@dataclass(frozen=True)
class TensorEntry:
    """One tensor in a validated header; offsets are absolute file offsets."""

    dtype: str  # safetensors header code, e.g. "F16"
    shape: Tuple[int, ...]
    start: int
    end: int


@dataclass
class OpenFile:
    """A chunk file open for reading, its header validated (see
    :meth:`Blobs.open_checked`). Closing is idempotent."""

    fd: int
    nbytes: int
    head: bytes  # the header's bytes, as read (they are hashed too)
    tensors: Dict[str, TensorEntry]
    metadata: dict

    def close(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)

    def __enter__(self) -> "OpenFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass(frozen=True)
class NodeFile:
    """A node file's bytes as its header and views of the tensors' own memory, in
    file order: written with vectored writes (:class:`kvstore.disk.publish.WriteBatch`),
    never first serialized into one copy (a save's copy of every KV byte cost as much
    as writing it to the page cache).

    Attributes:
        buffers: The header (padded so that data starts at a multiple of
            ``DATA_ALIGN``), then each tensor's bytes, in file order.
        nbytes: The file's size.
    """

    buffers: Tuple[Any, ...]  # 1-D byte buffers: bytes, memoryviews, uint8 arrays
    nbytes: int

    @classmethod
    def from_bytes(cls, data) -> "NodeFile":
        """A file whose bytes already exist (a download, a test's file)."""
        view = memoryview(data).cast("B")
        return cls((view,), len(view))

    @classmethod
    def from_tensors(
        cls,
        tensors: Mapping[str, Tuple[str, Sequence[int], np.ndarray]],
        metadata: Dict[str, str],
    ) -> "NodeFile":
        """``name -> (mlx dtype name, shape, numpy data)``: data may be a strided view
        (a node's tokens of a cache buffer); rows contiguous in memory are written
        from where they are.

        Raises:
            ValueError: an array whose bytes do not match its shape and dtype.
        """
        specs = tuple(
            (name, dtype, tuple(map(int, shape)))
            for name, (dtype, shape, _) in tensors.items()
        )
        head, order = _header(specs, tuple(sorted(metadata.items())))
        buffers = [memoryview(head)]
        for name, nbytes in order:
            blocks = _blocks(tensors[name][2])
            if sum(map(len, blocks)) != nbytes:
                raise ValueError(
                    f"tensor {name!r}: {sum(map(len, blocks))} bytes of data, its "
                    f"dtype and shape need {nbytes}"
                )
            buffers += blocks
        return cls(tuple(buffers), len(head) + sum(n for _, n in order))

    def tobytes(self) -> bytes:
        """The whole file in one buffer (a copy)."""
        return b"".join(self.buffers)


@functools.lru_cache(maxsize=256)
def _header(
    specs: Tuple[Tuple[str, str, Tuple[int, ...]], ...],
    metadata: Tuple[Tuple[str, str], ...],
) -> Tuple[bytes, Tuple[Tuple[str, int], ...]]:
    """safetensors' own header for tensors of these names, dtypes and shapes, padded
    to ``DATA_ALIGN``, and ``(name, bytes)`` in file order.

    Nodes of one size share it (cached). safetensors writes the header: it is given
    the specs with every data pointer at one zero buffer, and only the header of its
    output is kept.
    """
    sizes = [math.prod(shape) * DTYPES[dtype][1] for _, dtype, shape in specs]
    zeros = np.zeros(max(sizes, default=0) or 1, np.uint8)
    raw = serialize(
        {
            name: TensorSpec(
                dtype=dtype, shape=list(shape), data_ptr=zeros.ctypes.data, data_len=n
            )
            for (name, dtype, shape), n in zip(specs, sizes)
        },
        metadata=dict(metadata),
    )
    (hlen,) = struct.unpack_from("<Q", raw)
    # Spaces after the JSON are the format's own header padding.
    pad = -(8 + hlen) % DATA_ALIGN
    head = struct.pack("<Q", hlen + pad) + raw[8 : 8 + hlen] + b" " * pad
    _, entries, _ = parse_header(head, len(head) + sum(sizes))
    order = sorted(entries.items(), key=lambda kv: kv[1].start)
    return head, tuple((name, e.end - e.start) for name, e in order)


_MIN_BLOCK = 512  # smaller contiguous runs are gathered into one copy instead


def _blocks(a: np.ndarray) -> List[np.ndarray]:
    """``a``'s bytes in C order, as 1-D uint8 views of the runs that are contiguous in
    memory (one per leading index); an array with no such runs is copied once."""
    if a.size == 0:
        return []
    if a.flags.c_contiguous:
        return [a.reshape(-1).view(np.uint8)]
    k, run = a.ndim, a.itemsize  # axes [k:] are contiguous, ``run`` bytes long
    while k > 0 and (a.shape[k - 1] == 1 or a.strides[k - 1] == run):
        run *= a.shape[k - 1]
        k -= 1
    if k < a.ndim and run >= _MIN_BLOCK:
        try:
            rows = a.view(np.uint8)  # the last axis is contiguous: bytes of it
            rows.shape = (*a.shape[:k], run)  # raises where that would need a copy
            try:
                flat = rows.view()
                flat.shape = (-1, run)
                return list(flat)
            except AttributeError:  # leading axes that do not merge
                return [rows[i] for i in np.ndindex(*a.shape[:k])]
        except (ValueError, AttributeError):
            pass
    return [np.ascontiguousarray(a).reshape(-1).view(np.uint8)]


def serialize_node(
    tensors: Mapping[str, Tuple[str, Sequence[int], np.ndarray]],
    metadata: Dict[str, str],
) -> bytes:
    """The bytes of a node file: ``name -> (mlx dtype name, shape, numpy data)``."""
    return NodeFile.from_tensors(tensors, metadata).tobytes()


def parse_header(
    prefix: bytes, file_size: int
) -> Tuple[int, Dict[str, TensorEntry], dict]:
    """Validate a safetensors header before trusting any size in it.

    Args:
        prefix: The first bytes of the file (at least the whole header).
        file_size: The real size of the file.

    Returns:
        ``(data_start, tensors, metadata)``. Tensors tile the data section exactly.

    Raises:
        CorruptBlob: anything inconsistent.
    """
    if file_size < 8 or len(prefix) < 8:
        raise CorruptBlob(f"file of {file_size} bytes has no header")
    (hlen,) = struct.unpack_from("<Q", prefix)
    if hlen > min(MAX_HEADER_BYTES, file_size - 8):
        raise CorruptBlob(f"header length {hlen} exceeds file size {file_size}")
    if len(prefix) < 8 + hlen:
        raise CorruptBlob("header truncated")
    try:
        header = json.loads(prefix[8 : 8 + hlen])
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise CorruptBlob(f"header is not JSON: {str(e)[:80]}") from None
    if not isinstance(header, dict):
        raise CorruptBlob("header is not a JSON object")
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(
        isinstance(v, str) for v in metadata.values()
    ):
        raise CorruptBlob("header metadata is not an object of strings")
    data_start = 8 + hlen
    tensors = {}
    for name, info in header.items():
        try:
            dtype, shape, (s, e) = info["dtype"], info["shape"], info["data_offsets"]
            ok = (
                dtype in CODE_SIZES
                and isinstance(shape, list)
                and all(isinstance(d, int) and d >= 0 for d in shape)
                and isinstance(s, int)
                and isinstance(e, int)
                and 0 <= s <= e
            )
        except (TypeError, KeyError, ValueError):
            ok = False
        if not ok:
            raise CorruptBlob(f"header entry {name!r} is malformed")
        # Python ints: a hostile shape must not overflow into a small size.
        if e - s != math.prod(shape) * CODE_SIZES[dtype]:
            raise CorruptBlob(
                f"tensor {name!r}: {e - s} bytes do not fit shape {shape}"
            )
        tensors[name] = TensorEntry(dtype, tuple(shape), data_start + s, data_start + e)
    pos = data_start
    for entry in sorted(tensors.values(), key=lambda t: t.start):
        if entry.start != pos:
            raise CorruptBlob("tensors do not tile the data section")
        pos = entry.end
    if pos != file_size:
        raise CorruptBlob(f"data ends at {pos}, file has {file_size} bytes")
    return data_start, tensors, metadata


def check_layout(
    tensors: Dict[str, TensorEntry], expected: Mapping[str, Tuple[str, Tuple[int, ...]]]
):
    """Every expected tensor present with the expected dtype and shape, nothing else."""
    if set(tensors) != set(expected):
        missing = sorted(set(expected) - set(tensors))[:3]
        extra = sorted(set(tensors) - set(expected))[:3]
        raise CorruptBlob(
            f"tensor names differ (missing {missing}, unexpected {extra})"
        )
    for name, (dtype, shape) in expected.items():
        code = DTYPES[dtype][0]
        t = tensors[name]
        if t.dtype != code or t.shape != tuple(shape):
            raise CorruptBlob(
                f"tensor {name!r} is {t.dtype}{list(t.shape)}, expected {code}{list(shape)}"
            )


DELTA_PART, STATE_PART = (
    "",
    ".state",
)  # a node's two files: its own tokens' KV; a checkpoint


# Hex digits of a node's hash that name its directory, by the store's format version
# (kvstore.disk.index.READ_FORMATS). 256 directories per namespace put ~4,000 files
# in each at a million nodes, where creating and fsyncing a file grew dearer;
# 4,096 keep them to a few hundred.
FANOUT_CHARS = {1: 2, 2: 3}


class Blobs:
    """Content-addressed chunk files under ``<root>/<ns>/<h[:k]>/<h>.safetensors``,
    ``k`` the store format's :data:`FANOUT_CHARS`.

    A node may also have a state file, ``<h>.state.safetensors``: the checkpoint of
    the layers whose state does not concatenate (see :mod:`kvstore.disk.adapters`).

    No symlink below ``root`` is followed: files are read through
    :func:`fsutil.open_regular_beneath`; a node whose directories are not real ones
    has no files as far as writing, removing and quarantining go.

    Args:
        root: The blobs directory.
        quarantine: Where broken files are moved for inspection.
        create: Create ``root`` when missing (a read-only open does not).
        format_version: The store's format version (its index records it), which
            sets the layout. The default: a new store's.
    """

    SUFFIX = ".safetensors"

    def __init__(
        self,
        root: str,
        quarantine: str,
        *,
        create: bool = True,
        format_version: int = max(FANOUT_CHARS),
    ):
        if format_version not in FANOUT_CHARS:
            raise ValueError(f"no file layout for store format {format_version}")
        self.root = root
        self.quarantine_dir = quarantine
        self.fanout = FANOUT_CHARS[format_version]
        self._headers: Dict[tuple, tuple] = {}  # validated headers, by their bytes
        if create:
            fsutil.makedirs(root)

    @classmethod
    def of_store(
        cls, path: str, format_version: int, *, create: bool = True
    ) -> "Blobs":
        """The node files of the store directory ``path`` (``blobs/``, broken ones
        moved to ``quarantine/``), laid out as its ``format_version`` says."""
        return cls(
            os.path.join(path, "blobs"),
            os.path.join(path, "quarantine"),
            create=create,
            format_version=format_version,
        )

    def path_parts(self, ns: bytes, h: bytes, part: str = DELTA_PART) -> List[str]:
        """Node ``h``'s file path below :attr:`root`: namespace directory, fan-out
        directory, file name."""
        hx = h.hex()
        return [ns.hex(), hx[: self.fanout], hx + part + self.SUFFIX]

    def path(self, ns: bytes, h: bytes, part: str = DELTA_PART) -> str:
        return os.path.join(self.root, *self.path_parts(ns, h, part))

    def _real_dirs(self, ns: bytes, h: bytes) -> bool:
        """Whether node ``h``'s directories are real ones (or missing), not links."""
        try:
            fsutil.check_real_dirs(self.root, self.path_parts(ns, h)[:2])
        except fsutil.NotRegularFile:
            return False
        return True

    def open_file(
        self,
        ns: bytes,
        h: bytes,
        part: str = DELTA_PART,
        *,
        dirs: Optional[fsutil.DirsBeneath] = None,
    ) -> int:
        """Open node ``h``'s file (delta or state ``part``) to read: a descriptor.

        Args:
            dirs: Directory descriptors kept from :meth:`dirs` (for many files
                opened in path order); without it each open walks from the root.

        Raises:
            FileNotFoundError: no file.
            fsutil.NotRegularFile: a symlink, FIFO... in its place or on its path.
        """
        if dirs is not None:
            return dirs.open(self.path_parts(ns, h, part))
        return fsutil.open_regular_beneath(self.root, self.path_parts(ns, h, part))

    def dirs(self) -> fsutil.DirsBeneath:
        """Descriptors of directories to keep between :meth:`open_file` calls."""
        return fsutil.DirsBeneath(self.root)

    # -- writing -----------------------------------------------------------

    def adopt(self, final: str) -> "Published":
        """Size, checksum and inode of a complete file another writer published."""
        try:
            f = os.fdopen(fsutil.open_regular(final), "rb")
        except fsutil.NotRegularFile as e:  # planted there: never adopt it
            raise OSError(errno.EEXIST, f"{final} {e.strerror}") from None
        with f:
            existing = f.read()
            inode = os.fstat(f.fileno()).st_ino
        parse_header(existing, len(existing))
        return Published(len(existing), file_checksum(existing), inode, False)

    def published_inode(
        self, ns: bytes, h: bytes, part: str = DELTA_PART
    ) -> Optional[int]:
        """The inode now at node ``h``'s path, None when there is no file."""
        try:
            return os.lstat(self.path(ns, h, part)).st_ino
        except FileNotFoundError:
            return None

    # -- reading -----------------------------------------------------------

    def _open(self, ns: bytes, h: bytes, nbytes: int, part: str) -> int:
        try:
            fd = self.open_file(ns, h, part)
        except FileNotFoundError:
            raise CorruptBlob("file is missing") from None
        except fsutil.NotRegularFile as e:
            raise CorruptBlob(f"file {e.strerror}") from None
        size = os.fstat(fd).st_size
        if size != nbytes:
            os.close(fd)
            raise CorruptBlob(f"file has {size} bytes, the index says {nbytes}")
        return fd

    def read_header(
        self, fd: int, nbytes: int, expected: Mapping[str, Tuple[str, Tuple[int, ...]]]
    ) -> Tuple[bytes, Dict[str, TensorEntry], dict]:
        """Read, validate and check a file's header against ``expected``.

        Files of one namespace and size have byte-identical headers, so a header
        seen before is recognised by its bytes instead of being parsed again.
        """
        head = os.pread(fd, min(nbytes, 16384), 0)
        if len(head) >= 8:
            (hlen,) = struct.unpack_from("<Q", head)
            if 8 + hlen > len(head) and hlen <= min(MAX_HEADER_BYTES, nbytes - 8):
                head = os.pread(fd, 8 + hlen, 0)
            head = head[: 8 + hlen]
        key = (head, nbytes, id(expected))
        cached = self._headers.get(key)
        if cached is not None and cached[0] is expected:
            return head, cached[1], cached[2]
        _, tensors, metadata = parse_header(head, nbytes)
        if expected is not None:
            check_layout(tensors, expected)
        if len(self._headers) > 4096:
            self._headers.clear()
        self._headers[key] = (expected, tensors, metadata)
        return head, tensors, metadata

    def read_staged(
        self,
        ns: bytes,
        h: bytes,
        *,
        nbytes: int,
        checksum: int,
        expected: Optional[Mapping[str, Tuple[str, Tuple[int, ...]]]],
        staging: bytearray,
        part: str = DELTA_PART,
    ) -> Tuple[memoryview, Dict[str, TensorEntry], dict]:
        """Read and verify a whole file into ``staging`` (at least ``nbytes`` long).

        For a file that is not placed whole (a node cut short, a state file, the
        RAM tier's copy); whole nodes go straight to their arrays with
        :meth:`read_into`. Returns a view of the file's bytes in ``staging``, its
        tensors and metadata. With ``expected``
        None the tensor table is only checked for consistency (the caller checks it).
        """
        if len(staging) < nbytes:
            raise ValueError(
                f"staging buffer of {len(staging)} bytes for a {nbytes}-byte file"
            )
        with self.open_checked(
            ns, h, nbytes=nbytes, expected=expected, part=part
        ) as opened:
            head = opened.head
            view = memoryview(staging)[:nbytes]
            view[: len(head)] = head
            rest = view[len(head) :]
            got = fsutil.preadv(opened.fd, [rest], len(head), nbytes=len(rest))
            if got != len(rest):
                raise CorruptBlob("file shrank while being read")
        if xxhash.xxh3_64_intdigest(view) != checksum:
            raise CorruptBlob("checksum mismatch")
        return view, opened.tensors, opened.metadata

    def open_checked(
        self,
        ns: bytes,
        h: bytes,
        *,
        nbytes: int,
        expected: Optional[Mapping[str, Tuple[str, Tuple[int, ...]]]],
        part: str = DELTA_PART,
    ) -> "OpenFile":
        """Open node ``h``'s file (delta or state ``part``) and validate its header
        (against ``expected``, unless None) before any data is read. The caller
        closes the result (or reads it with :meth:`read_into`, which does).

        Raises:
            CorruptBlob: missing, wrong size or bad header.
        """
        fd = self._open(ns, h, nbytes, part)
        try:
            head, tensors, metadata = self.read_header(fd, nbytes, expected)
        except BaseException:
            os.close(fd)
            raise
        return OpenFile(fd, nbytes, head, tensors, metadata)

    def read_into(
        self,
        opened: "OpenFile",
        *,
        checksum: int,
        targets: Callable[[Mapping[str, TensorEntry]], List[memoryview]],
    ) -> dict:
        """Read an opened file's data straight into caller buffers, then verify its
        checksum; closes the file.

        One copy, from the page cache to the destination: no staging buffer. The
        checksum is computed over the header and the buffers in file order.

        Args:
            opened: From :meth:`open_checked` (its header is already validated).
            targets: Called with the file's validated tensors; returns writable
                buffers that tile the data section exactly, in file order.

        Returns:
            The file's metadata.

        Raises:
            CorruptBlob: short read or checksum mismatch. The buffers may then hold
                partial data.
        """
        with opened:
            digest = xxhash.xxh3_64(opened.head)
            pos = len(opened.head)
            buffers = targets(opened.tensors)
            update = digest.update
            # Hash each batch right after reading it, while it is still in the CPU
            # cache: a second pass over the whole node would cost memory bandwidth.
            for i, j, want in buffer_batches(
                tuple(map(len, buffers)), HASH_BATCH_BYTES
            ):
                batch = buffers[i:j]
                if fsutil.preadv(opened.fd, batch, pos, nbytes=want) != want:
                    raise CorruptBlob("file shrank while being read")
                pos += want
                collections.deque(map(update, batch), 0)  # a loop in C
        if pos != opened.nbytes:
            raise ValueError(f"targets cover {pos} of {opened.nbytes} bytes")
        if digest.intdigest() != checksum:
            raise CorruptBlob("checksum mismatch")
        return opened.metadata

    def read_all(
        self,
        ns: bytes,
        h: bytes,
        *,
        nbytes: int,
        checksum: int,
        expected: Optional[Mapping[str, Tuple[str, Tuple[int, ...]]]],
        part: str = DELTA_PART,
    ) -> Tuple[bytearray, Dict[str, TensorEntry], dict]:
        """Read and verify a whole file into a new buffer: ``(data, tensors, metadata)``."""
        data = bytearray(nbytes)
        _, tensors, metadata = self.read_staged(
            ns,
            h,
            nbytes=nbytes,
            checksum=checksum,
            expected=expected,
            staging=data,
            part=part,
        )
        return data, tensors, metadata

    # -- removal and maintenance ----------------------------------------------

    def size(self, ns: bytes, h: bytes) -> Optional[int]:
        """Bytes of node ``h``'s files (delta and state), None when it has none."""
        sizes = []
        if not self._real_dirs(ns, h):
            return None
        for part in (DELTA_PART, STATE_PART):
            try:
                sizes.append(os.lstat(self.path(ns, h, part)).st_size)
            except FileNotFoundError:
                pass
        return sum(sizes) if sizes else None

    def remove(self, ns: bytes, h: bytes) -> bool:
        """Unlink node ``h``'s files (both parts); whether there was one.

        Raises:
            OSError: a part could not be unlinked (the other part was tried too).
        """
        if not self._real_dirs(ns, h):
            return False
        error, removed = None, False
        for part in (DELTA_PART, STATE_PART):
            try:
                removed = fsutil.unlink_if_exists(self.path(ns, h, part)) or removed
            except OSError as e:
                error = error or e
        if error is not None:
            raise error
        return removed

    def quarantine(self, ns: bytes, h: bytes, reason: str) -> Optional[str]:
        """Move a broken node's files aside (with a note saying why); None if gone."""
        if not self._real_dirs(ns, h):
            return None
        fsutil.makedirs(self.quarantine_dir)
        moved = None
        for part in (DELTA_PART, STATE_PART):
            dst = os.path.join(
                self.quarantine_dir,
                f"{ns.hex()}-{h.hex()}-{int(time.time())}{part}{self.SUFFIX}",
            )
            try:
                shutil.move(self.path(ns, h, part), dst)
            except FileNotFoundError:
                continue
            flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0)
            with os.fdopen(os.open(dst + ".reason", flags, 0o644), "w") as f:
                f.write(reason + "\n")
            moved = moved or dst
        return moved

    def iter_files(self) -> Iterator[Tuple[str, str]]:
        """Yield ``(kind, path)`` for every file: kind is "blob", "temp" or "other".

        In sorted path order, which for node files is their index keys' order: looking
        them up as they come reads the index in key order, not at random."""
        for dirpath, dirs, files in os.walk(self.root):
            dirs.sort()  # os.walk descends in the order left in ``dirs``
            for name in sorted(files):
                path = os.path.join(dirpath, name)
                if name.endswith(".tmp"):
                    yield "temp", path
                elif name.endswith(self.SUFFIX):
                    yield "blob", path
                else:
                    yield "other", path

    def parse_path(self, path: str) -> Optional[Tuple[bytes, bytes]]:
        """``(ns, h)`` for a node file path (either part) under this root, None for
        anything else."""
        rel = os.path.relpath(path, self.root).split(os.sep)
        if len(rel) != 3 or not rel[2].endswith(self.SUFFIX):
            return None
        stem = rel[2][: -len(self.SUFFIX)]
        if stem.endswith(STATE_PART):
            stem = stem[: -len(STATE_PART)]
        try:
            ns = bytes.fromhex(rel[0])
            h = bytes.fromhex(stem)
        except ValueError:
            return None
        if len(ns) != 16 or len(h) != 16 or rel[1] != rel[2][: self.fanout]:
            return None
        return ns, h


@functools.lru_cache(maxsize=64)
def buffer_batches(
    lengths: Tuple[int, ...], nbytes: int
) -> Tuple[Tuple[int, int, int], ...]:
    """``(i, j, bytes)``: buffers ``[i, j)`` of the given lengths in runs of about
    ``nbytes`` (at least one buffer, at most IOV_MAX). Cached: nodes of one size are
    cut the same way, and a node has hundreds of buffers."""
    ends = list(itertools.accumulate(lengths))
    out, i, done = [], 0, 0
    while i < len(lengths):
        hi = min(len(lengths), i + _IOV_MAX)
        j = max(i + 1, bisect.bisect_right(ends, done + nbytes, i, hi))
        out.append((i, j, ends[j - 1] - done))
        i, done = j, ends[j - 1]
    return tuple(out)


def file_checksum(data: bytes) -> int:
    return xxhash.xxh3_64_intdigest(data)
