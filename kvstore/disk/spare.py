"""Room kept on the store's file system for the index commits that free disk space.

LMDB never overwrites a page a reader may see: a commit writes new pages first, and
frees the old ones only once it is durable. So deleting records needs disk space, and
on a full file system ``kvstore gc`` could free nothing: its first commit failed with
ENOSPC. Every writable open keeps ``index/spare``, a file of :data:`SPARE_BYTES`
written in full (real blocks, not a sparse file); a commit that frees space and
finds the disk full deletes it and tries again (:meth:`kvstore.disk.index.Index.write`).
Eviction starts with small commits (:func:`kvstore.maintenance.evict_to_budget`), so
that room is enough for the first one; the node files it unlinks make room for the
rest. ``gc`` makes the spare again when it is done.
"""

import errno
import logging
import os
import secrets

from ..platform import fsutil

log = logging.getLogger("kvstore")

SPARE_NAME = "spare"
SPARE_BYTES = 1 << 20
_BLOCK = 64 << 10
_LEFTOVER_SECONDS = 600.0


def path_of(index_dir: str) -> str:
    return os.path.join(index_dir, SPARE_NAME)


def ensure(index_dir: str) -> bool:
    """Make ``index/spare`` if it is missing or short; False when there is no room
    (or no permission) for it now. Never raises for the file system's answers."""
    final = path_of(index_dir)
    try:
        st = os.lstat(final)
        if st.st_size >= SPARE_BYTES and st.st_blocks * 512 >= SPARE_BYTES:
            return True
    except FileNotFoundError:
        pass
    except OSError:
        return False
    _remove_leftovers(index_dir)
    tmp = os.path.join(index_dir, f".{SPARE_NAME}.{os.getpid()}.{secrets.token_hex(4)}")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(tmp, flags, 0o644)
    except OSError as e:
        log.debug("kvstore: no spare room kept in %s: %s", index_dir, e)
        return False
    try:
        block = bytes(_BLOCK)
        for _ in range(SPARE_BYTES // _BLOCK):
            os.write(fd, block)  # zeros written, not a hole: the blocks are taken now
        os.fsync(fd)
        os.close(fd)
        fd = -1
        os.replace(tmp, final)
        return True
    except OSError as e:
        if e.errno != errno.ENOSPC:
            log.warning("kvstore: cannot keep spare room in %s: %s", index_dir, e)
        return False
    finally:
        if fd >= 0:
            os.close(fd)
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass


def _remove_leftovers(index_dir: str) -> None:
    """Unlink spares that processes killed while writing them left (a spare takes
    milliseconds to write: any older than :data:`_LEFTOVER_SECONDS` is one)."""
    fsutil.remove_leftovers(
        index_dir, f".{SPARE_NAME}.", older_than_s=_LEFTOVER_SECONDS
    )


def release(index_dir: str) -> int:
    """Delete ``index/spare`` to make room: the bytes it held (0: there was none)."""
    final = path_of(index_dir)
    try:
        size = os.lstat(final).st_size
        os.unlink(final)
    except OSError:
        return 0
    return size
