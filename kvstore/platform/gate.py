"""A readers-writer gate for threads: many share it, one task at a time runs alone.

Used where a native library must not run one call while others are in flight: an
LMDB map resize while transactions are open (:mod:`kvstore.disk.index`), MLX's stream
synchronizations while a Python file is being loaded (:mod:`.mlxsync`).
"""

import threading
from contextlib import contextmanager
from typing import Callable, Iterator, TypeVar

T = TypeVar("T")


class NestedAlone(RuntimeError):
    """:meth:`Gate.alone` called by a thread that holds the gate (it would wait for
    itself)."""


class Gate:
    """A readers-writer gate: users share it, one task at a time takes it alone.

    Sharing nests (a thread already inside passes at once, even while a task waits
    to be alone, since that task waits for the outer use anyway). Waiting tasks keep
    new users out, so a stream of users cannot starve them.

    Args:
        nested: The message of :class:`NestedAlone`.
    """

    def __init__(self, *, nested: str = "a gate taken alone by a thread inside it"):
        self._nested = nested
        self._lock = threading.Lock()  # taken directly where nobody waits: cheaper
        self._cond = threading.Condition(self._lock)
        self._active = 0  # threads holding the gate
        self._alone = False
        self._waiting = 0  # tasks waiting for the active users to leave
        self._local = threading.local()

    def depth(self) -> int:
        """How many uses of the gate the calling thread is inside."""
        return getattr(self._local, "depth", 0)

    def enter(self) -> None:
        """Hold the gate (shared) for one use; :meth:`exit` after it."""
        local = self._local
        depth = getattr(local, "depth", 0)
        if depth == 0:
            with self._lock:
                while self._alone or self._waiting:
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
    def shared(self) -> Iterator[None]:
        """:meth:`enter` and :meth:`exit` around a block."""
        self.enter()
        try:
            yield
        finally:
            self.exit()

    def alone(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` once no other thread holds the gate, keeping new users out.

        Raises:
            NestedAlone: the calling thread holds the gate itself.
        """
        if self.depth():
            raise NestedAlone(self._nested)
        with self._cond:
            self._waiting += 1
            try:
                while self._alone or self._active:
                    self._cond.wait()
            finally:
                self._waiting -= 1
            self._alone = True
        try:
            return fn()
        finally:
            with self._cond:
                self._alone = False
                self._cond.notify_all()
