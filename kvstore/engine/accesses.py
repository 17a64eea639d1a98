"""Access times of a store's nodes and its measured rates, batched for the writer."""

import threading
import time
from typing import Dict, Iterable, Optional

from ..disk.index import Index
from . import payoff
from .writer import BackgroundWriter


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
        self._touched: Dict[bytes, float] = {}
        self.rates_kept: Optional[float] = None  # when the rates were last kept
        self._rates_due = False  # the rates go into the next write of accesses

    def touch(self, hashes: Iterable[bytes]) -> None:
        """Note an access to nodes ``hashes`` now."""
        now = time.time()
        with self._lock:
            for h in hashes:
                self._touched[h] = now
            many = len(self._touched) >= 256
        if many:
            self.writer.submit(self.flush)

    def take(self) -> Dict[bytes, float]:
        """The accesses noted so far, which the caller then writes (:meth:`apply`)."""
        with self._lock:
            touched, self._touched = self._touched, {}
        return touched

    def apply(self, txn, touched: Dict[bytes, float]) -> None:
        """Write ``touched`` (and the rates, when due) in the write transaction ``txn``."""
        for h, t in touched.items():
            self.index.touch(txn, self.namespace, h, t)
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
