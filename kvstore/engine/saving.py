"""The write path of ``KVStore``: capturing a cache's nodes, then (writer thread)
serializing, reserving disk bytes, publishing the files and committing their nodes.

:class:`WritePath` is given the parts it shares with the read path and removal.
"""

import logging
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import mlx.core as mx
import numpy as np

from .. import maintenance
from ..disk import reservations, salts
from ..disk.adapters import Layout, LayoutMismatch
from ..disk.blobs import (
    DELTA_PART,
    STATE_PART,
    Blobs,
    NodeFile,
    node_metadata,
    parse_header,
)
from ..disk.chunking import chain_hashes, split_spans
from ..disk.index import Index, IndexDamaged, NodeRecord
from ..disk.policy import stronger_kind
from ..disk.publish import WriteBatch
from ..platform import devices
from .accesses import Accesses
from .counters import Counters
from .ram import RamEntry, RamTier
from .removal import BrokenNodes, Budgets, Removal
from .restore import MLX_LOCK, ReadPath, state_key
from .shapes import NodeShapes
from .writer import BackgroundWriter

log = logging.getLogger("kvstore")


class HeldTokens:
    """The new tokens of every delta tensor of one save, held for the writer thread.

    On the CPU and Metal these are views of the cache's own buffers (no copy, and
    immune to the caller's updates: while a view holds a buffer, MLX copies it to
    update it). With CUDA they are device copies, read on the host only on the
    writer thread (:mod:`kvstore.platform.devices`): the caller's live cache stays in
    device memory, and ``save()`` does not wait for the copy to reach the host.
    """

    def __init__(
        self,
        views: Dict[str, mx.array],
        *,
        pause: Optional[Callable[[], None]] = None,
    ):
        self._arrays = devices.readable_copies(views)
        self._host: Optional[Dict[str, np.ndarray]] = None
        self._pause = pause  # the writer's wait_turn, between slices of the copy
        if not devices.host_access_moves_arrays():
            self.host()

    def host(self) -> Dict[str, np.ndarray]:
        """``name -> (1, heads, tokens, width)`` host arrays (made once)."""
        if self._host is None:
            self._host = {
                k: devices.host_copy(v, lock=MLX_LOCK, pause=self._pause)
                for k, v in self._arrays.items()
            }
            self._arrays = {}
        return self._host

    def release(self, *, state_read: bool = False) -> None:
        """Drop the host arrays once the save is written. With CUDA their buffers
        (and a checkpoint's, ``state_read``) were moved to host memory: MLX would
        otherwise hand them out again for GPU work, which then migrates them back
        (measured: decode 17% slower after a 32K-token save of an 8B model), so its
        buffer cache is cleared."""
        read = self._host is not None or state_read
        moved = read and devices.host_access_moves_arrays()
        self._host, self._arrays = None, {}
        if moved:
            mx.clear_cache()

    def nbytes(self, a: int, b: int) -> int:
        """Bytes of tokens ``[a, b)`` of every tensor."""
        arrays = self._host if self._host is not None else self._arrays
        if not arrays:
            return 0
        return sum(x.nbytes // x.shape[2] * (b - a) for x in arrays.values())


@dataclass
class NodeSlices:
    """Tokens ``[a, b)`` of a save's :class:`HeldTokens`: one node's delta tensors."""

    held: HeldTokens
    a: int
    b: int

    def items(self):
        """``(name, numpy view)`` pairs (host arrays made on first use)."""
        return ((k, x[:, :, self.a : self.b]) for k, x in self.held.host().items())


@dataclass
class NewNode:
    """A node to write: its delta slices (None: already stored) and maybe a state."""

    h: bytes
    parent: bytes
    start: int
    tokens: np.ndarray
    slices: Optional[NodeSlices]
    state: Optional[Dict[str, Tuple[str, mx.array]]] = None
    raw: Optional[Dict[str, bytes]] = None  # files by part, validated (remote tier)


def _with_state(rec: NodeRecord, published) -> NodeRecord:
    """``rec`` with the state file ``published`` attached."""
    fields = {**rec.__dict__, "state_nbytes": published.nbytes}
    fields["state_checksum"] = published.checksum
    return NodeRecord(**fields)


def _attempts(batch: WriteBatch) -> List[Tuple[bytes, str, int, int]]:
    """``(hash, part, bytes, inode)`` of the files ``batch`` may have put under their
    final names: what a failed or partly skipped save removes again."""
    return [(s.h, s.part, s.nbytes, s.inode) for s in batch.staged if s.link_tried]


class WritePath:
    """Saves into one namespace of a store: :meth:`save` captures the nodes and
    queues :meth:`write_nodes` on the background writer.

    Args:
        index: The store's index.
        blobs: The store's node files.
        ram: The RAM tier, filled with what this process writes.
        layout: The namespace's cache layout.
        namespace: The namespace's id.
        root: The namespace's root (its unsalted tree).
        chunk_tokens: Tokens per node at most.
        shapes: The node files' expected tensors.
        reads: The read path, whose walk finds what is stored already.
        writer: The background writer the files are written on.
        removal: Eviction and cleanup after failed or superseded saves.
        broken: The broken nodes (a rewrite heals them).
        accesses: Access times, written with a save's reservation.
        counters: Where writes are counted.
        budgets: The disk budgets (read at each save).
        remote: The remote tier new nodes are uploaded to, or None.
    """

    def __init__(
        self,
        *,
        index: Index,
        blobs: Blobs,
        ram: RamTier,
        layout: Layout,
        namespace: bytes,
        root: bytes,
        chunk_tokens: int,
        shapes: NodeShapes,
        reads: ReadPath,
        writer: BackgroundWriter,
        removal: Removal,
        broken: BrokenNodes,
        accesses: Accesses,
        counters: Counters,
        budgets: Budgets,
        remote=None,
    ):
        self.index = index
        self.blobs = blobs
        self.ram = ram
        self.layout = layout
        self.namespace = namespace
        self.root = root
        self.chunk_tokens = chunk_tokens
        self.shapes = shapes
        self.reads = reads
        self.writer = writer
        self.removal = removal
        self.broken = broken
        self.accesses = accesses
        self.counters = counters
        self.budgets = budgets
        self.remote = remote

    def accepts(self, cache, ntokens: int, *, exact: bool) -> bool:
        """Check ``cache`` against the layout. A wrong call (token count, layer count)
        raises; a cache whose layers differ from the layout probed at open is logged,
        counted (``saves_refused``) and not saved."""
        try:
            self.layout.check_cache(cache, ntokens, exact=exact)
        except LayoutMismatch as e:
            log.warning("kvstore: not saved: %s", e)
            self.counters.add(saves_refused=1)
            return False
        return True

    def save(
        self,
        arr,
        cache,
        *,
        kind: str,
        pin: bool,
        boundaries,
        tree: Optional[Tuple[bytes, bytes]] = None,
        exact: Optional[bool] = None,
    ) -> int:
        """Capture the new nodes of ``cache`` (holding ``arr``) and queue their write;
        returns how many there are (0 too when the save is refused or dropped).

        Args:
            tree: ``(tree root, quota root)`` of a salted tree; None: the namespace's.
            exact: Check ``cache`` against the layout first (:meth:`accepts`),
                holding exactly ``arr`` (True) or at least it (False); None: not
                checked.
        """
        if exact is not None and not self.accepts(cache, len(arr), exact=exact):
            return 0
        root, group = tree or (self.root, None)  # a salted tree's, or the namespace's
        try:
            path = self.reads.find(arr, limit=len(arr), full_only=True, root=root)
        except IndexDamaged:  # logged once by the index; nothing more is written
            self.counters.add(writes_dropped=1)
            return 0
        pos = sum(step.take for step in path)
        parent = path[-1].h if path else root
        spans = split_spans(pos, len(arr), self.chunk_tokens, boundaries)
        hashes = chain_hashes(parent, arr, spans)
        nodes, nbytes, state = [], 0, None
        with MLX_LOCK:
            # One view per delta tensor over all the new tokens (a node's slice of it
            # is taken in numpy below: a few MLX ops per save, not per node), and the
            # checkpoint of the state layers at the end of ``arr``.
            views = (
                self.layout.node_slices(cache, spans[0][0], spans[-1][1])
                if spans
                else {}
            )
            if self.layout.has_state and (spans or not path[-1].rec.has_state):
                state = self.layout.state_arrays(cache)
                copies = devices.readable_copies({k: a for k, (_, a) in state.items()})
                state = {k: (dtype, copies[k]) for k, (dtype, _) in state.items()}
            held = HeldTokens(views, pause=self.writer.wait_turn)
        for (s, e), h in zip(spans, hashes):
            a, b = s - spans[0][0], e - spans[0][0]
            nbytes += held.nbytes(a, b)
            nodes.append(NewNode(h, parent, s, arr[s:e].copy(), NodeSlices(held, a, b)))
            parent = h
        if state is not None:
            if not nodes:  # a checkpoint for the stored node ``arr`` ends at
                last = path[-1]
                nodes.append(
                    NewNode(
                        last.h, last.rec.parent, last.rec.start, last.rec.tokens, None
                    )
                )
            nodes[-1].state = state
            nbytes += sum(a.nbytes for _, a in state.values())
        existing = [step.h for step in path]
        self.accesses.touch(existing)

        def job():
            try:
                self.write_nodes(
                    nodes, kind=kind, pin=pin, existing=existing, root=root, group=group
                )
            finally:
                nodes.clear()
                held.release(state_read=state is not None)

        if (nodes or pin) and not self.writer.submit(job, nbytes):
            self.counters.add(writes_dropped=1)
            log.warning(
                "kvstore: %d bytes of writes pending (max_pending_bytes %d); dropped "
                "the save of a %d-token prompt (first node %s): %d new nodes, %d bytes",
                self.writer.pending_bytes,
                self.writer.max_pending_bytes,
                len(arr),
                (path[0].h if path else hashes[0]).hex()[:12],
                len(nodes),
                nbytes,
            )
            return 0
        return len(nodes)

    def pin_stored(self, existing: List[bytes], *, kind: str) -> None:
        """Queue pinning the stored nodes ``existing`` (nothing to write)."""
        self.writer.submit(
            lambda: self.write_nodes([], kind=kind, pin=True, existing=existing)
        )

    def _serialize(
        self, node: NewNode
    ) -> Tuple[Optional[NodeFile], Optional[NodeFile]]:
        """Writer thread: the files of ``node`` that the index lacks, its delta file and
        its state file (None: nothing to write), as views of the cache's arrays (no
        copy: :class:`kvstore.disk.blobs.NodeFile`)."""
        ns = self.namespace
        rec = self.index.get_node(ns, node.h)
        if node.raw is not None:  # downloaded and validated by the remote tier
            raw, node.raw = node.raw, None
            delta, state = raw.get(DELTA_PART), raw.get(STATE_PART)
            return (
                NodeFile.from_bytes(delta) if delta and rec is None else None,
                (
                    NodeFile.from_bytes(state)
                    if state and (rec is None or not rec.has_state)
                    else None
                ),
            )
        delta = state = None
        if rec is None and node.slices is not None:
            expected = self.shapes.expected(len(node.tokens))
            tensors = {
                name: (*expected[name], np.asarray(x))
                for name, x in node.slices.items()
            }
            delta = NodeFile.from_tensors(tensors, node_metadata(ns))
        if node.state is not None and (rec is None or not rec.has_state):
            with MLX_LOCK:
                tensors = {
                    name: (dtype, a.shape, np.asarray(a))
                    for name, (dtype, a) in node.state.items()
                }
            state = NodeFile.from_tensors(tensors, node_metadata(ns))
        node.slices = node.state = None  # the files' buffers keep what they need
        return delta, state

    def _publish(
        self, nodes: List[NewNode], files: List[tuple], batch: WriteBatch
    ) -> List[tuple]:
        """Writer thread: write every file of :meth:`_serialize` into ``batch`` and
        publish them together (durable before any is linked, see
        :mod:`kvstore.disk.publish`). Returns ``(node, delta, state)`` per node, each file
        as a ``(NodeFile, Published)`` pair or None."""
        ns, parts = self.namespace, []
        for node, pair in zip(nodes, files):
            for part, data in zip((DELTA_PART, STATE_PART), pair):
                if data is not None:
                    batch.add(ns, node.h, data, part)
                    parts.append(data)
        published = iter(zip(parts, batch.publish()))
        return [
            (node, *(None if data is None else next(published) for data in pair))
            for node, pair in zip(nodes, files)
        ]

    def _reserve(self, nodes: List[NewNode], files: List[tuple]) -> Optional[bytes]:
        """Writer thread: reserve the disk bytes of ``files`` in the index, evicting what
        the budget needs, and unlink the evicted nodes' files.

        Returns:
            The reservation's key (the commit deletes it), or None when nothing is
            to be written.
        """
        nbytes = sum(f.nbytes for pair in files for f in pair if f is not None)
        if nbytes == 0:
            return None
        ns = self.namespace
        # The nodes the new ones hang from, and nodes getting only a checkpoint.
        keep = {(ns, node.parent) for node in nodes}
        keep |= {(ns, node.h) for node, (delta, _) in zip(nodes, files) if not delta}
        key = reservations.new_key()
        touched = self.accesses.take()

        def reserve(txn):
            self.accesses.apply(txn, touched)  # eviction order must see them
            return maintenance.reserve_room(
                self.index, txn, self.budgets.disk_bytes, nbytes, key=key, keep=keep
            )

        try:
            evicted = self.index.write(reserve)
            self.removal.release_evicted(evicted)
        except BaseException:
            self.removal.unreserve(key)
            raise
        return key

    def write_nodes(
        self,
        nodes: List[NewNode],
        *,
        kind: str,
        pin: bool,
        existing: List[bytes],
        root: Optional[bytes] = None,
        group: Optional[bytes] = None,
    ):
        """Writer thread: serialize the files, reserve their bytes under the disk budget
        (:meth:`_reserve`), write them, then commit their nodes in one transaction that
        also drops the reservation. A file is reserved until it is indexed or unlinked.
        ``root``: a salted tree's (its nodes stay off the remote tier and count
        against ``salt_disk_bytes``); None: the namespace's. ``group``: the root whose
        quota the tree counts against (a tenant's, :func:`kvstore.disk.salts.tree_of`).
        """
        ns = self.namespace
        files = []
        for node in nodes:
            self.writer.wait_turn()  # between nodes: decoding goes first
            files.append(self._serialize(node))
        reservation, batch = None, WriteBatch(self.blobs)
        try:
            # Reserve (evicting), unlink the evicted files, only then write: files on
            # disk stay <= indexed + reserved bytes, and reserving keeps that <= budget.
            if self.budgets.disk_bytes is not None:
                reservation = self._reserve(nodes, files)
            written = self._publish(nodes, files, batch)
        except BaseException:
            self.removal.release_failed_save(_attempts(batch), reservation)
            raise
        finally:
            batch.close()
        attempts = _attempts(batch)
        now = time.time()
        evicted, unindexed, late, skipped = [], [], [0], [0]

        def commit(txn):
            if reservation is not None:
                reservations.delete(self.index, txn, reservation)
            if root is not None and group not in (None, root):
                salts.join_group(self.index, txn, ns, group, root)
            evicted[:] = self.removal.make_room(txn, written, root, group)
            added, superseded, skipped[0] = self._index_nodes(
                txn, written, kind=kind, pin=pin, now=now
            )
            if pin:
                for h in existing + [node.h for node, _, _ in written]:
                    self.index.set_pinned(txn, ns, h, True)
            indexed = {h for h, *_ in added}
            unindexed[:] = [a for a in attempts if a[0] not in indexed]
            if reservation is not None:
                # Files this commit leaves unindexed stay reserved until unlinked.
                late[0] = sum(rec.total_bytes for _, rec in evicted if rec is not None)
                late[0] += sum(rec.total_bytes for _, rec in superseded)
                late[0] += sum(nbytes for _, _, nbytes, _ in unindexed)
                if late[0]:
                    reservations.put(self.index, txn, reservation, late[0])
            return added, superseded

        try:
            added, superseded = self.index.write(commit)
        except BaseException:
            self.removal.release_failed_save(attempts, reservation)
            raise
        try:
            self.removal.release_evicted(evicted)
            self.removal.unlink_unindexed([h for h, _ in superseded])
            # Files of nodes the commit skipped (their parent was evicted meanwhile,
            # say) would be orphans: remove them unless another save indexed them.
            self.removal.remove_written(unindexed)
        finally:
            if reservation is not None and late[0]:
                self.removal.unreserve(reservation)
            elif reservation is not None:
                reservations.forget(reservation)  # the commit deleted it
        self._record_written(added, skipped[0], root)

    def _is_ours(self, h: bytes, published, part: str = "") -> bool:
        # Index only the very file we checked: one removed (or replaced) by another
        # process since then must not be indexed with our checksum.
        return self.blobs.published_inode(self.namespace, h, part) == published.inode

    def _index_nodes(
        self, txn, written: List[tuple], *, kind: str, pin: bool, now: float
    ) -> Tuple[List[tuple], List[tuple], int]:
        """Inside the commit: index the ``written`` nodes, parents first.

        Returns ``(hash, record, delta, state)`` of each node added (delta and state:
        the NodeFiles for the RAM tier, None where the file is another writer's), the
        nodes it superseded, and how many nodes were skipped (their parent evicted or
        their file replaced meanwhile)."""
        ns = self.namespace
        added, superseded, skipped = [], [], 0
        unsaved = set()  # hashes of nodes skipped: their descendants are skipped too
        for node, delta, state in written:
            if state is not None and not self._is_ours(node.h, state[1], STATE_PART):
                state = None
            if delta is None:
                rec = self.index.get_node(ns, node.h, txn)
                if state is None or rec is None or rec.has_state:
                    continue
                # A checkpoint for a node stored without one.
                rec = _with_state(rec, state[1])
                self.index.replace_node(txn, ns, node.h, rec)
                added.append((node.h, rec, None, state[0]))
                continue
            # A first node hangs from a root (the namespace's or a salted one).
            parent_ok = node.parent not in unsaved and (
                node.start == 0 or self.index.get_node(ns, node.parent, txn)
            )
            if not parent_ok or not self._is_ours(node.h, delta[1]):
                # Its parent was evicted, or its file replaced, meanwhile: this node
                # and those below it stay unsaved (counted, not raised). A pull's
                # batch holds other subtrees too, which go on.
                unsaved.add(node.h)
                skipped += 1
                continue
            rec = NodeRecord(
                node.parent,
                node.start,
                node.tokens,
                delta[1].nbytes,
                delta[1].checksum,
                kind,
                pin,
                now,
            )
            if state is not None:
                rec = _with_state(rec, state[1])
            if self.index.put_node(txn, ns, node.h, rec):
                if not added and not self.layout.has_state:
                    superseded = self._supersede(txn, node.h, rec)
                # The RAM tier holds our bytes only if they are the file's.
                added.append(
                    (
                        node.h,
                        rec,
                        delta[0] if delta[1].ours else None,
                        state[0] if state is not None and state[1].ours else None,
                    )
                )
        return added, superseded, skipped

    def _record_written(
        self, added: List[tuple], skipped: int, root: Optional[bytes]
    ) -> None:
        """After the commit: the RAM tier, the counters, the remote tier's uploads
        (not a salted tree's) and the disk budget."""
        self._fill_ram(added)
        self.broken.healed(h for h, *_ in added)  # healed by a rewrite
        self.counters.add(
            nodes_written=len(added),
            nodes_skipped=skipped,
            bytes_written=sum(rec.total_bytes for _, rec, *_ in added),
        )
        salted = root not in (None, self.root)
        if self.remote is not None and added and not salted:
            self.remote.after_commit(added)  # queues uploads; returns at once
        self.removal.enforce_disk_budget()

    def _fill_ram(self, added: List[tuple]) -> None:
        """Put the files of ``added`` (``(hash, record, delta, state)``, NodeFiles) into
        the RAM tier. Only the last ``ram_bytes`` of them: earlier ones would be
        evicted by later ones of the same save, after a copy for nothing."""
        room, chosen = self.ram.max_bytes, []
        for h, rec, data, state_data in reversed(added):
            for key, f in ((state_key(h), state_data), (h, data)):
                if f is not None and f.nbytes <= room:
                    room -= f.nbytes
                    chosen.append((key, f, rec))
        for key, f, rec in reversed(chosen):
            raw = f.tobytes()
            _, tensors, _ = parse_header(raw, len(raw))
            self.ram.put(key, RamEntry(raw, tensors, rec.kind, rec.pinned))

    def _supersede(
        self, txn, h: bytes, rec: NodeRecord
    ) -> List[Tuple[bytes, NodeRecord]]:
        """Drop unpinned leaf siblings whose tokens are a strict prefix of the new node's.

        The new node can be sliced to restore them, so keeping them only costs bytes.
        Returns their ``(hash, record)``.
        """
        gone = []
        for sib, srec, common in self.index.nearest_children(
            self.namespace,
            rec.parent,
            rec.tokens,
            txn,
            on_corrupt=self.broken.corrupt_record,
        ):
            if (
                sib != h
                and common == srec.ntokens < rec.ntokens
                and not srec.pinned
                and not self.index.has_children(txn, self.namespace, sib)
            ):
                if stronger_kind(srec.kind, rec.kind) != rec.kind:
                    continue  # keep a system prompt's tail rather than demote it
                self.index.delete_node(txn, self.namespace, sib)
                gone.append((sib, srec))
        return gone
