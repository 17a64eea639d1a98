"""Reading the remote's trie: manifests by node, children by parent, briefly cached."""

import logging
import threading
import time
from collections import OrderedDict
from typing import Any, Optional, Set, Tuple

import numpy as np

from ..disk.index import NodeRecord
from .client import LIST_PAGE, S3Client
from .errors import NotFound, RemoteCorrupt
from .manifest import CHILD_KEY, decode_manifest, manifest_limit

log = logging.getLogger("kvstore")


def wrong_start(rec: NodeRecord, start: int) -> Optional[str]:
    """Why a manifest does not start at ``start`` (its parent's end); None if it does."""
    if rec.start == start:
        return None
    return f"manifest start {rec.start}, expected {start}"


class _Expiring:
    """A bounded map whose entries expire ``seconds`` after they were set."""

    def __init__(self, seconds: float, size: int = 8192):
        self.seconds, self.size = seconds, size
        self._lock = threading.Lock()
        self._items: "OrderedDict[bytes, Tuple[float, Any]]" = OrderedDict()

    def get(self, key: bytes) -> Optional[Tuple[float, Any]]:
        """``(expiry, value)``, or None when absent or expired."""
        with self._lock:
            hit = self._items.get(key)
            if hit is None:
                return None
            if hit[0] < time.monotonic():
                del self._items[key]
                return None
            return hit

    def set(self, key: bytes, value) -> None:
        with self._lock:
            self._items[key] = (time.monotonic() + self.seconds, value)
            self._items.move_to_end(key)
            while len(self._items) > self.size:
                self._items.popitem(last=False)


class ManifestReader:
    """Validated manifests and children listings of the remote, each remembered for
    ``cache_seconds`` (a miss too: a node uploaded meanwhile is seen after that long).
    """

    def __init__(self, s3: S3Client, *, cache_seconds: float, max_object_bytes: int):
        self._s3 = s3
        self.max_object_bytes = max_object_bytes
        self._manifests = _Expiring(cache_seconds)
        self._listings = _Expiring(cache_seconds)

    def manifest(
        self,
        ns: bytes,
        parent: bytes,
        h: bytes,
        *,
        start: Optional[int],
        chunk_tokens: int,
        tokens: Optional[np.ndarray] = None,
        strict: bool = False,
    ) -> Optional[NodeRecord]:
        """Node ``h``'s manifest, validated; None when the remote lacks it or it is
        invalid (reported). With ``strict``, an invalid one raises RemoteCorrupt.
        ``start`` None: the caller checks where the node starts."""
        hit = self._manifests.get(h)
        if hit is not None and not strict:
            return hit[1]
        listing = self._listings.get(parent)
        if listing is not None and h not in listing[1] and not strict:
            return None  # the parent's fresh listing says no such child
        key = self._s3.manifest_key(ns, parent, h)
        try:
            raw = self._s3.get(key, limit=manifest_limit(chunk_tokens))
            rec = decode_manifest(
                raw,
                ns=ns,
                h=h,
                chunk_tokens=chunk_tokens,
                max_object_bytes=self.max_object_bytes,
            )
            if rec.parent != parent:
                raise RemoteCorrupt("manifest names another parent")
            wrong = None if start is None else wrong_start(rec, start)
            if wrong is not None:
                raise RemoteCorrupt(wrong)
            if tokens is not None and not np.array_equal(rec.tokens, tokens):
                raise RemoteCorrupt("manifest tokens differ from the prompt's")
        except NotFound:
            rec = None
        except RemoteCorrupt as e:
            if strict:
                raise RemoteCorrupt(f"{key}: {e}") from None
            self.report_corrupt(f"{key}: {e}")
            rec = None
        self._manifests.set(h, rec)
        return rec

    def mark_missing(self, h: bytes) -> None:
        """Treat node ``h`` as absent until the cache expires (its files are broken)."""
        self._manifests.set(h, None)

    def report_corrupt(self, what: str) -> None:
        self._s3.counters.error("remote_corrupt", what)
        log.warning("kvstore: remote object %s; treating it as a miss", what)

    def children(self, ns: bytes, parent: bytes) -> Set[bytes]:
        """Hashes of ``parent``'s children on the remote (the first page of them)."""
        hit = self._listings.get(parent)
        if hit is not None:
            return hit[1]
        prefix = self._s3.key(ns, "nodes", parent.hex()) + "/"
        out = set()
        for key in self._s3.list_keys(prefix, max_keys=LIST_PAGE):
            m = CHILD_KEY.fullmatch(key[len(prefix) :])
            if m:
                out.add(bytes.fromhex(m.group(1)))
        self._listings.set(parent, out)
        return out
