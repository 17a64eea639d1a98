"""A mark that an index was checked whole and closed unchanged, like a file system's
clean flag.

A library open checks a bounded set of pages and then every page in the background
(:mod:`kvstore.disk.pageguard`); writes wait for that check, which takes seconds at a
million nodes. Yet most opens find the file exactly as the last process left it. So a
process whose check passed (every page it can reach is one it checked or one LMDB
wrote since) leaves ``index/checked`` when it closes the index, naming the file's
state: its inode, size, both meta pages, and a modification time that the close sets
itself to the nanosecond. The next open that finds the same state knows every
reachable page was checked and skips the background check, as ``e2fsck`` skips a
file system that was unmounted cleanly.

Why a change is always seen:

* any commit rewrites a meta page (a new transaction id) and sets the modification
  time from the kernel's coarse clock, which the fine-grained stamp never equals;
* a write by anything else (a damaged sector rewritten, a test zeroing a page) sets
  the modification time as well;
* a file system that keeps coarser times than the stamp gets no mark (a later write
  within the same tick could leave the same time);
* a close marks only a file that nothing but this process's own commits changed
  since its check began (:class:`Watch`): damage written while it had the file
  open, or another process's commit, leaves no mark.

What no mark can see is what no open sees short of reading every page: a disk that
changes bytes by itself after they were checked (``kvstore verify`` reads them all).

Why a crash never leaves a mark that lies: the data is on disk before the mark is
written (LMDB syncs every commit, and the close syncs again), and a mark torn or lost
by the crash, or a stamp the crash lost, only makes the next open check every page.
"""

import json
import logging
import os
import secrets
import threading
import time
from typing import Optional, Tuple

from ..platform import fsutil
from . import mdbcheck

log = logging.getLogger("kvstore")

MARK_NAME = "checked"
_TMP_PREFIX = f".{MARK_NAME}."
_VERSION = 1
_MAX_BYTES = 4096  # a mark is ~600 bytes; anything longer is not one


def _state(fd: int) -> Optional[dict]:
    """What the mark records of the open ``data.mdb``, or None (not an LMDB file)."""
    metas = mdbcheck.read_meta_pages(fd)
    if any(m is None for m in metas) or mdbcheck.meta_problem(metas) is not None:
        return None
    st = os.fstat(fd)
    return {
        "version": _VERSION,
        "inode": [st.st_dev, st.st_ino],
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "metas": [[m.txnid, m.body[16:].hex()] for m in metas],
    }


def _latest(fd: int) -> Tuple[int, int]:
    """``(modification time, newest meta page's transaction id)`` of ``data.mdb``."""
    metas = [m for m in mdbcheck.read_meta_pages(fd) if m is not None]
    return os.fstat(fd).st_mtime_ns, max((m.txnid for m in metas), default=-1)


class Watch:
    """Whether every change to ``data.mdb`` since its check began was a commit of
    this process: only then may its close leave the mark.

    Each commit is seen from inside its write transaction (LMDB's writer lock keeps
    other processes' commits out) and just after it; a change between two of them
    that was not a commit of ours (another process's, or bytes written by anything
    else) makes the file unexplained for the rest of the process's life.
    """

    def __init__(self, fd: int):
        self._fd = fd
        self._lock = threading.Lock()  # a commit's two looks, one thread at a time
        self._known: Optional[Tuple[int, int]] = None  # the state last explained
        self.explained = True

    def begin(self, txnid: Optional[int] = None) -> None:
        """The check began on snapshot ``txnid`` (None: the newest, just checked):
        the file as it is now is known."""
        now = _latest(self._fd)
        with self._lock:
            self._known = now
            if txnid is not None and now[1] != txnid:  # a commit since the snapshot
                self.explained = False

    def before_commit(self) -> None:
        """Inside a write transaction, before it changes anything."""
        self._lock.acquire()
        try:
            if _latest(self._fd) != self._known:
                self.explained = False
        except OSError:
            self.explained = False

    def after_commit(self, txnid: Optional[int]) -> None:
        """After the transaction ``txnid`` committed (None: it was aborted)."""
        try:
            if txnid is not None:
                self._known = now = _latest(self._fd)
                if now[1] != txnid:
                    self.explained = False
        except OSError:
            self.explained = False
        finally:
            self._lock.release()

    def unchanged(self) -> bool:
        """Nothing but this process's commits changed the file since :meth:`begin`."""
        with self._lock:
            try:
                return self.explained and _latest(self._fd) == self._known
            except OSError:
                return False


def matches(index_dir: str, fd: int) -> bool:
    """Whether ``index/checked`` names the state of ``data.mdb`` open as ``fd``: every
    page a read can reach was checked by a process that closed it so. Any doubt
    (no mark, a mark of another state, one that is not a mark) is False."""
    try:
        with open(os.path.join(index_dir, MARK_NAME), "rb") as f:
            raw = f.read(_MAX_BYTES + 1)
    except OSError:
        return False
    if len(raw) > _MAX_BYTES:
        return False
    try:
        mark = json.loads(raw)
    except ValueError:
        return False
    try:
        state = _state(fd)
    except OSError:
        return False
    return state is not None and isinstance(mark, dict) and mark == state


def names_file(index_dir: str) -> bool:
    """:func:`matches` for ``index_dir/data.mdb`` before anything opened it (False
    for a file that is missing or not a regular file: the open then says why)."""
    try:
        fd = fsutil.open_regular(os.path.join(index_dir, "data.mdb"))
    except OSError:
        return False
    try:
        return matches(index_dir, fd)
    finally:
        os.close(fd)


def write(index_dir: str, fd: int) -> bool:
    """Stamp ``data.mdb`` (open as ``fd``, its data on disk, its pages all checked)
    and leave the mark naming it. False, with no mark left, where the file system
    keeps coarser times or something wrote meanwhile; errors are logged, not raised
    (a missing mark costs the next open its background check, nothing else)."""
    path = os.path.join(index_dir, MARK_NAME)
    try:
        # A time of this instant to the nanosecond, with random low digits: no
        # coarse-clock time a later write gets can equal it.
        stamp = time.time_ns() // 1000 * 1000 + 1 + secrets.randbelow(999)
        _set_time(fd, os.path.join(index_dir, "data.mdb"), stamp)
        state = _state(fd)
        if state is None or state["mtime_ns"] != stamp:
            unlink(index_dir)  # truncated by the file system, or a commit meanwhile
            return False
        _remove_leftovers(index_dir)
        tmp = os.path.join(
            index_dir, f"{_TMP_PREFIX}{os.getpid()}.{secrets.token_hex(4)}"
        )
        try:
            out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            with os.fdopen(out, "w") as f:
                os.fchmod(out, 0o644)  # whatever the umask, as the store's files
                json.dump(state, f)
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        if os.fstat(fd).st_mtime_ns != stamp:  # a commit between the stamp and now
            unlink(index_dir)
            return False
        return True
    except (OSError, NotImplementedError) as e:
        log.debug("kvstore: no checked mark left in %s: %s", index_dir, e)
        unlink(index_dir)
        return False


def _set_time(fd: int, path: str, ns: int) -> None:
    """Set the file's access and modification times: through its descriptor where the
    platform can (``futimens``), else by path (the state read back from the descriptor
    afterwards then tells whether the path still names that file)."""
    if os.utime in os.supports_fd:
        os.utime(fd, ns=(ns, ns))
    else:
        os.utime(path, ns=(ns, ns), follow_symlinks=False)


def unlink(index_dir: str) -> None:
    """Remove the mark (damage found: the next open checks every page)."""
    try:
        os.unlink(os.path.join(index_dir, MARK_NAME))
    except FileNotFoundError:
        pass
    except OSError as e:
        log.warning("kvstore: cannot remove %s: %s", MARK_NAME, e)


def _remove_leftovers(index_dir: str) -> None:
    """Unlink marks that processes killed while writing them left (a mark takes
    microseconds to write: any older than a minute is one)."""
    fsutil.remove_leftovers(index_dir, _TMP_PREFIX, older_than_s=60)
