"""Removing node files for ``KVStore``: eviction under the disk budget, quarantine of
broken nodes, and cleaning up after failed or superseded saves.

``Removal`` is a mixin of :class:`kvstore.store.KVStore`. Files are unlinked through
:func:`kvstore.maintenance.release_files`, which re-checks the index first.
"""

import logging
from typing import Optional, Sequence

from . import maintenance, salts
from .index import NodeRecord
from .restore import state_key

log = logging.getLogger("kvstore")


class Removal:
    """Evicting, quarantining and unlinking the node files of a
    :class:`kvstore.store.KVStore`, and forgetting them in its RAM tier."""

    def _release_failed_save(
        self, attempts: list, reservation: Optional[bytes] = None
    ) -> None:
        """A save failed before its commit (disk full, I/O error): remove the files it
        published (:meth:`_remove_written`), so that nothing of it stays on disk and the
        space comes back; then delete its disk reservation."""
        try:
            self._remove_written(attempts)
        finally:
            if reservation is not None:
                self._unreserve(reservation)

    def _remove_written(self, attempts: list) -> None:
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

    def _unlink_unindexed(self, hashes: Sequence[bytes]) -> None:
        """Unlink files of deleted nodes, re-checking the index under the writer lock
        (:func:`kvstore.maintenance.release_files`)."""
        for h in hashes:
            self._forget(h)
        maintenance.release_files(
            self.index, self.blobs, [(self.namespace, h) for h in hashes]
        )

    def _quarantine(self, h: bytes, reason: str, rec: Optional[NodeRecord]) -> None:
        """Writer thread: remove a broken node and its descendants from the index, then
        move its file to quarantine and unlink theirs.

        Only while its record is still ``rec``, the one found broken (checked in the
        deleting transaction): a node another process evicted, or evicted and saved
        again, meanwhile is not this process's to remove. Either way the node is no
        longer skipped by this process's walks afterwards (a new record is usable).
        """
        ns = self.namespace

        def delete(txn):
            if not self._same_record(txn, h, rec):
                return None
            return maintenance.delete_subtree(self.index, txn, ns, h)

        gone = self.index.write(delete, frees=True)
        if gone is not None:
            keys = [(ns, h)] + [(ns, x) for x, _ in gone if x != h]
            for _, x in keys:
                self._forget(x)
            released = maintenance.release_files(
                self.index, self.blobs, keys, quarantine={(ns, h): reason}
            )
            if released.quarantined:
                with self._lock:
                    self._counters.quarantined.extend(released.quarantined)
        with self._lock:
            self._broken.discard(h)

    def _make_room(
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
        quota = self.salt_disk_bytes if root not in (None, self.root) else None
        if self.disk_bytes is None and quota is None:
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
        if self.disk_bytes is not None:
            gone += maintenance.make_room(
                self.index, txn, self.disk_bytes, incoming, keep=keep
            )
        return gone

    def _release_evicted(self, evicted: list) -> None:
        """After the commit: unlink the files of the nodes :meth:`_make_room` evicted."""
        if not evicted:
            return
        for (ns, h), _ in evicted:
            if ns == self.namespace:
                self._forget(h)
        maintenance.release_files(self.index, self.blobs, [key for key, _ in evicted])
        with self._lock:
            self._counters.nodes_evicted += len(evicted)

    def _enforce_disk_budget(self) -> None:
        """Evict least recently used unpinned leaves until the store fits ``disk_bytes``
        (:func:`kvstore.maintenance.evict_to_budget`)."""
        if self.disk_bytes is None:
            return
        self._flush_touches()  # eviction order must see the latest accesses
        evicted = maintenance.evict_to_budget(
            self.index,
            self.blobs,
            self.disk_bytes,
            on_evict=lambda keys: [self._forget(h) for _, h in keys],
        )
        with self._lock:
            self._counters.nodes_evicted += evicted.nodes
        if evicted.excess:
            log.warning(
                "kvstore: disk budget exceeded by %d bytes that cannot be evicted (pinned)",
                evicted.excess,
            )

    def _forget(self, h: bytes) -> None:
        """Drop node ``h``'s files from the RAM tier."""
        self.ram.discard(h)
        self.ram.discard(state_key(h))
