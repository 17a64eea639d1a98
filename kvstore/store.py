"""The public ``KVStore`` façade: composes the index, chunk files, RAM tier and writer.

The read path is in :mod:`kvstore.restore`, the write path in :mod:`kvstore.saving`,
and the removal of node files in :mod:`kvstore.removal` (mixins of ``KVStore``).
"""

import atexit
import logging
import os
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache, QuantizedKVCache, make_prompt_cache

from . import maintenance
from .disk import adapters, reservations, salts, spare
from .disk.blobs import STATE_PART, Blobs, CorruptBlob
from .disk.chunking import as_token_array, root_hash
from .disk.index import KINDS, Index, StoreError
from .disk.namespace import open_namespace
from .disk.storecheck import check_store_dirs
from .engine import payoff
from .engine.assemble import PlanAllocator
from .engine.loadpath import default_restore_io
from .engine.ram import RamTier
from .engine.removal import Removal
from .engine.restore import ReadPath, Step
from .engine.saving import WritePath
from .engine.writer import BackgroundWriter
from .maintenance.common import check_int
from .platform import fsutil
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


@dataclass
class _Counters:
    hits: int = 0
    misses: int = 0
    tokens_reused: int = 0
    tokens_requested: int = 0
    restore_seconds: float = 0.0
    corrupt: int = 0
    errors: int = 0
    nodes_written: int = 0
    bytes_written: int = 0
    nodes_evicted: int = 0
    nodes_skipped: int = 0  # a commit found their parent gone (evicted meanwhile)
    writes_dropped: int = 0
    saves_refused: int = 0  # the cache's layout differed from the one probed at open
    quarantined: List[str] = field(default_factory=list)


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


def _check_arguments(path, model, tokenizer, **numbers) -> None:
    """Refuse, naming the argument, what :class:`KVStore` cannot open with."""
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


class KVStore(ReadPath, WritePath, Removal):
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
            room's allocation costs.
        kv_bits: Store and return ``QuantizedKVCache`` layers of this many bits in
            place of the model's ``KVCache`` layers (as mlx-lm's ``--kv-bits``).
        kv_group_size: Quantization group size with ``kv_bits``.
        remote: A shared remote tier behind the disk: an ``s3://bucket/prefix`` URL
            or a :class:`kvstore.remote.RemoteTier` (needs boto3). Fetches download
            what the remote has beyond the local nodes; new nodes are uploaded in the
            background. A failing remote is logged and counted, never raised.
        restore: ``"auto"``: a fetch restores a stored prefix only when reading it
            is faster than prefilling it, by the rates measured on this machine
            (:mod:`kvstore.payoff`; until a prefill rate is known, always);
            ``"always"`` or ``"never"`` force either way. None: ``$KVSTORE_RESTORE``,
            else ``"auto"``.

    Raises:
        StoreError: ``path`` exists but is not a kvstore, or has another format.
        UnsupportedCacheError: the model's cache layout cannot be stored.
    """

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
        _check_arguments(
            path,
            model,
            tokenizer,
            chunk_tokens=chunk_tokens,
            kv_group_size=kv_group_size,
            kv_bits=kv_bits,
            ram_bytes=ram_bytes,
            max_pending_bytes=max_pending_bytes,
            read_threads=read_threads,
            restore_room=restore_room,
            disk_bytes=disk_bytes,
            salt_disk_bytes=salt_disk_bytes,
        )
        if restore is None:
            restore = os.environ.get("KVSTORE_RESTORE") or "auto"
            payoff.check_mode(restore, name="$KVSTORE_RESTORE")
        else:
            payoff.check_mode(restore)
        self.path = os.fspath(path)
        self.remote = _remote_tier(remote)
        _prepare_dir(self.path)

        self.model = model
        self.tokenizer = tokenizer
        self.chunk_tokens = chunk_tokens
        self.disk_bytes = disk_bytes
        self.salt_disk_bytes = salt_disk_bytes
        self.index = Index(os.path.join(self.path, "index"))
        try:
            # A model seen before: its layout from the namespace record, no probe.
            opened = open_namespace(
                self.index,
                model,
                tokenizer,
                _cache_maker(model, kv_bits, kv_group_size),
                chunk_tokens=chunk_tokens,
            )
        except BaseException:
            self.index.close()
            raise
        self.layout, self.namespace = opened.layout, opened.namespace
        self.description = opened.description
        self.root = root_hash(self.namespace)
        # Reservations of saves that died with their process (or this one) free up.
        reservations.drop_stale(self.index)
        spare.ensure(self.index.path)  # room for gc's first commit on a full disk
        if disk_bytes is not None:  # for tools that work without the model (kvstore gc)
            maintenance.write_disk_budget(self.index, disk_bytes)
        self.blobs = Blobs(
            os.path.join(self.path, "blobs"), os.path.join(self.path, "quarantine")
        )
        self.ram = RamTier(ram_bytes)
        self.writer = BackgroundWriter(max_pending_bytes=max_pending_bytes)
        self.restore_room = restore_room
        self._token_bytes = sum(  # KV bytes per token of the delta layers
            heads * width * getattr(mx, dtype).size
            for dtype, heads, width in self.layout.rows.values()
        )
        self.policy = payoff.RestorePolicy(
            restore,
            rates=self.index.read(
                lambda txn: payoff.read_rates(
                    txn, self.index.db["meta"], self.namespace
                )
            ),
        )
        self._rates_kept: Optional[float] = None  # when the rates were last kept
        self._rates_due = False  # the rates go into the next write of accesses
        self.restore_io = default_restore_io()
        self.read_threads = read_threads
        self._readers = ThreadPoolExecutor(
            self.read_threads, thread_name_prefix="kvstore-read"
        )
        self._allocator = PlanAllocator()  # a restore's arrays: see kvstore.assemble
        self._counters = _Counters()
        self._lock = threading.Lock()
        self._touched: Dict[bytes, float] = {}
        self._broken: set = set()
        self._node_files: Dict[int, Tuple[Dict, int]] = {}  # by tokens: _node_file
        self._staging = threading.local()  # per reader thread: one node file at a time
        self._secret: Optional[bytes] = None  # the salt secret, read at first use
        self._closed = False
        self._preload_pinned()
        if self.remote is not None:
            self.remote.bind(self)
        # Pending writes are flushed at interpreter exit even without close().
        ref = weakref.ref(self)
        atexit.register(lambda: ref() is not None and ref().close())

    # -- context manager ---------------------------------------------------

    def __enter__(self) -> "KVStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Wait for pending writes, then release the index. Idempotent."""
        if self._closed:
            return
        if os.getpid() != self.index.pid:  # a forked child: the parent owns the writer
            self._closed = True
            return
        self.flush()
        if self.remote is not None:
            self.remote.close()  # waits (bounded) for uploads, ends downloads
        self._closed = True
        self.writer.close()
        self._readers.shutdown()
        self._allocator.close()
        self.index.close()

    def flush(self) -> None:
        """Wait until every write submitted so far is on disk and indexed."""
        self._check_open()
        self.writer.submit(self._flush_touches)
        self.writer.flush()

    # -- fetch -------------------------------------------------------------

    def fetch(self, tokens, *, salt: salts.Salt = None) -> Tuple[List[Any], int]:
        """Restore the longest stored prefix of ``tokens``.

        Args:
            tokens: The prompt's token ids.
            salt: Reuse only KV saved with this salt (a tenant's tree; see
                :mod:`kvstore.salts`): a string, or a :class:`kvstore.Tenant` (a
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
        self._check_open()
        arr = as_token_array(tokens)
        parts = salts.parse_salt(salt)
        tic = time.perf_counter()
        if self.remote is not None and parts is None:
            # Salted trees stay local: another machine's store has another secret.
            self.remote.before_fetch(arr)  # bounded wait; never raises
        try:
            cache, n = self._fetch(arr, root=self._tree_of(parts)[0])
        except Exception:
            log.exception("kvstore: fetch failed; treating it as a miss")
            with self._lock:
                self._counters.errors += 1
            cache, n = self.new_cache(), 0
        with self._lock:
            c = self._counters
            c.tokens_requested += len(arr)
            c.hits += n > 0
            c.misses += n == 0
            c.tokens_reused += n
            c.restore_seconds += time.perf_counter() - tic
        return cache, n

    # -- save --------------------------------------------------------------

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
        arr = self._checked(tokens, kind, "save", pin=pin, boundaries=boundaries)
        root, group = self._tree_of(salts.parse_salt(salt))
        if not self._storable(cache, len(arr), exact=True):
            return 0
        return self._save(
            arr,
            cache,
            kind=kind,
            pin=pin,
            boundaries=boundaries,
            root=root,
            group=group,
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
        arr = self._checked(tokens, kind, "save", pin=pin)
        root, group = self._tree_of(salts.parse_salt(salt))
        if not self._storable(cache, len(arr), exact=False):
            return 0
        return self._save(
            arr, cache, kind=kind, pin=pin, boundaries=(), root=root, group=group
        )

    def _storable(self, cache: Sequence[Any], ntokens: int, *, exact: bool) -> bool:
        """Check ``cache`` against the layout. A wrong call (token count, layer count)
        raises; a cache whose layers differ from the layout probed at open is logged,
        counted (``saves_refused``) and not saved."""
        try:
            self.layout.check_cache(cache, ntokens, exact=exact)
        except adapters.LayoutMismatch as e:
            log.warning("kvstore: not saved: %s", e)
            with self._lock:
                self._counters.saves_refused += 1
            return False
        return True

    def _checked(
        self, tokens, kind: str, what: str, *, pin=False, boundaries=()
    ) -> np.ndarray:
        """Validate the arguments every write entry point shares."""
        self._check_open()
        arr = as_token_array(tokens)
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
                raise ValueError(
                    f"boundaries[{i}] = {b} is outside the {len(arr)} tokens"
                )
        return arr

    # -- prefill -----------------------------------------------------------

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
        arr = self._checked(tokens, kind, "prefill", pin=pin, boundaries=boundaries)
        check_int("step_tokens", step_tokens, minimum=1)
        root, group = self._tree_of(salts.parse_salt(salt))
        vocab = getattr(getattr(self.model, "args", None), "vocab_size", None)
        if isinstance(vocab, int) and arr.max() >= vocab:
            bad = int(np.flatnonzero(arr >= vocab)[0])
            raise ValueError(
                f"tokens[{bad}] = {arr[bad]} is not below the model's vocab_size {vocab}"
            )
        stored = self.index.read(
            lambda txn: self._walk(txn, arr, limit=len(arr), full_only=True, root=root)
        )
        complete = sum(step.take for step in stored) == len(arr)
        if (
            complete
            and (not self.layout.has_state or stored[-1].rec.has_state)
            and self._intact(stored)
        ):
            self._touch(step.h for step in stored)
            if pin:
                self.writer.submit(
                    lambda: self._write_nodes(
                        [], kind=kind, pin=True, existing=[s.h for s in stored]
                    )
                )
            return {"tokens": len(arr), "computed": 0, "reused": len(arr)}
        cache, n = self.fetch(arr, salt=salt)
        stops = sorted({b for b in boundaries if n < b < len(arr)} | {len(arr)})
        if not self.layout.has_state:
            stops = [len(arr)]  # deltas can be cut anywhere: one save at the end
        pos = n
        for stop in stops:
            self.extend(cache, arr, pos, stop, step_tokens=step_tokens)
            pos = stop
            bounds = [b for b in boundaries if b < stop]
            self._save(
                arr[:stop],
                cache,
                kind=kind,
                pin=pin,
                boundaries=bounds,
                root=root,
                group=group,
            )
        return {"tokens": len(arr), "computed": len(arr) - n, "reused": n}

    def _intact(self, steps: List[Step]) -> bool:
        """Whether the stored nodes' files read back whole (checksums), so a prefill
        may skip them; the first broken one is reported and quarantined as a fetch
        would, and the prefill computes it again."""
        for step in steps:
            rec = step.rec
            parts = [("", rec.nbytes, rec.checksum, self._expected(rec.ntokens))]
            if rec.has_state:
                parts.append((STATE_PART, rec.state_nbytes, rec.state_checksum, None))
            try:
                for part, nbytes, checksum, expected in parts:
                    if part == "" and step.h in self.ram:
                        continue  # checked when it was loaded
                    meta = self.blobs.read_all(
                        self.namespace,
                        step.h,
                        nbytes=nbytes,
                        checksum=checksum,
                        expected=expected,
                        part=part,
                    )[2]
                    self._check_meta(meta)
            except (CorruptBlob, OSError) as e:
                self._read_failed(step.h, e, rec)
                return False
        return True

    def extend(
        self, cache: List[Any], tokens, start: int, end: int, *, step_tokens: int = 512
    ) -> None:
        """Run the model over ``tokens[start:end]`` into ``cache`` (which holds
        ``tokens[:start]``), ``step_tokens`` at a time."""
        arr = as_token_array(tokens)
        tic = time.perf_counter()
        for s in range(start, end, step_tokens):
            self.model(mx.array(arr[s : min(s + step_tokens, end)])[None], cache=cache)
            mx.eval([c.state for c in cache])
        self.note_prefill(end - start, time.perf_counter() - tic)

    def new_cache(self) -> List[Any]:
        """An empty cache of the layout this store holds (what ``fetch`` returns on a miss)."""
        return self.layout.make_cache()

    def lookup(self, tokens, *, salt: salts.Salt = None) -> int:
        """How many tokens :meth:`fetch` would restore now (index only, no file is
        read): a caller holding a prefix elsewhere (a RAM cache) can skip a restore
        that would not be longer. A broken file found later makes the fetch shorter.
        """
        self._check_open()
        arr = as_token_array(tokens)
        root = self._tree_of(salts.parse_salt(salt))[0]
        path = self.index.read(
            lambda txn: self._walk(txn, arr, limit=len(arr) - 1, root=root)
        )
        return sum(step.take for step in path)

    def note_prefill(self, tokens: int, seconds: float) -> None:
        """Tell the store that the model prefilled ``tokens`` tokens in ``seconds``
        (a generate loop's own measurement), for deciding what restores pay (see
        ``restore``). ``kvstore.stream_generate`` and :meth:`prefill` call it;
        the rate is kept in the store for other processes on this host."""
        if self.policy.rates.note_prefill(tokens, seconds):
            self._keep_rates()

    def _keep_rates(self) -> None:
        """Have the measured rates written into the store with the next accesses
        (a save, a flush, close), at most every :data:`kvstore.payoff.PERSIST_EVERY_S`:
        no write of its own, so a fetch never queues one."""
        now, kept = time.monotonic(), self._rates_kept
        if kept is None or now - kept >= payoff.PERSIST_EVERY_S:
            self._rates_kept, self._rates_due = now, True

    def _tree_of(self, parts) -> Tuple[bytes, bytes]:
        """``(tree root, quota root)`` of a salt parsed by ``salts.parse_salt``."""
        if parts is None:
            return self.root, self.root
        if self._secret is None:
            self._secret = salts.store_secret(self.index)
        return salts.tree_of(self.root, self._secret, parts)

    def held_tokens(self, cache: Sequence[Any]) -> Optional[int]:
        """Tokens ``cache`` holds, as far as its layers tell (None: only recurrent
        layers, which do not count their tokens)."""
        return self.layout.held_tokens(cache)

    # -- bookkeeping ---------------------------------------------------------

    def _touch(self, hashes) -> None:
        now = time.time()
        with self._lock:
            for h in hashes:
                self._touched[h] = now
            many = len(self._touched) >= 256
        if many:
            self.writer.submit(self._flush_touches)

    def _take_touches(self) -> Dict[bytes, float]:
        with self._lock:
            touched, self._touched = self._touched, {}
        return touched

    def _apply_touches(self, txn, touched: Dict[bytes, float]) -> None:
        for h, t in touched.items():
            self.index.touch(txn, self.namespace, h, t)
        if self._rates_due:
            self._rates_due = False
            payoff.write_rates(
                txn, self.index.db["meta"], self.namespace, self.policy.rates
            )

    def _flush_touches(self) -> None:
        touched = self._take_touches()
        if touched or self._rates_due:
            self.index.write(lambda txn: self._apply_touches(txn, touched))

    def pin(self, tokens, *, pinned: bool = True) -> int:
        """Pin (or unpin) the stored prefix of ``tokens`` and its ancestors.

        Pinned nodes are never evicted and are loaded into RAM at open. Unpinning
        keeps ancestors that another pinned prompt still needs. Returns the number of
        nodes changed.
        """
        arr = self._checked(tokens, "user", "pin")
        _check_bool("pinned", pinned)
        self.flush()
        path = self.index.read(
            lambda txn: self._walk(txn, arr, limit=len(arr), full_only=True)
        )
        if not path:
            return 0
        return maintenance.pin_path(
            self.path, self.namespace.hex(), path[-1].h.hex(), pinned
        )

    def stats(self) -> Dict[str, Any]:
        """Counts for the store (all namespaces), this model's namespace, and this process."""
        namespaces = self.index.namespaces()
        nodes, tokens, nbytes, pinned = self.index.counters(self.namespace)
        total = self.index.total_bytes()
        remote = {"remote": None} if self.remote is None else self.remote.stats()
        with self._lock:
            c = self._counters
            return {
                "path": self.path,
                "namespace": self.namespace.hex(),
                "namespaces": len(namespaces),
                "nodes": nodes,
                "stored_tokens": tokens,
                "bytes_on_disk": nbytes,
                "pinned_bytes": pinned,
                "store_bytes_on_disk": total,
                "disk_budget": self.disk_bytes,
                "salt_disk_budget": self.salt_disk_bytes,
                "ram_bytes": self.ram.nbytes,
                "ram_entries": len(self.ram),
                "ram_budget": self.ram.max_bytes,
                "hits": c.hits,
                "misses": c.misses,
                "tokens_requested": c.tokens_requested,
                "tokens_reused": c.tokens_reused,
                "restore_seconds": c.restore_seconds,
                "corrupt": c.corrupt,
                "quarantined": list(c.quarantined),
                "errors": c.errors,
                "nodes_written": c.nodes_written,
                "bytes_written": c.bytes_written,
                "nodes_evicted": c.nodes_evicted,
                "nodes_skipped": c.nodes_skipped,
                "writes_dropped": c.writes_dropped,
                "saves_refused": c.saves_refused,
                "writes_failed": self.writer.failed,
                "pending_write_bytes": self.writer.pending_bytes,
                "pending_write_jobs": self.writer.depth,
                "store_problem": self._store_problem(),
                **self.policy.stats(),
                **remote,
            }

    def _store_problem(self) -> Optional[str]:
        """Why the store stopped taking writes (its index files were deleted or
        replaced under this process, see :meth:`Index.check_lock_file`), or None."""
        try:
            self.index.check_lock_file()
        except StoreError:
            pass
        return self.index.problem

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this KVStore is closed")
        if os.getpid() != self.index.pid:
            raise RuntimeError(
                "this KVStore was opened before a fork(); LMDB environments cannot cross "
                "fork(): open a new KVStore in the child process"
            )


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
        if remote._store is not None:
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


def check_store(path: str) -> None:
    """What opening a ``KVStore`` at ``path`` checks before it needs the model: a
    store directory (created when missing), writable, whose index, if it has one,
    is kvstore's, of this format version and whole.

    Raises:
        StoreError: with one line naming the store and the problem.
    """
    _prepare_dir(path)
    if os.path.lexists(os.path.join(path, "index", "data.mdb")):
        Index(os.path.join(path, "index"), create=False).close()
