"""Opening an index directory as kvstore's LMDB environment, after checking it.

LMDB trusts the files it is given: a ``data.mdb`` shorter than the pages its meta page
names kills the process with SIGBUS at the first read past the end, a FIFO blocks the
open for ever, and another program's environment opens as well as kvstore's (and
would be written into). So before LMDB maps anything, :func:`open_env` checks that the
directory and its files are regular and ``data.mdb`` is whole; then that the pages
LMDB's open reads are sound (:func:`open_env`'s ``check``; :func:`check_index_pages`
checks every page before a whole-index scan); after opening, that the
environment holds kvstore's databases of this format version, or nothing at all (only
then is it initialized). A read-only open writes nothing, not even LMDB's lock file.

``lock.mdb`` is LMDB's only means of coordinating processes: deleted while a process
uses it, the next process to open the store makes a new one and two writers overwrite
each other's commits. Every process that has an index open holds a shared record lock
on kvstore's own ``kvstore.lock`` (:class:`_Holder`), so a process finding
``lock.mdb`` missing can tell whether anybody still uses the old one, and refuses to
open then; a process whose ``lock.mdb`` vanished stops writing
(:meth:`kvstore.disk.index.Index.check_lock_file`).
"""

import errno
import os
import stat
import time
from contextlib import contextmanager
from typing import (
    Callable,
    Dict,
    Iterator,
    NamedTuple,
    Optional,
    Sequence,
    Tuple,
    TypeVar,
)

import lmdb

from ..platform import fsutil
from . import mdbcheck, mdbfile


class StoreError(Exception):
    """The store directory cannot be used (not a store, other format version...)."""


class IndexDamaged(StoreError):
    """``index/data.mdb`` holds pages LMDB did not write there (:mod:`.mdbcheck`):
    ``kvstore verify --fix`` salvages it (:mod:`kvstore.maintenance.salvage`)."""

    def __init__(self, message: str, problem: str):
        super().__init__(message)
        self.problem = problem  # what is damaged, without the advice


def damaged(store: str, problem: str) -> IndexDamaged:
    """The one-line error for a damaged index, with what to do about it."""
    return IndexDamaged(
        f"{store}: index/data.mdb is damaged ({problem}): `kvstore verify --fix` "
        "salvages every record it can still read into a new index and moves the "
        "damaged one aside",
        problem,
    )


LOCK_FILE = "kvstore.lock"
_OPENING, _HOLDING = 0, 1  # bytes of LOCK_FILE: one opener at a time; every holder
_RACES = 3  # checks of a data.mdb whose meta page changed (a commit) meanwhile
_T = TypeVar("_T")
RESIZED_TRIES = 64  # transactions begun in a row while other processes grow the map
CHECKS = ("roots", "full")  # open_env's page checks: bounded, or every page


class Opened(NamedTuple):
    env: lmdb.Environment
    dbs: Dict[str, object]  # name -> database handle (read-only: those that exist)
    lock_fd: Optional[int]  # LOCK_FILE, held shared until closed
    lock_id: Optional[tuple]  # (st_dev, st_ino) of lock.mdb as opened
    format_version: int  # the store's, as its meta database records it


def store_name(index_path: str) -> str:
    """The store directory of an index directory, as messages name it."""
    return os.path.dirname(os.path.normpath(index_path)) or "."


def open_env(
    path: str,
    *,
    dbs: Sequence[str],
    create: bool,
    readonly: bool,
    map_size: int,
    format_version: int,
    reads: Sequence[int] = (),
    check: str = "roots",
) -> Opened:
    """Check the index directory ``path`` and open it (see the module docstring).

    ``format_version`` is what a new index records; a store of that version or of
    one in ``reads`` opens, any other is refused.

    ``check`` is how much of ``data.mdb`` is checked before LMDB reads it
    (:mod:`.mdbcheck`): ``"roots"`` the meta pages, the main database, small
    trees whole and each large tree's root page (a time that does not grow with
    the index; :class:`kvstore.disk.index.Index` checks the rest in the
    background); ``"full"`` every page a read can reach, for an open followed by a
    scan of the whole index.

    Raises:
        StoreError: with one line naming the store and the problem.
    """
    store = store_name(path)
    if check not in CHECKS:
        raise ValueError(f"check must be one of {CHECKS}, not {check!r}")
    _check_dir(path, store, create=create and not readonly)
    data = os.path.join(path, "data.mdb")
    lock = os.path.join(path, "lock.mdb")
    data_size = check_data_file(data, store)
    lock_exists = _check_regular(lock, store, "index/lock.mdb")
    new = not data_size  # LMDB initializes an empty data.mdb as a new environment
    if new and (readonly or not create):
        raise StoreError(f"{store}: no kvstore index here")
    if not readonly:
        denied = _not_writable(path, data if data_size is not None else None, lock)
        if denied:
            raise StoreError(
                f"{store}: the store is read-only (no write permission on {denied})"
            )
    # A store that has no LOCK_FILE yet gets one only once it is known to be kvstore's.
    holder = _Holder.take(path, store, create=new and not readonly)
    try:
        if not lock_exists and not new and holder is not None and not holder.alone():
            raise StoreError(
                f"{store}: index/lock.mdb is missing while another process has the "
                "store open (LMDB cannot keep writers apart without it): stop the "
                "processes using the store, then open it again"
            )
        use_lock = not readonly or (lock_exists and os.access(lock, os.W_OK))
        try:
            # py-lmdb's own open reads the map too: another process growing it then
            # is MDB_MAP_RESIZED, and opening again reads the new size.
            env = _while_resized(
                store,
                lambda: lmdb.open(
                    path,
                    map_size=map_size,
                    max_dbs=len(dbs),
                    subdir=True,
                    readahead=False,
                    readonly=readonly,
                    lock=use_lock,
                    create=False,
                    mode=0o644,
                ),
            )
        except lmdb.Error as e:
            raise StoreError(
                f"{store}: cannot open the index: {_lmdb_reason(e)}"
            ) from None
        try:
            # Another process grew the map while this one opened it: adopt its size
            # (no transaction of this new environment is active).

            def read():  # the pages LMDB's open reads are checked before it does
                _check_pages(env, data, store, full=check == "full")
                return _open_dbs(
                    env,
                    store,
                    dbs,
                    readonly=readonly,
                    format_version=format_version,
                    reads=reads,
                )

            handles, version = _while_resized(
                store, read, on_resized=lambda: env.set_mapsize(0)
            )
            lock_id = None
            if use_lock:
                st = os.stat(lock)
                lock_id = (st.st_dev, st.st_ino)
        except lmdb.MapResizedError:
            env.close()
            raise
        except lmdb.Error as e:  # what the page check cannot see (a bad key's bytes)
            env.close()
            raise damaged(store, f"{type(e).__name__}: {e}") from None
        except BaseException:
            env.close()
            raise
        if holder is None and not readonly:
            holder = _Holder.take(path, store, create=True)  # now known to be ours
        if holder is not None:
            holder.hold()
    except BaseException:
        if holder is not None:
            holder.close()
        raise
    finally:
        if holder is not None:
            holder.done_opening()
    lock_fd = holder.fd if holder is not None else None
    return Opened(env, handles, lock_fd, lock_id, version)


def _while_resized(store: str, attempt: Callable[[], _T], *, on_resized=None) -> _T:
    """``attempt()``, tried again (``RESIZED_TRIES`` times in all, ``on_resized()``
    before each new try) while it meets MDB_MAP_RESIZED: another process growing
    the map."""
    for _ in range(RESIZED_TRIES - 1):
        try:
            return attempt()
        except lmdb.MapResizedError:
            if on_resized is not None:
                on_resized()
    try:
        return attempt()
    except lmdb.MapResizedError:
        raise StoreError(f"{store}: the LMDB map keeps being resized") from None


def check_data_file(path: str, store: str) -> Optional[int]:
    """The size of ``data.mdb`` (None: missing) once it is known that LMDB can map it:
    a regular file whose meta pages are LMDB's and that holds every page LMDB reads
    (the pages past its end, if any, are free: :mod:`kvstore.disk.mdbfile`)."""
    if not _check_regular(path, store, "index/data.mdb"):
        return None
    try:
        fd = fsutil.open_regular(path)
    except fsutil.NotRegularFile:
        raise StoreError(f"{store}: index/data.mdb is not a regular file") from None
    try:
        whole, problem = True, None
        for _ in range(_RACES):
            # The meta page before the size: a commit writes its pages, then its meta.
            meta = mdbfile.newest_meta(fd)
            size = os.fstat(fd).st_size
            if size == 0:
                return 0
            if not meta:
                raise StoreError(
                    f"{store}: index/data.mdb is not an LMDB file ({size} bytes); not "
                    "a kvstore store"
                )
            problem = mdbcheck.meta_problem(mdbcheck.read_meta_pages(fd))
            if problem is not None:
                if mdbfile.newest_meta(fd) != meta:
                    continue  # a commit raced the reads
                raise damaged(store, problem)
            if size >= (max(2, meta.last_page + 1)) * meta.page_size:
                return size
            whole = mdbfile.unwritten_pages_are_free(fd, meta, size)
            if mdbfile.newest_meta(fd) == meta:  # else a commit raced the check
                break
        if problem is not None:
            raise damaged(store, problem)
        if not whole:
            need = (meta.last_page + 1) * meta.page_size
            raise StoreError(
                f"{store}: index/data.mdb is truncated ({size} bytes; LMDB would read "
                f"pages up to {need}): restore it from a copy, or move index/ aside to "
                "start a new index (the chunk files become orphans that `kvstore gc` "
                "removes)"
            )
        return size
    finally:
        os.close(fd)


def check_index_pages(env: lmdb.Environment, path: str) -> int:
    """Check every page a read transaction of ``env`` (the open index directory
    ``path``) can reach, before a scan of the whole index steps onto one: a damaged
    page would end the process in liblmdb (:func:`kvstore.disk.mdbcheck.check_file`). Its
    time grows with the index (tens of microseconds a page).

    Returns:
        The number of pages checked.

    Raises:
        IndexDamaged: with one line naming the store, the page and the way back.
    """
    return _check_pages(env, os.path.join(path, "data.mdb"), store_name(path))


def _check_pages(
    env: lmdb.Environment, data: str, store: str, *, full: bool = True
) -> int:
    """Check the pages of ``env``'s ``data.mdb`` that a read transaction can reach
    (``full``) or the bounded set of :func:`kvstore.disk.mdbcheck.check_roots`, before
    LMDB reads them. Returns the number of pages checked.

    The walk runs inside a read transaction, so no writer reuses the pages it reads.
    """
    fd = fsutil.open_regular(data)
    try:
        for _ in range(_RACES):
            with env.begin() as txn:
                txnid = txn.id()
                metas = mdbcheck.read_meta_pages(fd)
                problem = mdbcheck.meta_problem(metas)
                if problem is not None:
                    raise damaged(store, problem)
                mine = [m for m in metas if m.txnid == txnid]
                if not mine:
                    continue  # two commits since the transaction began: again
                walk = mdbcheck.check_file if full else mdbcheck.check_roots
                try:
                    return walk(fd, mine[0], os.fstat(fd).st_size)
                except mdbcheck.Damage as e:
                    raise damaged(store, str(e)) from None
        raise StoreError(f"{store}: the index changed too fast to be checked")
    finally:
        os.close(fd)


def _check_dir(path: str, store: str, *, create: bool) -> None:
    try:
        mode = os.lstat(path).st_mode
    except NotADirectoryError:
        raise StoreError(f"{store}: no kvstore here (not a directory)") from None
    except FileNotFoundError:
        if not create:
            raise StoreError(f"{store}: no kvstore index here") from None
        try:
            fsutil.makedirs(path)
        except OSError as e:
            raise StoreError(f"{store}: cannot create index/: {e.strerror}") from None
        return
    if stat.S_ISLNK(mode):
        raise StoreError(
            f"{store}: index is a symbolic link; kvstore follows no links inside a store"
        )
    if not stat.S_ISDIR(mode):
        raise StoreError(f"{store}: index is not a directory; not a kvstore store")


def _check_regular(path: str, store: str, name: str) -> bool:
    """Whether ``path`` exists; StoreError if it is not a regular file."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return False
    if not stat.S_ISREG(mode):
        raise StoreError(f"{store}: {name} is {_kind(mode)}, not a regular file")
    return True


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return "a device"


def _not_writable(path: str, data: Optional[str], lock: str) -> Optional[str]:
    """The first of the index directory and its files that cannot be written, or None."""
    if not os.access(path, os.W_OK | os.X_OK):
        return path
    for f in (data, lock):
        if f is not None and os.path.exists(f) and not os.access(f, os.R_OK | os.W_OK):
            return f
    return None


def _lmdb_reason(e: lmdb.Error) -> str:
    text = str(e)
    if isinstance(e, lmdb.InvalidError):
        return "index/data.mdb is not an LMDB file; not a kvstore store"
    if isinstance(e, lmdb.VersionMismatchError):
        return f"LMDB version mismatch ({text})"
    return text


def _open_dbs(
    env,
    store: str,
    names: Sequence[str],
    *,
    readonly: bool,
    format_version: int,
    reads: Sequence[int],
) -> Tuple[Dict[str, object], int]:
    """Handles of kvstore's databases and the store's format version, after checking
    that the environment holds nothing else; an empty environment is initialized
    with ``format_version`` (never a read-only one)."""
    with env.begin() as txn:
        keys = {bytes(k) for k, _ in txn.cursor()}
    wanted = {n.encode() for n in names}
    foreign = sorted(keys - wanted)
    if foreign:
        raise StoreError(
            f"{store}: not a kvstore store: its index is another program's LMDB "
            f"database (it holds {foreign[0][:40]!r}{' and more' if len(foreign) > 1 else ''})"
        )
    handles = {}
    try:
        for name in names:
            if name.encode() in keys:
                handles[name] = env.open_db(name.encode(), create=False)
    except lmdb.MapResizedError:
        raise
    except lmdb.Error:  # a plain key of that name, not a database (MDB_INCOMPATIBLE)
        raise StoreError(
            f"{store}: not a kvstore store: its index is another program's LMDB database"
        ) from None
    with env.begin() as txn:
        version = None
        if "meta" in handles:
            raw = txn.get(b"format_version", db=handles["meta"])
            version = None if raw is None else bytes(raw)
        held = any(txn.stat(db)["entries"] for db in handles.values())
    known = sorted({format_version, *reads})
    if version is not None:
        text = version.decode("ascii", "replace")
        if not version.isdigit() or int(version) not in known:
            shown = (
                text if text.isprintable() and len(text) <= 20 else repr(version[:20])
            )
            readable = " and ".join(str(v) for v in known)
            raise StoreError(
                f"{store}: store format version {shown}, this kvstore reads version "
                f"{readable}"
            )
    elif held:
        raise StoreError(
            f"{store}: not a kvstore store: its index holds data but no format version"
        )
    elif readonly:
        if not keys:
            # Made, then killed before its first commit (a crash while the store was
            # being created): an empty store. Every database reads as LMDB's main one,
            # which holds nothing either.
            main = env.open_db(None, create=False)
            return {name: main for name in names}, format_version
        raise StoreError(f"{store}: no kvstore index here (the index is empty)")
    missing = [n for n in names if n not in handles]
    if missing and not readonly:
        # A new index (or one made before a database was added): all in one commit.
        with env.begin(write=True) as txn:
            for name in missing:
                handles[name] = env.open_db(name.encode(), txn=txn)
            meta = handles["meta"]
            txn.put(
                b"format_version",
                str(format_version).encode(),
                db=meta,
                overwrite=False,
            )
            txn.put(b"created", repr(time.time()).encode(), db=meta, overwrite=False)
            version = bytes(txn.get(b"format_version", db=meta))
    # No version only where every database exists and holds nothing (made by a
    # kvstore that crashed while creating it): opened as before, as a new index.
    return handles, format_version if version is None else int(version)


class _Holder:
    """This process's record locks on ``index/kvstore.lock``: byte 0 while opening
    (openers queue), byte 1 shared for as long as the index is open."""

    def __init__(self, fd: int):
        self.fd = fd
        self._opening = True

    @classmethod
    def take(cls, path: str, store: str, *, create: bool) -> Optional["_Holder"]:
        """Open the lock file and wait for the other openers; None where it cannot be
        opened for writing (a read-only directory, or not created yet)."""
        flags = os.O_RDWR | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
        flags |= getattr(os, "O_NONBLOCK", 0) | (os.O_CREAT if create else 0)
        try:
            fd = os.open(os.path.join(path, LOCK_FILE), flags, 0o644)
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.EMLINK, errno.ENXIO, errno.EISDIR):
                raise StoreError(
                    f"{store}: index/{LOCK_FILE} is not a regular file"
                ) from None
            return None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise StoreError(f"{store}: index/{LOCK_FILE} is not a regular file")
        fsutil.lock_byte(fd, _OPENING, exclusive=True, blocking=True)
        return cls(fd)

    def alone(self) -> bool:
        """Whether no other process holds the index open (checked while opening)."""
        if not fsutil.lock_byte(self.fd, _HOLDING, exclusive=True, blocking=False):
            return False
        fsutil.unlock_byte(self.fd, _HOLDING)
        return True

    def hold(self) -> None:
        fsutil.lock_byte(self.fd, _HOLDING, exclusive=False, blocking=True)

    def done_opening(self) -> None:
        if self._opening and self.fd >= 0:
            self._opening = False
            fsutil.unlock_byte(self.fd, _OPENING)

    def close(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)


@contextmanager
def alone(path: str) -> Iterator[None]:
    """No other process has the index directory ``path`` open, nor opens it until the
    block ends (its openers wait): for replacing the whole index.

    Raises:
        StoreError: another process has it open.
    """
    store = store_name(path)
    holder = _Holder.take(path, store, create=True)
    if holder is None:
        raise StoreError(f"{store}: cannot lock index/{LOCK_FILE}")
    try:
        if not holder.alone():
            raise StoreError(
                f"{store}: another process has the store open: stop it first"
            )
        yield
    finally:
        holder.close()


def check_store_dirs(path: str) -> None:
    """StoreError if the store's own subdirectories (where present) are not real
    directories: a symlink there would lead reads, writes or quarantine moves out."""
    for name in ("index", "blobs", "quarantine"):
        try:
            mode = os.lstat(os.path.join(path, name)).st_mode
        except (FileNotFoundError, NotADirectoryError):  # the caller tells why
            continue
        if stat.S_ISLNK(mode):
            raise StoreError(
                f"{path}: {name} is a symbolic link; kvstore follows no links inside a "
                "store"
            )
        if not stat.S_ISDIR(mode):
            raise StoreError(f"{path}: {name} is not a directory; not a kvstore store")
