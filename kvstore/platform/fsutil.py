"""Platform file primitives, with a portable fallback for every Linux-only call.

Users run kvstore on macOS, where some calls behave differently or may be missing:
``os.preadv`` needs macOS 11 and a Python built for it, ``sync_file_range`` is
Linux-only, and ``fsync`` does not flush the drive's own cache (``F_FULLFSYNC`` does,
as LMDB and SQLite use it). Every caller goes through this module, so the fallbacks
are one switch away from being tested on Linux (``tests/test_fsutil.py`` runs them by
hiding the Linux-only functions).
"""

import ctypes
import ctypes.util
import errno
import functools
import os
import stat
import sys
import time
from typing import List, Optional, Sequence

# Resolved at call time (not import time), so tests can hide them with monkeypatch.
try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None

# Flags for opening a file to read that must never block or leave the store: a FIFO
# planted in place of a file would block a plain open for ever; a symlink would
# lead outside the store directory.
_READ_FLAGS = (
    os.O_RDONLY
    | getattr(os, "O_NONBLOCK", 0)
    | getattr(os, "O_NOFOLLOW", 0)
    | getattr(os, "O_CLOEXEC", 0)
)


class NotRegularFile(OSError):
    """A path that must be a regular file is something else (FIFO, device, symlink...)."""


def open_regular(path: str, *, dir_fd: Optional[int] = None) -> int:
    """Open ``path`` read-only, refusing anything that is not a regular file.

    The last component is never followed if it is a symlink, and the open never
    blocks (a FIFO opens at once with ``O_NONBLOCK``, then is refused).

    Returns:
        The file descriptor (the caller closes it).

    Raises:
        FileNotFoundError: no such file.
        NotRegularFile: a symlink, FIFO, socket, device or directory.
    """
    try:
        fd = os.open(path, _READ_FLAGS, dir_fd=dir_fd)
    except OSError as e:
        # O_NOFOLLOW on a symlink fails with ELOOP (Linux, macOS) or EMLINK (BSD).
        if e.errno in (errno.ELOOP, errno.EMLINK):
            raise NotRegularFile(e.errno, "is a symbolic link", path) from None
        if e.errno in (errno.ENXIO, errno.EISDIR):  # a socket; a directory
            raise NotRegularFile(e.errno, "is not a regular file", path) from None
        raise
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise NotRegularFile(errno.EINVAL, "is not a regular file", path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def preadv(fd: int, buffers: List[memoryview], offset: int, *, nbytes: int) -> int:
    """Read ``nbytes`` (the buffers' total length) into ``buffers`` in order, from
    file ``offset``; returns the bytes read, fewer only at end of file.

    Uses ``os.preadv`` where the platform has it. The fallback seeks and calls
    ``os.readv`` (POSIX, on every macOS): it moves the descriptor's file offset, so
    the descriptor must not be read by two threads at once (kvstore reads each open
    chunk file on one thread).
    """
    read = getattr(os, "preadv", None)
    total = 0
    while total < nbytes:
        if read is not None:
            got = read(fd, buffers, offset + total)
        else:
            os.lseek(fd, offset + total, os.SEEK_SET)
            got = os.readv(fd, buffers)
        if got <= 0:
            break
        total += got
        if total < nbytes:  # a short read: rare, so the slow re-slicing is fine
            buffers = _advance(buffers, got)
    return total


def _advance(buffers: List[memoryview], nbytes: int) -> List[memoryview]:
    """The part of ``buffers`` still to fill after ``nbytes`` were read into them."""
    for i, buf in enumerate(buffers):
        if nbytes < len(buf):
            return [buf[nbytes:]] + list(buffers[i + 1 :])
        nbytes -= len(buf)
    return []


def write_all(fd: int, buffers: Sequence) -> int:
    """Write every buffer to ``fd``, in order; returns the bytes written.

    Buffers are 1-D byte buffers (``len`` is their size in bytes: bytes, memoryviews
    of format "B", uint8 arrays). One vectored ``os.writev`` per call where the
    platform has it (the caller keeps a call's buffers under ``IOV_MAX``), else
    ``os.write`` per buffer; short writes are resumed.
    """
    writev = getattr(os, "writev", None)
    buffers = list(buffers)
    total = 0
    while buffers:
        if not len(buffers[0]):
            buffers = buffers[1:]
            continue
        n = writev(fd, buffers) if writev is not None else os.write(fd, buffers[0])
        if n <= 0:  # a regular file never takes 0 bytes of a non-empty write
            raise OSError(errno.EIO, "write took no bytes")
        total += n
        buffers = _advance(buffers, n)
    return total


_SYNC_FILE_RANGE_WRITE = 2  # <linux/fs.h>: start writeback, do not wait
_UNSUPPORTED = (errno.EINVAL, errno.ENOSYS, errno.ESPIPE, errno.EOPNOTSUPP)


def _load_sync_file_range():
    """libc's ``sync_file_range`` (Linux), or None where there is none (macOS, BSD)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


# Looked up when called, so tests can run the fallback (None) here.
sync_file_range = _load_sync_file_range()


def start_writeback(fd: int) -> bool:
    """Start writing a file's dirty pages to the device now, without waiting for it.

    A hint: the disk then works while the caller writes the next file, and the
    ``fsync`` that follows waits for less. Linux: ``sync_file_range`` with
    ``SYNC_FILE_RANGE_WRITE`` only, which never waits and never reports (so never
    consumes) a writeback error: the later ``fsync`` still sees every one. Elsewhere,
    or where the file system refuses it, nothing is done and the ``fsync`` does all
    the work. Returns whether writeback was started.
    """
    global sync_file_range
    fn = sync_file_range
    if fn is None:
        return False
    if fn(fd, 0, 0, _SYNC_FILE_RANGE_WRITE) == 0:
        return True
    err = ctypes.get_errno()
    if err in _UNSUPPORTED:
        sync_file_range = None  # this file system (or kernel) has none: stop asking
        return False
    raise OSError(err, os.strerror(err))


def prefetch(fd: int) -> bool:
    """Ask the kernel to start reading file ``fd`` into the page cache, and return at
    once: a scan that asks for a batch of files before reading them keeps many reads
    in flight instead of one (on this Linux VM a cold 2.4 KB file took ~400 us read
    alone, ~150 us with 256 asked ahead). Linux: ``posix_fadvise(WILLNEED)``;
    elsewhere (macOS has no ``posix_fadvise``), or where it is refused, nothing is
    asked and the reads that follow are the same, one at a time. Returns whether
    the kernel was asked."""
    advise = getattr(os, "posix_fadvise", None)
    if advise is None:
        return False
    try:
        advise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
    except OSError:
        return False
    return True


_NO_FULLFSYNC = (
    errno.ENOTSUP,
    errno.EOPNOTSUPP,
    errno.EINVAL,
    errno.ENOTTY,
    errno.ENOSYS,
)


def _full_fsync_flag() -> Optional[int]:
    return getattr(fcntl, "F_FULLFSYNC", None) if fcntl is not None else None


def fsync(fd: int, *, device: bool = True) -> None:
    """Make a file's data durable, including past the drive's own write cache.

    On macOS ``fsync`` only hands data to the drive, whose cache may lose it on
    power loss; ``F_FULLFSYNC`` flushes that cache (the same choice LMDB makes for
    its own commits there). File systems that refuse it get a plain ``fsync``.

    Args:
        device: False: a plain ``fsync`` only. Where ``F_FULLFSYNC`` exists that
            leaves the data in the drive's cache until a later ``fsync(other_fd)``
            with ``device=True`` on the same volume flushes that cache (a drive
            flushes its whole cache at once): a group of files then costs one cache
            flush, not one each. Elsewhere (Linux) ``fsync`` already flushes it.
    """
    full = _full_fsync_flag() if device else None
    if full is not None:
        try:
            fcntl.fcntl(fd, full)
            return
        except OSError as e:
            # Not supported by this file system: fall back to fsync. Any other error
            # (EIO, ENOSPC) is the write failing: never hidden by a later fsync.
            if e.errno not in _NO_FULLFSYNC:
                raise
    os.fsync(fd)


def fsync_dir(path: str, *, device: bool = True) -> None:
    """Make a directory's entries (created, linked, renamed files) durable.

    Some file systems refuse to open or fsync a directory; they order metadata
    updates themselves, so that is not an error. ``device`` as in :func:`fsync`.
    """
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        fsync(fd, device=device)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def iov_max() -> int:
    """Buffers one vectored read may take (``IOV_MAX``: 1024 on Linux and macOS).

    ``os.sysconf`` may not know the name or may answer -1 (no limit stated); the
    POSIX minimum, 16, is then used.
    """
    try:
        return max(16, os.sysconf("SC_IOV_MAX"))
    except (ValueError, OSError, AttributeError):
        return 16


# Errors of a hard link the file system cannot make (FAT/exFAT, some network mounts).
_NO_LINKS = (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK)
# Errors of a no-replace rename the file system or kernel does not offer.
_NO_RENAME_FLAGS = (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP)
_RENAME_NOREPLACE = 1  # Linux renameat2 flag
_RENAME_EXCL = 0x4  # macOS renamex_np flag
_AT_FDCWD = -100  # Linux


@functools.lru_cache(maxsize=None)
def load_libc():
    """The C library through ctypes (loaded once), None where it cannot be loaded."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    except OSError:
        return None


def _rename_noreplace(src: str, dst: str) -> bool:
    """Rename ``src`` to ``dst`` unless ``dst`` exists, atomically (Linux
    ``renameat2(RENAME_NOREPLACE)``, macOS ``renamex_np(RENAME_EXCL)``).

    Returns:
        False when neither call is available here (nothing was done).

    Raises:
        FileExistsError: ``dst`` exists (``src`` is left in place).
    """
    libc = load_libc()
    call = None
    if libc is not None and hasattr(libc, "renamex_np"):
        call = lambda a, b: libc.renamex_np(a, b, _RENAME_EXCL)  # noqa: E731
    elif libc is not None and hasattr(libc, "renameat2"):
        call = lambda a, b: libc.renameat2(  # noqa: E731
            _AT_FDCWD, a, _AT_FDCWD, b, _RENAME_NOREPLACE
        )
    if call is None:
        return False
    if call(os.fsencode(src), os.fsencode(dst)) == 0:
        return True
    err = ctypes.get_errno()
    if err in _NO_RENAME_FLAGS:
        return False
    raise OSError(err, os.strerror(err), dst)


def link_noreplace(src: str, dst: str) -> None:
    """Give the complete file ``src`` the name ``dst``, never replacing a file there.

    A hard link where the file system has them (``src`` stays, the caller removes
    it). Else an atomic no-replace rename (``src`` goes). Where neither exists, an
    existence check then ``os.replace``: two writers publishing the same name in the
    same instant could then replace one another's file; the loser's index entry then
    names a checksum the file does not have, which every read checks (a miss and a
    quarantine, never wrong KV).

    Raises:
        FileExistsError: ``dst`` exists.
    """
    try:
        os.link(src, dst)
        return
    except FileExistsError:
        raise
    except AttributeError:  # no os.link at all
        pass
    except OSError as e:
        if e.errno not in _NO_LINKS:
            raise
    if _rename_noreplace(src, dst):
        return
    if os.path.lexists(dst):
        raise FileExistsError(errno.EEXIST, "File exists", dst)
    os.replace(src, dst)


# -- paths inside a store ----------------------------------------------------------
# A store's subdirectories (index/, blobs/<ns>/<xx>/, quarantine/) are kvstore's own:
# one planted as a symlink must never lead a read or a write out of the store.

_DIR_FLAGS = (
    os.O_RDONLY
    | getattr(os, "O_DIRECTORY", 0)
    | getattr(os, "O_NOFOLLOW", 0)
    | getattr(os, "O_CLOEXEC", 0)
)


def open_regular_beneath(root: str, parts: List[str]) -> int:
    """:func:`open_regular` of ``root/parts[0]/.../parts[-1]``, following no symlink
    below ``root``: each directory is opened relative to its parent's descriptor.

    Raises:
        FileNotFoundError: no such file or directory.
        NotRegularFile: a component is a symlink or not a directory, or the file is
            not a regular file.
    """
    with DirsBeneath(root) as dirs:  # the directories, closed once the file is open
        return open_regular(parts[-1], dir_fd=dirs.dir(parts[:-1]))


class DirsBeneath:
    """:func:`open_regular_beneath` for many files of a few directories: the
    descriptors of the last file's directories are kept and reused, so a scan in path
    order opens one file per file instead of a whole chain of directories.

    A kept descriptor follows its directory even if the name was removed or replaced
    meanwhile, so a file not found through one is looked for again through freshly
    opened directories before :class:`FileNotFoundError` is believed. Close it (or use
    it as a context manager) to close the kept descriptors.
    """

    def __init__(self, root: str):
        self.root = root
        self._names: List[str] = []  # directories below root of the kept chain
        self._fds: List[int] = []  # root's descriptor, then one per name

    def open(self, parts: List[str]) -> int:
        """Open ``root/parts...`` as :func:`open_regular_beneath` does."""
        try:
            return open_regular(parts[-1], dir_fd=self.dir(parts[:-1]))
        except FileNotFoundError:
            self.close()  # stale or missing: look again from the root
            return open_regular(parts[-1], dir_fd=self.dir(parts[:-1]))

    def dir(self, names: List[str]) -> int:
        """The descriptor of ``root/names...``, reusing the kept chain's shared part
        (each directory opened relative to its parent, never through a symlink)."""
        same = 0
        while same < min(len(names), len(self._names)) and (
            names[same] == self._names[same]
        ):
            same += 1
        while len(self._names) > same:  # drop the kept chain below the shared part
            self._names.pop()
            os.close(self._fds.pop())
        if not self._fds:
            self._fds.append(_open_dir(self.root, None))
        for name in names[same:]:
            self._fds.append(_open_dir(name, self._fds[-1]))
            self._names.append(name)
        return self._fds[-1]

    def close(self) -> None:
        while self._fds:
            os.close(self._fds.pop())
        self._names.clear()

    def __enter__(self) -> "DirsBeneath":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _open_dir(path: str, dir_fd: Optional[int]) -> int:
    try:
        return os.open(path, _DIR_FLAGS, dir_fd=dir_fd)
    except OSError as e:
        # A symlink fails with ELOOP (EMLINK on BSD); a file with ENOTDIR.
        if e.errno in (errno.ELOOP, errno.EMLINK, errno.ENOTDIR):
            raise NotRegularFile(e.errno, "is not a directory", path) from None
        raise


def check_real_dirs(root: str, parts: List[str]) -> None:
    """Raise :class:`NotRegularFile` if ``root/parts[0]``, ``root/parts[0]/parts[1]``...
    exists as anything but a directory (a symlink to one included). Missing ones pass.

    For paths about to be written, renamed or unlinked by name (the check and the use
    are not atomic; reads use :func:`open_regular_beneath`, which is).
    """
    path = root
    for name in parts:
        path = os.path.join(path, name)
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            return
        if not stat.S_ISDIR(mode):
            raise NotRegularFile(errno.ENOTDIR, "is not a directory", path)


def makedirs(path: str, mode: int = 0o755) -> None:
    """``os.makedirs(path, exist_ok=True)`` giving every directory it creates ``mode``
    (masked by the umask, so never wider): ``os.makedirs`` gives the parents it creates
    ``0o777 & ~umask``, world-writable under umask 000."""
    if os.path.isdir(path):
        return
    parent = os.path.dirname(os.path.abspath(path))
    if parent != path and not os.path.isdir(parent):
        makedirs(parent, mode)
    try:
        os.mkdir(path, mode)
    except FileExistsError:
        if not os.path.isdir(path):
            raise


# -- advisory locks ------------------------------------------------------------------


def lock_byte(fd: int, offset: int, *, exclusive: bool, blocking: bool) -> bool:
    """Take a POSIX record lock on byte ``offset`` of ``fd`` (shared or exclusive);
    False when ``blocking`` is off and another process holds a conflicting one.

    Record locks belong to the process (taking one again converts it) and go away
    when it exits or closes any descriptor of the file. Where the platform has none
    (Windows) or the file system refuses them (ENOLCK), returns True: nothing locked.
    """
    if getattr(fcntl, "lockf", None) is None:
        return True
    op = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
    if not blocking:
        op |= fcntl.LOCK_NB
    try:
        fcntl.lockf(fd, op, 1, offset, os.SEEK_SET)
    except OSError as e:
        if e.errno in (errno.EACCES, errno.EAGAIN):
            return False
        if e.errno in (errno.ENOLCK, errno.EINVAL, errno.ENOTSUP):
            return True
        raise
    return True


def unlock_byte(fd: int, offset: int) -> None:
    """Release :func:`lock_byte`'s lock on byte ``offset``."""
    if getattr(fcntl, "lockf", None) is not None:
        try:
            fcntl.lockf(fd, fcntl.LOCK_UN, 1, offset, os.SEEK_SET)
        except OSError:
            pass


def unlink_if_exists(path: str) -> bool:
    """Remove the file at ``path``; whether there was one."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True


def remove_leftovers(directory: str, prefix: str, *, older_than_s: float) -> None:
    """Unlink the files in ``directory`` whose names start with ``prefix`` and that
    were last changed more than ``older_than_s`` ago: temporary files that a process
    killed while writing them left (a live writer's file is younger). Errors are
    ignored: another process may remove them first."""
    try:
        names = [n for n in os.listdir(directory) if n.startswith(prefix)]
    except OSError:
        return
    now = time.time()
    for name in names:
        path = os.path.join(directory, name)
        try:
            if now - os.lstat(path).st_mtime > older_than_s:
                os.unlink(path)
        except OSError:
            pass
