"""The RAM tier: verified chunk files kept in memory under a byte budget."""

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Dict, Hashable, Optional

from ..disk.blobs import TensorEntry
from ..disk.policy import RAM_ORDER


@dataclass(frozen=True)
class RamEntry:
    """A node's whole file, already checksummed, with its parsed header."""

    data: bytes  # or a bytearray nobody writes to
    tensors: Dict[str, TensorEntry]
    kind: str
    pinned: bool

    @property
    def nbytes(self) -> int:
        return len(self.data)


class RamTier:
    """LRU per (pinned, kind) bucket, evicted in :data:`policy.RAM_ORDER`.

    Thread-safe: the generate loop reads while the background writer inserts.

    Args:
        max_bytes: Budget for the bytes held; 0 disables the tier.
    """

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._buckets = {b: OrderedDict() for b in RAM_ORDER}
        self._where: Dict[Hashable, tuple] = {}
        # Bytes per bucket, kept as entries come and go: an insert asks how much the
        # buckets below it hold without summing their entries (O(1) per operation).
        self._bucket_bytes = dict.fromkeys(RAM_ORDER, 0)
        self._nbytes = 0
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        return self._nbytes

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, key) -> bool:
        return key in self._where

    def get(self, key: Hashable) -> Optional[RamEntry]:
        with self._lock:
            bucket = self._where.get(key)
            if bucket is None:
                return None
            self._buckets[bucket].move_to_end(key)
            return self._buckets[bucket][key]

    def put(self, key: Hashable, entry: RamEntry) -> bool:
        """Insert ``entry``; False if it does not fit even after evicting others."""
        if self.max_bytes == 0 or entry.nbytes > self.max_bytes:
            return False
        with self._lock:
            bucket = (entry.pinned, entry.kind)
            rank = RAM_ORDER.index(bucket)
            # Never evict a more important bucket to make room for a less important
            # entry, and evict nothing at all when the entry would not fit anyway.
            evictable = sum(self._bucket_bytes[b] for b in RAM_ORDER[: rank + 1])
            if self._nbytes - evictable + entry.nbytes > self.max_bytes:
                return False
            self._discard(key)
            while self._nbytes + entry.nbytes > self.max_bytes:
                self._evict_one(below=rank)
            self._buckets[bucket][key] = entry
            self._where[key] = bucket
            self._bucket_bytes[bucket] += entry.nbytes
            self._nbytes += entry.nbytes
            return True

    def discard(self, key: Hashable) -> None:
        with self._lock:
            self._discard(key)

    def clear(self) -> None:
        with self._lock:
            for bucket in self._buckets.values():
                bucket.clear()
            self._where.clear()
            self._bucket_bytes = dict.fromkeys(RAM_ORDER, 0)
            self._nbytes = 0

    def _discard(self, key):
        bucket = self._where.pop(key, None)
        if bucket is not None:
            nbytes = self._buckets[bucket].pop(key).nbytes
            self._bucket_bytes[bucket] -= nbytes
            self._nbytes -= nbytes

    def _evict_one(self, *, below: int) -> bool:
        for bucket in RAM_ORDER[: below + 1]:
            entries = self._buckets[bucket]
            if entries:
                key, entry = entries.popitem(last=False)
                del self._where[key]
                self._bucket_bytes[bucket] -= entry.nbytes
                self._nbytes -= entry.nbytes
                return True
        return False
