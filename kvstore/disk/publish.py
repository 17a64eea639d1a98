"""Publishing the node files of one save, made durable together.

Per file the steps are the ones a single atomic write takes: a temp file created
exclusively in the node's directory, its bytes written, ``fsync``, a hard link to
the final name (never replacing a file), the directory ``fsync``. A save does each
step for all its files before the next step, so that their durability is one piece
of work instead of one per file:

1. every file is written to its temp file, and the kernel is told to start writing
   it to the device at once (:func:`kvstore.platform.fsutil.start_writeback`), so the disk
   works while the next file is written;
2. every temp file is fsynced, by ``SYNC_THREADS`` threads at once (the oldest ones
   while later ones are written, to keep at most ``OPEN_FILES`` descriptors);
3. only then is every file linked to its final name, and
4. every directory touched (each once) is fsynced, again by several threads.

Each ``fsync`` also flushes the drive's cache: one after the other, a save's 128
files and 100 directories cost 228 flushes, and while other processes write, each
waits for their writes too (measured: 0.5-0.9 s of a 32K-token save). Issued
concurrently, the file system joins them into shared journal commits and the block
layer merges their flushes. On macOS the drive's cache is flushed once per step
instead, by the last ``fsync`` (``F_FULLFSYNC``; see :func:`kvstore.platform.fsutil.fsync`).

Why this order is as safe as one file at a time: a file gets its final name only
after its bytes are durable (2 before 3), and the caller commits the index only
after ``publish`` returns (4 before the commit), so no index entry can name a file
that a crash could tear. A crash in between leaves temp files or unindexed files
under final names (orphans), as a crash between two single writes did; `kvstore gc`
removes both. Files of one save are never read through the index before the commit,
so the order among them does not matter.
"""

import collections
import errno
import os
import secrets
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import xxhash

from ..platform import fsutil
from . import reservations
from .blobs import (
    DELTA_PART,
    HASH_BATCH_BYTES,
    Blobs,
    NodeFile,
    Published,
    buffer_batches,
)

# Temp files open at once (written, or being fsynced): older ones are fsynced (their
# writeback started when written) and closed. Bounds descriptors (macOS allows a
# process 256 by default) without waiting early for a file still being written.
OPEN_FILES = 32
# Threads issuing a save's fsyncs at once (the GIL is released while they wait).
SYNC_THREADS = 4
_LINK_ATTEMPTS = 5  # publishing races with other processes' evictions of that file


def temp_name(h: bytes) -> str:
    """A new temp file name for node ``h``: ``.<h>.<pid>.<start>.<random>.tmp``. The
    writer's pid and start time (:mod:`kvstore.disk.reservations`) tell ``gc`` whether it
    is gone; the random part keeps names of one process apart (the file is created
    with ``O_EXCL`` anyway)."""
    pid, start = reservations.own_identity()
    return f".{h.hex()}.{pid}.{start}.{secrets.token_hex(4)}.tmp"


def temp_writer(name: str) -> Optional[Tuple[int, int]]:
    """``(pid, start time)`` of the process that made temp file ``name`` (start 0:
    unknown, a name without it), None for a name :func:`temp_name` did not make."""
    if not (name.startswith(".") and name.endswith(".tmp")):
        return None
    fields = name[1:-4].split(".")
    if len(fields) not in (3, 4) or not all(f.isdigit() for f in fields[1:-1]):
        return None
    pid = int(fields[1])
    start = int(fields[2]) if len(fields) == 4 else 0
    return (pid, start) if pid > 0 else None


@dataclass
class Staged:
    """One file of a batch, written to its temp file."""

    h: bytes
    part: str
    tmp: str
    final: str
    nbytes: int
    fd: int = -1  # open until fsynced
    inode: int = 0
    checksum: int = 0
    link_tried: bool = False  # the final name may now be this file


class WriteBatch:
    """The files of one save: :meth:`add` each, then :meth:`publish` them together;
    :meth:`close` (always, e.g. in ``finally``) removes what is left of temp files.

    Args:
        blobs: The store's chunk files (paths and adoption of existing files).
    """

    def __init__(self, blobs: Blobs):
        self.blobs = blobs
        self.staged: List[Staged] = []
        self._open: "collections.deque[Staged]" = collections.deque()
        self._syncing: "collections.deque[Future]" = collections.deque()
        self._dirs: Dict[str, None] = {}  # to fsync, in order, once each

    def add(self, ns: bytes, h: bytes, data: NodeFile, part: str = DELTA_PART):
        """Write ``data`` to a new temp file in node ``h``'s directory and start its
        writeback. Returns its :class:`Staged` entry (also in :attr:`staged`)."""
        if not isinstance(data, NodeFile):
            data = NodeFile.from_bytes(data)
        final = self.blobs.path(ns, h, part)
        directory = os.path.dirname(final)
        root = self.blobs.root
        if not os.path.isdir(root):  # the store was deleted: do not remake it
            raise FileNotFoundError(errno.ENOENT, "the blobs directory is gone", root)
        # Never write out of the store through a directory replaced by a link.
        fsutil.check_real_dirs(root, self.blobs.path_parts(ns, h)[:2])
        self._make_dir(directory)
        tmp = os.path.join(directory, temp_name(h))
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        staged = Staged(h, part, tmp, final, data.nbytes, fd)
        self.staged.append(staged)  # from here on close() removes the temp file
        self._open.append(staged)
        digest = xxhash.xxh3_64()
        buffers = data.buffers
        for i, j, _ in buffer_batches(tuple(map(len, buffers)), HASH_BATCH_BYTES):
            batch = buffers[i:j]
            collections.deque(map(digest.update, batch), 0)  # while in the CPU cache
            fsutil.write_all(fd, batch)
        fsutil.start_writeback(fd)
        staged.inode = os.fstat(fd).st_ino  # the final name's too, once linked
        staged.checksum = digest.intdigest()
        # Half the descriptors for files still being written back, half for fsyncs
        # in flight; a full window waits for the oldest fsync.
        while len(self._open) > max(1, OPEN_FILES // 2):
            self._sync_later(self._open.popleft())
        while len(self._open) + len(self._syncing) > max(2, OPEN_FILES):
            self._syncing.popleft().result()  # raises the fsync's error
        return staged

    def publish(self) -> List[Published]:
        """Make every temp file durable, link each to its final name (or adopt the
        file another writer published there first), then fsync every directory once.

        Returns one :class:`Published` per :meth:`add`, in order. On an error the
        caller removes the final names whose ``link_tried`` is set and that still
        hold this batch's inode (:meth:`kvstore.engine.removal.Removal.remove_written`).
        """
        last = self._open.pop() if self._open else None
        while self._open:
            self._sync_later(self._open.popleft())
        self._wait()
        # Every other file is synced: the last one's flushes the drive's cache for
        # all of them (macOS; see fsutil.fsync). All are durable before any is linked.
        if last is not None:
            fd, last.fd = last.fd, -1
            _sync_file(fd, device=True)
        out = [self._link(s) for s in self.staged]
        for s in self.staged:
            fsutil.unlink_if_exists(s.tmp)
        dirs = list(self._dirs)
        for d in dirs[:-1]:
            self._syncing.append(_pool().submit(fsutil.fsync_dir, d, device=False))
        self._wait()
        if dirs:
            fsutil.fsync_dir(dirs[-1])
        return out

    def close(self) -> None:
        """Wait for fsyncs in flight, close what is open and unlink every temp file
        left (idempotent)."""
        try:
            self._wait()
        except Exception:
            pass  # publish() raised it, or the save fails anyway
        for s in self.staged:
            if s.fd >= 0:
                fd, s.fd = s.fd, -1
                try:
                    os.close(fd)
                except OSError:
                    pass
            fsutil.unlink_if_exists(s.tmp)
        self._open.clear()

    def __enter__(self) -> "WriteBatch":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- steps ------------------------------------------------------------------

    def _make_dir(self, directory: str) -> None:
        """Create ``directory`` (and its namespace directory) when missing; the
        parents of created directories are fsynced too, so their entries last."""
        self._dirs[directory] = None
        if os.path.isdir(directory):
            return
        parent = os.path.dirname(directory)
        if not os.path.isdir(parent):
            self._dirs[os.path.dirname(parent)] = None
        fsutil.makedirs(directory)
        self._dirs[parent] = None

    def _sync_later(self, s: Staged) -> None:
        """fsync and close ``s`` on a pool thread (the job owns its descriptor)."""
        fd, s.fd = s.fd, -1
        self._syncing.append(_pool().submit(_sync_file, fd, device=False))

    def _wait(self) -> None:
        """Wait for every fsync in flight; raise the first error (after all ended)."""
        error = None
        while self._syncing:
            try:
                self._syncing.popleft().result()
            except BaseException as e:
                error = error or e
        if error is not None:
            raise error

    def _link(self, s: Staged) -> Published:
        """Give ``s`` its final name; a file already there is adopted, not replaced.

        Two processes may compute the same node with KV differing in the last bits
        (prefill split at other points). The first file published wins; the loser
        adopts it (its size and checksum) instead of overwriting a file whose
        checksum another process may be committing.
        """
        s.link_tried = True
        for _ in range(_LINK_ATTEMPTS):
            try:
                fsutil.link_noreplace(s.tmp, s.final)  # see there without hard links
            except FileExistsError:
                try:
                    return self.blobs.adopt(s.final)
                except FileNotFoundError:
                    continue  # removed (evicted) since: publish ours after all
            return Published(s.nbytes, s.checksum, s.inode, True)
        raise OSError(errno.EAGAIN, f"{s.final} keeps appearing and vanishing")


def _sync_file(fd: int, *, device: bool) -> None:
    try:
        fsutil.fsync(fd, device=device)
    finally:
        os.close(fd)


_POOL: Tuple[int, Optional[ThreadPoolExecutor]] = (0, None)
_POOL_LOCK = threading.Lock()


def _pool() -> ThreadPoolExecutor:
    """The process's fsync threads (a new pool in a forked child: threads do not
    survive fork)."""
    global _POOL
    with _POOL_LOCK:
        pid, pool = _POOL
        if pool is None or pid != os.getpid():
            pool = ThreadPoolExecutor(SYNC_THREADS, thread_name_prefix="kvstore-sync")
            _POOL = (os.getpid(), pool)
        return pool


def write_one(
    blobs: Blobs, ns: bytes, h: bytes, data, part: str = DELTA_PART
) -> Published:
    """Publish ``data`` (bytes or a :class:`NodeFile`) as the file of node ``h``,
    atomically and durably: a batch of one file.

    A crash leaves either no file or the whole file, never a torn one; a file
    another writer published there first is adopted, never replaced.
    """
    with WriteBatch(blobs) as batch:
        batch.add(ns, h, data, part)
        (published,) = batch.publish()
    return published
