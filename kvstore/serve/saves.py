"""Saves of ``kvstore serve``, off mlx-lm's generation thread.

A save captures the new tokens of a cache (views on the CPU, device copies with
CUDA) before the background writer writes them. Done on the generation thread it
holds up every stream being decoded, and while the writer is behind by more than
``max_pending_bytes`` the store drops the save. :class:`SaveQueue` instead runs the
captures on a thread of its own:

* the generation thread only queues the cache (already in mlx-lm's RAM LRU, which
  never changes it) after evaluating it there;
* a queued save whose tokens a later one of the same tree extends is merged into
  it (the later save writes every node the earlier one would have);
* while the writer is full a save waits, and is retried when the writer drains,
  as long as its prefix is still in RAM; one whose prefix left RAM meanwhile is
  lost (counted), as its KV is gone.
"""

import collections
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Deque, List, Optional

from ..disk.policy import stronger_kind

log = logging.getLogger("kvstore.server")

# How often a waiting save looks at the writer again.
POLL_S = 0.05
# Queued saves at most (each holds a cache that RAM may drop); the oldest goes first.
MAX_QUEUED = 64


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

    def covered_by(self, other: "SaveJob") -> bool:
        """Whether saving ``other`` writes every node this job would."""
        return (
            other.store is self.store
            and other.salt == self.salt
            and other.held >= self.held
            and other.tokens[: self.held] == self.tokens[: self.held]
            and stronger_kind(self.kind, other.kind) == other.kind
        )


class SaveQueue:
    """Runs saves on a thread of its own; merges, defers, never blocks its caller.

    Args:
        in_ram: ``in_ram(job)``: whether the job's prefix is still in the RAM LRU.
        count: ``count(**deltas)``: the prompt cache's counters.
        max_queued: Saves queued at most.
    """

    def __init__(
        self,
        *,
        in_ram: Callable[[SaveJob], bool],
        count: Callable[..., None],
        max_queued: int = MAX_QUEUED,
    ):
        self._in_ram = in_ram
        self._count = count
        self._max_queued = max_queued
        self._jobs: Deque[SaveJob] = collections.deque()
        self._busy = False
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

    def flush(self) -> None:
        """Wait until every queued save is handed to its store's writer."""
        with self._cond:
            while self._jobs or self._busy:
                self._cond.wait()

    def close(self) -> None:
        """Hand every queued save over, then end the thread. Idempotent."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._jobs and not self._closed:
                    self._cond.wait()
                if not self._jobs:
                    return
                job = self._jobs.popleft()
                self._busy = True
            try:
                self._save(job)
            except Exception:
                log.exception("kvstore: a save failed")
                self._count(saves_skipped=1, store_errors=1)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _save(self, job: SaveJob) -> None:
        """Capture ``job`` once its store's writer has room for it; one the writer
        refuses all the same (counted there) waits and is tried again, while its
        prefix is in RAM."""
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
        """Wait a poll; False (the save is lost, counted) once its prefix left RAM."""
        time.sleep(POLL_S)
        try:
            if self._in_ram(job):
                return True
        except Exception:
            log.exception("kvstore: cannot tell whether a deferred save is in RAM")
        log.warning(
            "kvstore: a deferred save of %d tokens left RAM before the writer had "
            "room for it",
            job.held,
        )
        self._count(saves_lost=1)
        return False


def _room_for(job: SaveJob) -> bool:
    """Whether the store's writer takes the job's new tokens now: it refuses a
    save that would take the bytes waiting past ``max_pending_bytes`` (unless
    nothing waits). The new tokens are those past the stored prefix."""
    writer = job.store.writer
    pending = writer.pending_bytes
    if not pending:
        return True
    stored = job.store.lookup(job.tokens[: job.held + 1], salt=job.salt)
    need = max(0, job.held - stored) * job.store.parts.shapes.token_bytes
    return pending + need <= writer.max_pending_bytes


def _writes_dropped(store) -> int:
    return store.parts.counters.snapshot().writes_dropped


def evaluate(cache: List[Any]) -> Optional[BaseException]:
    """Evaluate a cache's arrays on this (the generation) thread, so that another
    thread only reads arrays of finished work. Returns the error, if any."""
    import mlx.core as mx

    try:
        mx.eval([c.state for c in cache])
        return None
    except Exception as e:  # e.g. a layer holding no state yet: saved as it is
        return e
