"""Uploading: a queue of new nodes that one thread sends, files first, manifest last."""

import json
import logging
import threading
import time
from collections import OrderedDict
from typing import Iterable, Optional, Set

from ..disk.blobs import CorruptBlob
from ..disk.index import NodeRecord
from .client import S3Client
from .errors import RemoteError
from .manifest import check_node_file, encode_manifest, node_parts

log = logging.getLogger("kvstore")


class Uploader:
    """Sends a store's new nodes to the remote from a background thread.

    Args:
        s3: The remote.
        max_pending: Nodes waiting beyond this are dropped (counted).
        attempts: Attempts per node, with exponential backoff.
        closing: Set when the tier closes: the thread stops, waits end.
    """

    def __init__(
        self, s3: S3Client, *, max_pending: int, attempts: int, closing: threading.Event
    ):
        self._s3 = s3
        self._counters = s3.counters
        self.max_pending, self.attempts = max_pending, attempts
        self._closing = closing
        self._cond = threading.Condition()
        self._pending: "OrderedDict[bytes, NodeRecord]" = OrderedDict()
        self._uploading = 0
        self._thread: Optional[threading.Thread] = None
        self._namespaces_done: Set[bytes] = set()

    def start(self, store) -> None:
        self._thread = threading.Thread(
            target=self._loop, args=(store,), name="kvstore-upload", daemon=True
        )
        self._thread.start()

    def pending(self) -> int:
        """Nodes queued or being sent."""
        with self._cond:
            return len(self._pending) + self._uploading

    def add(self, added: Iterable[tuple]) -> None:
        """Queue ``(h, rec, ...)`` for upload."""
        with self._cond:
            for h, rec, *_ in added:
                if self._closing.is_set() or (
                    h not in self._pending and len(self._pending) >= self.max_pending
                ):
                    self._counters.add(uploads_dropped=1)
                    continue
                self._pending[h] = rec  # a later record (with a checkpoint) replaces
            self._cond.notify_all()

    def wait(self, timeout: float) -> bool:
        """Wait until queued uploads are done; False at the timeout or when the circuit
        breaker opens (a dead remote is not waited for)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._pending or self._uploading:
                left = deadline - time.monotonic()
                if left <= 0 or self._s3.circuit_open() or self._thread is None:
                    return False
                self._cond.wait(min(left, 0.1))
        return True

    def drain(self, timeout: float) -> None:
        """Before close: wait (up to ``timeout``, while the remote answers)."""
        if self._thread is not None and not self.wait(timeout):
            log.warning(
                "kvstore: remote %s: %d node uploads not done at close",
                self._s3.url,
                self.pending(),
            )

    def stop(self) -> None:
        """After ``closing`` is set: drop what is still queued, end the thread."""
        with self._cond:
            self._counters.add(uploads_dropped=len(self._pending))
            self._pending.clear()
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()

    def _loop(self, store) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._closing.is_set():
                    self._cond.wait()
                if self._closing.is_set():
                    return
                h, rec = self._pending.popitem(last=False)
                self._uploading += 1
            try:
                self._upload_with_retries(store, h, rec)
            except Exception:
                log.exception("kvstore: remote upload failed")
                self._counters.add(upload_errors=1)
            finally:
                with self._cond:
                    self._uploading -= 1
                    self._cond.notify_all()

    def _upload_with_retries(self, store, h: bytes, rec: NodeRecord) -> None:
        ns = store.namespace
        for attempt in range(self.attempts):
            # Wait out an open breaker (or stop at close) rather than spin on it.
            while self._s3.circuit_open() and not self._closing.wait(0.2):
                pass
            if self._closing.is_set():
                self._counters.add(uploads_dropped=1)
                return
            try:
                if ns not in self._namespaces_done:
                    self.put_namespace(ns, store.description)
                self.upload_node(store.blobs, ns, h, rec, store.layout)
                return
            except (CorruptBlob, OSError) as e:
                # The local file went (evicted, quarantined) or is broken: not ours to
                # send. A broken one is the store's to report.
                self._counters.add(uploads_skipped=1)
                if isinstance(e, CorruptBlob):
                    store.parts.broken.report(h, f"before upload: {e}", rec)
                return
            except RemoteError:
                if attempt == self.attempts - 1:
                    self._counters.add(upload_errors=1)
                    return
                self._closing.wait(0.5 * 2**attempt)

    def put_namespace(self, ns: bytes, description: dict) -> None:
        """Upload the namespace's description once (for people and tools browsing)."""
        key = self._s3.key(ns, "namespace.json")
        if self._s3.head(key) is None:
            self._s3.put(key, json.dumps(description, sort_keys=True).encode())
        self._namespaces_done.add(ns)

    def upload_node(
        self, blobs, ns: bytes, h: bytes, rec: NodeRecord, layout, *, head: bool = True
    ) -> bool:
        """Upload node ``h`` (files first, manifest last); False when the remote has it.

        The manifest goes last: a reader that finds a manifest finds its files (S3 and
        its clones are read-after-write consistent), and a crash between the two leaves
        an unreferenced file, never a manifest without its file.

        Raises:
            RemoteError: the remote failed. CorruptBlob, OSError: the local file is
                missing or does not match its record (checked before sending).
        """
        mkey = self._s3.manifest_key(ns, rec.parent, h)
        if head:
            meta = self._s3.head(mkey)
            if meta is not None and (meta.get("state") == "1" or not rec.has_state):
                self._counters.add(uploads_present=1)
                return False
        for part, nbytes, checksum in node_parts(rec):
            data = blobs.read_all(
                ns, h, nbytes=nbytes, checksum=checksum, expected=None, part=part
            )[0]
            check_node_file(data, rec, part, ns=ns, layout=layout)
            self._s3.put(self._s3.blob_key(ns, h, checksum, part), bytes(data))
        self._s3.put(
            mkey,
            encode_manifest(ns, h, rec),
            {"state": "1" if rec.has_state else "0"},
        )
        self._counters.add(uploads=1)
        return True
