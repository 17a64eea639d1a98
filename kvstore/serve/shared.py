"""Restores of requests that arrive together and share a prefix: one read.

Returning users often share a long system prompt and come back at once (a server's
restart, a burst). Each request's prefetch (:mod:`kvstore.serve.prefetch`) would
read the shared prefix from the store and copy it to the device again; on an H200
eight 0.85 GB restores took 2.1 s, bound by the host-to-device copies, where four of
them were the same system prompts. :class:`SharedRestores` lets a prefetch whose
tokens share a long prefix with a restore in progress (or done and not yet taken
by its request's lookup) wait for that restore, then read from the store only the
nodes past the shared prefix and join them to a copy of it on the device.

Only a restore no lookup has taken yet is shared: until then no generate loop has
written to its cache, so its first tokens are exactly what the store holds. An
entry is dropped when its lookup takes it; one never taken goes with its KV (a
weak reference). Entries are keyed by model and salt: tenants never share.
"""

import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, List, Optional, Tuple

import numpy as np

from ..disk.chunking import common_prefix

# A shared prefix shorter than this is read again rather than waited for.
MIN_SHARED_TOKENS = 256
# How long a prefetch waits for the restore it shares a prefix with.
WAIT_S = 30.0


@dataclass(eq=False)
class Restoring:
    """One prefetch's restore: its request's ``key`` (model, salt) and tokens; once
    ``done``, a weak reference to its :class:`~kvstore.engine.tail.Tail` when it
    restored the whole prefix (``start`` 0)."""

    key: Any
    tokens: np.ndarray  # int32, as the store compares token ids
    done: threading.Event = field(default_factory=threading.Event)
    tail: Optional[weakref.ref] = None


class SharedRestores:
    """The prefetches restoring now, or restored and not yet taken."""

    def __init__(self, *, min_shared: int = MIN_SHARED_TOKENS, wait_s: float = WAIT_S):
        self.min_shared = min_shared
        self.wait_s = wait_s
        self._lock = threading.Lock()
        self._entries: List[Restoring] = []

    def begin(
        self, key: Any, tokens: List[int], held: int
    ) -> Tuple[Restoring, Optional[Restoring], int]:
        """Register a restore of ``tokens`` past ``held`` RAM tokens. Returns its
        entry, the entry sharing the longest prefix with it (at least
        ``min_shared`` tokens past ``held``; None if none) and that prefix's
        length, at most ``len(tokens) - 1`` (the store restores no more)."""
        entry = Restoring(key, np.asarray(tokens, dtype=np.int32))
        best, best_n = None, 0
        with self._lock:
            self._entries = [e for e in self._entries if _alive(e)]
            for other in self._entries:
                if other.key != key:
                    continue
                n = min(common_prefix(other.tokens, entry.tokens), len(tokens) - 1)
                if n > best_n:
                    best, best_n = other, n
            self._entries.append(entry)
        if best is None or best_n - held < self.min_shared:
            return entry, None, 0
        return entry, best, best_n

    def end(self, entry: Restoring, tail: Any) -> None:
        """``entry``'s restore finished with ``tail`` (or None)."""
        if tail is not None and tail.start == 0:
            entry.tail = weakref.ref(tail)
        entry.done.set()

    def head(self, other: Restoring, tokens: int) -> Any:
        """Wait for ``other`` and return its tail when it holds at least ``tokens``
        tokens from the prompt's start (else None)."""
        if not other.done.wait(self.wait_s) or other.tail is None:
            return None
        tail = other.tail()
        return tail if tail is not None and tail.end >= tokens else None

    def taken(self, entry: Optional[Restoring]) -> None:
        """``entry``'s request was looked up: its cache is the request's now."""
        if entry is None:
            return
        with self._lock:
            self._entries = [e for e in self._entries if e is not entry]
        entry.tail = None

    def __len__(self) -> int:
        with self._lock:
            return sum(1 for e in self._entries if _alive(e))


def _alive(entry: Restoring) -> bool:
    """Still restoring, or restored a tail that is still held somewhere."""
    if not entry.done.is_set():
        return True
    return entry.tail is not None and entry.tail() is not None
