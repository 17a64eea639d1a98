"""A background thread that runs write jobs in order, so callers never wait for disk."""

import logging
import queue
import threading
from typing import Callable, Optional

from ..disk.storecheck import IndexDamaged, StoreError

log = logging.getLogger("kvstore")


class BackgroundWriter:
    """Runs submitted jobs one at a time on a daemon thread.

    Args:
        max_pending_bytes: A job carrying bytes (a save's KV) is refused while more
            than this many bytes would wait, so a slow disk cannot exhaust memory.
            Jobs carrying none (access times, pins, quarantines) are never refused:
            they hold no memory, and refusing them would lose them silently.
    """

    def __init__(self, *, max_pending_bytes: int, name: str = "kvstore-writer"):
        self.max_pending_bytes = max_pending_bytes
        self.pending_bytes = 0
        self.failed = 0
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
        """Wait until every submitted job has run."""
        self._queue.join()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()

    def _run(self):
        while True:
            item = self._queue.get()
            if item is None:
                self._queue.task_done()
                return
            job, nbytes = item
            try:
                job()
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
