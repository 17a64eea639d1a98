"""Platform file primitives, with a portable fallback for every Linux-only call.

Users run kvstore on macOS, where some calls behave differently or may be missing:
``os.preadv`` needs macOS 11 and a Python built for it, and ``fsync`` does not flush
the drive's own cache (``F_FULLFSYNC`` does, as LMDB and SQLite use it). Every caller
goes through this module, so the fallbacks are one switch away from being tested on
Linux (``tests/test_fsutil.py`` runs them by hiding the Linux-only functions).
"""

import errno
import os
import stat
import sys
from typing import List, Optional

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


def fsync(fd: int) -> None:
    """Make a file's data durable, including past the drive's own write cache.

    On macOS ``fsync`` only hands data to the drive, whose cache may lose it on
    power loss; ``F_FULLFSYNC`` flushes that cache (the same choice LMDB makes for
    its own commits there). File systems that refuse it get a plain ``fsync``.
    """
    full = getattr(fcntl, "F_FULLFSYNC", None) if fcntl is not None else None
    if full is not None:
        try:
            fcntl.fcntl(fd, full)
            return
        except OSError:
            pass  # not supported by this file system: fall back to fsync
    os.fsync(fd)


def fsync_dir(path: str) -> None:
    """Make a directory's entries (created, linked, renamed files) durable.

    Some file systems refuse to open or fsync a directory; they order metadata
    updates themselves, so that is not an error.
    """
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


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
    fd = _open_dir(root, None)
    try:
        for name in parts[:-1]:
            sub = _open_dir(name, fd)
            os.close(fd)
            fd = sub
        return open_regular(parts[-1], dir_fd=fd)
    finally:
        os.close(fd)


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
