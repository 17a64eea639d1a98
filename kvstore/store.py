"""The public ``KVStore`` façade: it opens the index, the node files, the RAM tier and
the writer, and composes the parts that do the work, each given what it shares:

* :class:`~kvstore.engine.restore.ReadPath`: fetches (the trie walk, node reads);
* :class:`~kvstore.engine.saving.WritePath`: saves (capture, then on the writer
  thread reserve, publish, commit);
* :class:`~kvstore.engine.removal.Removal`: node files leaving the disk (eviction,
  quarantine, cleanup), and :class:`~kvstore.engine.removal.BrokenNodes`: the broken
  nodes this process found;
* :class:`~kvstore.engine.accesses.Accesses` (access times and rates, written by the
  writer), :class:`~kvstore.engine.shapes.NodeShapes` (what a node file must look
  like) and :class:`~kvstore.engine.counters.Counters` (this process's counts).
"""

import atexit
import logging
import os
import time
import weakref
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
from mlx_lm.models.cache import KVCache, QuantizedKVCache, make_prompt_cache

from . import maintenance
from .disk import reservations, salts, spare
from .disk.blobs import Blobs
from .disk.chunking import root_hash
from .disk.index import KINDS, Index, StoreError
from .disk.namespace import open_namespace
from .disk.storecheck import check_store_dirs
from .engine import payoff
from .engine.calibrate import measure_restore_rate
from .engine.loadpath import default_restore_io
from .engine.parts import Parts
from .engine.ram import RamTier
from .engine.removal import Budgets
from .engine.tail import Tail
from .engine.writer import BackgroundWriter
from .maintenance.common import check_int
from .platform import fsutil, mlxsync
from .remote import RemoteTier

__all__ = [
    "DEFAULT_MAX_PENDING_BYTES",
    "DEFAULT_RAM_BYTES",
    "KVStore",
    "StoreError",
    "check_store",
]

log = logging.getLogger("kvstore")

DEFAULT_RAM_BYTES = 512 << 20
DEFAULT_MAX_PENDING_BYTES = 2 << 30


# Lowest value of each number KVStore takes; optional ones may also be None (for
# disk budgets None is "no budget": 0 would keep nothing).
_MINIMUMS = {
    "chunk_tokens": 1,
    "kv_group_size": 1,
    "ram_bytes": 0,
    "max_pending_bytes": 0,
    "read_threads": 1,
    "restore_room": 0,
}
_OPTIONAL_MINIMUMS = {"kv_bits": 1, "disk_bytes": 1, "salt_disk_bytes": 1}


def _check_arguments(path, model, tokenizer, **numbers) -> Dict[str, Any]:
    """Refuse, naming the argument, what :class:`KVStore` cannot open with; the
    numbers, checked."""
    for name, minimum in _MINIMUMS.items():
        check_int(name, numbers[name], minimum=minimum)
    for name, minimum in _OPTIONAL_MINIMUMS.items():
        if numbers[name] is not None:
            check_int(name, numbers[name], minimum=minimum)
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__}")
    if not callable(model) or not (
        hasattr(model, "layers") or hasattr(model, "make_cache")
    ):
        raise TypeError(
            f"model must be an mlx-lm model (from mlx_lm.load), got "
            f"{type(model).__name__}"
        )
    if tokenizer is not None and not hasattr(tokenizer, "get_vocab"):
        raise TypeError(
            f"tokenizer must be an mlx-lm or Hugging Face tokenizer (with "
            f"get_vocab()) or None, got {type(tokenizer).__name__}"
        )
    return numbers


def _numbers(arguments: Dict[str, Any]) -> Dict[str, Any]:
    """The numbers among ``KVStore``'s arguments (``locals()`` of its ``__init__``)."""
    return {name: arguments[name] for name in (*_MINIMUMS, *_OPTIONAL_MINIMUMS)}


def _restore_mode(restore: Optional[str]) -> str:
    """``KVStore``'s ``restore`` argument, checked; None: ``$KVSTORE_RESTORE``, else auto."""
    if restore is not None:
        payoff.check_mode(restore)
        return restore
    restore = os.environ.get("KVSTORE_RESTORE") or "auto"
    payoff.check_mode(restore, name="$KVSTORE_RESTORE")
    return restore


def _open_namespace(
    index: Index, model, tokenizer, kv_bits, kv_group_size, chunk_tokens
):
    """The model's namespace in ``index`` (created, or found by its model key: then its
    layout comes from the namespace record, with no probe), after dropping the disk
    reservations of dead saves and making sure of the spare room. The index is closed
    if this fails."""
    try:
        opened = open_namespace(
            index,
            model,
            tokenizer,
            _cache_maker(model, kv_bits, kv_group_size),
            chunk_tokens=chunk_tokens,
        )
    except BaseException:
        index.close()
        raise
    # Reservations of saves that died with their process (or this one) free up.
    reservations.drop_stale(index)
    spare.ensure(index.path)  # room for gc's first commit on a full disk
    return opened


def _checked(
    parts: Parts, tokens, kind: str, what: str, *, pin=False, boundaries=()
) -> np.ndarray:
    """Validate the arguments every write entry point shares, the store being open
    (``parts``); the tokens as an array."""
    arr = parts.tokens(tokens)
    if len(arr) == 0:
        raise ValueError(f"tokens is empty: nothing to {what}")
    if not isinstance(kind, str) or kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    _check_bool("pin", pin)
    if isinstance(boundaries, (str, bytes)) or not hasattr(boundaries, "__iter__"):
        raise TypeError(
            f"boundaries must be a list of token positions, got "
            f"{type(boundaries).__name__}"
        )
    for i, b in enumerate(boundaries):
        if not isinstance(b, (int, np.integer)) or isinstance(b, (bool, np.bool_)):
            raise TypeError(
                f"boundaries[{i}] is {type(b).__name__} {b!r}, expected int"
            )
        if not 0 <= b <= len(arr):
            raise ValueError(f"boundaries[{i}] = {b} is outside the {len(arr)} tokens")
    return arr


def _check_held(held) -> None:
    if not isinstance(held, int) or held < 0:
        raise ValueError(f"held must be a token count >= 0, got {held!r}")


class _Setting:
    """A ``KVStore`` attribute that is a part's setting (``parts.<part>.<name>``),
    read and set there: the parts see a change at once (a disk budget lowered while
    the store is open)."""

    def __init__(self, part: str, name: str):
        self.part, self.name = part, name

    def __get__(self, store, owner=None):
        if store is None:
            return self
        return getattr(getattr(store.parts, self.part), self.name)

    def __set__(self, store, value) -> None:
        setattr(getattr(store.parts, self.part), self.name, value)


def _open_parts(
    path: str,
    model,
    tokenizer,
    *,
    remote,
    restore: str,
    chunk_tokens: int,
    ram_bytes: int,
    disk_bytes: Optional[int],
    salt_disk_bytes: Optional[int],
    max_pending_bytes: int,
    read_threads: int,
    restore_room: int,
    kv_bits: Optional[int],
    kv_group_size: int,
) -> Parts:
    """Open (or create) the store at ``path`` for ``model`` and compose its parts:
    the arguments are ``KVStore``'s."""
    _prepare_dir(path)
    index = Index(os.path.join(path, "index"))
    opened = _open_namespace(
        index, model, tokenizer, kv_bits, kv_group_size, chunk_tokens
    )
    # Recorded for tools that work without the model (kvstore gc); written only when
    # it changed: a write waits for the index's full page check (disk/pageguard).
    if disk_bytes is not None and maintenance.read_disk_budget(index) != disk_bytes:
        maintenance.write_disk_budget(index, disk_bytes)
    rates = index.read(
        lambda txn: payoff.read_rates(txn, index.db["meta"], opened.namespace),
        guarded=True,  # a search
    )
    parts = Parts(
        model=model,
        index=index,
        blobs=Blobs.of_store(path, index.format_version),
        ram=RamTier(ram_bytes),
        writer=BackgroundWriter(max_pending_bytes=max_pending_bytes),
        policy=payoff.RestorePolicy(restore, rates=rates),
        layout=opened.layout,
        namespace=opened.namespace,
        description=opened.description,
        root=root_hash(opened.namespace),
        chunk_tokens=chunk_tokens,
        budgets=Budgets(disk_bytes, salt_disk_bytes),
        remote=remote,
        restore_room=restore_room,
        read_threads=read_threads,
        restore_io=default_restore_io(),
    )
    parts.reads.preload_pinned()
    return parts


class KVStore:
    """A persistent store of KV snapshots for one mlx-lm model.

    Args:
        path: The store directory; created when missing. Several processes may
            share it (one LMDB writer at a time, many readers).
        model: The mlx-lm model whose caches are stored.
        tokenizer: Optional; its vocabulary becomes part of the namespace. Pass it
            to share snapshots with ``kvstore prefill`` and ``kvstore serve``.
        chunk_tokens: Tokens per trie node.
        ram_bytes: Budget of the in-memory tier (0 disables it).
        disk_bytes: Budget of the chunk files on disk (None: unlimited).
        salt_disk_bytes: Quota of each salted tree's chunk files (None: none): a
            save under a salt evicts that tree's least recently used prefixes, never
            another tenant's, so one tenant cannot push all others out.
        max_pending_bytes: A save whose KV would take the bytes waiting for the
            disk beyond this is dropped (counted in ``writes_dropped``).
        read_threads: Threads reading chunk files in parallel during a restore
            (the calling thread is one of them). Two were fastest on the 2-core
            CPU machine and on an H100's 16-core host alike (docs/gpu.md).
        restore_room: Tokens past a restore that its arrays have room for (rounded
            up to mlx-lm's cache step): the prompt's rest and the first generated
            token are then written in place, where an exactly full cache would copy
            every layer to grow on the first forward pass. 0: no room. Restores
            of less than 32 MiB of KV get none: that copy is then about what the
            room's allocation costs. With MLX's CUDA backend the rows are always
            whole cache steps (its fast decode needs them).
        kv_bits: Store and return ``QuantizedKVCache`` layers of this many bits in
            place of the model's ``KVCache`` layers (as mlx-lm's ``--kv-bits``).
        kv_group_size: Quantization group size with ``kv_bits``.
        remote: A shared remote tier behind the disk: an ``s3://bucket/prefix`` URL
            or a :class:`kvstore.remote.RemoteTier` (needs boto3). Fetches download
            what the remote has beyond the local nodes; new nodes are uploaded in the
            background. A failing remote is logged and counted, never raised.
        restore: ``"auto"``: a fetch restores a stored prefix only when reading it
            is faster than prefilling it, by the rates measured on this machine
            (:mod:`kvstore.engine.payoff`; until a prefill rate is known, always);
            ``"always"`` or ``"never"`` force either way. None: ``$KVSTORE_RESTORE``,
            else ``"auto"``.

    Raises:
        StoreError: ``path`` exists but is not a kvstore, or has another format.
        UnsupportedCacheError: the model's cache layout cannot be stored.
    """

    disk_bytes = _Setting("budgets", "disk_bytes")
    salt_disk_bytes = _Setting("budgets", "salt_disk_bytes")
    restore_room = _Setting("reads", "restore_room")
    restore_io = _Setting("reads", "restore_io")

    def __init__(
        self,
        path: str,
        model,
        tokenizer=None,
        *,
        chunk_tokens: int = 256,
        ram_bytes: int = DEFAULT_RAM_BYTES,
        disk_bytes: Optional[int] = None,
        salt_disk_bytes: Optional[int] = None,
        max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES,
        read_threads: int = 2,
        restore_room: int = 2048,
        kv_bits: Optional[int] = None,
        kv_group_size: int = 64,
        remote=None,
        restore: Optional[str] = None,
    ):
        numbers = _check_arguments(path, model, tokenizer, **_numbers(locals()))
        restore = _restore_mode(restore)
        # Restores load Python files: MLX's CPU stream syncs must wait for them.
        mlxsync.install()
        self.path, self.model, self.tokenizer = os.fspath(path), model, tokenizer
        self.chunk_tokens, self.read_threads = chunk_tokens, read_threads
        self.remote = _remote_tier(remote)
        self.parts = p = _open_parts(
            self.path, model, tokenizer, remote=self.remote, restore=restore, **numbers
        )
        self.index, self.blobs, self.ram = p.index, p.blobs, p.ram
        self.writer, self.policy, self.description = p.writer, p.policy, p.description
        self.layout, self.namespace, self.root = p.layout, p.namespace, p.root
        if self.remote is not None:
            self.remote.bind(self)
        # Pending writes are flushed at interpreter exit even without close().
        ref = weakref.ref(self)
        atexit.register(lambda: ref() is not None and ref().close())

    def __enter__(self) -> "KVStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Wait for pending writes, then release the index. Idempotent."""
        self.parts.close()

    def flush(self) -> None:
        """Wait until every write submitted so far is on disk and indexed."""
        self.parts.flush()

    def fetch(self, tokens, *, salt: salts.Salt = None) -> Tuple[List[Any], int]:
        """Restore the longest stored prefix of ``tokens``.

        Args:
            tokens: The prompt's token ids.
            salt: Reuse only KV saved with this salt (a tenant's tree; see
                :mod:`kvstore.disk.salts`): a string, or a :class:`kvstore.Tenant` (a
                gateway's tenant, apart from every string salt); None: the
                unsalted tree.

        Returns:
            ``(cache, n)``: fresh cache objects (owned by the caller) holding the KV
            of ``tokens[:n]``, with ``n <= len(tokens) - 1``. On a miss, or when a
            stored file turns out to be broken, an empty cache and ``n == 0``.

        Raises:
            TypeError, ValueError: ``tokens`` is not a list of token ids, or ``salt``
                (or a part of a Tenant) not a non-empty string of at most 256 bytes.
        """
        arr, tic = self.parts.tokens(tokens), time.perf_counter()
        root = self.parts.before_fetch(arr, salts.parse_salt(salt))
        return self.parts.reads.fetch(arr, root=root, started=tic)

    def fetch_beyond(
        self, tokens, held: int, *, salt: salts.Salt = None, weigh: bool = True
    ) -> Optional[Tail]:
        """Restore the stored KV of ``tokens`` past the first ``held``, which the
        caller has in a cache of its own.

        Only the nodes from the one holding token ``held`` on are read, and only
        when reading them is faster than prefilling ``stored - held`` tokens
        (``restore="auto"``, by the measured rates). With state layers the whole
        stored prefix is restored or nothing.

        Args:
            tokens: The prompt's token ids.
            held: Tokens of ``tokens`` the caller holds (0: none).
            salt: The tree to read (see :meth:`fetch`).
            weigh: False: restore what is stored whatever the rates say (the caller
                weighed it against its own queue: ``kvstore serve``'s restores of
                returning users).

        Returns:
            A :class:`Tail` (``start <= held < end <= len(tokens) - 1``), or None
            when the store holds nothing past ``held`` or the tokens are cheaper
            to prefill. Never raises for a broken store (a miss, logged).
        """
        arr, tic = self.parts.tokens(tokens), time.perf_counter()
        _check_held(held)
        root = self.parts.before_fetch(arr, salts.parse_salt(salt))
        return self.parts.tail.fetch_beyond(
            arr, held, root=root, started=tic, weigh=weigh
        )

    def join_tail(self, head: Sequence[Any], tail: Tail, *, query: int) -> List[Any]:
        """``head`` (a cache holding at least ``tail.start`` tokens) with ``tail``
        appended: fresh cache objects holding ``tail.end`` tokens, with room past
        them for the rest of a ``query``-token prompt (``restore_room``).

        Raises:
            LayoutMismatch, ValueError: ``head`` does not have this store's layout
                (another layer class, fewer tokens), or the layout has state layers.
        """
        return self.parts.tail.join(head, tail, query=query)

    def frozen_tail(self, tail: Tail) -> Tail:
        """A whole-prefix ``tail`` (``start`` 0) in fresh cache objects holding
        views of its arrays, which writes into ``tail``'s cache leave as they are
        (for another thread to copy its first tokens while a generate loop uses
        ``tail``'s)."""
        return self.parts.tail.frozen(tail)

    def save(
        self,
        tokens,
        cache: Sequence[Any],
        *,
        kind: str = "user",
        pin: bool = False,
        boundaries: Sequence[int] = (),
        salt: salts.Salt = None,
    ) -> int:
        """Store the KV of ``tokens`` held by ``cache``, sharing stored prefixes.

        Returns at once; the files are written by a background thread (see
        :meth:`flush`). The arrays are captured now, so the caller may keep using
        and mutating ``cache``.

        Args:
            tokens: The token ids the cache covers, exactly.
            cache: mlx-lm cache objects holding ``len(tokens)`` tokens.
            kind: "system", "user" or "assistant" (eviction order in RAM).
            pin: Never evict these nodes; load them into RAM at open.
            boundaries: Token positions that must end a node (message ends).
            salt: Save into this salt's tree (see :meth:`fetch`); None: unsalted.

        Returns:
            The number of new nodes queued for writing; 0 too when ``cache``'s layers
            differ from the layout probed at open (logged, ``stats()["saves_refused"]``).

        Raises:
            TypeError, ValueError: bad arguments, or ``cache`` does not hold
                ``len(tokens)`` tokens or has another number of layers.
        """
        arr = _checked(self.parts, tokens, kind, "save", pin=pin, boundaries=boundaries)
        tree = self.parts.tree_of(salts.parse_salt(salt))
        return self.parts.writes.save(
            arr, cache, kind=kind, pin=pin, boundaries=boundaries, tree=tree, exact=True
        )

    def save_prefix(
        self,
        tokens,
        cache: Sequence[Any],
        *,
        kind: str = "user",
        pin: bool = False,
        salt: salts.Salt = None,
    ) -> int:
        """Like :meth:`save`, for a cache that may hold more tokens than ``tokens``
        (a generate loop's cache after the first new token): only the prefix is stored.
        A layout with state layers (sliding windows, recurrent state) cannot be cut
        back, so its cache must hold exactly ``tokens``.
        """
        arr = _checked(self.parts, tokens, kind, "save", pin=pin)
        tree = self.parts.tree_of(salts.parse_salt(salt))
        return self.parts.writes.save(
            arr, cache, kind=kind, pin=pin, boundaries=(), tree=tree, exact=False
        )

    def prefill(
        self,
        tokens,
        *,
        kind: str = "system",
        pin: bool = False,
        boundaries: Sequence[int] = (),
        step_tokens: int = 512,
        salt: salts.Salt = None,
    ) -> Dict[str, int]:
        """Compute what is missing of ``tokens`` (after the longest stored prefix) and save it.

        With state layers (sliding windows, recurrent state) the computation stops at
        every boundary to save a checkpoint there, so each message end is restorable.

        Returns:
            ``{"tokens": len, "computed": model tokens run, "reused": tokens restored}``.
        """
        arr = _checked(
            self.parts, tokens, kind, "prefill", pin=pin, boundaries=boundaries
        )
        return self.parts.prefill.run(
            arr,
            self.fetch,
            salt=salt,
            kind=kind,
            pin=pin,
            boundaries=boundaries,
            step_tokens=step_tokens,
        )

    def extend(
        self, cache: List[Any], tokens, start: int, end: int, *, step_tokens: int = 512
    ) -> None:
        """Run the model over ``tokens[start:end]`` into ``cache`` (which holds
        ``tokens[:start]``), ``step_tokens`` at a time."""
        self.parts.prefill.extend(cache, tokens, start, end, step_tokens=step_tokens)

    def new_cache(self) -> List[Any]:
        """An empty cache of the layout this store holds (what ``fetch`` returns on a miss)."""
        return self.layout.make_cache()

    def lookup(self, tokens, *, salt: salts.Salt = None) -> int:
        """How many tokens :meth:`fetch` would restore now (index only, no file is
        read): a caller holding a prefix elsewhere (a RAM cache) can skip a restore
        that would not be longer. A broken file found later makes the fetch shorter.
        """
        arr = self.parts.tokens(tokens)
        root = self.parts.tree_of(salts.parse_salt(salt))[0]
        return self.parts.reads.stored_past(arr, len(arr), root=root)[0]

    def estimate_past(
        self, tokens, held: int, *, salt: salts.Salt = None
    ) -> Tuple[int, Optional[float], Optional[float]]:
        """``(stored, read_s, prefill_s)``: the tokens :meth:`lookup` gives, and the
        estimated seconds to restore those past the first ``held`` and to prefill
        them instead, by the measured rates (None while a rate is not known). Index
        only, like :meth:`lookup`."""
        arr = self.parts.tokens(tokens)
        root = self.parts.tree_of(salts.parse_salt(salt))[0]
        stored, nbytes = self.parts.reads.stored_past(arr, held, root=root)
        rates = self.policy.rates
        if stored <= held:
            return stored, None, None
        read_s = self.policy.read_seconds(nbytes) if rates.restore else None
        prefill_s = (stored - held) / rates.prefill if rates.prefill else None
        return stored, read_s, prefill_s

    def note_prefill(self, tokens: int, seconds: float) -> None:
        """Tell the store that the model prefilled ``tokens`` tokens in ``seconds``
        (a generate loop's own measurement), for deciding what restores pay (see
        ``restore``). ``kvstore.stream_generate`` and :meth:`prefill` call it;
        the rate is kept in the store for other processes on this host.

        Raises:
            ValueError: ``tokens`` is not a finite number >= 0, ``seconds`` not a
                finite number > 0, or ``tokens / seconds`` is not finite.
        """
        self.parts.prefill.note_prefill(tokens, seconds)

    def measure_restore_rate(self) -> bool:
        """Measure how fast this machine restores, by restoring part of a stored
        prompt now and dropping it, for ``restore="auto"`` to decide the first
        fetches by (until a fetch has restored, none is known). Nothing is counted
        as a fetch; the rate is kept with the next write.

        Returns:
            Whether one was measured (False: no prompt of two nodes stored, a
            broken file, which is reported, or a layout with state layers).
        """
        return measure_restore_rate(self.parts.reads)

    def held_tokens(self, cache: Sequence[Any]) -> Optional[int]:
        """Tokens ``cache`` holds, as far as its layers tell (None: only recurrent
        layers, which do not count their tokens)."""
        return self.layout.held_tokens(cache)

    def pin(self, tokens, *, pinned: bool = True) -> int:
        """Pin (or unpin) the stored prefix of ``tokens`` and its ancestors.

        Pinned nodes are never evicted and are loaded into RAM at open. Unpinning
        keeps ancestors that another pinned prompt still needs. Returns the number of
        nodes changed.
        """
        arr = _checked(self.parts, tokens, "user", "pin")
        _check_bool("pinned", pinned)
        return self.parts.pin(arr, pinned=pinned, path=self.path)

    def stats(self) -> Dict[str, Any]:
        """Counts for the store (all namespaces), this model's namespace, and this process."""
        remote = {"remote": None} if self.remote is None else self.remote.stats()
        return {"path": self.path, **self.parts.stats(), **remote}


def _check_bool(name: str, value) -> None:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(
            f"{name} must be True or False, got {type(value).__name__} {value!r}"
        )


def _remote_tier(remote):
    """``KVStore``'s ``remote`` argument as an unbound RemoteTier, or None."""
    if remote is None:
        return None
    if isinstance(remote, RemoteTier):
        if remote.bound:
            raise ValueError(f"remote {remote!r} already serves another KVStore")
        return remote
    return RemoteTier(remote)  # TypeError/ValueError for a bad URL, ImportError: boto3


def _cache_maker(model, kv_bits: Optional[int], kv_group_size: int):
    """Builds the model's empty cache, with ``KVCache`` layers quantized on request."""
    if kv_bits is None:
        return lambda: make_prompt_cache(model)

    def make():
        return [
            (
                QuantizedKVCache(group_size=kv_group_size, bits=kv_bits)
                if type(c) is KVCache
                else c
            )
            for c in make_prompt_cache(model)
        ]

    return make


def _prepare_dir(path: str) -> None:
    """Create a new store directory, or check that an existing one is a store that
    this process can write to."""
    if os.path.islink(path) and not os.path.exists(path):
        raise StoreError(
            f"{path} is a dangling symbolic link (to {os.readlink(path)!r})"
        )
    if os.path.exists(path) and not os.path.isdir(path):
        raise StoreError(f"{path} exists and is not a directory")
    if os.path.isdir(path):
        entries = set(os.listdir(path)) - {"quarantine"}
        if entries == {"blobs"}:
            # A store whose index/ was deleted: start a new index; the old chunk files
            # are orphans now (misses), which `kvstore gc` removes.
            log.warning(
                "kvstore: %s has chunk files but no index/; starting a new index", path
            )
        elif entries and "index" not in entries:
            raise StoreError(
                f"{path} is not a kvstore directory (it holds {sorted(entries)[:5]} but no index/)"
            )
    try:
        fsutil.makedirs(path)  # 0o755 whatever the umask
    except OSError as e:
        raise StoreError(
            f"cannot create the store directory {path}: {e.strerror}"
        ) from None
    check_store_dirs(path)
    for name in ("", "blobs"):  # (the index checks its own files)
        where = os.path.join(path, name) if name else path
        if os.path.isdir(where) and not os.access(where, os.W_OK | os.X_OK):
            raise StoreError(
                f"{path}: the store is read-only (no write permission on {where})"
            )


def check_store(path: str, *, check: str = "roots") -> None:
    """What opening a ``KVStore`` at ``path`` checks before it needs the model: a
    store directory (created when missing), writable, whose index, if it has one,
    is kvstore's, of this format version and whole.

    Args:
        path: The store directory.
        check: How much of the index's pages to check: ``"roots"`` (what every open
            checks), ``"full"`` (every page, in a time that grows with the index) or
            ``"marked"`` (every page unless the last close left the clean mark:
            ``kvstore serve``'s start; see :class:`kvstore.disk.index.Index`).

    Raises:
        StoreError: with one line naming the store and the problem.
    """
    _prepare_dir(path)
    if os.path.lexists(os.path.join(path, "index", "data.mdb")):
        Index(os.path.join(path, "index"), create=False, check=check).close()
