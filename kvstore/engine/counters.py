"""This process's counts of one store, shared by its parts under one lock."""

import dataclasses
import threading
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List


@dataclass
class Counts:
    """What ``KVStore.stats()`` reports of this process."""

    hits: int = 0
    misses: int = 0
    tokens_reused: int = 0
    tokens_requested: int = 0
    restore_seconds: float = 0.0
    corrupt: int = 0
    errors: int = 0
    nodes_written: int = 0
    bytes_written: int = 0
    nodes_evicted: int = 0
    nodes_skipped: int = 0  # a commit found their parent gone (evicted meanwhile)
    writes_dropped: int = 0
    saves_refused: int = 0  # the cache's layout differed from the one probed at open
    quarantined: List[str] = field(default_factory=list)


class Counters:
    """:class:`Counts` that the read path, the write path and removal add to from
    their threads (callers, readers, the writer)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._counts = Counts()

    def add(self, **deltas: float) -> None:
        """Add ``deltas`` (field name -> amount) in one step."""
        with self._lock:
            for name, amount in deltas.items():
                setattr(self._counts, name, getattr(self._counts, name) + amount)

    def fetched(self, requested: int, reused: int, seconds: float) -> None:
        """Count a fetch of ``requested`` tokens that restored ``reused`` of them."""
        self.add(
            tokens_requested=requested,
            hits=int(reused > 0),
            misses=int(reused == 0),
            tokens_reused=reused,
            restore_seconds=seconds,
        )

    def quarantined(self, paths: Iterable[str]) -> None:
        """Note files moved to quarantine."""
        with self._lock:
            self._counts.quarantined.extend(paths)

    def snapshot(self) -> Counts:
        """A copy of the counts, taken at once."""
        with self._lock:
            c = self._counts
            return dataclasses.replace(c, quarantined=list(c.quarantined))

    def stats(self) -> Dict[str, Any]:
        """The counts as ``KVStore.stats()`` reports them."""
        c = self.snapshot()
        return {
            "hits": c.hits,
            "misses": c.misses,
            "tokens_requested": c.tokens_requested,
            "tokens_reused": c.tokens_reused,
            "restore_seconds": c.restore_seconds,
            "corrupt": c.corrupt,
            "quarantined": c.quarantined,
            "errors": c.errors,
            "nodes_written": c.nodes_written,
            "bytes_written": c.bytes_written,
            "nodes_evicted": c.nodes_evicted,
            "nodes_skipped": c.nodes_skipped,
            "writes_dropped": c.writes_dropped,
            "saves_refused": c.saves_refused,
        }
