"""Reading a batch of chunk files with many reads in flight (:class:`ReadAhead`)."""

import os
from concurrent.futures import Executor
from typing import Dict, List, Optional, Tuple

from ..disk.blobs import DELTA_PART, STATE_PART, Blobs
from ..disk.index import NodeRecord
from ..platform import fsutil

# Threads opening a batch's files. Opening a file whose inode is not cached reads
# it, one read at a time per thread: on this Linux VM a store of a million nodes,
# not in the page cache, took ~0.7 ms a file to verify with one.
OPENERS = 8


class ReadAhead:
    """Files of the next records opened and asked for at once
    (:func:`kvstore.platform.fsutil.prefetch`), so that a store whose files are not in
    the page cache is read with many reads in flight; each descriptor is taken once,
    the rest closed. A file that cannot be opened here is opened again by its check,
    which reports why. With a ``pool``, the batch is opened by ``OPENERS`` of its
    threads, each a contiguous part of it (asked for in key order, hence path
    order) with its own kept directories; without one, on this thread.

    Args:
        blobs: The store's chunk files.
        pool: Threads to open files on (at least ``OPENERS``), or None.
    """

    def __init__(self, blobs: Blobs, *, pool: Optional[Executor] = None):
        self.blobs = blobs
        self.pool = pool
        self.fds: Dict[Tuple[bytes, bytes, str], int] = {}

    def ask(self, items: List[Tuple[bytes, bytes, NodeRecord]]) -> None:
        if self.pool is None or len(items) < 2 * OPENERS:
            self.fds.update(self._open(items))
            return
        step = -(-len(items) // OPENERS)
        parts = [items[i : i + step] for i in range(0, len(items), step)]
        for opened in self.pool.map(self._open, parts):
            self.fds.update(opened)

    def _open(self, items) -> Dict[Tuple[bytes, bytes, str], int]:
        out = {}
        try:
            with self.blobs.dirs() as dirs:
                for ns, h, rec in items:
                    parts = (DELTA_PART, STATE_PART) if rec.has_state else (DELTA_PART,)
                    for part in parts:
                        try:
                            fd = self.blobs.open_file(ns, h, part, dirs=dirs)
                        except OSError:
                            continue
                        out[(ns, h, part)] = fd
                        fsutil.prefetch(fd)
        except BaseException:
            for fd in out.values():
                os.close(fd)
            raise
        return out

    def take(self, ns: bytes, h: bytes, part: str) -> Optional[int]:
        return self.fds.pop((ns, h, part), None)

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()
