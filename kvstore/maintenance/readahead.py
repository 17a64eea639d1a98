"""Reading a batch of chunk files with many reads in flight (:class:`ReadAhead`)."""

import os
import time
from concurrent.futures import Executor
from typing import Callable, Dict, List, Optional, Tuple

from ..disk.blobs import DELTA_PART, STATE_PART, Blobs
from ..disk.index import NodeRecord
from ..platform import fsutil

# Threads opening a batch's files while opens are slow. Opening a file whose inode is
# not cached reads it, one read at a time per thread: on this Linux VM a store of a
# million nodes not in the page cache took 713 s to verify opening on one thread,
# 407 s on 8. Cached opens take ~10 us, and threads only add their switching (100,000
# nodes in the page cache: 6.1-6.6 s on one thread, 7.9-8.7 s on 8).
OPENERS = 8
SLOW_OPEN_S = 100e-6
# Files of a batch first opened one at a time on the calling thread, each timed
# alone: the first slow one sends the rest to the threads.
PROBE = 4


class Openers:
    """Runs ``open_part(items)`` for a batch of files: its first files one at a time
    on the calling thread, each timed alone (threads' timings would include their
    switching), until one is slow (over ``SLOW_OPEN_S``: an inode read from the
    disk); then the rest split among ``OPENERS`` of ``pool``'s threads. While they
    are fast, the whole batch stays on the calling thread.

    Args:
        pool: Threads (at least ``OPENERS``).
        clock: Seconds, for the timing (tests pass their own).
    """

    def __init__(
        self, pool: Executor, *, clock: Callable[[], float] = time.perf_counter
    ):
        self.pool = pool
        self.clock = clock

    def run(self, open_part: Callable[[list], dict], items: list) -> dict:
        out, start, slow = {}, 0, False
        while start < min(PROBE, len(items)) and not slow:
            tic = self.clock()
            out.update(open_part(items[start : start + 1]))
            slow = self.clock() - tic > SLOW_OPEN_S
            start += 1
        rest = items[start:]
        if not slow or len(rest) < 2 * OPENERS:
            out.update(open_part(rest))
            return out
        step = -(-len(rest) // OPENERS)
        parts = [rest[i : i + step] for i in range(0, len(rest), step)]
        for opened in self.pool.map(open_part, parts):
            out.update(opened)
        return out


class ReadAhead:
    """Files of the next records opened and asked for at once
    (:func:`kvstore.platform.fsutil.prefetch`), so that a store whose files are not in
    the page cache is read with many reads in flight; each descriptor is taken once,
    the rest closed. A file that cannot be opened here is opened again by its check,
    which reports why. Opened by ``openers`` (:class:`Openers`), on this thread or
    its threads, each a contiguous part of the batch in key order (hence path order,
    its directories kept from file to file).

    Args:
        blobs: The store's chunk files.
        openers: Where the files are opened.
    """

    def __init__(self, blobs: Blobs, openers: Openers):
        self.blobs = blobs
        self.openers = openers
        self.fds: Dict[Tuple[bytes, bytes, str], int] = {}

    def ask(self, items: List[Tuple[bytes, bytes, NodeRecord]]) -> None:
        self.fds.update(self.openers.run(self._open, items))

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
