"""Removing node files for ``KVStore``: eviction under the disk budget, quarantine of
broken nodes, and cleaning up after failed or superseded saves; and the broken nodes
this process has found (:class:`BrokenNodes`).

Files are unlinked through :func:`kvstore.maintenance.release_files`, which re-checks
the index first.
"""

import logging
import threading
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

from .. import maintenance
from ..disk import reservations, salts
from ..disk.blobs import Blobs, CorruptBlob
from ..disk.index import CorruptRecord, Index, NodeRecord
from .accesses import Accesses
from .counters import Counters
from .ram import RamTier
from .restore import state_key
from .writer import BackgroundWriter

log = logging.getLogger("kvstore")


@dataclass
class Budgets:
    """The disk budgets a store's saves keep to (None: none); they may be changed
    while the store is open."""

    disk_bytes: Optional[int] = None  # the store's node files
    salt_disk_bytes: Optional[int] = None  # each salted tree's (a tenant's)


def same_record(
    index: Index, namespace: bytes, txn, h: bytes, rec: Optional[NodeRecord]
) -> bool:
    """Whether node ``h``'s record in ``txn`` is still ``rec`` (the same files);
    with ``rec`` None, whether it is still a record that does not decode."""
    try:
        now = index.get_node(namespace, h, txn)
    except CorruptRecord:
        return rec is None
    return now is not None and rec is not None and now.same_files(rec)


class Removal:
    """Evicting, quarantining and unlinking the node files of one namespace of a
    store, and forgetting them in its RAM tier.

    Args:
        index: The store's index.
        blobs: The store's node files.
        ram: The RAM tier, which must not keep removed nodes.
        namespace: The namespace whose nodes this removes.
        root: The namespace's root (its unsalted tree).
        budgets: The disk budgets (read at each save: they may change).
        counters: Where evictions and quarantined files are counted.
        accesses: The access times eviction goes by (flushed first).
    """

    def __init__(
        self,
        *,
        index: Index,
        blobs: Blobs,
        ram: RamTier,
        namespace: bytes,
        root: bytes,
        budgets: Budgets,
        counters: Counters,
        accesses: Accesses,
    ):
        self.index = index
        self.blobs = blobs
        self.ram = ram
        self.namespace = namespace
        self.root = root
        self.budgets = budgets
        self.counters = counters
        self.accesses = accesses

    def release_failed_save(
        self, attempts: list, reservation: Optional[bytes] = None
    ) -> None:
        """A save failed before its commit (disk full, I/O error): remove the files it
        published (:meth:`remove_written`), so that nothing of it stays on disk and the
        space comes back; then delete its disk reservation."""
        try:
            self.remove_written(attempts)
        finally:
            if reservation is not None:
                self.unreserve(reservation)

    def remove_written(self, attempts: list) -> None:
        """Remove the files of ``attempts``, ``(hash, part, bytes, inode)`` of files a
        save may have published, that no index record names.

        A file is removed only if it is the very file the save wrote (its inode: a
        file another writer published there first, and this save adopted, stays).
        :func:`kvstore.maintenance.release_files` keeps any file the index refers to.
        """
        if not attempts:
            return
        ns = self.namespace
        keys = [
            (ns, h)
            for h, part, _, inode in attempts
            if self.blobs.published_inode(ns, h, part) == inode
        ]
        try:
            maintenance.release_files(self.index, self.blobs, keys)
        except Exception:
            log.exception("kvstore: cannot remove the files of a failed save")

    def unlink_unindexed(self, hashes: Sequence[bytes]) -> None:
        """Unlink files of deleted nodes, re-checking the index under the writer lock
        (:func:`kvstore.maintenance.release_files`)."""
        for h in hashes:
            self.forget(h)
        maintenance.release_files(
            self.index, self.blobs, [(self.namespace, h) for h in hashes]
        )

    def quarantine(self, h: bytes, reason: str, rec: Optional[NodeRecord]) -> None:
        """Writer thread: remove a broken node and its descendants from the index, then
        move its file to quarantine and unlink theirs.

        Only while its record is still ``rec``, the one found broken (checked in the
        deleting transaction): a node another process evicted, or evicted and saved
        again, meanwhile is not this process's to remove.
        """
        ns = self.namespace

        def delete(txn):
            if not same_record(self.index, ns, txn, h, rec):
                return None
            return maintenance.delete_subtree(self.index, txn, ns, h)

        gone = self.index.write(delete, frees=True)
        if gone is not None:
            keys = [(ns, h)] + [(ns, x) for x, _ in gone if x != h]
            for _, x in keys:
                self.forget(x)
            released = maintenance.release_files(
                self.index, self.blobs, keys, quarantine={(ns, h): reason}
            )
            if released.quarantined:
                self.counters.quarantined(released.quarantined)

    def make_room(
        self,
        txn,
        written: list,
        root: Optional[bytes] = None,
        group: Optional[bytes] = None,
    ) -> list:
        """In the commit's transaction: evict what the new nodes need to fit the salted
        tree's quota (``salt_disk_bytes``, for a save under a salt: the nodes of the
        trees counting against ``group``, a tenant's, only) and the disk budget
        (:func:`kvstore.maintenance.make_room`), sparing the nodes they hang from.
        """
        quota = self.budgets.salt_disk_bytes if root not in (None, self.root) else None
        if self.budgets.disk_bytes is None and quota is None:
            return []
        ns, nodes_db = self.namespace, self.index.db["nodes"]
        new = [
            (node, delta[1].nbytes + (state[1].nbytes if state else 0))
            for node, delta, state in written
            if delta is not None and txn.get(ns + node.h, db=nodes_db) is None
        ]
        if not new:
            return []
        incoming = sum(nbytes for _, nbytes in new)
        keep = {(ns, node.parent) for node, _ in new}
        gone = []
        if quota is not None:
            gone += salts.make_tree_room(
                self.index, txn, ns, root, quota, incoming, keep=keep, group=group
            )
        if self.budgets.disk_bytes is not None:
            gone += maintenance.make_room(
                self.index, txn, self.budgets.disk_bytes, incoming, keep=keep
            )
        return gone

    def release_evicted(self, evicted: list) -> None:
        """After the commit: unlink the files of the nodes :meth:`make_room` evicted."""
        if not evicted:
            return
        for (ns, h), _ in evicted:
            if ns == self.namespace:
                self.forget(h)
        maintenance.release_files(
            self.index, self.blobs, [key for key, _ in evicted], sizes=False
        )
        self.counters.add(nodes_evicted=len(evicted))

    def enforce_disk_budget(self) -> None:
        """Evict least recently used unpinned leaves until the store fits ``disk_bytes``
        (:func:`kvstore.maintenance.evict_to_budget`)."""
        if self.budgets.disk_bytes is None:
            return
        self.accesses.flush()  # eviction order must see the latest accesses
        evicted = maintenance.evict_to_budget(
            self.index,
            self.blobs,
            self.budgets.disk_bytes,
            on_evict=lambda keys: [self.forget(h) for _, h in keys],
        )
        self.counters.add(nodes_evicted=evicted.nodes)
        if evicted.excess:
            log.warning(
                "kvstore: disk budget exceeded by %d bytes that cannot be evicted (pinned)",
                evicted.excess,
            )

    def unreserve(self, key: bytes) -> None:
        """Delete reservation ``key``. If that fails, this process forgets it anyway, so
        its next reservation (or anyone's, after the timeout) drops it as stale."""
        try:
            self.index.write(lambda txn: reservations.delete(self.index, txn, key))
        except Exception:
            log.exception("kvstore: cannot delete a disk reservation")
        finally:
            reservations.forget(key)

    def forget(self, h: bytes) -> None:
        """Drop node ``h``'s files from the RAM tier."""
        self.ram.discard(h)
        self.ram.discard(state_key(h))


class BrokenNodes:
    """The nodes this process found broken: skipped by its walks until the writer has
    quarantined them (or a save has written them again).

    Args:
        index: The store's index.
        namespace: The namespace of the nodes.
        removal: What forgets and quarantines a broken node.
        writer: The thread quarantines run on.
        counters: Where broken nodes and read errors are counted.
    """

    def __init__(
        self,
        *,
        index: Index,
        namespace: bytes,
        removal: Removal,
        writer: BackgroundWriter,
        counters: Counters,
    ):
        self.index = index
        self.namespace = namespace
        self.removal = removal
        self.writer = writer
        self.counters = counters
        self._lock = threading.Lock()
        self._broken: set = set()

    def __contains__(self, h: bytes) -> bool:
        return h in self._broken

    def __len__(self) -> int:
        return len(self._broken)

    def healed(self, hashes: Iterable[bytes]) -> None:
        """Nodes ``hashes`` were written again (a save's commit): no longer broken."""
        with self._lock:
            self._broken.difference_update(hashes)

    def corrupt_record(self, h: bytes, error: CorruptRecord) -> None:
        """Node ``h``'s index record does not decode (an ``on_corrupt`` callback)."""
        self.report(h, f"index record: {error}")

    def read_failed(
        self, h: bytes, error: BaseException, rec: Optional[NodeRecord]
    ) -> None:
        """A node's files could not be read for a fetch (or a prefill, a preload).

        Only evidence that the data is bad (:class:`CorruptBlob`: checksum, header,
        size, a missing file; :class:`CorruptRecord`) reports the node broken, and
        only while the index still holds the record it was read for. Any other
        ``OSError`` (out of descriptors or memory, an interrupted call, EIO) is a
        miss and a counted error: nothing is removed, the next fetch tries again.
        """
        if isinstance(error, (CorruptBlob, CorruptRecord)):
            self.report(h, str(error), rec)
            return
        if isinstance(error, OSError):
            log.warning(
                "kvstore: cannot read node %s now (%s); a miss, nothing removed",
                h.hex()[:12],
                error,
            )
        else:
            log.error("kvstore: reading node failed", exc_info=error)
        self.counters.add(errors=1)

    def report(self, h: bytes, reason: str, rec: Optional[NodeRecord] = None) -> None:
        """Report node ``h`` broken (a miss from it on) and have the writer quarantine
        it: ``rec`` is the record its files were read for (None: a record that does
        not decode). A node whose record has gone or changed since (another process
        evicted it, or evicted and saved it again) is a plain miss instead."""
        if rec is not None and not self.index.read(
            lambda txn: same_record(self.index, self.namespace, txn, h, rec),
            guarded=True,  # a search
        ):
            log.debug("kvstore: node %s went while it was read: a miss", h.hex()[:12])
            return
        with self._lock:
            if h in self._broken:
                return
            self._broken.add(h)
        self.counters.add(corrupt=1)
        log.warning(
            "kvstore: node %s is broken (%s); treating it as a miss",
            h.hex()[:12],
            reason,
        )
        self.removal.forget(h)
        self.writer.submit(lambda: self._quarantine(h, reason, rec))

    def _quarantine(self, h: bytes, reason: str, rec: Optional[NodeRecord]) -> None:
        """Writer thread: quarantine ``h`` (:meth:`Removal.quarantine`); then this
        process's walks no longer skip it, whether it was removed or not (a new
        record is usable)."""
        self.removal.quarantine(h, reason, rec)
        with self._lock:
            self._broken.discard(h)
