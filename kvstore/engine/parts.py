"""The parts a ``KVStore`` is composed of, built together so that each is given, at
construction, what it shares with the others."""

import os
from typing import Any, Callable, Dict, Optional, Tuple

import numpy as np

from .. import maintenance
from ..disk import salts
from ..disk.adapters import Layout
from ..disk.blobs import Blobs
from ..disk.chunking import as_token_array
from ..disk.index import Index, IndexDamaged, StoreError
from .accesses import Accesses
from .counters import Counters
from .payoff import RestorePolicy
from .prefill import Prefill
from .ram import RamTier
from .removal import BrokenNodes, Budgets, Removal
from .restore import ReadPath
from .saving import WritePath
from .shapes import NodeShapes
from .tail import TailRead
from .writer import BackgroundWriter


class Parts:
    """The read path, the write path and removal of one namespace of an open store,
    and what they share.

    Attributes:
        counters: This process's counts (:class:`~.counters.Counters`).
        shapes: What a node file must look like (:class:`~.shapes.NodeShapes`).
        accesses: Access times and rates for the writer (:class:`~.accesses.Accesses`).
        removal: Eviction, quarantine, cleanup (:class:`~.removal.Removal`).
        broken: The broken nodes found (:class:`~.removal.BrokenNodes`).
        reads: Fetches (:class:`~.restore.ReadPath`).
        tail: Restores past a caller's own copy (:class:`~.tail.TailRead`).
        writes: Saves (:class:`~.saving.WritePath`).
        prefill: The model run over what is missing, saved (:class:`~.prefill.Prefill`).

    Args:
        model: The mlx-lm model (for prefills).
        index, blobs, ram, writer, policy: The store's index, node files, RAM tier,
            background writer and restore policy.
        layout, namespace, description, root, chunk_tokens: The namespace's layout,
            id, description, root and tokens per node.
        budgets: The disk budgets (may change while open).
        remote: The remote tier, or None.
        restore_room, read_threads, restore_io: The read path's settings.
    """

    def __init__(
        self,
        *,
        model,
        index: Index,
        blobs: Blobs,
        ram: RamTier,
        writer: BackgroundWriter,
        policy: RestorePolicy,
        layout: Layout,
        namespace: bytes,
        description,
        root: bytes,
        chunk_tokens: int,
        budgets: Budgets,
        remote=None,
        restore_room: int,
        read_threads: int,
        restore_io: str,
    ):
        self.index, self.blobs, self.ram, self.writer = index, blobs, ram, writer
        self.policy, self.layout, self.root = policy, layout, root
        self.namespace, self.description = namespace, description
        self.budgets, self.remote = budgets, remote
        self.closed = False
        self._secret: Optional[bytes] = None  # the salt secret, read at first use
        self.counters = Counters()
        self.shapes = NodeShapes(layout, namespace, chunk_tokens)
        self.accesses = Accesses(index, namespace, writer, policy.rates)
        common = dict(index=index, namespace=namespace)
        files = dict(common, blobs=blobs, ram=ram, root=root)
        self.removal = Removal(
            **files, budgets=budgets, counters=self.counters, accesses=self.accesses
        )
        self.broken = BrokenNodes(
            **common, removal=self.removal, writer=writer, counters=self.counters
        )
        paths = dict(
            files,
            layout=layout,
            chunk_tokens=chunk_tokens,
            shapes=self.shapes,
            broken=self.broken,
            accesses=self.accesses,
        )
        self.reads = ReadPath(
            **paths,
            counters=self.counters,
            policy=policy,
            restore_room=restore_room,
            read_threads=read_threads,
            restore_io=restore_io,
        )
        self.tail = TailRead(
            reads=self.reads,
            layout=layout,
            shapes=self.shapes,
            policy=policy,
            accesses=self.accesses,
            counters=self.counters,
        )
        self.writes = WritePath(
            **paths,
            reads=self.reads,
            writer=writer,
            removal=self.removal,
            counters=self.counters,
            budgets=budgets,
            remote=remote,
        )
        self.prefill = Prefill(
            model=model,
            layout=layout,
            reads=self.reads,
            writes=self.writes,
            policy=policy,
            accesses=self.accesses,
            tree_of=self.tree_of,
        )

    def before_fetch(self, arr, parts) -> Callable[[], bytes]:
        """Have the remote tier download what it holds past the local nodes of
        ``arr`` (unsalted fetches: ``parts`` None), then return how to find the
        tree's root of ``parts`` (inside the fetch's error handling)."""
        if self.remote is not None and parts is None:
            # Salted trees stay local: another machine's store has another secret.
            self.remote.before_fetch(arr)  # bounded wait; never raises
        return lambda: self.tree_of(parts)[0]

    def pin(self, arr, *, pinned: bool, path: str) -> int:
        """Pin (or unpin) the stored prefix of ``arr`` and its ancestors in the store
        at ``path`` (:func:`kvstore.maintenance.pin_path`), once pending writes are
        in; the number of nodes changed."""
        self.flush()
        stored = self.reads.find(arr, limit=len(arr), full_only=True)
        if not stored:
            return 0
        h = stored[-1].h.hex()
        return maintenance.pin_path(path, self.namespace.hex(), h, pinned)

    def tree_of(self, parts) -> Tuple[bytes, bytes]:
        """``(tree root, quota root)`` of a salt parsed by ``salts.parse_salt``."""
        if parts is None:
            return self.root, self.root
        if self._secret is None:
            self._secret = salts.store_secret(self.index)
        return salts.tree_of(self.root, self._secret, parts)

    def stats(self) -> Dict[str, Any]:
        """This namespace's and this process's part of ``KVStore.stats()``."""
        try:
            nodes, tokens, nbytes, pinned = self.index.counters(self.namespace)
            namespaces, total = len(self.index.namespaces()), self.index.total_bytes()
        except IndexDamaged:  # store_problem says why
            (nodes, tokens, nbytes, pinned), namespaces, total = (0,) * 4, 0, 0
        return {
            "namespace": self.namespace.hex(),
            "namespaces": namespaces,
            "nodes": nodes,
            "stored_tokens": tokens,
            "bytes_on_disk": nbytes,
            "pinned_bytes": pinned,
            "store_bytes_on_disk": total,
            "disk_budget": self.budgets.disk_bytes,
            "salt_disk_budget": self.budgets.salt_disk_bytes,
            "ram_bytes": self.ram.nbytes,
            "ram_entries": len(self.ram),
            "ram_budget": self.ram.max_bytes,
            **self.counters.stats(),
            "writes_failed": self.writer.failed,
            "pending_write_bytes": self.writer.pending_bytes,
            "pending_write_jobs": self.writer.depth,
            "write_yielded_seconds": round(self.writer.yielded_s, 3),
            "store_problem": self._store_problem(),
            **self.policy.stats(),
        }

    def _store_problem(self) -> Optional[str]:
        """Why the store stopped taking writes (its index files were deleted or
        replaced under this process, see :meth:`Index.check_lock_file`), or None."""
        try:
            self.index.check_lock_file()
        except StoreError:
            pass
        return self.index.problem

    def check_open(self) -> None:
        """Refuse use after :meth:`close`, or in a process forked from the opener."""
        if self.closed:
            raise RuntimeError("this KVStore is closed")
        if os.getpid() != self.index.pid:
            raise RuntimeError(
                "this KVStore was opened before a fork(); LMDB environments cannot cross "
                "fork(): open a new KVStore in the child process"
            )

    def tokens(self, tokens) -> np.ndarray:
        """``tokens`` as the array every call works on, once the store is known to
        be open (:meth:`check_open`)."""
        self.check_open()
        return as_token_array(tokens)

    def flush(self) -> None:
        """Wait until every write submitted so far is on disk and indexed."""
        self.check_open()
        self.writer.submit(self.accesses.flush)
        self.writer.flush()

    def close(self) -> None:
        """Wait for pending writes, then stop the remote tier, the writer, the readers
        and the index. Idempotent; in a forked child it only marks the parts closed
        (the parent owns the writer)."""
        if self.closed:
            return
        if os.getpid() != self.index.pid:
            self.closed = True
            return
        self.flush()
        if self.remote is not None:
            self.remote.close()  # waits (bounded) for uploads, ends downloads
        self.closed = True
        self.writer.close()
        self.reads.close()
        self.index.close()
