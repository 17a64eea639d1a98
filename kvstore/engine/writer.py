"""A background thread that runs write jobs in order, so callers never wait for disk."""

import logging
import queue
import threading
import time
from typing import Callable, Optional

from ..disk.storecheck import IndexDamaged, StoreError

log = logging.getLogger("kvstore")

# How often a job waiting for its turn asks again whether the foreground is busy.
_TURN_POLL_S = 0.02


class BackgroundWriter:
    """Runs submitted jobs one at a time on a daemon thread.

    Args:
        max_pending_bytes: A job carrying bytes (a save's KV) is refused while more
            than this many bytes would wait, so a slow disk cannot exhaust memory.
            Jobs carrying none (access times, pins, quarantines) are never refused:
            they hold no memory, and refusing them would lose them silently.

    A job may step aside for the process's foreground work (:meth:`wait_turn`, called
    between its steps): while ``yield_to()`` says that work is busy (``kvstore
    serve``: its generation loop decoding), for at most ``max_yield_s`` per job and
    never while a flush or close waits.
    """

    def __init__(self, *, max_pending_bytes: int, name: str = "kvstore-writer"):
        self.max_pending_bytes = max_pending_bytes
        self.pending_bytes = 0
        self.failed = 0
        self.yield_to: Optional[Callable[[], bool]] = None
        self.max_yield_s = 30.0
        self.yielded_s = 0.0  # seconds jobs waited for their turn
        self._job_started = 0.0
        self._hurry = 0  # flushes and closes waiting
        self._said: Optional[str] = None  # the last store problem logged
        self._queue: "queue.Queue" = queue.Queue()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], None], nbytes: int = 0) -> bool:
        """Queue ``job``, which holds ``nbytes`` of memory until it has run.

        Returns:
            False when the job carries bytes and the limit refuses it (the caller
            counts and reports the dropped save); True when it was queued.
        """
        with self._lock:
            if (
                nbytes
                and self.pending_bytes
                and self.pending_bytes + nbytes > self.max_pending_bytes
            ):
                return False
            self.pending_bytes += nbytes
        self._queue.put((job, nbytes))
        return True

    @property
    def depth(self) -> int:
        """Jobs submitted and not finished yet (the running one included)."""
        return self._queue.unfinished_tasks

    def flush(self) -> None:
        """Wait until every submitted job has run (none steps aside meanwhile)."""
        with self._lock:
            self._hurry += 1
        try:
            self._queue.join()
        finally:
            with self._lock:
                self._hurry -= 1

    def close(self) -> None:
        with self._lock:
            self._hurry += 1  # never undone: nothing waits for its turn again
        self._queue.put(None)
        self._thread.join()

    def wait_turn(self) -> None:
        """Writer thread, between two steps of a job: wait while the foreground is
        busy (see the class), then return."""
        busy = self.yield_to
        if busy is None:
            return
        tic = time.monotonic()
        try:
            while (
                not self._hurry
                and time.monotonic() - self._job_started < self.max_yield_s
                and busy()
            ):
                time.sleep(_TURN_POLL_S)
        except Exception:
            log.exception("kvstore: cannot tell whether the foreground is busy")
        self.yielded_s += time.monotonic() - tic

    def _run(self):
        while True:
            item = self._queue.get()
            if item is None:
                self._queue.task_done()
                return
            job, nbytes = item
            self._job_started = time.monotonic()
            yielded = self.yielded_s
            try:
                job()
                log.debug(
                    "kvstore: wrote %d bytes in %.1f ms (%.1f ms of it yielding)",
                    nbytes,
                    1e3 * (time.monotonic() - self._job_started),
                    1e3 * (self.yielded_s - yielded),
                )
            # The store stopped taking writes: said once (damage: by the index).
            except StoreError as e:
                self.failed += 1
                if str(e) != self._said and not isinstance(e, IndexDamaged):
                    self._said = str(e)
                    log.error("kvstore: background write failed: %s", e)
            except Exception:
                self.failed += 1
                log.exception("kvstore: background write failed")
            finally:
                with self._lock:
                    self.pending_bytes -= nbytes
                self._queue.task_done()
