"""The public ``KVStore`` façade: composes the index, chunk files, RAM tier and writer."""

import atexit
import functools
import logging
import math
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

from . import adapters, maintenance, reservations
from .assemble import AssemblyPlan
from .blobs import (
    DELTA_PART,
    DTYPES,
    MAX_HEADER_BYTES,
    STATE_PART,
    Blobs,
    CorruptBlob,
    metadata_matches,
    node_metadata,
    parse_header,
    serialize_node,
)
from .chunking import as_token_array, chain_hash, chain_hashes, root_hash, split_spans
from .index import KINDS, CorruptRecord, Index, NodeRecord, StoreError
from .maintenance.common import check_int
from .policy import stronger_kind
from .ram import RamEntry, RamTier
from .writer import BackgroundWriter

log = logging.getLogger("kvstore")

# kvstore's own MLX graph work (allocating, slicing) is serialized across threads:
# a server may fetch from HTTP threads while its generation thread saves.
MLX_LOCK = threading.RLock()

DEFAULT_RAM_BYTES = 512 << 20
DEFAULT_MAX_PENDING_BYTES = 2 << 30


@dataclass
class _Step:
    """One node on a walked path and how many of its tokens are used."""

    h: bytes
    rec: NodeRecord
    take: int


@dataclass
class _NewNode:
    """A node to write: its delta slices (None: already stored) and maybe a state."""

    h: bytes
    parent: bytes
    start: int
    tokens: np.ndarray
    slices: Optional[Dict[str, mx.array]]
    state: Optional[Dict[str, Tuple[str, mx.array]]] = None
    raw: Optional[Dict[str, bytes]] = None  # files by part, validated (remote tier)


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
    writes_dropped: int = 0
    quarantined: List[str] = field(default_factory=list)


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
        max_pending_bytes: Writes waiting for the disk beyond this are dropped.
        read_threads: Threads reading chunk files in parallel during a restore.
        kv_bits: Store and return ``QuantizedKVCache`` layers of this many bits in
            place of the model's ``KVCache`` layers (as mlx-lm's ``--kv-bits``).
        kv_group_size: Quantization group size with ``kv_bits``.
        remote: A shared remote tier behind the disk: an ``s3://bucket/prefix`` URL
            or a :class:`kvstore.remote.RemoteTier` (needs boto3). Fetches download
            what the remote has beyond the local nodes; new nodes are uploaded in the
            background. A failing remote is logged and counted, never raised.

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
        max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES,
        read_threads: int = 2,
        kv_bits: Optional[int] = None,
        kv_group_size: int = 64,
        remote=None,
    ):
        check_int("chunk_tokens", chunk_tokens, minimum=1)
        check_int("kv_group_size", kv_group_size, minimum=1)
        if kv_bits is not None:
            check_int("kv_bits", kv_bits, minimum=1)
        check_int("ram_bytes", ram_bytes, minimum=0)
        check_int("max_pending_bytes", max_pending_bytes, minimum=0)
        check_int("read_threads", read_threads, minimum=1)
        if disk_bytes is not None:
            check_int("disk_bytes", disk_bytes, minimum=0)
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(
                f"path must be a str or os.PathLike, got {type(path).__name__}"
            )
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
        self.path = os.fspath(path)
        self.remote = _remote_tier(remote)
        _prepare_dir(self.path)

        self.model = model
        self.tokenizer = tokenizer
        self.chunk_tokens = chunk_tokens
        self.disk_bytes = disk_bytes
        self.layout = adapters.probe_layout(
            model, _cache_maker(model, kv_bits, kv_group_size)
        )
        from .namespace import fingerprint

        self.namespace, self.description = fingerprint(
            model, tokenizer, self.layout, chunk_tokens=chunk_tokens
        )
        self.root = root_hash(self.namespace)

        self.index = Index(os.path.join(self.path, "index"))
        self.index.register_namespace(self.namespace, self.description)
        # Reservations of saves that died with their process (or this one) free up.
        reservations.drop_stale(self.index)
        if disk_bytes is not None:  # for tools that work without the model (kvstore gc)
            maintenance.write_disk_budget(self.index, disk_bytes)
        self.blobs = Blobs(
            os.path.join(self.path, "blobs"), os.path.join(self.path, "quarantine")
        )
        self.ram = RamTier(ram_bytes)
        self.writer = BackgroundWriter(max_pending_bytes=max_pending_bytes)
        self._readers = ThreadPoolExecutor(
            read_threads, thread_name_prefix="kvstore-read"
        )
        self._counters = _Counters()
        self._lock = threading.Lock()
        self._touched: Dict[bytes, float] = {}
        self._broken: set = set()
        self._expected_by_size: Dict[int, Dict[str, Tuple[str, Tuple]]] = {}
        self._data_bytes: Dict[int, int] = {}  # a node file's data bytes, by tokens
        self._staging = threading.local()  # per reader thread: one node file at a time
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
        self.index.close()

    def flush(self) -> None:
        """Wait until every write submitted so far is on disk and indexed."""
        self._check_open()
        self.writer.submit(self._flush_touches)
        self.writer.flush()

    # -- fetch -------------------------------------------------------------

    def fetch(self, tokens) -> Tuple[List[Any], int]:
        """Restore the longest stored prefix of ``tokens``.

        Returns:
            ``(cache, n)``: fresh cache objects (owned by the caller) holding the KV
            of ``tokens[:n]``, with ``n <= len(tokens) - 1``. On a miss, or when a
            stored file turns out to be broken, an empty cache and ``n == 0``.

        Raises:
            TypeError, ValueError: ``tokens`` is not a list of token ids.
        """
        self._check_open()
        arr = as_token_array(tokens)
        tic = time.perf_counter()
        if self.remote is not None:
            self.remote.before_fetch(arr)  # bounded wait; never raises
        try:
            cache, n = self._fetch(arr)
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

    def _fetch(self, arr: np.ndarray, retries: int = 2) -> Tuple[List[Any], int]:
        path = self.index.read(lambda txn: self._walk(txn, arr, limit=len(arr) - 1))
        if not path:
            return self.new_cache(), 0
        with MLX_LOCK:
            plan = AssemblyPlan(self.layout.rows, sum(step.take for step in path))
        jobs, offset = [], 0  # (index of the node in path, future)
        if self.layout.rows:  # a layout of state layers only has nothing to copy
            for i, step in enumerate(path):
                jobs.append(
                    (i, self._readers.submit(self._read_node, step, plan, offset))
                )
                offset += step.take
        state = None
        if self.layout.has_state:
            last = len(path) - 1
            jobs.append((last, self._readers.submit(self._read_state, path[last])))
        failed = len(path)
        for at, job in jobs:
            error = job.exception()
            if error is None:
                continue
            if at >= failed:
                continue  # only the first broken node counts: the rest is cut anyway
            failed = at
            if isinstance(error, (CorruptBlob, CorruptRecord, OSError)):
                self._report_broken(path[at].h, str(error))
            else:
                log.error("kvstore: reading node failed", exc_info=error)
                with self._lock:
                    self._counters.errors += 1
        if self.layout.has_state:
            if failed < len(path):
                # The checkpoint's path is broken: look again (broken nodes are skipped
                # now) for the next best checkpoint.
                return (
                    self._fetch(arr, retries - 1) if retries else (self.new_cache(), 0)
                )
            state = jobs[-1][1].result()
        path = path[:failed]  # a broken node: keep only what precedes it
        n = sum(step.take for step in path)
        if n == 0:
            return self.new_cache(), 0
        self._touch(step.h for step in path)
        with MLX_LOCK:
            return self.layout.build(plan.delta_arrays(n), state or {}, n), n

    def _walk(
        self, txn, arr: np.ndarray, *, limit: int, full_only: bool = False
    ) -> List[_Step]:
        """Follow stored nodes along ``arr[:limit]``, checking every node's tokens.

        With ``full_only`` the walk stops before a node that is not wholly used. A
        layout with state layers restores only at a node holding a checkpoint: its
        fetch walk returns the longest such path.
        """
        checkpoints = self.layout.has_state and not full_only
        full_only = full_only or checkpoints
        path: List[_Step] = []
        best: List[_Step] = []  # the longest path ending at a checkpoint
        best_end = 0
        parent, pos, C = self.root, 0, self.chunk_tokens
        while pos < limit:
            usable = [
                step
                for step in self._candidates(
                    txn, parent, arr[pos : pos + C], checkpoints
                )
                if step.rec.start == pos
            ]
            for step in usable:
                step.take = min(step.take, limit - pos)
            if full_only:
                usable = [step for step in usable if step.take == step.rec.ntokens]
            if checkpoints:
                for step in usable:
                    if step.rec.has_state and pos + step.take > best_end:
                        best, best_end = path + [step], pos + step.take
            if not usable:
                break
            step = usable[0]
            path.append(step)
            if step.take < step.rec.ntokens:
                break
            parent, pos = step.h, pos + step.take
        return best if checkpoints else path

    def _candidates(
        self, txn, parent: bytes, query: np.ndarray, checkpoints: bool
    ) -> List[_Step]:
        """Children of ``parent`` matching a prefix of ``query``, longest match first.

        With ``checkpoints``, every child whose tokens are a prefix of the query: a
        shorter sibling may hold the only checkpoint (a system prompt's tail stored
        after a longer prompt without that boundary).
        """
        out = []
        if len(query) == self.chunk_tokens:  # the common case: found by its hash
            h = chain_hash(parent, query)
            rec = self._get_node(txn, h)
            if rec is not None and np.array_equal(rec.tokens, query):
                out.append(_Step(h, rec, len(query)))
                if not checkpoints:
                    return out
        out += [
            _Step(h, rec, common)
            for h, rec, common in self.index.nearest_children(
                self.namespace, parent, query, txn, on_corrupt=self._corrupt_record
            )
            if h not in self._broken
        ]
        if checkpoints:
            out += self._shorter_children(txn, parent, query)
        unique = {step.h: step for step in reversed(out)}  # keep the first of each
        return sorted(unique.values(), key=lambda step: -step.take)

    def _shorter_children(self, txn, parent: bytes, query: np.ndarray) -> List[_Step]:
        """Children whose tokens are a strict prefix of ``query`` (found by hash)."""
        out = []
        for h, rec in self.index.prefix_children(
            self.namespace, parent, query, txn, on_corrupt=self._corrupt_record
        ):
            if h not in self._broken and np.array_equal(
                rec.tokens, query[: rec.ntokens]
            ):
                out.append(_Step(h, rec, rec.ntokens))
        return out

    def _get_node(self, txn, h: bytes) -> Optional[NodeRecord]:
        if h in self._broken:
            return None
        try:
            return self.index.get_node(self.namespace, h, txn)
        except CorruptRecord as e:
            self._corrupt_record(h, e)
            return None

    def _corrupt_record(self, h: bytes, error: CorruptRecord) -> None:
        self._report_broken(h, f"index record: {error}")

    def _check_sizes(self, rec: NodeRecord) -> None:
        """Refuse a record whose sizes no node file of this store has, before anything
        is allocated for it: a corrupt record must not cost gigabytes of memory."""
        if rec.ntokens > self.chunk_tokens:
            raise CorruptRecord(
                f"record holds {rec.ntokens} tokens, nodes hold at most "
                f"{self.chunk_tokens}"
            )
        data = self._data_bytes.get(rec.ntokens)
        if data is None:
            data = self._data_bytes[rec.ntokens] = sum(
                math.prod(shape) * DTYPES[dtype][1]
                for dtype, shape in self._expected(rec.ntokens).values()
            )
        if not data + 8 < rec.nbytes <= data + 8 + MAX_HEADER_BYTES:
            raise CorruptRecord(
                f"record says the file has {rec.nbytes} bytes; a node of "
                f"{rec.ntokens} tokens has {data} bytes of data and a header"
            )

    def _read_node(self, step: _Step, plan: AssemblyPlan, offset: int) -> None:
        """Copy the first ``step.take`` tokens of one node to row ``offset`` of the plan.

        Raises CorruptBlob or OSError when the node's file is broken.
        """
        rec, key = step.rec, step.h
        entry = self.ram.get(key)
        if entry is not None:
            data, tensors = memoryview(entry.data), entry.tensors
        elif step.take == rec.ntokens:
            # The whole node: read straight into the plan's arrays (one copy).
            self._check_sizes(rec)
            meta = self.blobs.read_into(
                self.namespace,
                key,
                nbytes=rec.nbytes,
                checksum=rec.checksum,
                expected=self._expected(rec.ntokens),
                targets=functools.partial(
                    plan.node_targets, offset=offset, node_tokens=rec.ntokens
                ),
            )
            self._check_meta(meta)
            return
        else:
            self._check_sizes(rec)
            staging = getattr(self._staging, "buf", None)
            if staging is None or len(staging) < rec.nbytes:
                # A new buffer rather than a resize: an earlier view may still be alive.
                staging = self._staging.buf = bytearray(rec.nbytes)
            data, tensors, meta = self.blobs.read_staged(
                self.namespace,
                key,
                nbytes=rec.nbytes,
                checksum=rec.checksum,
                expected=self._expected(rec.ntokens),
                staging=staging,
            )
            self._check_meta(meta)
        plan.copy_node(
            data, tensors, offset=offset, take=step.take, node_tokens=rec.ntokens
        )

    def _read_state(self, step: _Step):
        """The decoded checkpoint of ``step``'s node (see ``Layout.decode_state``).

        Raises CorruptBlob or OSError when the node's state file is broken.
        """
        rec, key = step.rec, _state_key(step.h)
        entry = self.ram.get(key)
        if entry is not None:
            data, tensors = memoryview(entry.data), entry.tensors
        else:
            data, tensors, meta = self.blobs.read_all(
                self.namespace,
                step.h,
                nbytes=rec.state_nbytes,
                checksum=rec.state_checksum,
                expected=None,
                part=STATE_PART,
            )
            self._check_meta(meta)
            data = memoryview(data)
        return self.layout.decode_state(data, tensors, rec.end)

    def _check_meta(self, meta: dict) -> None:
        if not metadata_matches(meta, self.namespace):
            raise CorruptBlob("file belongs to another namespace")

    def _report_broken(self, h: bytes, reason: str) -> None:
        with self._lock:
            if h in self._broken:
                return
            self._broken.add(h)
            self._counters.corrupt += 1
        log.warning(
            "kvstore: node %s is broken (%s); treating it as a miss",
            h.hex()[:12],
            reason,
        )
        self._forget(h)
        self.writer.submit(lambda: self._quarantine(h, reason))

    # -- save --------------------------------------------------------------

    def save(
        self,
        tokens,
        cache: Sequence[Any],
        *,
        kind: str = "user",
        pin: bool = False,
        boundaries: Sequence[int] = (),
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

        Returns:
            The number of new nodes queued for writing.
        """
        arr = self._checked(tokens, kind, "save", pin=pin, boundaries=boundaries)
        self.layout.check_cache(cache, len(arr))
        return self._save(arr, cache, kind=kind, pin=pin, boundaries=boundaries)

    def save_prefix(
        self, tokens, cache: Sequence[Any], *, kind: str = "user", pin: bool = False
    ) -> int:
        """Like :meth:`save`, for a cache that may hold more tokens than ``tokens``
        (a generate loop's cache after the first new token): only the prefix is stored.
        A layout with state layers (sliding windows, recurrent state) cannot be cut
        back, so its cache must hold exactly ``tokens``.
        """
        arr = self._checked(tokens, kind, "save", pin=pin)
        self.layout.check_cache(cache, len(arr), exact=False)
        return self._save(arr, cache, kind=kind, pin=pin, boundaries=())

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

    def _save(self, arr, cache, *, kind, pin, boundaries) -> int:
        path = self.index.read(
            lambda txn: self._walk(txn, arr, limit=len(arr), full_only=True)
        )
        pos = sum(step.take for step in path)
        parent = path[-1].h if path else self.root
        spans = split_spans(pos, len(arr), self.chunk_tokens, boundaries)
        hashes = chain_hashes(parent, arr, spans)
        nodes, nbytes = [], 0
        with MLX_LOCK:
            for (s, e), h in zip(spans, hashes):
                slices = self.layout.node_slices(cache, s, e)
                nbytes += sum(x.nbytes for x in slices.values())
                nodes.append(_NewNode(h, parent, s, arr[s:e].copy(), slices))
                parent = h
            if self.layout.has_state and (nodes or not path[-1].rec.has_state):
                # The checkpoint of the state layers at the end of ``arr``.
                if not nodes:
                    last = path[-1]
                    nodes.append(
                        _NewNode(
                            last.h,
                            last.rec.parent,
                            last.rec.start,
                            last.rec.tokens,
                            None,
                        )
                    )
                nodes[-1].state = self.layout.state_arrays(cache)
                nbytes += sum(a.nbytes for _, a in nodes[-1].state.values())
            # Views of the cache's buffers: no copy, and immune to the caller's updates.
            mx.eval([(n.slices, n.state) for n in nodes])
        existing = [step.h for step in path]
        self._touch(existing)

        def job():
            self._write_nodes(nodes, kind=kind, pin=pin, existing=existing)

        if (nodes or pin) and not self.writer.submit(job, nbytes):
            with self._lock:
                self._counters.writes_dropped += 1
            log.warning(
                "kvstore: %d bytes of writes pending; dropped a save",
                self.writer.pending_bytes,
            )
            return 0
        return len(nodes)

    def _serialize(self, node: _NewNode) -> Tuple[Optional[bytes], Optional[bytes]]:
        """Writer thread: the bytes of the files of ``node`` that the index lacks, its
        delta file and its state file (None: nothing to write)."""
        ns = self.namespace
        rec = self.index.get_node(ns, node.h)
        if node.raw is not None:  # downloaded and validated by the remote tier
            raw, node.raw = node.raw, None
            return (
                raw.get(DELTA_PART) if rec is None else None,
                raw.get(STATE_PART) if rec is None or not rec.has_state else None,
            )
        delta = state = None
        if rec is None and node.slices is not None:
            expected = self._expected(len(node.tokens))
            tensors = {
                name: (*expected[name], np.ascontiguousarray(np.asarray(x)))
                for name, x in node.slices.items()
            }
            delta = serialize_node(tensors, node_metadata(ns))
        if node.state is not None and (rec is None or not rec.has_state):
            tensors = {
                name: (dtype, a.shape, np.ascontiguousarray(np.asarray(a)))
                for name, (dtype, a) in node.state.items()
            }
            state = serialize_node(tensors, node_metadata(ns))
        node.slices = node.state = None  # release the cache's buffers early
        return delta, state

    def _publish(
        self, node: _NewNode, files: tuple, attempts: list
    ) -> Tuple[Optional[tuple], Optional[tuple]]:
        """Writer thread: write the ``(delta, state)`` bytes of :meth:`_serialize`, as
        ``(data, Published)`` pairs (None where there were no bytes).

        Every write is first noted in ``attempts`` as ``(hash, part, bytes)``, so that
        a failed save can remove what it published (:meth:`_release_failed_save`).
        """
        ns, (delta_data, state_data) = self.namespace, files
        delta = state = None
        if delta_data is not None:
            attempts.append((node.h, DELTA_PART, delta_data))
            delta = (delta_data, self.blobs.write(ns, node.h, delta_data))
        if state_data is not None:
            attempts.append((node.h, STATE_PART, state_data))
            state = (state_data, self.blobs.write(ns, node.h, state_data, STATE_PART))
        return delta, state

    def _reserve(self, nodes: List[_NewNode], files: List[tuple]) -> Optional[bytes]:
        """Writer thread: reserve the disk bytes of ``files`` in the index, evicting what
        the budget needs, and unlink the evicted nodes' files.

        Returns:
            The reservation's key (the commit deletes it), or None when nothing is
            to be written.
        """
        nbytes = sum(len(data) for pair in files for data in pair if data is not None)
        if nbytes == 0:
            return None
        ns = self.namespace
        # The nodes the new ones hang from, and nodes getting only a checkpoint.
        keep = {(ns, node.parent) for node in nodes}
        keep |= {(ns, node.h) for node, (delta, _) in zip(nodes, files) if not delta}
        key = reservations.new_key()
        touched = self._take_touches()

        def reserve(txn):
            self._apply_touches(txn, touched)  # eviction order must see them
            return maintenance.reserve_room(
                self.index, txn, self.disk_bytes, nbytes, key=key, keep=keep
            )

        try:
            evicted = self.index.write(reserve)
            self._release_evicted(evicted)
        except BaseException:
            self._unreserve(key)
            raise
        return key

    def _unreserve(self, key: bytes) -> None:
        """Delete reservation ``key``. If that fails, this process forgets it anyway, so
        its next reservation (or anyone's, after the timeout) drops it as stale."""
        try:
            self.index.write(lambda txn: reservations.delete(self.index, txn, key))
        except Exception:
            log.exception("kvstore: cannot delete a disk reservation")
        finally:
            reservations.forget(key)

    def _write_nodes(
        self, nodes: List[_NewNode], *, kind: str, pin: bool, existing: List[bytes]
    ):
        """Writer thread: serialize the files, reserve their bytes under the disk budget
        (:meth:`_reserve`), write them, then commit their nodes in one transaction that
        also drops the reservation. A file is reserved until it is indexed or unlinked.
        """
        ns = self.namespace
        files = [self._serialize(node) for node in nodes]
        written, attempts, reservation = [], [], None
        try:
            # Reserve (evicting), unlink the evicted files, only then write: files on
            # disk stay <= indexed + reserved bytes, and reserving keeps that <= budget.
            if self.disk_bytes is not None:
                reservation = self._reserve(nodes, files)
            for node, pair in zip(nodes, files):
                written.append((node, *self._publish(node, pair, attempts)))
        except BaseException:
            self._release_failed_save(attempts, reservation)
            raise
        now = time.time()
        evicted, unindexed, late = [], [], [0]

        def is_ours(h: bytes, published, part: str = "") -> bool:
            # Index only the very file we checked: one removed (or replaced) by another
            # process since then must not be indexed with our checksum.
            return self.blobs.published_inode(ns, h, part) == published.inode

        def commit(txn):
            added, superseded = [], []
            if reservation is not None:
                reservations.delete(self.index, txn, reservation)
            evicted[:] = self._make_room(txn, written)
            for node, delta, state in written:
                if state is not None and not is_ours(node.h, state[1], STATE_PART):
                    state = None
                if delta is None:
                    rec = self.index.get_node(ns, node.h, txn)
                    if state is None or rec is None or rec.has_state:
                        continue
                    # A checkpoint for a node stored without one.
                    rec = _with_state(rec, state[1])
                    self.index.replace_node(txn, ns, node.h, rec)
                    added.append((node.h, rec, None, state[0]))
                    continue
                parent_ok = node.parent == self.root or self.index.get_node(
                    ns, node.parent, txn
                )
                if not parent_ok or not is_ours(node.h, delta[1]):
                    break
                rec = NodeRecord(
                    node.parent,
                    node.start,
                    node.tokens,
                    delta[1].nbytes,
                    delta[1].checksum,
                    kind,
                    pin,
                    now,
                )
                if state is not None:
                    rec = _with_state(rec, state[1])
                if self.index.put_node(txn, ns, node.h, rec):
                    if not added and not self.layout.has_state:
                        superseded = self._supersede(txn, node.h, rec)
                    # The RAM tier holds our bytes only if they are the file's.
                    added.append(
                        (
                            node.h,
                            rec,
                            delta[0] if delta[1].ours else None,
                            state[0] if state is not None and state[1].ours else None,
                        )
                    )
            if pin:
                for h in existing + [node.h for node, _, _ in written]:
                    self.index.set_pinned(txn, ns, h, True)
            indexed = {h for h, *_ in added}
            unindexed[:] = [a for a in attempts if a[0] not in indexed]
            if reservation is not None:
                # Files this commit leaves unindexed stay reserved until unlinked.
                late[0] = sum(rec.total_bytes for _, rec in evicted if rec is not None)
                late[0] += sum(rec.total_bytes for _, rec in superseded)
                late[0] += sum(len(data) for _, _, data in unindexed)
                if late[0]:
                    reservations.put(self.index, txn, reservation, late[0])
            return added, superseded

        try:
            added, superseded = self.index.write(commit)
        except BaseException:
            self._release_failed_save(attempts, reservation)
            raise
        try:
            self._release_evicted(evicted)
            self._unlink_unindexed([h for h, _ in superseded])
            # Files of nodes the commit skipped (their parent was evicted meanwhile,
            # say) would be orphans: remove them unless another save indexed them.
            self._remove_written(unindexed)
        finally:
            if reservation is not None and late[0]:
                self._unreserve(reservation)
            elif reservation is not None:
                reservations.forget(reservation)  # the commit deleted it
        for h, rec, data, state_data in added:
            for key, raw in ((h, data), (_state_key(h), state_data)):
                if raw is not None and self.ram.max_bytes >= len(raw):
                    _, tensors, _ = parse_header(raw, len(raw))
                    self.ram.put(key, RamEntry(raw, tensors, rec.kind, rec.pinned))
        with self._lock:
            self._broken.difference_update(h for h, *_ in added)  # healed by a rewrite
            self._counters.nodes_written += len(added)
            self._counters.bytes_written += sum(rec.total_bytes for _, rec, *_ in added)
        if self.remote is not None and added:
            self.remote.after_commit(added)  # queues uploads; returns at once
        self._enforce_disk_budget()

    def _release_failed_save(
        self, attempts: list, reservation: Optional[bytes] = None
    ) -> None:
        """A save failed before its commit (disk full, I/O error): remove the files it
        published (:meth:`_remove_written`), so that nothing of it stays on disk and the
        space comes back; then delete its disk reservation."""
        try:
            self._remove_written(attempts)
        finally:
            if reservation is not None:
                self._unreserve(reservation)

    def _remove_written(self, attempts: list) -> None:
        """Remove the files of ``attempts``, ``(hash, part, bytes)`` of writes tried, that
        no index record names.

        A file is removed only if it holds those very bytes (published by us, maybe
        before an error). :func:`kvstore.maintenance.release_files` keeps any file the
        index refers to.
        """
        if not attempts:
            return
        ns = self.namespace
        keys = []
        for h, part, data in attempts:
            try:
                with open(self.blobs.path(ns, h, part), "rb") as f:
                    if f.read(len(data) + 1) == data:
                        keys.append((ns, h))
            except OSError:
                pass  # no file (or an unreadable one, left to `kvstore gc`)
        try:
            maintenance.release_files(self.index, self.blobs, keys)
        except Exception:
            log.exception("kvstore: cannot remove the files of a failed save")

    def _expected(self, ntokens: int) -> Dict[str, Tuple[str, Tuple]]:
        """The tensors of a node file of ``ntokens`` tokens (one shared dict per size)."""
        expected = self._expected_by_size.get(ntokens)
        if expected is None:
            expected = self.layout.delta_tensors(ntokens)
            self._expected_by_size[ntokens] = expected
        return expected

    def _supersede(
        self, txn, h: bytes, rec: NodeRecord
    ) -> List[Tuple[bytes, NodeRecord]]:
        """Drop unpinned leaf siblings whose tokens are a strict prefix of the new node's.

        The new node can be sliced to restore them, so keeping them only costs bytes.
        Returns their ``(hash, record)``.
        """
        gone = []
        for sib, srec, common in self.index.nearest_children(
            self.namespace, rec.parent, rec.tokens, txn, on_corrupt=self._corrupt_record
        ):
            if (
                sib != h
                and common == srec.ntokens < rec.ntokens
                and not srec.pinned
                and not self.index.has_children(txn, self.namespace, sib)
            ):
                if stronger_kind(srec.kind, rec.kind) != rec.kind:
                    continue  # keep a system prompt's tail rather than demote it
                self.index.delete_node(txn, self.namespace, sib)
                gone.append((sib, srec))
        return gone

    # -- removal -------------------------------------------------------------

    def _unlink_unindexed(self, hashes: Sequence[bytes]) -> None:
        """Unlink files of deleted nodes, re-checking the index under the writer lock
        (:func:`kvstore.maintenance.release_files`)."""
        for h in hashes:
            self._forget(h)
        maintenance.release_files(
            self.index, self.blobs, [(self.namespace, h) for h in hashes]
        )

    def _quarantine(self, h: bytes, reason: str) -> None:
        """Writer thread: remove a broken node and its descendants from the index, then
        move its file to quarantine and unlink theirs."""
        ns = self.namespace
        gone = self.index.write(
            lambda txn: maintenance.delete_subtree(self.index, txn, ns, h)
        )
        keys = [(ns, h)] + [(ns, x) for x, _ in gone if x != h]
        for _, x in keys:
            self._forget(x)
        released = maintenance.release_files(
            self.index, self.blobs, keys, quarantine={(ns, h): reason}
        )
        if released.quarantined:
            with self._lock:
                self._counters.quarantined.extend(released.quarantined)

    def _make_room(self, txn, written: list) -> list:
        """In the commit's transaction: evict what the new nodes need to fit the disk
        budget (:func:`kvstore.maintenance.make_room`), sparing the nodes they hang from.
        """
        if self.disk_bytes is None:
            return []
        ns, nodes_db = self.namespace, self.index.db["nodes"]
        new = [
            (node, delta[1].nbytes + (state[1].nbytes if state else 0))
            for node, delta, state in written
            if delta is not None and txn.get(ns + node.h, db=nodes_db) is None
        ]
        if not new:
            return []
        return maintenance.make_room(
            self.index,
            txn,
            self.disk_bytes,
            sum(nbytes for _, nbytes in new),
            keep={(ns, node.parent) for node, _ in new},
        )

    def _release_evicted(self, evicted: list) -> None:
        """After the commit: unlink the files of the nodes :meth:`_make_room` evicted."""
        if not evicted:
            return
        for (ns, h), _ in evicted:
            if ns == self.namespace:
                self._forget(h)
        maintenance.release_files(self.index, self.blobs, [key for key, _ in evicted])
        with self._lock:
            self._counters.nodes_evicted += len(evicted)

    def _enforce_disk_budget(self) -> None:
        """Evict least recently used unpinned leaves until the store fits ``disk_bytes``
        (:func:`kvstore.maintenance.evict_to_budget`)."""
        if self.disk_bytes is None:
            return
        self._flush_touches()  # eviction order must see the latest accesses
        evicted = maintenance.evict_to_budget(self.index, self.blobs, self.disk_bytes)
        for (_, h), _ in evicted.gone:
            self._forget(h)
        with self._lock:
            self._counters.nodes_evicted += evicted.nodes
        if evicted.excess:
            log.warning(
                "kvstore: disk budget exceeded by %d bytes that cannot be evicted (pinned)",
                evicted.excess,
            )

    # -- prefill -----------------------------------------------------------

    def prefill(
        self,
        tokens,
        *,
        kind: str = "system",
        pin: bool = False,
        boundaries: Sequence[int] = (),
        step_tokens: int = 512,
    ) -> Dict[str, int]:
        """Compute what is missing of ``tokens`` (after the longest stored prefix) and save it.

        With state layers (sliding windows, recurrent state) the computation stops at
        every boundary to save a checkpoint there, so each message end is restorable.

        Returns:
            ``{"tokens": len, "computed": model tokens run, "reused": tokens restored}``.
        """
        arr = self._checked(tokens, kind, "prefill", pin=pin, boundaries=boundaries)
        check_int("step_tokens", step_tokens, minimum=1)
        vocab = getattr(getattr(self.model, "args", None), "vocab_size", None)
        if isinstance(vocab, int) and arr.max() >= vocab:
            bad = int(np.flatnonzero(arr >= vocab)[0])
            raise ValueError(
                f"tokens[{bad}] = {arr[bad]} is not below the model's vocab_size {vocab}"
            )
        stored = self.index.read(
            lambda txn: self._walk(txn, arr, limit=len(arr), full_only=True)
        )
        complete = sum(step.take for step in stored) == len(arr)
        if complete and (not self.layout.has_state or stored[-1].rec.has_state):
            self._touch(step.h for step in stored)
            if pin:
                self.writer.submit(
                    lambda: self._write_nodes(
                        [], kind=kind, pin=True, existing=[s.h for s in stored]
                    )
                )
            return {"tokens": len(arr), "computed": 0, "reused": len(arr)}
        cache, n = self.fetch(arr)
        stops = sorted({b for b in boundaries if n < b < len(arr)} | {len(arr)})
        if not self.layout.has_state:
            stops = [len(arr)]  # deltas can be cut anywhere: one save at the end
        pos = n
        for stop in stops:
            self.extend(cache, arr, pos, stop, step_tokens=step_tokens)
            pos = stop
            bounds = [b for b in boundaries if b < stop]
            self._save(arr[:stop], cache, kind=kind, pin=pin, boundaries=bounds)
        return {"tokens": len(arr), "computed": len(arr) - n, "reused": n}

    def extend(
        self, cache: List[Any], tokens, start: int, end: int, *, step_tokens: int = 512
    ) -> None:
        """Run the model over ``tokens[start:end]`` into ``cache`` (which holds
        ``tokens[:start]``), ``step_tokens`` at a time."""
        arr = as_token_array(tokens)
        for s in range(start, end, step_tokens):
            self.model(mx.array(arr[s : min(s + step_tokens, end)])[None], cache=cache)
            mx.eval([c.state for c in cache])

    def new_cache(self) -> List[Any]:
        """An empty cache of the layout this store holds (what ``fetch`` returns on a miss)."""
        return self.layout.make_cache()

    def held_tokens(self, cache: Sequence[Any]) -> Optional[int]:
        """Tokens ``cache`` holds, as far as its layers tell (None: only recurrent
        layers, which do not count their tokens)."""
        return self.layout.held_tokens(cache)

    def _forget(self, h: bytes) -> None:
        """Drop node ``h``'s files from the RAM tier."""
        self.ram.discard(h)
        self.ram.discard(_state_key(h))

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

    def _flush_touches(self) -> None:
        touched = self._take_touches()
        if touched:
            self.index.write(lambda txn: self._apply_touches(txn, touched))

    def _preload_pinned(self) -> None:
        """Load pinned nodes' files into the RAM tier (as far as its budget allows)."""
        if self.ram.max_bytes == 0:
            return
        for h in self.index.pinned(self.namespace):
            try:
                rec = self.index.get_node(self.namespace, h)
                if (
                    rec is None
                    or self.ram.nbytes + rec.total_bytes > self.ram.max_bytes
                ):
                    continue
                self._check_sizes(rec)
                parts = [(h, rec.nbytes, rec.checksum, "", self._expected(rec.ntokens))]
                if rec.has_state:
                    parts.append(
                        (
                            _state_key(h),
                            rec.state_nbytes,
                            rec.state_checksum,
                            STATE_PART,
                            None,
                        )
                    )
                for key, nbytes, checksum, part, expected in parts:
                    data, tensors, meta = self.blobs.read_all(
                        self.namespace,
                        h,
                        nbytes=nbytes,
                        checksum=checksum,
                        expected=expected,
                        part=part,
                    )
                    self._check_meta(meta)
                    if part == STATE_PART:
                        self.layout.decode_state(memoryview(data), tensors, rec.end)
                    self.ram.put(key, RamEntry(data, tensors, rec.kind, True))
            except (CorruptBlob, CorruptRecord, OSError) as e:
                self._report_broken(h, str(e))

    def pin(self, tokens, *, pinned: bool = True) -> int:
        """Pin (or unpin) the stored prefix of ``tokens`` and its ancestors.

        Pinned nodes are never evicted and are loaded into RAM at open. Unpinning
        keeps ancestors that another pinned prompt still needs. Returns the number of
        nodes changed.
        """
        from . import maintenance

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
                "writes_dropped": c.writes_dropped + self.writer.dropped,
                "writes_failed": self.writer.failed,
                "pending_write_bytes": self.writer.pending_bytes,
                **remote,
            }

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this KVStore is closed")
        if os.getpid() != self.index.pid:
            raise RuntimeError(
                "this KVStore was opened before a fork(); LMDB environments cannot cross "
                "fork(): open a new KVStore in the child process"
            )


def _state_key(h: bytes) -> bytes:
    """The RAM tier's key for node ``h``'s state file (``h`` is its delta file's)."""
    return h + STATE_PART.encode()


def _check_bool(name: str, value) -> None:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(
            f"{name} must be True or False, got {type(value).__name__} {value!r}"
        )


def _with_state(rec: NodeRecord, published) -> NodeRecord:
    """``rec`` with the state file ``published`` attached."""
    fields = {**rec.__dict__, "state_nbytes": published.nbytes}
    fields["state_checksum"] = published.checksum
    return NodeRecord(**fields)


def _remote_tier(remote):
    """``KVStore``'s ``remote`` argument as an unbound RemoteTier, or None."""
    if remote is None:
        return None
    from .remote import RemoteTier

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
    """Create a new store directory, or check that an existing one is a store."""
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
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise StoreError(
            f"cannot create the store directory {path}: {e.strerror}"
        ) from None
