"""Growing an LMDB map while other threads of the process use it.

``mdb_env_set_mapsize`` may only run while no transaction of the process is active
(LMDB does not check; py-lmdb invalidates the objects of transactions still open):
other threads' transactions then fail with "Invalid argument" or "closed/deleted/
dropped object". Every transaction of an environment passes a :class:`MapGate` shared
by its threads; a resize waits at the gate until no transaction is active, and holds
new ones back meanwhile, so the map grows without any thread seeing it.
"""

import threading
from contextlib import contextmanager
from typing import Callable, Iterator, TypeVar

T = TypeVar("T")


class NestedResize(RuntimeError):
    """A resize asked for by a thread inside a transaction (it would wait for itself)."""


class MapGate:
    """A readers-writer gate: transactions share it, a map resize takes it alone.

    Transactions nest (a thread inside one may begin another: it passes at once, even
    while a resize waits, since that resize waits for the outer one anyway). Waiting
    resizes keep new transactions out, so a stream of readers cannot starve them.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()  # taken directly where nobody waits: cheaper
        self._cond = threading.Condition(self._lock)
        self._active = 0  # threads inside a transaction
        self._resizing = False
        self._waiting = 0  # resizes waiting for the active transactions to end
        self._local = threading.local()

    def depth(self) -> int:
        """How many transactions the calling thread is inside."""
        return getattr(self._local, "depth", 0)

    def enter(self) -> None:
        """Hold the gate (shared) for one transaction; :meth:`exit` after it."""
        local = self._local
        depth = getattr(local, "depth", 0)
        if depth == 0:
            with self._lock:
                while self._resizing or self._waiting:
                    self._cond.wait()
                self._active += 1
        local.depth = depth + 1

    def exit(self) -> None:
        local = self._local
        depth = local.depth = local.depth - 1
        if depth == 0:
            with self._lock:
                self._active -= 1
                if self._active == 0 and self._waiting:
                    self._cond.notify_all()

    @contextmanager
    def transaction(self) -> Iterator[None]:
        """:meth:`enter` and :meth:`exit` around a block."""
        self.enter()
        try:
            yield
        finally:
            self.exit()

    def alone(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` (a map resize) once no transaction of the process is active.

        Raises:
            NestedResize: the calling thread is inside a transaction itself.
        """
        if self.depth():
            raise NestedResize(
                "the LMDB map cannot grow inside a transaction of the same thread"
            )
        with self._cond:
            self._waiting += 1
            try:
                while self._resizing or self._active:
                    self._cond.wait()
            finally:
                self._waiting -= 1
            self._resizing = True
        try:
            return fn()
        finally:
            with self._cond:
                self._resizing = False
                self._cond.notify_all()
