"""Saves of ``kvstore serve``, off mlx-lm's generation thread.

A save captures the new tokens of a cache (views on the CPU, device copies with
CUDA) before the background writer writes them. Done on the generation thread it
holds up every stream being decoded, and while the writer is behind by more than
``max_pending_bytes`` the store drops the save. :class:`SaveQueue` instead runs the
captures on a thread of its own:

* the generation thread only queues the cache (already in mlx-lm's RAM LRU, which
  never changes it) after evaluating it there; the caches a batch step stores wait
  for that in :class:`StepHeldSaves` until the loop decodes or rests;
* a queued save whose tokens a later one of the same tree extends is merged into
  it (the later save writes every node the earlier one would have);
* a save waits while the generation loop is busy (``busy()``: a step runs, or it
  did work within :data:`kvstore.serve.timing.REST_S`): its device-to-host copies
  and the writer's work slow the decoding of every stream (with CUDA, a stream
  decoded at 0.80-0.85x of its speed while KV moved to the host beside it, and a
  batch's prefill step took 1.5-2x as long). It goes ahead once the loop rests,
  after :data:`MAX_DEFER_S`, while more than :data:`MAX_HELD` saves wait, once
  mlx-lm's RAM cache no longer holds its tokens (evicted: then the save alone keeps
  that KV in memory, which mlx-lm does not count), and at a flush or close. While a
  longer entry holds them (mlx-lm drops a trimmable cache's prefixes when it stores
  a longer one: a chat's last turn when its next prompt is prefilled) it waits with
  that entry's KV instead of its own. Meanwhile later turns of the same
  conversation merge into it;
* while the writer is full a save waits, and is retried when the writer drains:
  from its own RAM entry, or from a longer entry that replaced it (mlx-lm drops a
  trimmable cache's prefixes when it stores a longer one: a system prompt's entry
  when the whole prompt's comes), whose first tokens are then saved. Once no RAM
  entry holds its prefix (mlx-lm's LRU evicted it) the save keeps its own
  reference to the KV, as long as the KV kept so stays within the writer's own
  bound (``max_pending_bytes``): waiting saves never hold more than the writer may
  queue. Past that the save is lost (counted).
"""

import collections
import logging
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Deque, List, Optional, Sequence, Tuple

import numpy as np

from ..disk.chunking import common_prefix
from ..disk.policy import stronger_kind

log = logging.getLogger("kvstore.server")

# How often a waiting save looks at the writer (and the generation loop) again.
POLL_S = 0.05
# Saves wait for the generation loop to rest, but no longer than this after they were
# queued, nor while more than MAX_HELD wait.
MAX_DEFER_S = 30.0
MAX_HELD = 16
# Queued saves at most (each holds a cache that RAM may drop); the oldest goes first.
MAX_QUEUED = 64
# Steps of the generation loop a save is held for at most before it is copied out
# (StepHeldSaves): while prompts keep arriving, every step processes some.
MAX_STEPS_HELD = 16


@dataclass
class SaveJob:
    """One cache to save: the first ``held`` of ``tokens`` (the RAM LRU's key)."""

    store: Any
    model_key: Any
    tokens: List[int]
    held: int
    cache: List[Any]
    kind: str
    salt: Any
    queued_at: float = field(default_factory=time.monotonic)
    evicted_bytes: int = 0  # KV kept only by this job, after RAM evicted its entry
    _array: Optional[np.ndarray] = field(default=None, repr=False, compare=False)

    def held_array(self) -> np.ndarray:
        """The ``held`` tokens it saves, as an array (made once)."""
        if self._array is None:
            self._array = np.asarray(self.tokens[: self.held])
        return self._array

    def covered_by(self, other: "SaveJob") -> bool:
        """Whether saving ``other`` writes every node this job would."""
        return (
            other.store is self.store
            and other.salt == self.salt
            and other.held >= self.held
            and other.tokens[: self.held] == self.tokens[: self.held]
            and stronger_kind(self.kind, other.kind) == other.kind
        )


class StepHeldSaves:
    """Saves the generation loop queued while a batch runs, held until it decodes.

    A cache mlx-lm stores at the end of a prompt's segment is a view of the batch,
    and copying it out for a save right there (3.3 ms a save on an H200, 8 users,
    6.8K tokens) delays every first token of the batch; so does copying out the
    caches of finished chats just as the next turns arrive. Held here, they are
    copied together, in one ``mx.eval``, at the top of the loop once a step has run
    since that processed no prompt (the first tokens are out; plain decoding), once
    the loop has rested :data:`~kvstore.serve.timing.REST_S`, or after
    :data:`MAX_STEPS_HELD` steps at most.

    Everything but :meth:`wait_empty` runs on the generation thread (or after it
    ended: :meth:`take`).
    """

    def __init__(self):
        self._jobs: List[tuple] = []  # (job, the steps the loop had run when held)
        self._handing = 0  # taken by due(), not yet queued (handed())
        self._cond = threading.Condition()

    def hold(self, job: SaveJob, *, steps: int) -> None:
        with self._cond:
            self._jobs.append((job, steps))

    def due(self, *, steps: int, decoding: bool, rested: bool) -> List[SaveJob]:
        """The saves to queue now.

        Args:
            steps: The steps the loop has run.
            decoding: The last step processed no prompt tokens.
            rested: The loop has rested: every held save goes.
        """

        def go(mark: int) -> bool:
            return (
                rested or (decoding and steps > mark) or steps - mark >= MAX_STEPS_HELD
            )

        with self._cond:
            out = [j for j, mark in self._jobs if go(mark)]
            self._jobs = [(j, m) for j, m in self._jobs if not go(m)]
            self._handing += len(out)
        return out

    def handed(self, n: int) -> None:
        """``n`` saves :meth:`due` gave are queued (or failed): a flush waits for
        them until then."""
        with self._cond:
            self._handing -= n
            self._cond.notify_all()

    def take(self) -> List[SaveJob]:
        """Every held save (the loop has ended); :meth:`handed` once queued."""
        return self.due(steps=0, decoding=True, rested=True)

    def __len__(self) -> int:
        with self._cond:
            return len(self._jobs)

    def wait_empty(self, timeout: float) -> bool:
        """Wait until the loop has queued every held save; False on timeout."""
        with self._cond:
            return self._cond.wait_for(
                lambda: not self._jobs and not self._handing, timeout
            )


class SaveQueue:
    """Runs saves on a thread of its own; merges, defers, never blocks its caller.

    Args:
        in_ram: ``in_ram(job)``: a RAM LRU cache holding the job's prefix (its
            own, or a longer one), or None once no entry holds it.
        count: ``count(**deltas)``: the prompt cache's counters.
        max_queued: Saves queued at most.
        busy: Whether the generation loop works now (a save waits while it does;
            never, by default).
        max_defer_s: How long a save waits for the loop to rest at most.
        max_evicted_bytes: KV that waiting saves may keep after RAM evicted their
            entries (None: each store writer's ``max_pending_bytes``).
    """

    def __init__(
        self,
        *,
        in_ram: Callable[[SaveJob], Optional[List[Any]]],
        count: Callable[..., None],
        max_queued: int = MAX_QUEUED,
        busy: Callable[[], bool] = lambda: False,
        max_defer_s: float = MAX_DEFER_S,
        max_evicted_bytes: Optional[int] = None,
    ):
        self._in_ram = in_ram
        self._count = count
        self._max_queued = max_queued
        self._busy_loop = busy
        self._max_defer_s = max_defer_s
        self._max_evicted_bytes = max_evicted_bytes
        self._evicted_bytes = 0  # of waiting jobs: only the saving thread counts
        self._jobs: Deque[SaveJob] = collections.deque()
        self._held: Optional[SaveJob] = None  # the oldest job, counted as held
        self._busy = False
        self._current: Optional[SaveJob] = None  # the job being saved
        self._hurry = 0  # flushes waiting: saves go ahead at once
        self._closed = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(
            target=self._run, name="kvstore-saves", daemon=True
        )
        self._thread.start()

    def put(self, job: SaveJob) -> None:
        """Queue ``job`` (generation thread): returns at once."""
        with self._cond:
            merged = [j for j in self._jobs if j.covered_by(job)]
            for j in merged:
                self._jobs.remove(j)
            self._jobs.append(job)
            lost = 0
            while len(self._jobs) > self._max_queued:
                self._jobs.popleft()
                lost += 1
            self._cond.notify_all()
        if merged or lost:
            self._count(saves_merged=len(merged), saves_lost=lost)

    @property
    def queued(self) -> int:
        """Saves queued, not yet handed to a writer."""
        with self._cond:
            return len(self._jobs) + self._busy

    def kept_prefix(
        self, model_key, salt, tokens: Sequence[int], *, longer_than: int
    ) -> Tuple[Optional[SaveJob], int]:
        """``(job, n)``: the save, queued or being saved, whose KV holds the longest
        prefix of ``tokens`` (``n`` tokens, over ``longer_than``), or ``(None,
        longer_than)``. mlx-lm's LRU may have evicted an entry whose save still waits
        with its KV: a lookup can use it rather than prefill it again. The job's
        cache was evaluated on the generation thread (a longer entry's when it
        replaced its own); only its first ``held`` tokens are the job's."""
        with self._cond:
            jobs = list(self._jobs)
            if self._current is not None:
                jobs.append(self._current)
        jobs = [
            job
            for job in jobs
            if job.held > longer_than
            and job.model_key == model_key
            and job.salt == salt
        ]
        best, best_n = None, longer_than
        want = np.asarray(tokens) if jobs else None
        for job in jobs:
            n = common_prefix(job.held_array(), want)
            if n > best_n:
                best, best_n = job, n
        return best, best_n

    def flush(self) -> None:
        """Wait until every queued save is handed to its store's writer (none waits
        for the generation loop to rest meanwhile)."""
        with self._cond:
            self._hurry += 1
            self._cond.notify_all()
            try:
                while self._jobs or self._busy:
                    self._cond.wait()
            finally:
                self._hurry -= 1

    def close(self) -> None:
        """Hand every queued save over, then end the thread. Idempotent."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join()

    def _run(self) -> None:
        while True:
            job = self._next_job()
            if job is None:
                return
            try:
                self._save(job)
            except Exception:
                log.exception("kvstore: a save failed")
                self._count(saves_skipped=1, store_errors=1)
            finally:
                with self._cond:
                    self._busy = False
                    self._current = None
                    self._cond.notify_all()

    def _next_job(self) -> Optional[SaveJob]:
        """The oldest job once it may go ahead (None: closed and nothing queued).
        The generation loop and the RAM cache are asked without the queue's lock:
        the generation thread takes that lock in :meth:`put` while it may hold the
        RAM cache's."""
        while True:
            with self._cond:
                while not self._jobs and not self._closed:
                    self._cond.wait()
                if not self._jobs:
                    return None
                oldest, waiting = self._jobs[0], len(self._jobs)
                hurry = self._closed or self._hurry > 0
            if hurry or not self._wait_for_rest(oldest, waiting):
                with self._cond:
                    if self._jobs:
                        self._busy = True
                        job = self._current = self._jobs.popleft()
                        log.debug(
                            "kvstore: save of %d tokens goes ahead after %.0f ms "
                            "(%d queued%s)",
                            job.held,
                            1e3 * (time.monotonic() - job.queued_at),
                            waiting,
                            ", hurried" if hurry else "",
                        )
                        return job
                continue
            if self._held is not oldest:
                self._held = oldest
                self._count(saves_held=1)
            with self._cond:
                if not self._hurry and not self._closed:
                    self._cond.wait(POLL_S)  # a put, flush or close wakes it sooner

    def _wait_for_rest(self, oldest: SaveJob, waiting: int) -> bool:
        """Whether the oldest job waits for the generation loop to rest."""
        if waiting > MAX_HELD:
            return False
        if time.monotonic() - oldest.queued_at >= self._max_defer_s:
            return False
        try:
            # Checked while the loop works only: a search of the RAM cache's trie.
            if not self._busy_loop():
                return False
            cache = self._in_ram(oldest)
            if cache is None:
                return False  # evicted: the job alone holds its KV, uncounted
            # A longer entry replaced its own (mlx-lm drops a trimmable cache's
            # prefixes): it waits with that entry's KV, and its own can be freed.
            oldest.cache = cache
            return True
        except Exception:
            log.exception("kvstore: cannot tell whether the generation loop rests")
            return False

    def _save(self, job: SaveJob) -> None:
        """Capture ``job`` once its store's writer has room for it; one the writer
        refuses all the same (counted there) waits and is tried again, while its
        prefix is in RAM or its KV is kept (:meth:`_wait`)."""
        tic = time.monotonic()
        try:
            self._save_when_room(job)
        finally:
            log.debug(
                "kvstore: save of %d tokens captured in %.1f ms",
                job.held,
                1e3 * (time.monotonic() - tic),
            )
            self._evicted_bytes -= job.evicted_bytes
            job.evicted_bytes = 0

    def _save_when_room(self, job: SaveJob) -> None:
        deferred = False
        while True:
            if _room_for(job):
                dropped = _writes_dropped(job.store)
                try:
                    job.store.save_prefix(
                        list(job.tokens[: job.held]),
                        job.cache,
                        kind=job.kind,
                        salt=job.salt,
                    )
                except Exception as e:
                    log.warning("kvstore: not saved (%s: %s)", type(e).__name__, e)
                    self._count(saves_skipped=1, store_errors=1)
                    return
                if _writes_dropped(job.store) == dropped:
                    return
            if not deferred:
                deferred = True
                self._count(saves_deferred=1)
            if not self._wait(job):
                return

    def _wait(self, job: SaveJob) -> bool:
        """Wait a poll; False (the save is lost, counted) once its prefix left RAM
        and its KV cannot be kept (:meth:`_keep_evicted`). The job saves from the
        RAM entry holding its prefix while there is one."""
        time.sleep(POLL_S)
        try:
            cache = self._in_ram(job)
            if cache is not None:
                job.cache = cache  # the same KV: a longer entry's first tokens
                return True
        except Exception:
            log.exception("kvstore: cannot tell whether a deferred save is in RAM")
        if self._keep_evicted(job):
            return True
        log.warning(
            "kvstore: a deferred save of %d tokens left RAM before the writer had "
            "room for it",
            job.held,
        )
        self._count(saves_lost=1)
        return False

    def _keep_evicted(self, job: SaveJob) -> bool:
        """Whether ``job`` keeps its KV after RAM evicted it: the first time, if
        the KV that waiting saves keep so stays within the bound."""
        if job.evicted_bytes:
            return True
        nbytes = max(1, job.held * job.store.parts.shapes.token_bytes)
        bound = self._max_evicted_bytes
        if bound is None:
            bound = job.store.writer.max_pending_bytes
        if self._evicted_bytes + nbytes > bound:
            return False
        job.evicted_bytes = nbytes
        self._evicted_bytes += nbytes
        self._count(saves_kept_evicted=1)
        return True


def _room_for(job: SaveJob) -> bool:
    """Whether the store's writer takes the job's new tokens now: it refuses a
    save that would take the bytes waiting past ``max_pending_bytes`` (unless
    nothing waits). The new tokens are those past the last stored node the prompt
    uses whole (at most: a node may also end where a segment does)."""
    writer = job.store.writer
    pending = writer.pending_bytes
    if not pending:
        return True
    stored = job.store.lookup(job.tokens[: job.held + 1], salt=job.salt)
    # A stored node the prompt leaves midway is not extended: the save writes a new
    # sibling from that node's start.
    stored -= stored % job.store.chunk_tokens
    need = max(0, job.held - stored) * job.store.parts.shapes.token_bytes
    return pending + need <= writer.max_pending_bytes


def _writes_dropped(store) -> int:
    return store.parts.counters.snapshot().writes_dropped


class Settled:
    """The caches whose arrays the generation thread has evaluated (queued saves'):
    the only RAM entries a waiting save may take its KV from on the save thread.
    MLX evaluates a lazy array on the thread that asks for it, which races the
    generation thread, and on CUDA fails there ("There is no Stream(gpu, 0) in
    current thread": a fresh entry still held for its own save). Layers are kept
    by weak reference; a layer that takes none is never settled."""

    def __init__(self):
        self._layers: "weakref.WeakSet[Any]" = weakref.WeakSet()

    def add(self, cache: List[Any]) -> None:
        try:
            self._layers.update(cache)
        except TypeError:
            pass

    def __contains__(self, cache) -> bool:
        try:
            return bool(cache) and all(layer in self._layers for layer in cache)
        except TypeError:
            return False


def evaluate_all(caches: List[List[Any]], settled: Optional[Settled] = None) -> None:
    """Evaluate several caches in one ``mx.eval`` (one wait for the device instead of
    one each); a cache that fails it is evaluated alone (:func:`evaluate`). Those
    evaluated go to ``settled``."""
    import mlx.core as mx

    try:
        mx.eval([c.state for cache in caches for c in cache])
        done = caches
    except Exception:
        done = [cache for cache in caches if evaluate(cache) is None]
    if settled is not None:
        for cache in done:
            settled.add(cache)


def evaluate(cache: List[Any]) -> Optional[BaseException]:
    """Evaluate a cache's arrays on this (the generation) thread, so that another
    thread only reads arrays of finished work (MLX is not thread-safe: a lazy graph
    evaluated from two threads races). ``mx.async_eval`` instead saved ~1 ms of the
    3.3 ms a queued save takes on an H200 (8 users, 6.8K tokens): not worth
    another thread waiting on work in flight. Returns the error, if any."""
    import mlx.core as mx

    try:
        mx.eval([c.state for c in cache])
        return None
    except Exception as e:  # e.g. a layer holding no state yet: saved as it is
        return e
