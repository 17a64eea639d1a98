"""Platform memory primitives, each with a fallback where the platform lacks it.

:func:`prefault` makes fresh pages present and writable before they are first
written. A restore into new memory otherwise takes one page fault per 4 KiB page,
inside the kernel's copy from the page cache; Linux (5.14 and later) can do that work
in one loop per range (``madvise(MADV_POPULATE_WRITE)``), for less CPU. Elsewhere it
does nothing and the copy takes the faults as before: only speed differs, never what
is restored.
"""

import ctypes
import mmap
import sys
from typing import Iterable, Optional, Tuple

PAGE = mmap.PAGESIZE
_MADV_POPULATE_WRITE = 23  # Linux 5.14+


class _Libc:
    """The C library's ``madvise`` and ``mincore``, loaded on first use (Linux only)."""

    def __init__(self):
        self.lib = None
        self.populate = sys.platform.startswith("linux")

    def get(self):
        if self.lib is None and self.populate:
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
                self.populate = False
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
