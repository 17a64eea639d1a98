"""The read path of ``KVStore``: walking the trie (:mod:`.walk`), reading and checking
node files.

:class:`ReadPath` owns its trie walk, its reader threads and the thread allocating a
restore's arrays; it is given the index, node files, RAM tier, layout and the parts it
shares with the write path and removal.
"""

import functools
import itertools
import logging
import os
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import numpy as np
from mlx_lm.models.cache import KVCache

from ..disk.adapters import Layout
from ..disk.blobs import STATE_PART, Blobs, CorruptBlob, OpenFile
from ..disk.index import CorruptRecord, Index, IndexDamaged
from ..platform import devices
from .accesses import Accesses
from .assemble import AssemblyPlan, PlanAllocator
from .counters import Counters
from .loadpath import Failures, FileSource, MemorySource, load_arrays
from .payoff import READS, Decision, RestorePolicy
from .ram import RamEntry, RamTier
from .shapes import NodeShapes
from .walk import Step, TrieWalk

log = logging.getLogger("kvstore")

# kvstore's own MLX graph work (allocating, slicing) is serialized across threads:
# a server may fetch from HTTP threads while its generation thread saves.
MLX_LOCK = threading.RLock()
# Node files opened (header checked) while a restore's arrays are allocated: about as
# many as that allocation takes to hide, and a bound on the descriptors a fetch holds.
OPEN_AHEAD = 64

_Opened = Union[OpenFile, BaseException, None]  # a node's file, opened ahead or not


# Restores of less KV than this get no room: room needs a buffer of its own per tensor
# (MLX copies a shared buffer on the first update), and allocating a model's 60 of
# them cost 2.5-6 ms here, about what growing an exactly full cache copies at 16-32
# MiB (measured: 4K float16 first update 70-120 ms shared, 1-5 ms in place).
ROOM_MIN_BYTES = 32 << 20


# Nodes per band a reader takes at a time: at least two bands per reader when there
# are enough nodes, so that the readers finish together.
BAND_NODES = 4
# Into fresh memory, each band's rows are first prefaulted in one call per head and
# tensor. A call costs about 12 us beyond its pages here, so those bands are longer:
# calls of up to this many bytes, but no longer than one reader's share (32K float16
# tokens of SmolLM2's shape: 238 ms in 128 KiB calls, 216 ms in 1 MiB calls).
PREFAULT_CALL_BYTES = 1 << 20


def _band_size(nodes: int, readers: int, *, call_bytes: int = 0) -> int:
    """Nodes per band of a restore of ``nodes`` nodes on ``readers`` threads.

    Args:
        call_bytes: Bytes of one node's rows of one head (the smallest), whose band
            is prefaulted at once; 0 when nothing is prefaulted.
    """
    if call_bytes:
        want = -(-PREFAULT_CALL_BYTES // call_bytes)
        return max(1, min(want, -(-nodes // readers)))
    return max(1, min(BAND_NODES, nodes // (2 * readers)))


def _bands(nodes: int, size: int) -> List[Tuple[int, int]]:
    """``(first, last)`` node ranges of ``size`` nodes (the last may be shorter)."""
    return [(i, min(nodes, i + size)) for i in range(0, nodes, size)]


def _capacity(
    n: int, query: int, room: int, token_bytes: int, *, whole_steps: bool = False
) -> int:
    """Rows to allocate for a restore of ``n`` tokens of a ``query``-token prompt
    (``token_bytes`` of KV per token).

    Room for up to ``room`` more of the prompt's tokens and the first generated one,
    in whole cache steps: the caller's next forward pass writes its keys and values in
    place, where an exactly full cache would first copy every layer to grow.
    ``whole_steps``: whole cache steps even with no room (see :func:`whole_steps`).
    """
    if room == 0 or n * token_bytes < ROOM_MIN_BYTES:
        if not whole_steps:
            return n
        want = n
    else:
        want = min(query, n + room) + 1
    return -(-want // KVCache.step) * KVCache.step


def whole_steps() -> bool:
    """Whether a restore's arrays always hold whole cache steps of rows: with MLX's
    CUDA backend, which decodes with cuDNN only over a KV buffer of whole 256-row
    steps (mlx-lm's), else with a slower kernel. mlx-lm's cache keeps an odd row
    count as it grows, so an exactly full restore decoded at 0.54x for good (32,768
    tokens of an 8B model on an H200). The CPU and Metal take any rows.
    ``KVSTORE_WHOLE_STEPS=1|0`` forces either (to measure both on one machine)."""
    forced = os.environ.get("KVSTORE_WHOLE_STEPS", "")
    if forced in ("0", "1"):
        return forced == "1"
    return devices.cuda_backend()


def state_key(h: bytes) -> bytes:
    """The RAM tier's key for node ``h``'s state file (``h`` is its delta file's)."""
    return h + STATE_PART.encode()


class ReadPath:
    """Restores of one namespace of a store: the trie walk, the parallel node reads
    into an :class:`~kvstore.engine.assemble.AssemblyPlan` (or through ``mx.load``,
    :mod:`kvstore.engine.loadpath`), checked against the index; broken nodes go to
    ``broken``.

    Args:
        index: The store's index.
        blobs: The store's node files.
        ram: The RAM tier, read first.
        layout: The namespace's cache layout.
        namespace: The namespace's id.
        root: The namespace's root (its unsalted tree).
        chunk_tokens: Tokens per node at most.
        shapes: The node files' expected tensors and sizes.
        broken: The broken nodes (skipped; where a failed read is reported).
        accesses: Where restored nodes' accesses and the rates are noted.
        counters: Where fetches are counted.
        policy: Whether a restore pays (:mod:`kvstore.engine.payoff`); it records
            each restore's rate.
        restore_room: Tokens of room past a restore (see ``KVStore``).
        read_threads: Threads reading node files, this one included.
        restore_io: ``"assemble"`` or ``"load"`` (:func:`default_restore_io`).
    """

    def __init__(
        self,
        *,
        index: Index,
        blobs: Blobs,
        ram: RamTier,
        layout: Layout,
        namespace: bytes,
        root: bytes,
        chunk_tokens: int,
        shapes: NodeShapes,
        broken,
        accesses: Accesses,
        counters: Counters,
        policy: RestorePolicy,
        restore_room: int,
        read_threads: int,
        restore_io: str,
    ):
        self.index = index
        self.blobs = blobs
        self.ram = ram
        self.layout = layout
        self.namespace = namespace
        self.root = root
        self.chunk_tokens = chunk_tokens
        self.shapes = shapes
        self.broken = broken
        self.accesses = accesses
        self.counters = counters
        self.policy = policy
        self.restore_room = restore_room
        self.read_threads = read_threads
        self.restore_io = restore_io
        self.whole_steps = whole_steps()
        self.trie = TrieWalk(
            index=index,
            namespace=namespace,
            root=root,
            chunk_tokens=chunk_tokens,
            layout=layout,
            broken=broken,
        )
        self._readers = ThreadPoolExecutor(
            self.read_threads, thread_name_prefix="kvstore-read"
        )
        # A restore's arrays: see kvstore.engine.assemble.
        self._allocator = PlanAllocator()
        self._staging = threading.local()  # per reader thread: one node file at a time

    def close(self) -> None:
        """Stop the reader threads and the allocating thread."""
        self._readers.shutdown()
        self._allocator.close()

    def fetch(
        self, arr: np.ndarray, *, root: Callable[[], bytes], started: float
    ) -> Tuple[List[Any], int]:
        """Restore the longest stored prefix of ``arr`` in the tree whose root
        ``root()`` gives, and count the fetch (begun at ``started``, a
        ``perf_counter``). Never raises for a broken store (a damaged salt secret
        too): the error is logged and counted, and the fetch is a miss."""
        try:
            cache, n = self.restore(arr, root=root())
        except IndexDamaged:  # logged once by the index: a miss from now on
            self.counters.add(errors=1)
            cache, n = self.layout.make_cache(), 0
        except Exception:
            log.exception("kvstore: fetch failed; treating it as a miss")
            self.counters.add(errors=1)
            cache, n = self.layout.make_cache(), 0
        self.counters.fetched(len(arr), n, time.perf_counter() - started)
        return cache, n

    def find(
        self,
        arr: np.ndarray,
        *,
        limit: int,
        full_only: bool = False,
        root: Optional[bytes] = None,
    ) -> List[Step]:
        """The stored nodes along ``arr[:limit]`` (:meth:`TrieWalk.walk`), in a read
        transaction of its own."""
        return self.index.read(
            lambda txn: self.trie.walk(
                txn, arr, limit=limit, full_only=full_only, root=root
            ),
            guarded=True,  # searches, and children ranges it covers
        )

    def stored_past(
        self, arr: np.ndarray, held: int, *, root: bytes
    ) -> Tuple[int, int]:
        """``(stored, nbytes)``: how many tokens of ``arr`` a fetch would restore now
        (0 when the index is damaged, which the index logged once), and the bytes of
        the nodes a restore of the tokens past ``held`` would read (index only)."""
        try:
            path = self.find(arr, limit=len(arr) - 1, root=root)
        except IndexDamaged:
            self.counters.add(errors=1)
            return 0, 0
        stored = nbytes = 0
        for step in path:
            stored += step.take
            if stored > held:
                nbytes += step.rec.total_bytes
        return stored, nbytes

    def all_stored(self, arr: np.ndarray, *, root: bytes) -> Optional[List[Step]]:
        """The nodes holding all of ``arr`` (with the checkpoint at its end that a
        layout with state layers needs), their files read back whole, their access
        noted; None if any is missing or broken (a broken one is reported)."""
        stored = self.find(arr, limit=len(arr), full_only=True, root=root)
        complete = sum(step.take for step in stored) == len(arr)
        if (
            complete
            and (not self.layout.has_state or stored[-1].rec.has_state)
            and self.intact(stored)
        ):
            self.accesses.touch(step.h for step in stored)
            return stored
        return None

    def restore(
        self,
        arr: np.ndarray,
        retries: int = 2,
        *,
        root: Optional[bytes] = None,
        decision: Optional[Decision] = None,
    ) -> Tuple[List[Any], int]:
        """:meth:`fetch` without the counting: ``(cache, n)``. ``decision``: one
        made already (a tail read's), else the policy decides."""
        path = self.find(arr, limit=len(arr) - 1, root=root)
        if not path:
            return self.layout.make_cache(), 0
        costs = self.read_costs(path)
        if decision is None:
            decision = self.policy.decide(
                [s.take for s in path], costs, cuttable=not self.layout.has_state
            )
            if not decision.restore:
                self.policy.record(decision, nbytes=0, seconds=0.0)
                if self.policy.mode == "auto":
                    log.info(
                        "kvstore: recomputing %d stored tokens: reading %d bytes "
                        "would take %.1f ms, prefilling them %.1f ms",
                        decision.tokens,
                        sum(costs),
                        decision.restore_s * 1e3,
                        decision.recompute_s * 1e3,
                    )
                return self.layout.make_cache(), 0
        if decision.nodes is not None:  # the first nodes only: cheaper than all
            log.info(
                "kvstore: restoring the first %d of %d stored tokens; the rest is "
                "faster to prefill than to read",
                decision.tokens,
                sum(s.take for s in path),
            )
            path, costs = path[: decision.nodes], costs[: decision.nodes]
        nbytes = sum(costs)
        tic = time.perf_counter()
        failures, state_job, delta, sharing = self.read_reported(path, len(arr))
        failed = failures.first
        state = None
        if state_job is not None:
            if failed < len(path):
                # The checkpoint's path is broken: look again (broken nodes are skipped
                # now) for the next best checkpoint.
                return (
                    self.restore(arr, retries - 1, root=root, decision=decision)
                    if retries
                    else (self.layout.make_cache(), 0)
                )
            state = state_job.result()
        complete = failed >= len(path)
        path = path[:failed]  # a broken node: keep only what precedes it
        n = sum(step.take for step in path)
        if n == 0:
            return self.layout.make_cache(), 0
        self.accesses.touch(step.h for step in path)
        with MLX_LOCK:
            cache = self.layout.build(delta, state or {}, n)
        # A restore cut short says nothing of the rate: counted, not measured. One
        # beside others is rated by the time it would have taken alone.
        seconds = time.perf_counter() - tic
        self.policy.record(
            decision,
            nbytes=nbytes if complete else 0,
            seconds=seconds,
            sharing=sharing,
        )
        if complete:
            self.accesses.keep_rates()
        return cache, n

    def read_costs(self, path: List[Step]) -> List[int]:
        """Bytes of node (and checkpoint) files a restore of each node of ``path``
        reads: the RAM tier's nodes cost no read."""
        costs = [0 if s.h in self.ram else s.rec.nbytes for s in path]
        last = path[-1]
        if self.layout.has_state and state_key(last.h) not in self.ram:
            costs[-1] += last.rec.state_nbytes
        return costs

    def read_reported(
        self, path: List[Step], query: int
    ) -> Tuple["Failures", Optional[Future], Dict[str, Any], float]:
        """:meth:`read`, tracked among the process's restores, with the first broken
        node reported (only it counts: the rest is cut): ``(failures, state job or
        None, delta arrays by name, the mean number of restores that read beside
        it)``."""
        with READS.track() as reading:
            failures, state_job, delta = self.read(path, query)
        failed = failures.first
        if failed < len(path):
            step = path[failed]
            self.broken.read_failed(step.h, failures.errors[failed], step.rec)
        return failures, state_job, delta, reading.sharing

    def read(
        self, path: List[Step], query: int
    ) -> Tuple["Failures", Optional[Future], Dict[str, Any]]:
        """Read the nodes of ``path`` for a ``query``-token prompt into new arrays:
        ``(failures, state job or None, delta arrays by name)`` (:meth:`_read_path`,
        or :meth:`_load_path` through ``mx.load`` where ``restore_io`` is load)."""
        read = self._load_path if self.restore_io == "load" else self._read_path
        return read(path, query)

    def _read_path(
        self, path: List[Step], query: int
    ) -> Tuple["Failures", Optional[Future], Dict[str, Any]]:
        """Allocate the restore of ``path`` and read its nodes (and the last node's
        state file, if the layout has state) on the reader threads and this one.

        Returns ``(failures, state job or None, delta arrays by name)``; every job
        is done.
        """
        n = sum(step.take for step in path)
        failures = Failures(len(path))
        jobs = []  # (the path index its crash is charged to, future)
        state_job = None
        if self.layout.has_state:  # first: it runs beside the node readers
            state_job = self._readers.submit(self._read_state, path[-1])
            jobs.append((len(path) - 1, state_job))
        opened: Dict[int, _Opened] = {}  # by index in path
        capacity = self.capacity(n, query)
        try:
            # The arrays are allocated on the allocator's thread while this one opens
            # the first node files. The lock is held here, for the allocating thread.
            with MLX_LOCK:
                plan = self._allocator.run(
                    lambda: AssemblyPlan(self.layout.rows, n, capacity=capacity),
                    lambda: self._open_ahead(path, opened),
                )
            if self.layout.rows:
                offsets = list(itertools.accumulate((s.take for s in path), initial=0))
                readers = min(self.read_threads, len(path))
                fresh = plan.fresh()
                call = plan.row_bytes() * n // len(path) if fresh else 0
                size = _band_size(len(path), readers, call_bytes=call)
                pending: "queue.SimpleQueue[Tuple[int, int]]" = queue.SimpleQueue()
                for band in _bands(len(path), size):
                    pending.put(band)
                # A few long jobs pulling nodes, not one job per node: submitting
                # hundreds of futures while the first run costs ~10 ms of GIL at 32K.
                read = functools.partial(
                    self._read_nodes,
                    path,
                    plan,
                    offsets,
                    pending,
                    failures,
                    opened,
                    fresh,
                )
                for _ in range(readers - 1):
                    jobs.append((0, self._readers.submit(read)))
                read()  # this thread reads too: no wake-up to wait for
            for at, job in jobs:
                if job.exception() is not None:  # readers' own errors are in failures
                    failures.add(at, job.exception())
        finally:
            for f in list(opened.values()):  # nodes cut off or found in the RAM tier
                if isinstance(f, OpenFile):
                    f.close()
        return failures, state_job, plan.delta_arrays()

    def capacity(self, n: int, query: int) -> int:
        """Rows of a restore's arrays: :func:`_capacity` with this store's room."""
        return _capacity(
            n,
            query,
            self.restore_room,
            self.shapes.token_bytes,
            whole_steps=self.whole_steps,
        )

    def _load_path(
        self, path: List[Step], query: int
    ) -> Tuple["Failures", Optional[Future], Dict[str, Any]]:
        """:meth:`_read_path` through ``mx.load`` (see :mod:`kvstore.engine.loadpath`):
        on CUDA, the arrays reach device memory in one host-to-device copy."""
        n = sum(step.take for step in path)
        failures = Failures(len(path))
        state_job = None
        if self.layout.has_state:
            state_job = self._readers.submit(self._read_state, path[-1])
        delta: Dict[str, Any] = {}
        try:
            if self.layout.rows:
                capacity = self.capacity(n, query)
                offsets = list(itertools.accumulate((s.take for s in path), initial=0))
                # Not under MLX_LOCK: the load's graph is this thread's own (MLX gives
                # each thread its own stream), so restores overlap with each other.
                delta = load_arrays(
                    self.layout.rows,
                    capacity,
                    offsets=offsets[:-1],
                    takes=[step.take for step in path],
                    open_source=lambda i: self._node_source(path[i]),
                    failures=failures,
                    pool=self._readers,
                    threads=min(self.read_threads, len(path)),
                )
        finally:
            if state_job is not None and state_job.exception() is not None:
                failures.add(len(path) - 1, state_job.exception())
        return failures, state_job, delta

    def _node_source(self, step: Step):
        """Where :func:`kvstore.engine.loadpath.load_arrays` reads ``step``'s node from: the
        RAM tier, the open file of a whole node, or a node cut short read whole."""
        rec = step.rec
        entry = self.ram.get(step.h)
        if entry is not None:
            return MemorySource(entry.data, entry.tensors)
        if step.take == rec.ntokens:
            opened = self._open_node(step)
            try:
                self.shapes.check_meta(opened.metadata)
            except BaseException:
                opened.close()
                raise
            return FileSource(opened, checksum=rec.checksum)
        self.shapes.check_sizes(rec)
        data, tensors, meta = self.blobs.read_staged(
            self.namespace,
            step.h,
            nbytes=rec.nbytes,
            checksum=rec.checksum,
            expected=self.shapes.expected(rec.ntokens),
            staging=bytearray(rec.nbytes),
        )
        self.shapes.check_meta(meta)
        return MemorySource(data, tensors)

    def _open_node(self, step: Step) -> OpenFile:
        """Open a whole node's file, its record and header checked."""
        self.shapes.check_sizes(step.rec)
        return self.blobs.open_checked(
            self.namespace,
            step.h,
            nbytes=step.rec.nbytes,
            expected=self.shapes.expected(step.rec.ntokens),
        )

    def _open_ahead(self, path: List[Step], opened: Dict[int, _Opened]) -> None:
        """Open the first :data:`OPEN_AHEAD` whole nodes' files into ``opened``: runs
        while the restore's arrays are allocated. A failure is kept for the node's
        reader to raise."""
        if not self.layout.rows:  # a layout of state layers only: no node files
            return
        for i, step in enumerate(path[:OPEN_AHEAD]):
            if step.take != step.rec.ntokens or step.h in self.ram:
                continue
            try:
                opened[i] = self._open_node(step)
            except Exception as e:
                opened[i] = e

    def _read_nodes(
        self,
        path: List[Step],
        plan: AssemblyPlan,
        offsets: List[int],
        pending: "queue.SimpleQueue[Tuple[int, int]]",
        failures: "Failures",
        opened: Dict[int, _Opened],
        fresh: bool,
    ) -> None:
        """Read the bands of nodes of ``path`` taken from ``pending`` until it is
        empty; with ``fresh`` memory, each band's rows are prefaulted first.

        A node's exception goes to ``failures``; nodes after a broken one are
        skipped, as the restore is cut there anyway. Files in ``opened`` (by index)
        are used, and taken out: the fetch closes whatever is left.
        """
        while True:
            try:
                first, last = pending.get_nowait()
            except queue.Empty:
                return
            if first > failures.first:
                continue
            if fresh:
                plan.prefault(offsets[first], offsets[last])
            for i in range(first, last):
                if i > failures.first:
                    break
                try:
                    self._read_node(path[i], plan, offsets[i], opened.pop(i, None))
                except Exception as e:  # the fetch reports the first broken node only
                    failures.add(i, e)

    def _read_node(
        self, step: Step, plan: AssemblyPlan, offset: int, opened: _Opened = None
    ) -> None:
        """Copy the first ``step.take`` tokens of one node to row ``offset`` of the plan.

        ``opened`` is the node's file as :meth:`_open_ahead` left it, if it did.

        Raises CorruptBlob or OSError when the node's file is broken.
        """
        rec, key = step.rec, step.h
        entry = self.ram.get(key)
        if entry is not None:
            data, tensors = memoryview(entry.data), entry.tensors
        elif step.take == rec.ntokens:
            # The whole node: read straight into the plan's arrays (one copy).
            if isinstance(opened, BaseException):
                raise opened
            if opened is None:
                opened = self._open_node(step)
            meta = self.blobs.read_into(
                opened,
                checksum=rec.checksum,
                targets=functools.partial(
                    plan.node_targets, offset=offset, node_tokens=rec.ntokens
                ),
            )
            self.shapes.check_meta(meta)
            return
        else:
            self.shapes.check_sizes(rec)
            staging = getattr(self._staging, "buf", None)
            if staging is None or len(staging) < rec.nbytes:
                # A new buffer rather than a resize: an earlier view may still be alive.
                staging = self._staging.buf = bytearray(rec.nbytes)
            data, tensors, meta = self.blobs.read_staged(
                self.namespace,
                key,
                nbytes=rec.nbytes,
                checksum=rec.checksum,
                expected=self.shapes.expected(rec.ntokens),
                staging=staging,
            )
            self.shapes.check_meta(meta)
        plan.copy_node(
            data, tensors, offset=offset, take=step.take, node_tokens=rec.ntokens
        )

    def _read_state(self, step: Step):
        """The decoded checkpoint of ``step``'s node (see ``Layout.decode_state``).

        Raises CorruptBlob or OSError when the node's state file is broken.
        """
        rec, key = step.rec, state_key(step.h)
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
            self.shapes.check_meta(meta)
            data = memoryview(data)
        return self.layout.decode_state(data, tensors, rec.end)

    def preload_pinned(self) -> None:
        """Load pinned nodes' files into the RAM tier (as far as its budget allows)."""
        if self.ram.max_bytes == 0:
            return
        for h in self.index.pinned(self.namespace):
            rec = None
            try:
                rec = self.index.get_node(self.namespace, h)
                if (
                    rec is None
                    or self.ram.nbytes + rec.total_bytes > self.ram.max_bytes
                ):
                    continue
                self.shapes.check_sizes(rec)
                parts = [
                    (h, rec.nbytes, rec.checksum, "", self.shapes.expected(rec.ntokens))
                ]
                if rec.has_state:
                    parts.append(
                        (
                            state_key(h),
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
                    self.shapes.check_meta(meta)
                    if part == STATE_PART:
                        self.layout.decode_state(memoryview(data), tensors, rec.end)
                    self.ram.put(key, RamEntry(data, tensors, rec.kind, True))
            except (CorruptBlob, CorruptRecord, OSError) as e:
                self.broken.read_failed(h, e, rec)

    def intact(self, steps: List[Step]) -> bool:
        """Whether the stored nodes' files read back whole (checksums), so a prefill
        may skip them; the first broken one is reported and quarantined as a fetch
        would, and the prefill computes it again."""
        for step in steps:
            rec = step.rec
            parts = [("", rec.nbytes, rec.checksum, self.shapes.expected(rec.ntokens))]
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
                    self.shapes.check_meta(meta)
            except (CorruptBlob, OSError) as e:
                self.broken.read_failed(step.h, e, rec)
                return False
        return True
