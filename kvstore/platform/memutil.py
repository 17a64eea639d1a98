"""Platform memory primitives, each with a fallback where the platform lacks it.

:func:`prefault` makes fresh pages present and writable before they are first
written. A restore into new memory otherwise takes one page fault per 4 KiB page,
inside the kernel's copy from the page cache; Linux (5.14 and later) can do that work
in one loop per range (``madvise(MADV_POPULATE_WRITE)``), for less CPU. Elsewhere it
does nothing and the copy takes the faults as before: only speed differs, never what
is restored.

:func:`release_file_pages` drops a process's resident pages of a memory-mapped file
(LMDB's index): a scan of the whole index then holds a bounded number of its pages,
not all of them. Linux only (``/proc/self/maps`` and ``madvise(MADV_DONTNEED)``);
elsewhere it does nothing, and only the scan's memory differs, never its results.
"""

import ctypes
import mmap
import os
import sys
from typing import Iterable, List, Optional, Tuple

PAGE = mmap.PAGESIZE
_MADV_POPULATE_WRITE = 23  # Linux 5.14+
_MADV_DONTNEED = 4
_MAPS = "/proc/self/maps"


class _Libc:
    """The C library's ``madvise`` and ``mincore``, loaded on first use (Linux only)."""

    def __init__(self):
        self.lib = None
        self.populate = sys.platform.startswith("linux")
        self.release = sys.platform.startswith("linux")

    def get(self):
        if self.lib is None and (self.populate or self.release):
            try:
                lib = ctypes.CDLL(None, use_errno=True)
                lib.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
                lib.madvise.restype = ctypes.c_int
                lib.mincore.argtypes = [
                    ctypes.c_void_p,
                    ctypes.c_size_t,
                    ctypes.c_void_p,
                ]
                lib.mincore.restype = ctypes.c_int
                self.lib = lib
            except (OSError, AttributeError):
                self.populate = self.release = False
        return self.lib


_LIBC = _Libc()


def prefault_supported() -> bool:
    """Whether :func:`prefault` can do anything here (tests turn it off with
    ``monkeypatch.setattr(memutil._LIBC, "populate", False)``)."""
    return _LIBC.get() is not None and _LIBC.populate


def disable_prefault() -> None:
    """Make :func:`prefault` a no-op in this process (the bench measures restores
    without it)."""
    _LIBC.populate = False


def disable_release() -> None:
    """Make :func:`release_file_pages` a no-op in this process (macOS's path)."""
    _LIBC.release = False


def file_mappings(path: str) -> List[Tuple[int, int]]:
    """``(start, end)`` of this process's mappings of file ``path`` (empty where the
    platform cannot tell: no ``/proc/self/maps``, or release is off)."""
    if _LIBC.get() is None or not _LIBC.release:
        return []
    target = os.path.realpath(path)
    out = []
    try:
        with open(_MAPS) as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[5].rstrip("\n") == target:
                    start, end = (int(x, 16) for x in fields[0].split("-"))
                    out.append((start, end))
    except OSError:  # no /proc here after all
        _LIBC.release = False
        return []
    return out


def resident_file_bytes() -> Optional[int]:
    """Bytes of this process's resident pages that are backed by files (its mapped
    files, the index's among them; shared memory too): ``/proc/self/statm``'s third
    field. None where there is no ``/proc`` (macOS): the caller cannot tell."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[2]) * PAGE
    except (OSError, ValueError, IndexError):
        return None


def release_ranges(ranges: Iterable[Tuple[int, int]]) -> bool:
    """Drop this process's resident pages of shared file mappings (``(start, end)``,
    from :func:`file_mappings`, which must still be those mappings).

    Touching them again reads them back from the page cache (the data of a shared
    file mapping lives there, never only in the process), so this is safe while the
    mapping is in use, by LMDB say. Returns whether anything was released.
    """
    lib = _LIBC.get()
    if lib is None or not _LIBC.release:
        return False
    done = False
    for start, end in ranges:
        done |= lib.madvise(start, end - start, _MADV_DONTNEED) == 0
    return done


def release_file_pages(path: str) -> bool:
    """:func:`release_ranges` of every mapping of file ``path`` (looked up now)."""
    return release_ranges(file_mappings(path))


def prefault(ranges: Iterable[Tuple[int, int]]) -> bool:
    """Make the pages of every ``(address, length)`` range present and writable.

    Addresses are rounded down to a page. Returns False, having done nothing more,
    once the kernel refuses (older than 5.14): callers stop asking.
    """
    lib = _LIBC.get()
    if lib is None or not _LIBC.populate:
        return False
    for address, length in ranges:
        start = address - address % PAGE
        if lib.madvise(start, length + address - start, _MADV_POPULATE_WRITE) != 0:
            _LIBC.populate = False  # EINVAL: no MADV_POPULATE_WRITE in this kernel
            return False
    return True


def resident(address: int) -> Optional[bool]:
    """Whether the page holding ``address`` is present (None where unknown): memory
    a process reuses is, fresh memory is not."""
    lib = _LIBC.get()
    if lib is None:
        return None
    vec = (ctypes.c_ubyte * 1)()
    if lib.mincore(address - address % PAGE, PAGE, vec) != 0:
        return None
    return bool(vec[0] & 1)
