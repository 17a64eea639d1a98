"""The LMDB index: nodes of the token-chunk trie, trie edges, access times, pins,
namespaces, per-namespace counters and the disk reservations of saves in flight
(:mod:`kvstore.disk.reservations`). Knows nothing about tensors.

Keys are fixed-width bytes so that a namespace's entries are contiguous and a
node's children sort by their first tokens (see :func:`child_key`).
"""

import json
import logging
import os
import struct
import threading
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import lmdb
import numpy as np

from ..platform import memutil
from ..platform.gate import Gate
from . import cleanmark, mdbcheck, spare, storecheck
from .chunking import HASH_BYTES, common_prefix
from .pageguard import PageAudit
from .storecheck import IndexDamaged, StoreError

log = logging.getLogger("kvstore")

# Of the store directory (meta db); records carry their own. A new store gets
# FORMAT_VERSION; every version in READ_FORMATS still opens. Version 1 spread node
# files over 256 directories per namespace, version 2 over 4,096
# (kvstore.disk.blobs.FANOUT_CHARS): a million files then share no big directory.
FORMAT_VERSION = 2
READ_FORMATS = (1, 2)
RECORD_VERSION = 2  # 2 added the optional state (checkpoint) file; 1 still decodes
KINDS = ("assistant", "user", "system")  # eviction order: first goes first
CHILD_KEY_TOKENS = 64  # first tokens of a child kept in its edge key
# In the meta database: a model key (kvstore.disk.namespace.model_key) -> its namespace.
# Kept there rather than in a database of its own, which kvstore versions that do not
# know it would take for another program's.
MODEL_KEY_PREFIX = b"model-key:"
_PAD = b"\xff\xff\xff\xff"  # sorts after every big-endian token id < 2**31
_MAX_MAP = 1 << 40
DEFAULT_MAP_SIZE = 64 << 20
INITIAL_MAP_ENV = "KVSTORE_INITIAL_MAP_BYTES"
_RESIZED_TRIES = storecheck.RESIZED_TRIES

# What liblmdb answers when it meets a page it did not write (the page check at open
# saw none: the file was damaged since).
_DAMAGE_ERRORS = (lmdb.CorruptedError, lmdb.PageNotFoundError)

_OPEN: Dict[Tuple[str, int], "_Env"] = {}
_OPEN_LOCK = threading.Lock()


class CorruptRecord(Exception):
    """An index record failed validation."""


@dataclass(frozen=True)
class NodeRecord:
    """One trie node: a span of tokens whose KV lives in one blob file."""

    parent: bytes
    start: int  # position of the node's first token in the prompt
    tokens: np.ndarray  # int32 token ids of this node only
    nbytes: int  # size of the blob file
    checksum: int  # xxh3_64 of the whole blob file
    kind: str = "user"
    pinned: bool = False
    created: float = 0.0
    state_nbytes: int = 0  # size of the node's state file; 0: no checkpoint
    state_checksum: int = 0

    @property
    def ntokens(self) -> int:
        return len(self.tokens)

    @property
    def has_state(self) -> bool:
        return self.state_nbytes > 0

    @property
    def total_bytes(self) -> int:
        """Bytes of the node's files on disk (delta file and state file)."""
        return self.nbytes + self.state_nbytes

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)

    @property
    def counts(self) -> Tuple[int, int, int, int]:
        """What the node adds to its namespace's counters (:attr:`Index.COUNTERS`):
        nodes, tokens, bytes, pinned bytes."""
        return 1, self.ntokens, self.total_bytes, self.total_bytes * self.pinned

    def same_files(self, other: "NodeRecord") -> bool:
        """Whether ``other`` records the same node files (a pin or kind change keeps
        them; a node evicted and saved again has another record)."""
        return (
            self.parent == other.parent
            and self.start == other.start
            and (self.nbytes, self.checksum, self.created)
            == (other.nbytes, other.checksum, other.created)
            and (self.state_nbytes, self.state_checksum)
            == (other.state_nbytes, other.state_checksum)
            and np.array_equal(self.tokens, other.tokens)
        )

    _HEAD = struct.Struct("<BBBxIIQQd16s")
    _STATE = struct.Struct("<QQ")  # version 2: state file size and checksum

    def encode(self) -> bytes:
        head = self._HEAD.pack(
            RECORD_VERSION,
            KINDS.index(self.kind),
            int(self.pinned),
            self.start,
            len(self.tokens),
            self.nbytes,
            self.checksum,
            self.created,
            self.parent,
        )
        state = self._STATE.pack(self.state_nbytes, self.state_checksum)
        return head + state + np.ascontiguousarray(self.tokens, dtype="<i4").tobytes()

    @classmethod
    def decode(cls, raw: bytes) -> "NodeRecord":
        size = cls._HEAD.size
        if len(raw) < size:
            raise CorruptRecord(f"record of {len(raw)} bytes is shorter than {size}")
        version, kind, flags, start, n, nbytes, checksum, created, parent = (
            cls._HEAD.unpack_from(raw)
        )
        state_nbytes = state_checksum = 0
        if version == RECORD_VERSION:
            if len(raw) < size + cls._STATE.size:
                raise CorruptRecord(f"record of {len(raw)} bytes has no state field")
            state_nbytes, state_checksum = cls._STATE.unpack_from(raw, size)
            size += cls._STATE.size
        elif version != 1:
            raise CorruptRecord(f"record format {version}, expected {RECORD_VERSION}")
        if kind >= len(KINDS) or flags > 1:
            raise CorruptRecord(f"record kind {kind} / flags {flags} out of range")
        if len(raw) != size + 4 * n or n == 0:
            raise CorruptRecord(
                f"record holds {len(raw) - size} token bytes, not {4 * n}"
            )
        tokens = np.frombuffer(raw, dtype="<i4", offset=size)
        return cls(
            parent,
            start,
            tokens,
            nbytes,
            checksum,
            KINDS[kind],
            bool(flags),
            created,
            state_nbytes,
            state_checksum,
        )


def _clear_stale_readers(env: lmdb.Environment) -> int:
    """Free the reader slots of processes that died holding a read transaction.

    A stale slot keeps its snapshot's pages from being reused (the map grows without
    need) and takes one of the reader table's slots. Returns how many were cleared.
    """
    try:
        return env.reader_check()
    except lmdb.Error:  # e.g. a read-only lock file: harmless, LMDB works without it
        return 0


def child_key(
    ns: bytes, parent: bytes, tokens: np.ndarray, child: bytes = b""
) -> bytes:
    """Edge key: namespace, parent, the child's first tokens (big-endian, padded), child.

    Big-endian ids make byte order equal token order, so the child sharing the
    longest prefix with a query sits next to the query's position in the key order.
    """
    head = np.ascontiguousarray(tokens[:CHILD_KEY_TOKENS], dtype=">u4").tobytes()
    head += _PAD * (CHILD_KEY_TOKENS - len(head) // 4)
    return ns + parent + head + child


def initial_map_size() -> int:
    """The map size an index opens with when none is given (see :class:`Index`)."""
    raw = os.environ.get(INITIAL_MAP_ENV)
    if raw is None:
        return DEFAULT_MAP_SIZE
    try:
        size = int(raw)
    except ValueError:
        size = 0
    if not 0 < size <= _MAX_MAP:
        raise ValueError(
            f"{INITIAL_MAP_ENV}={raw!r}: expected a number of bytes up to {_MAX_MAP}"
        )
    return size


class _Env:
    """One process's open LMDB environment of an index directory, shared by every
    :class:`Index` opened on that directory (LMDB allows one per process)."""

    def __init__(
        self, opened: storecheck.Opened, *, path: str, readonly: bool, audit: PageAudit
    ):
        self.path = path
        self.env = opened.env
        self.audit = audit  # the full page check since the open (pageguard)
        self.dbs = opened.dbs
        self.readonly = readonly
        self.lock_fd = opened.lock_fd  # kvstore.lock, held shared while open (or None)
        self.lock_id = opened.lock_id  # (st_dev, st_ino) of lock.mdb as opened
        self.format_version = opened.format_version
        self.refs = 0
        self.problem: Optional[str] = None  # set when lock.mdb was deleted under us
        self.damage: Optional[IndexDamaged] = None  # damage met since the open
        # Every transaction shares it; a map resize runs alone. mdb_env_set_mapsize may
        # only run with no transaction of the process active (LMDB does not check;
        # others then fail with "Invalid argument" or "closed/deleted/dropped object").
        self.gate = Gate(nested="the LMDB map cannot grow inside a transaction")
        # Where the index file is mapped (Index.release_pages); None: not looked up
        # since the last resize, which may move the map.
        self.mapped: Optional[List[Tuple[int, int]]] = None

    def note_damage(self, store: str, problem: str) -> IndexDamaged:
        """Note damage in the index: logged once, and from now on this process
        neither reads nor writes the index (every fetch a miss). Returns the error to
        raise."""
        with _OPEN_LOCK:
            if self.damage is None:
                self.damage = storecheck.damaged(store, problem)
                self.problem = str(self.damage)
                log.error("kvstore: %s; reads and writes stopped", self.damage)
                cleanmark.unlink(self.path)  # the next open checks every page
        return self.damage

    def close(self) -> None:
        if not self.readonly and self.damage is None and self.problem is None:
            try:
                self._leave_mark()
            except Exception:  # a mark is an optimisation: never a failed close
                log.exception("kvstore: %s: leaving the clean mark failed", self.path)
        self.audit.close()  # its thread reads in a transaction: stopped first
        self.env.close()
        if self.lock_fd is not None:
            os.close(self.lock_fd)  # releases this process's record locks on it

    def _leave_mark(self) -> None:
        """Leave the clean mark (:mod:`kvstore.disk.cleanmark`) if the full page
        check passed, after syncing: the mark must never be on disk before the data
        it names."""
        if not self.audit.passed:
            return
        try:
            self.env.sync(True)
        except lmdb.Error as e:
            log.debug("kvstore: %s: no clean mark: %s", self.path, e)
            return
        self.audit.leave_mark()


class Index:
    """The LMDB environment under ``<store>/index``.

    Opening checks the directory before LMDB maps anything (:mod:`kvstore.disk.storecheck`):
    its files must be regular files, ``data.mdb`` an LMDB file holding every page its
    meta page names (a truncated one would kill the process with SIGBUS on a read),
    and its contents kvstore's own databases of a format version this kvstore reads
    (:data:`READ_FORMATS`). Only an empty
    directory, or a store kvstore created, is ever written to.

    Args:
        path: The index directory (created if missing when ``create`` is true).
        create: Create a new index when none exists.
        readonly: Open without ever writing: LMDB's read-only mode, without its lock
            file where the directory is not writable. :meth:`write` then raises.
        map_size: Initial map size; the map doubles when it fills up. None: 64 MiB,
            or the bytes in the environment variable ``KVSTORE_INITIAL_MAP_BYTES``
            (for tests that make the map grow from a tiny start, in every process).
        check: ``"roots"``: the pages LMDB's open reads are checked (meta pages,
            small trees, each large tree's root: a time that does not grow with
            the index), then every page in the background; until that has passed,
            the read path checks its cursors' ranges and writes wait
            (:mod:`kvstore.disk.pageguard`); skipped where the last process to
            close the index had checked it and nothing changed the file since
            (:mod:`kvstore.disk.cleanmark`). ``"full"``: every page a read can
            reach before the open returns, for an open followed by a scan of the
            whole index (the maintenance commands; even where this process has the
            index open already). ``"marked"``: ``"roots"`` where the clean mark
            names the file as it is (every page was checked), else ``"full"``
            (``kvstore serve``'s start). See :mod:`kvstore.disk.mdbcheck`.
        format_version: What a new index records (an existing one keeps its own:
            :attr:`format_version`); a salvage rebuilds an index in its store's.

    Raises:
        StoreError: not a kvstore index, another format version, files that are not
            what LMDB expects, a store without write permission (unless ``readonly``),
            or ``index/lock.mdb`` missing while another process has the index open.
    """

    # A store made by an older kvstore may lack "reservations" (bytes of saves in
    # flight, :mod:`kvstore.disk.reservations`): opening it creates the database.
    DATABASES = (
        "meta",
        "nodes",
        "children",
        "atime",
        "pins",
        "namespaces",
        "counters",
        "reservations",
    )

    def __init__(
        self,
        path: str,
        *,
        create: bool = True,
        readonly: bool = False,
        map_size: Optional[int] = None,
        check: str = "roots",
        format_version: int = FORMAT_VERSION,
    ):
        if format_version not in READ_FORMATS:
            raise ValueError(f"format_version must be one of {READ_FORMATS}")
        self.path = path
        self.readonly = readonly
        self.pid = os.getpid()
        self._key = (os.path.realpath(path), self.pid)
        if check == "marked":
            check = "roots" if cleanmark.names_file(path) else "full"
        self._closed = True
        # LMDB allows one environment per directory and process: stores opened on one
        # path in one process (two models, say) share it.
        with _OPEN_LOCK:
            shared = _OPEN.get(self._key)
            recheck = start = False
            if shared is None:
                opened = storecheck.open_env(
                    path,
                    dbs=self.DATABASES,
                    create=create,
                    readonly=readonly,
                    map_size=map_size or initial_map_size(),
                    format_version=format_version,
                    reads=READ_FORMATS,
                    check=check,
                )
                try:
                    audit = PageAudit(
                        os.path.join(path, "data.mdb"), passed=check == "full"
                    )
                    audit.trust_mark()
                except BaseException:
                    opened.env.close()
                    if opened.lock_fd is not None:
                        os.close(opened.lock_fd)
                    raise
                shared = _Env(opened, path=path, readonly=readonly, audit=audit)
                _clear_stale_readers(shared.env)
                start = True
            elif shared.readonly and not readonly:
                raise StoreError(
                    f"{storecheck.store_name(path)}: the index is open read-only in "
                    "this process; close that first"
                )
            else:
                recheck = check == "full"  # opened here before: maybe bounded only
            shared.refs += 1
            _OPEN[self._key] = shared
        self._shared = shared
        self.env = shared.env
        self.db = shared.dbs
        self._closed = False
        if start:
            store = storecheck.store_name(path)
            shared.audit.start(
                self._read_txn,
                lambda problem: shared.note_damage(store, problem),
                name=store,
            )
        if recheck:
            try:
                self._check_all_pages()
            except BaseException:
                self.close()
                raise
            shared.audit.set_passed()

    def _check_all_pages(self) -> None:
        """:func:`kvstore.disk.storecheck.check_index_pages` on the open environment."""
        for _ in range(_RESIZED_TRIES):
            if self._shared.damage is not None:
                raise self._shared.damage
            with self._shared.gate.shared():
                try:
                    storecheck.check_index_pages(self.env, self.path)
                    return
                except lmdb.MapResizedError:
                    pass
            self._adopt_map_size()
        raise StoreError(f"{self.path}: the LMDB map keeps being resized")

    def release_pages(self) -> None:
        """Drop this process's resident pages of the index file: a scan of every
        record calls it now and then, so it does not hold the whole index in memory
        (:func:`kvstore.platform.memutil.release_file_pages`; safe during transactions).
        Inside the gate: no other thread moves the map between the lookup of its
        address and the release."""
        shared = self._shared
        shared.gate.enter()
        try:
            if shared.mapped is None:  # looked up once per map (a resize forgets it)
                shared.mapped = memutil.file_mappings(
                    os.path.join(self.path, "data.mdb")
                )
            memutil.release_ranges(shared.mapped)
        finally:
            shared.gate.exit()

    @property
    def format_version(self) -> int:
        """The store's format version (one of :data:`READ_FORMATS`)."""
        return self._shared.format_version

    @property
    def problem(self) -> Optional[str]:
        """Why this process stopped writing to the index, or None."""
        return self._shared.problem

    def _damaged(self, error: lmdb.Error) -> IndexDamaged:
        """Note damage that liblmdb met in the index (``data.mdb`` changed under this
        process): logged once, and from now on this process neither reads nor writes
        the index (every fetch a miss): a cursor stepping onto a damaged page would end
        the process in an assertion. Returns the error to raise."""
        return self._shared.note_damage(
            storecheck.store_name(self.path),
            f"{type(error).__name__} met while the store was open: {error}",
        )

    def _wait_checked(self) -> None:
        """Wait for the open's full page check (:mod:`kvstore.disk.pageguard`)
        before a whole-index scan or a write transaction.

        Raises:
            IndexDamaged: it found damage (or the index met some meanwhile).
        """
        audit = self._shared.audit
        if audit.passed:
            return
        if self._shared.gate.depth():  # inside a transaction: a waiting resize and
            return  # the check's own transaction would wait for each other
        if audit.wait() is None:
            return
        if self._shared.damage is not None:
            raise self._shared.damage
        # The background check stopped for another reason (an lmdb error, say): the
        # check runs here instead, once.
        try:
            self._check_all_pages()
        except IndexDamaged as e:
            raise self._shared.note_damage(
                storecheck.store_name(self.path), e.problem
            ) from None
        audit.set_passed()

    def cover(self, txn, name: str, prefix: bytes = b"") -> bool:
        """Make sure a cursor of ``txn`` on database ``name`` confined to keys
        starting with ``prefix`` steps onto no damaged page: checked until the
        open's full page check has passed (:meth:`PageAudit.cover`). False: they
        could not be checked (the snapshot's meta page is gone): do not step.

        Raises:
            IndexDamaged: a damaged page (logged once; the index is not used again).
        """
        audit = self._shared.audit
        if audit.passed:
            return True
        try:
            return audit.cover(txn, name, prefix)
        except mdbcheck.Damage as e:
            raise self._shared.note_damage(
                storecheck.store_name(self.path), str(e)
            ) from None

    def close(self):
        if self._closed:
            return
        self._closed = True
        with _OPEN_LOCK:
            shared = _OPEN.get(self._key)
            if shared is not self._shared:
                return
            shared.refs -= 1
            if shared.refs <= 0:
                del _OPEN[self._key]
                if os.getpid() == self.pid:
                    shared.close()

    # -- transactions ------------------------------------------------------

    def _check_pid(self):
        if os.getpid() != self.pid:
            raise RuntimeError(
                "an LMDB environment cannot be used across fork(): open a new KVStore "
                "in the child process"
            )

    def read(self, fn: Callable, *, guarded: bool = False):
        """Run ``fn(txn)`` in a read transaction, adopting a map grown by another
        process.

        Args:
            guarded: ``fn`` only searches (``get``) or checks its cursors' ranges
                first (:meth:`cover`); otherwise the read waits for the open's full
                page check (:mod:`kvstore.disk.pageguard`).
        """
        if not guarded:
            self._wait_checked()
        return self._read_txn(fn)

    def _read_txn(self, fn: Callable):
        self._check_pid()
        gate = self._shared.gate
        for _ in range(_RESIZED_TRIES):
            if self._shared.damage is not None:
                raise self._shared.damage
            gate.enter()  # not a generator context manager: ~5 us less per read
            try:
                with self.env.begin(write=False) as txn:
                    return fn(txn)
            except lmdb.MapResizedError:
                pass
            except _DAMAGE_ERRORS as e:
                raise self._damaged(e) from None
            finally:
                gate.exit()
            self._adopt_map_size()
        raise StoreError(f"{self.path}: the LMDB map keeps being resized")

    def _adopt_map_size(self) -> None:
        """Take the map size another process grew the map to, once no transaction of
        this process is active (LMDB's rule for ``mdb_env_set_mapsize``)."""
        self._shared.gate.alone(lambda: self._set_mapsize(0))

    def _set_mapsize(self, size: int) -> None:
        """Resize (or with 0, adopt) the map, alone in the gate; the map may move."""
        self._shared.mapped = None
        self.env.set_mapsize(size)

    def _grow(self, full: int) -> None:
        """Double the map that was ``full`` bytes when a write found it full, unless
        another thread grew it meanwhile; with no transaction of this process active."""
        if full >= _MAX_MAP:
            raise lmdb.MapFullError(
                f"{self.path}: the LMDB map is full at {full} bytes"
            )

        def grow():
            if self.env.info()["map_size"] <= full:
                self._set_mapsize(min(full * 2, _MAX_MAP))

        self._shared.gate.alone(grow)

    def check_lock_file(self, *, committed: bool = False) -> None:
        """Raise StoreError if ``lock.mdb`` is no longer the file this process opened.

        LMDB coordinates writers through that file: once it is deleted (or the whole
        store directory is), a process opening the store makes a new one and two
        writers could each overwrite the other's commits. Writing stops here instead,
        loudly, for good: the store must be reopened. ``committed``: checked after a
        commit, which may itself be lost.
        """
        shared = self._shared
        if shared.problem is None and shared.lock_id is not None:
            lock = os.path.join(self.path, "lock.mdb")
            try:
                st = os.stat(lock)
                same = (st.st_dev, st.st_ino) == shared.lock_id
            except OSError:
                same = False
            if not same:
                gone = (
                    "" if os.path.isdir(self.path) else " (the index directory is gone)"
                )
                shared.problem = (
                    f"{storecheck.store_name(self.path)}: index/lock.mdb was deleted or "
                    f"replaced while this process had the store open{gone}; writing "
                    "stopped (another process's writes and this one's could overwrite "
                    "each other): restart to reopen the store"
                )
                log.error("kvstore: %s", shared.problem)
                if committed:
                    log.error("kvstore: the last commit to %s may be lost", self.path)
        if shared.damage is not None:
            raise shared.damage
        if shared.problem is not None:
            raise StoreError(shared.problem)

    def write(self, fn: Callable, *, frees: bool = False):
        """Run ``fn(txn)`` in a write transaction, growing the map when it is full.

        Args:
            frees: The transaction deletes records whose files go afterwards: on a
                full disk it may use the room kept in ``index/spare``
                (:mod:`kvstore.disk.spare`).

        Raises:
            lmdb.DiskError: the file system is full (and no spare room is left).
        """
        self._check_pid()
        if self.readonly:
            raise StoreError(f"{self.path}: the index is open read-only")
        self._wait_checked()  # a write reads the free list and moves records
        self.check_lock_file()
        resized = 0
        while True:
            full = None
            with self._shared.gate.shared():
                watch, looked, txnid = self._shared.audit.watch, False, None
                try:
                    with self.env.begin(write=True) as txn:
                        watch.before_commit()  # inside LMDB's writer lock
                        looked = True
                        out = fn(txn)
                        txnid = txn.id()
                except lmdb.DiskError:
                    freed = spare.release(self.path) if frees else 0
                    if not freed:
                        raise
                    log.warning(
                        "kvstore: %s: the disk is full; used the %d bytes kept in "
                        "index/spare for a commit that frees space",
                        storecheck.store_name(self.path),
                        freed,
                    )
                    continue
                except lmdb.MapFullError:
                    full = self.env.info()["map_size"]  # no resize while in the gate
                except lmdb.MapResizedError:
                    resized += 1
                    if resized >= _RESIZED_TRIES:
                        raise StoreError(
                            f"{self.path}: the LMDB map keeps being resized"
                        ) from None
                except _DAMAGE_ERRORS as e:
                    raise self._damaged(e) from None
                else:
                    watch.after_commit(txnid)
                    looked = False
                    self.check_lock_file(committed=True)
                    return out
                finally:
                    if looked:  # aborted, or the commit failed
                        watch.after_commit(None)
            if full is None:
                self._adopt_map_size()
            elif not _clear_stale_readers(self.env):
                # (else pages a killed process's read snapshot held are free again)
                self._grow(full)

    # -- namespaces and counters ---------------------------------------------

    def register_namespace(
        self,
        ns: bytes,
        description: dict,
        *,
        model_key: Optional[bytes] = None,
        replace: bool = False,
    ):
        """Record namespace ``ns`` (a record already there is kept, unless
        ``replace``: the caller knows the record must hold these very bytes) and,
        with ``model_key``, that the model of that key has it
        (:func:`kvstore.disk.namespace.model_key`)."""
        blob = json.dumps(description, sort_keys=True).encode()

        def put(txn):
            if replace and txn.get(ns, db=self.db["namespaces"]) != blob:
                txn.put(ns, blob, db=self.db["namespaces"])
            else:
                txn.put(ns, blob, db=self.db["namespaces"], overwrite=False)
            if model_key is not None:
                txn.put(MODEL_KEY_PREFIX + model_key, ns, db=self.db["meta"])

        self.write(put)

    def namespace_for_model(self, model_key: bytes) -> Optional[Tuple[bytes, dict]]:
        """``(namespace, description)`` registered for ``model_key``, or None (never
        seen, its namespace dropped since, or an undecodable record)."""

        def get(txn):
            ns = txn.get(MODEL_KEY_PREFIX + model_key, db=self.db["meta"])
            if ns is None or len(ns) != HASH_BYTES:
                return None
            raw = txn.get(bytes(ns), db=self.db["namespaces"])
            return None if raw is None else (bytes(ns), bytes(raw))

        found = self.read(get, guarded=True)
        if found is None:
            return None
        try:
            description = json.loads(found[1])
        except ValueError:
            return None
        return (found[0], description) if isinstance(description, dict) else None

    def namespaces(self) -> Dict[bytes, dict]:
        def get(txn):
            if not self.cover(txn, "namespaces"):
                return {}
            return {
                bytes(k): json.loads(v) for k, v in txn.cursor(db=self.db["namespaces"])
            }

        return self.read(get, guarded=True)

    COUNTERS = struct.Struct("<qqqq")  # nodes, tokens, bytes, pinned bytes

    def counters(self, ns: bytes, txn=None) -> Tuple[int, int, int, int]:
        if txn is None:
            return self.read(lambda t: self.counters(ns, t), guarded=True)
        raw = txn.get(ns, db=self.db["counters"])
        return self.COUNTERS.unpack(raw) if raw else (0, 0, 0, 0)

    def _add_counters(self, txn, ns: bytes, rec: NodeRecord, sign: int):
        have = self.counters(ns, txn)
        new = [n + sign * d for n, d in zip(have, rec.counts)]
        txn.put(ns, self.COUNTERS.pack(*new), db=self.db["counters"])

    # -- nodes -----------------------------------------------------------------

    def get_node(self, ns: bytes, h: bytes, txn=None) -> Optional[NodeRecord]:
        """The node ``h`` or None; raises :class:`CorruptRecord` for a bad record."""
        if txn is None:
            return self.read(lambda t: self.get_node(ns, h, t), guarded=True)
        raw = txn.get(ns + h, db=self.db["nodes"])
        return None if raw is None else NodeRecord.decode(bytes(raw))

    def nearest_children(
        self,
        ns: bytes,
        parent: bytes,
        query: np.ndarray,
        txn=None,
        *,
        on_corrupt: Optional[Callable[[bytes, CorruptRecord], None]] = None,
    ) -> List[Tuple[bytes, NodeRecord, int]]:
        """Children of ``parent`` sharing the longest token prefix with ``query``.

        Returns ``(hash, record, common prefix)`` for the best candidates (at
        least one token in common), best first. Only the edge keys next to the
        query's position are read, so a node with many children costs O(log n).
        A child whose record is corrupt raises :class:`CorruptRecord`, or with
        ``on_corrupt`` is passed to ``on_corrupt(hash, error)`` and skipped.
        """
        if txn is None:
            return self.read(
                lambda t: self.nearest_children(
                    ns, parent, query, t, on_corrupt=on_corrupt
                ),
                guarded=True,
            )
        prefix = ns + parent
        if not self.cover(txn, "children", prefix):
            return []
        seek = child_key(ns, parent, query)
        cur = txn.cursor(db=self.db["children"])
        keys = []
        if cur.set_range(seek):
            keys.append(bytes(cur.key()))
            if cur.prev():
                keys.append(bytes(cur.key()))
        elif cur.last():
            keys.append(bytes(cur.key()))
        head_len = len(prefix) + 4 * CHILD_KEY_TOKENS
        keys = [k for k in keys if k.startswith(prefix)]
        # Children whose keys equal the query's on every key token: scan them all.
        full = [k for k in keys if k[:head_len] == seek[:head_len]]
        if full:
            keys = [k for k in keys if k not in full]
            cur.set_range(seek[:head_len])
            for k in cur.iternext(values=False):
                if not k.startswith(seek[:head_len]):
                    break
                keys.append(bytes(k))
        out = []
        for k in keys:
            h = k[head_len:]
            rec = self._get_reporting(ns, h, txn, on_corrupt)
            if rec is None:
                continue
            n = common_prefix(rec.tokens, query)
            if n > 0:
                out.append((h, rec, n))
        out.sort(key=lambda item: -item[2])
        return out

    def _get_reporting(self, ns: bytes, h: bytes, txn, on_corrupt):
        """:meth:`get_node`, passing a corrupt record to ``on_corrupt(h, error)`` (and
        returning None) when one is given."""
        try:
            return self.get_node(ns, h, txn)
        except CorruptRecord as e:
            if on_corrupt is None:
                raise
            on_corrupt(h, e)
            return None

    def prefix_children(
        self,
        ns: bytes,
        parent: bytes,
        query: np.ndarray,
        txn,
        on_corrupt: Optional[Callable[[bytes, CorruptRecord], None]] = None,
    ) -> List[Tuple[bytes, NodeRecord]]:
        """Children of fewer than ``CHILD_KEY_TOKENS`` tokens whose tokens may be a
        strict prefix of ``query``: one key seek per length (their padded edge keys
        cannot be found next to the query's). The caller compares the tokens.
        Corrupt records go to ``on_corrupt`` as in :meth:`nearest_children`."""
        if not self.cover(txn, "children", ns + parent):
            return []
        cur = txn.cursor(db=self.db["children"])
        out = []
        for n in range(1, min(len(query), CHILD_KEY_TOKENS)):
            head = child_key(ns, parent, query[:n])
            if cur.set_range(head) and bytes(cur.key()).startswith(head):
                h = bytes(cur.key())[len(head) :]
                rec = self._get_reporting(ns, h, txn, on_corrupt)
                if rec is not None:
                    out.append((h, rec))
        return out

    def children(self, ns: bytes, parent: bytes, txn=None) -> List[bytes]:
        if txn is None:
            return self.read(lambda t: self.children(ns, parent, t), guarded=True)
        prefix = ns + parent
        if not self.cover(txn, "children", prefix):
            return []
        cur = txn.cursor(db=self.db["children"])
        out = []
        if cur.set_range(prefix):
            for k in cur.iternext(values=False):
                if not k.startswith(prefix):
                    break
                out.append(bytes(k[len(prefix) + 4 * CHILD_KEY_TOKENS :]))
        return out

    def put_node(self, txn, ns: bytes, h: bytes, rec: NodeRecord) -> bool:
        """Insert a node inside a write transaction; False if it already exists."""
        key = ns + h
        if txn.get(key, db=self.db["nodes"]) is not None:
            return False
        txn.put(key, rec.encode(), db=self.db["nodes"])
        txn.put(child_key(ns, rec.parent, rec.tokens, h), b"", db=self.db["children"])
        txn.put(key, struct.pack("<d", rec.created), db=self.db["atime"])
        if rec.pinned:
            txn.put(key, b"", db=self.db["pins"])
        self._add_counters(txn, ns, rec, +1)
        return True

    def delete_node(self, txn, ns: bytes, h: bytes) -> Optional[NodeRecord]:
        """Remove one node (not its children) inside a write transaction."""
        raw = txn.get(ns + h, db=self.db["nodes"])
        if raw is None:
            return None
        try:
            rec = NodeRecord.decode(bytes(raw))
        except CorruptRecord:
            rec = None
        self.delete_read_node(txn, ns, h, rec)
        return rec

    def delete_read_node(self, txn, ns: bytes, h: bytes, rec: Optional[NodeRecord]):
        """:meth:`delete_node` of a node whose record this write transaction has just
        read: ``rec`` (None: it did not decode)."""
        key = ns + h
        txn.delete(key, db=self.db["nodes"])
        txn.delete(key, db=self.db["atime"])
        txn.delete(key, db=self.db["pins"])
        if rec is not None:
            txn.delete(child_key(ns, rec.parent, rec.tokens, h), db=self.db["children"])
            self._add_counters(txn, ns, rec, -1)

    def replace_node(self, txn, ns: bytes, h: bytes, rec: NodeRecord) -> None:
        """Rewrite an existing node's record (same tokens and parent), e.g. to add a
        state file, keeping the counters right."""
        old = self.get_node(ns, h, txn)
        assert old is not None and old.parent == rec.parent
        self._add_counters(txn, ns, old, -1)
        txn.put(ns + h, rec.encode(), db=self.db["nodes"])
        self._add_counters(txn, ns, rec, +1)

    def set_pinned(self, txn, ns: bytes, h: bytes, pinned: bool) -> bool:
        rec = self.get_node(ns, h, txn)
        if rec is None or rec.pinned == pinned:
            return False
        self._add_counters(txn, ns, rec, -1)
        rec = NodeRecord(**{**rec.__dict__, "pinned": pinned})
        txn.put(ns + h, rec.encode(), db=self.db["nodes"])
        if pinned:
            txn.put(ns + h, b"", db=self.db["pins"])
        else:
            txn.delete(ns + h, db=self.db["pins"])
        self._add_counters(txn, ns, rec, +1)
        return True

    def touch(self, txn, ns: bytes, h: bytes, when: float, *, resolution: float = 0):
        """Set the access time of a stored node to ``when``, unless the one it has is
        less than ``resolution`` seconds older (a read instead of a dirtied page)."""
        key = ns + h
        if resolution > 0:
            raw = txn.get(key, db=self.db["atime"])
            if raw is not None and len(raw) == 8:
                if when - struct.unpack("<d", raw)[0] < resolution:
                    return
        if txn.get(key, db=self.db["nodes"]) is not None:
            txn.put(key, struct.pack("<d", when), db=self.db["atime"])

    def pinned(self, ns: bytes) -> List[bytes]:
        def get(txn):
            if not self.cover(txn, "pins", ns):
                return []
            cur = txn.cursor(db=self.db["pins"])
            out = []
            if cur.set_range(ns):
                for k in cur.iternext(values=False):
                    if not k.startswith(ns):
                        break
                    out.append(bytes(k[len(ns) :]))
            return out

        return self.read(get, guarded=True)

    def iter_nodes(
        self, txn, ns: Optional[bytes] = None
    ) -> Iterator[Tuple[bytes, bytes, bytes]]:
        """Yield ``(namespace, hash, raw record)`` for every node (of one namespace)."""
        if not self.cover(txn, "nodes", ns or b""):
            return
        cur = txn.cursor(db=self.db["nodes"])
        start = ns or b""
        if not cur.set_range(start):
            return
        for k, v in cur:
            if ns is not None and not k.startswith(ns):
                break
            yield bytes(k[:HASH_BYTES]), bytes(k[HASH_BYTES:]), bytes(v)

    def atime(self, txn, ns: bytes, h: bytes) -> float:
        raw = txn.get(ns + h, db=self.db["atime"])
        return struct.unpack("<d", raw)[0] if raw else 0.0

    def has_children(self, txn, ns: bytes, h: bytes) -> bool:
        prefix = ns + h
        if not self.cover(txn, "children", prefix):
            return False
        cur = txn.cursor(db=self.db["children"])
        return cur.set_range(prefix) and bytes(cur.key()).startswith(prefix)

    def total_bytes(self, txn=None) -> int:
        if txn is None:
            return self.read(self.total_bytes, guarded=True)
        if not self.cover(txn, "counters"):
            return 0
        return sum(
            self.COUNTERS.unpack(v)[2] for _, v in txn.cursor(db=self.db["counters"])
        )
