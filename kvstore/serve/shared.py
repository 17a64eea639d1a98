"""Restores of requests that arrive together and share a prefix: one read.

Returning users often share a long system prompt and come back at once (a server's
restart, a burst). Each request's prefetch (:mod:`kvstore.serve.prefetch`) would
read the shared prefix from the store and copy it to the device again; on an H200
eight 0.85 GB restores took 2.1 s, bound by the host-to-device copies, where four of
them were the same system prompts. :class:`SharedRestores` lets a prefetch whose
tokens share a long prefix with a restore in progress (or done and not yet taken
by its request's lookup) wait for that restore, then read from the store only the
nodes past the shared prefix and join them to a copy of it on the device.

A request's restore is entered here as the request arrives (on its HTTP thread), in
the order requests arrive, before a prefetch thread starts it; a prefetch that waits
for another's restore runs on a thread of its own, not on one of the few that
restore (:class:`~kvstore.serve.prefetch.Prefetcher`). So users of a few system
prompts arriving together read each system prompt once, whichever restores start
first.

A restore hands its KV to the prefetches already waiting for it as it ends, before
its own request can reach a lookup; one arriving later finds it only while no
lookup has taken it. Waiters are handed views of it in cache objects of their own
(``freeze``): mlx-lm's one-at-a-time path (a request with a seed) writes into its
request's cache objects in place, and with CUDA another thread cannot evaluate what
the generation thread wrote there. An entry is dropped when its lookup takes it;
one never taken goes with its KV (a weak reference). Entries are keyed by model and
salt: tenants never share.

A restore of a whole prefix waits first for the prefetches it would delay that were
handed a prefix (:meth:`SharedRestores.let_joins_finish`): restores share the
reader threads, the host's memory bandwidth and the copies to the device, and a
joined one reads only a user's own turn (0.1-0.2 s on an H200 where a whole
6,500-token prompt took 0.6-0.7 s), so its user is answered first.
"""

import logging
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, List, NamedTuple, Optional

import numpy as np

from ..disk.chunking import common_prefix

log = logging.getLogger("kvstore.server")

# A shared prefix shorter than this is read again rather than waited for.
MIN_SHARED_TOKENS = 256
# How long a prefetch waits for the restore it shares a prefix with.
WAIT_S = 30.0
# How long a restore waits for the prefetches handed a prefix to finish theirs.
JOIN_WAIT_S = 2.0


@dataclass(eq=False)
class Restoring:
    """One prefetch's restore: its request's ``key`` (model, salt) and tokens; once
    ``done``, a weak reference to its :class:`~kvstore.engine.tail.Tail` when it
    restored the whole prefix (``start`` 0). ``waiters``: the later entries waiting
    for it; ``handed``: the tail handed to this one by the entry it waits for."""

    key: Any
    tokens: np.ndarray  # int32, as the store compares token ids
    done: threading.Event = field(default_factory=threading.Event)
    tail: Optional[weakref.ref] = None
    waiters: List["Restoring"] = field(default_factory=list)
    handed: Any = None

    def abandon(self) -> None:
        """Never restored (sent on to be prefilled, refused, cancelled): whoever
        waits for it reads from the store itself."""
        self.handed = None
        self.done.set()


class Registration(NamedTuple):
    """A restore entered in :class:`SharedRestores`: its ``entry``, and the earlier
    ``other`` sharing its first ``common`` tokens (None, 0: none worth waiting for)."""

    entry: Restoring
    other: Optional[Restoring]
    common: int


class SharedRestores:
    """The prefetches restoring now, or restored and not yet taken."""

    def __init__(
        self,
        *,
        min_shared: int = MIN_SHARED_TOKENS,
        wait_s: float = WAIT_S,
        freeze: Callable[[Any, Any], Any] = lambda key, tail: tail,
    ):
        self.min_shared = min_shared
        self.wait_s = wait_s
        self._freeze = freeze  # (key, tail) -> a copy no generate loop writes to
        self._lock = threading.Lock()
        self._entries: List[Restoring] = []
        self._handed: List[Restoring] = []  # waiters given a prefix, not yet done

    def begin(self, key: Any, tokens: List[int], held: int) -> Registration:
        """Register a restore of ``tokens`` past ``held`` RAM tokens. Returns its
        entry, the entry sharing the longest prefix with it (at least
        ``min_shared`` tokens past ``held``; None if none) and that prefix's
        length, at most ``len(tokens) - 1`` (the store restores no more). The
        entry must be ended (:meth:`end`) or abandoned: later ones may wait for it."""
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
                return Registration(entry, None, 0)
            if not best.done.is_set():
                best.waiters.append(entry)
        return Registration(entry, best, best_n)

    def end(self, entry: Restoring, tail: Any) -> None:
        """``entry``'s restore finished with ``tail`` (or None): handed to the
        entries waiting for it (a frozen copy: its request may be looked up and
        generated from before they copy it), and shared with later ones until it
        is taken."""
        whole = tail if tail is not None and tail.start == 0 else None
        handed = None
        with self._lock:
            waiting = whole is not None and any(
                not w.done.is_set() for w in entry.waiters
            )
        if waiting:
            try:
                handed = self._freeze(entry.key, whole)
            except Exception:  # they read from the store themselves
                log.exception("kvstore: a shared restore could not be handed over")
        with self._lock:
            if whole is not None:
                entry.tail = weakref.ref(whole)
            self._handed = _not_done(self._handed)  # those ended are no joins now
            for waiter in entry.waiters if handed is not None else ():
                if not waiter.done.is_set():
                    waiter.handed = handed
                    self._handed.append(waiter)
            entry.waiters, entry.handed = [], None
            entry.done.set()

    def head(
        self, other: Restoring, tokens: int, *, waiter: Optional[Restoring] = None
    ) -> Any:
        """Wait for ``other`` and return its tail when it holds at least ``tokens``
        tokens from the prompt's start (else None): the one it handed to
        ``waiter``, else its own while no lookup has taken it."""
        if not other.done.wait(self.wait_s):
            return None
        tail = None
        if waiter is not None:
            tail, waiter.handed = waiter.handed, None
        if tail is None and other.tail is not None:
            tail = other.tail()
        return tail if tail is not None and tail.end >= tokens else None

    def let_joins_finish(self, *, timeout: float = JOIN_WAIT_S) -> None:
        """Before a restore of a whole prefix: wait until every prefetch handed a
        prefix has ended (at most ``timeout``)."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                self._handed = _not_done(self._handed)
                waiter = self._handed[0] if self._handed else None
            left = deadline - time.monotonic()
            if waiter is None or left <= 0 or not waiter.done.wait(left):
                return

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


def _not_done(entries: List[Restoring]) -> List[Restoring]:
    return [e for e in entries if not e.done.is_set()]


def _alive(entry: Restoring) -> bool:
    """Still restoring, or restored a tail that is still held somewhere."""
    if not entry.done.is_set():
        return True
    return entry.tail is not None and entry.tail() is not None
