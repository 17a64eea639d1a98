"""Access times of a store's nodes and its measured rates, batched for the writer."""

import threading
import time
from typing import Dict, Iterable, Optional, Tuple

from ..disk.index import Index
from . import payoff
from .writer import BackgroundWriter

# A node above the one a request ends at gets its access time rewritten at most this
# often. Eviction takes a node's due time from its whole subtree (the ends' exact
# times), so this only coarsens ``kvstore ls``'s ``last_use``; a save or restore of a
# deep conversation rewrote hundreds of random index pages per request without it.
ANCESTOR_RESOLUTION_S = 600.0
_NOTED_MAX = 1 << 15  # ancestors remembered as noted (then forgotten all at once)


class Accesses:
    """Nodes' access times, kept in memory and written in the writer's transactions
    (a save's, a flush's), and the restore and prefill rates written with them.

    Args:
        index: The store's index.
        namespace: The namespace whose nodes are touched.
        writer: The store's background writer.
        rates: The rates to keep (``RestorePolicy.rates``).
    """

    def __init__(
        self,
        index: Index,
        namespace: bytes,
        writer: BackgroundWriter,
        rates: payoff.Rates,
    ):
        self.index = index
        self.namespace = namespace
        self.writer = writer
        self.rates = rates
        self._lock = threading.Lock()
        self._touched: Dict[bytes, Tuple[float, bool]] = {}  # (time, a path's end)
        self._noted: Dict[bytes, float] = {}  # ancestors: when last noted here
        self.rates_kept: Optional[float] = None  # when the rates were last kept
        self._rates_due = False  # the rates go into the next write of accesses

    def touch(self, path: Iterable[bytes]) -> None:
        """Note an access now to the nodes of ``path``, root first: the last is where
        the request ended (its time is exact), the others are its ancestors."""
        now = time.time()
        stale = now - ANCESTOR_RESOLUTION_S
        with self._lock:
            if len(self._noted) > _NOTED_MAX:
                self._noted.clear()
            last = None
            for h in path:
                # An ancestor noted within the resolution is not noted again (nor
                # looked up in the index); an end noted before stays one.
                if last is not None and self._noted.get(last, 0.0) < stale:
                    self._noted[last] = now
                    self._touched[last] = (now, self._touched.get(last, (0, False))[1])
                last = h
            if last is not None:
                self._touched[last] = (now, True)
            many = len(self._touched) >= 256
        if many:
            self.writer.submit(self.flush)

    def take(self) -> Dict[bytes, Tuple[float, bool]]:
        """The accesses noted so far, which the caller then writes (:meth:`apply`)."""
        with self._lock:
            touched, self._touched = self._touched, {}
        return touched

    def apply(self, txn, touched: Dict[bytes, Tuple[float, bool]]) -> None:
        """Write ``touched`` (and the rates, when due) in the write transaction ``txn``."""
        for h, (t, end) in touched.items():
            coarse = 0.0 if end else ANCESTOR_RESOLUTION_S
            self.index.touch(txn, self.namespace, h, t, resolution=coarse)
        if self._rates_due:
            self._rates_due = False
            payoff.write_rates(txn, self.index.db["meta"], self.namespace, self.rates)

    def flush(self) -> None:
        """Writer thread: write the accesses noted so far (and due rates)."""
        touched = self.take()
        if touched or self._rates_due:
            self.index.write(lambda txn: self.apply(txn, touched))

    def keep_rates(self) -> None:
        """Have the measured rates written into the store with the next accesses
        (a save, a flush, close), at most every :data:`kvstore.engine.payoff.PERSIST_EVERY_S`:
        no write of its own, so a fetch never queues one."""
        now, kept = time.monotonic(), self.rates_kept
        if kept is None or now - kept >= payoff.PERSIST_EVERY_S:
            self.rates_kept, self._rates_due = now, True
