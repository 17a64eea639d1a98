"""Disk-space reservations of saves in flight, in the index's ``reservations`` DB.

A writer reserves the bytes of a save's files before writing them and drops the
reservation in the transaction that indexes them, so the budget arithmetic
(:func:`kvstore.maintenance.make_room`) sees files that exist on disk but not yet in
the index. A reservation is keyed by its process (pid and start time) and a counter;
one whose process is gone, or older than :data:`STALE_SECONDS`, no longer counts.

Start times come from ``/proc`` on Linux and from ``sysctl(KERN_PROC_PID)`` on macOS,
so a pid reused by another process is told apart. Where neither answers, the start
time is 0 and only the pid is checked: a dead writer's reservation whose pid was
reused keeps counting until :data:`STALE_SECONDS` after it was made (the budget is
stricter for that long; nothing is lost).
"""

import ctypes
import itertools
import os
import struct
import sys
import threading
import time
from typing import Dict, List, NamedTuple, Optional, Set, Tuple

from ..platform.fsutil import load_libc
from .index import Index

# A save reserved this long ago is taken for a leftover even if its process lives.
STALE_SECONDS = 600.0

_KEY = struct.Struct(">IQQ")  # pid, process start time (0: unknown), counter
_VALUE = struct.Struct("<qd")  # bytes, when reserved (Unix seconds)

_counter = itertools.count(1)
_live: Set[bytes] = set()  # this process's reservations not yet released
_live_lock = threading.Lock()
_identity: Dict[int, int] = {}  # pid -> start time: a forked child reads its own


class Reservation(NamedTuple):
    """One reservation as stored."""

    key: bytes
    pid: int
    start: int
    nbytes: int
    when: float


def process_start_time(pid: int) -> Optional[int]:
    """An identifier of when process ``pid`` started, None if unknown or gone.

    Linux: clock ticks since boot (``/proc/<pid>/stat`` field 22). macOS:
    microseconds since the epoch (``kinfo_proc``'s ``p_starttime``). Compared only
    with values read on the same machine.
    """
    start = _proc_start_time(pid)
    if start is None and sys.platform == "darwin":
        start = _parse_kinfo(_darwin_kinfo(pid))
    return start


def _proc_start_time(pid: int) -> Optional[int]:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: count from its end.
    try:
        return int(stat[stat.rindex(b")") + 2 :].split()[19])
    except (ValueError, IndexError):
        return None


# sysctl(CTL_KERN, KERN_PROC, KERN_PROC_PID, pid) fills a struct kinfo_proc (648
# bytes on 64-bit macOS) whose first field, kp_proc.p_un.__p_starttime, is a struct
# timeval: tv_sec (8 bytes), tv_usec (4 bytes). The same field psutil reads.
_KINFO_MIB = (1, 14, 1)
_KINFO_SIZE = 648
_TIMEVAL = struct.Struct("=qi")


def _darwin_kinfo(pid: int) -> bytes:
    """The ``kinfo_proc`` of ``pid`` (empty: no such process, or sysctl failed)."""
    libc = load_libc()
    if libc is None or not hasattr(libc, "sysctl"):
        return b""
    mib = (ctypes.c_int * 4)(*_KINFO_MIB, pid)
    buf = ctypes.create_string_buffer(_KINFO_SIZE)
    size = ctypes.c_size_t(_KINFO_SIZE)
    if libc.sysctl(mib, 4, buf, ctypes.byref(size), None, ctypes.c_size_t(0)) != 0:
        return b""
    return buf.raw[: size.value]


def _parse_kinfo(raw: bytes) -> Optional[int]:
    """Start time (microseconds since the epoch) from a ``kinfo_proc``; None when
    there is none (sysctl returns no bytes for a pid that does not exist)."""
    if len(raw) < _TIMEVAL.size:
        return None
    sec, usec = _TIMEVAL.unpack_from(raw, 0)
    if sec <= 0 or not 0 <= usec < 1_000_000:
        return None
    return sec * 1_000_000 + usec


def _own_identity() -> Tuple[int, int]:
    pid = os.getpid()
    if pid not in _identity:
        _identity[pid] = process_start_time(pid) or 0
    return pid, _identity[pid]


def own_identity() -> Tuple[int, int]:
    """``(pid, start time)`` of this process, as :func:`process_alive` takes them (a
    start time of 0: unknown here)."""
    return _own_identity()


def process_alive(pid: int, start: int) -> bool:
    """Whether the process that made a reservation still runs.

    Compares start times where the platform shows them (a reused pid is another
    process), otherwise only asks whether some process has the pid.
    """
    now_start = process_start_time(pid) if start else None
    if now_start is not None:
        return now_start == start
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process, alive
    except OSError:
        return False
    return True


def key_for(pid: int, start: int, counter: int) -> bytes:
    """The key of reservation ``counter`` of process ``pid`` started at ``start``."""
    return _KEY.pack(pid, start, counter)


def new_key() -> bytes:
    """A key unique to this process and save, live until :func:`forget` is called."""
    key = key_for(*_own_identity(), next(_counter))
    with _live_lock:
        _live.add(key)
    return key


def put(index: Index, txn, key: bytes, nbytes: int, *, now: Optional[float] = None):
    """Record (or resize) reservation ``key`` of ``nbytes`` in a write transaction."""
    when = time.time() if now is None else now
    txn.put(key, _VALUE.pack(nbytes, when), db=index.db["reservations"])


def delete(index: Index, txn, key: bytes) -> None:
    """Drop reservation ``key`` (if still there) in a write transaction."""
    txn.delete(key, db=index.db["reservations"])


def forget(key: bytes) -> None:
    """This process no longer holds ``key`` (after the transaction deleting it)."""
    with _live_lock:
        _live.discard(key)


def listed(index: Index, txn) -> List[Reservation]:
    """Every reservation in the index, stale or not (malformed ones included as stale:
    pid 0, time 0)."""
    out = []
    for k, v in txn.cursor(db=index.db["reservations"]):
        k, v = bytes(k), bytes(v)
        if len(k) != _KEY.size or len(v) != _VALUE.size:
            out.append(Reservation(k, 0, 0, 0, 0.0))
            continue
        pid, start, _ = _KEY.unpack(k)
        nbytes, when = _VALUE.unpack(v)
        out.append(Reservation(k, pid, start, max(0, nbytes), when))
    return out


def is_stale(res: Reservation, *, now: float) -> bool:
    """Whether ``res`` is a leftover: its process is gone (or is this very process,
    which no longer holds it), or it is older than :data:`STALE_SECONDS`."""
    if res.pid == 0 or now - res.when > STALE_SECONDS:
        return True
    if (res.pid, res.start) == _own_identity():
        with _live_lock:
            return res.key not in _live
    return not process_alive(res.pid, res.start)


def live_bytes(index: Index, txn, *, now: Optional[float] = None) -> int:
    """Bytes of the live reservations; stale ones are deleted (a write transaction)."""
    now = time.time() if now is None else now
    total = 0
    for res in listed(index, txn):
        if is_stale(res, now=now):
            delete(index, txn, res.key)
        else:
            total += res.nbytes
    return total


def drop_stale(index: Index, *, now: Optional[float] = None) -> int:
    """Delete every stale reservation (this process's leftovers included). Returns how
    many went."""
    now = time.time() if now is None else now

    def find(txn):
        return [res for res in listed(index, txn) if is_stale(res, now=now)]

    def drop(txn):
        stale = find(txn)
        for res in stale:
            delete(index, txn, res.key)
        return len(stale)

    # Mostly there are none: a read transaction does not wait for LMDB's writer lock
    # (held by another process's commit, say) as opening a store would.
    if not index.read(find):
        return 0
    return index.write(drop)
