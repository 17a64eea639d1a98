"""Reading a batch of chunk files with many reads in flight (:class:`ReadAhead`)."""

import os
from typing import Dict, List, Optional, Tuple

from ..disk.blobs import DELTA_PART, STATE_PART, Blobs
from ..disk.index import NodeRecord
from ..platform import fsutil


class ReadAhead:
    """Files of the next records opened and asked for at once
    (:func:`kvstore.platform.fsutil.prefetch`), so that a store whose files are not in the page
    cache is read with many reads in flight; each descriptor is taken once, the rest
    closed. A file that cannot be opened here is opened again by its check, which
    reports why. Directories are opened once for the files of a batch (asked for in
    key order, hence in path order)."""

    def __init__(self, blobs: Blobs):
        self.blobs = blobs
        self.dirs = blobs.dirs()
        self.fds: Dict[Tuple[bytes, bytes, str], int] = {}

    def ask(self, items: List[Tuple[bytes, bytes, NodeRecord]]) -> None:
        for ns, h, rec in items:
            for part in (DELTA_PART, STATE_PART) if rec.has_state else (DELTA_PART,):
                try:
                    fd = self.blobs.open_file(ns, h, part, dirs=self.dirs)
                except OSError:
                    continue
                self.fds[(ns, h, part)] = fd
                fsutil.prefetch(fd)

    def take(self, ns: bytes, h: bytes, part: str) -> Optional[int]:
        return self.fds.pop((ns, h, part), None)

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()
        self.dirs.close()
