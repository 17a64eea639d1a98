"""The shared remote tier: node files in an S3-compatible object store, behind the disk.

``RemoteTier`` is what ``KVStore`` calls: before a fetch it follows the prompt on the
remote and downloads the nodes the disk lacks; after a commit it queues the new nodes
for upload (see ``uploads``). Manifests are read through ``reader``, requests go through
``client``; ``kvstore pull`` is :meth:`RemoteTier.pull`, ``kvstore push`` is in
``sync``.
"""

import itertools
import logging
import threading
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import numpy as np

from ..disk.blobs import CorruptBlob
from ..disk.chunking import chain_hash, chain_hashes, common_prefix
from ..disk.index import CorruptRecord, NodeRecord
from ..engine.saving import NewNode
from .client import (
    LIST_MAX_KEYS,
    LIST_TIMEOUT,
    ContextPool,
    Counters,
    S3Client,
    operation,
    parse_url,
)
from .errors import NotFound, RemoteCorrupt, RemoteError
from .manifest import check_node_file, is_int, node_parts
from .reader import ManifestReader, wrong_start
from .sync import list_nodes
from .uploads import Uploader

log = logging.getLogger("kvstore")

_WINDOW = 8  # full-chunk manifests asked for at once along a prompt
_BATCH_BYTES = 64 << 20  # downloaded bytes of a commit (two batches in memory at most)
_PULL_WAVE_NODES = 4096  # manifests a pull holds before downloading their files
_STATS = (
    "remote_hits",
    "remote_misses",
    "remote_errors",
    "remote_corrupt",
    "remote_skipped",
    "remote_timeouts",
    "remote_nodes_down",
    "bytes_down",
    "uploads",
    "uploads_present",
    "uploads_skipped",
    "uploads_dropped",
    "upload_errors",
    "bytes_up",
)


class RemoteTier:
    """An S3-compatible bucket shared by several stores (machines) of one model.

    Pass it (or just its URL) as ``KVStore(..., remote=...)``. Endpoint and credentials
    come from the usual environment (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``,
    ``AWS_SECRET_ACCESS_KEY``, ``AWS_PROFILE``, ...) unless ``endpoint_url`` is given.

    Args:
        url: ``s3://bucket/prefix``.
        endpoint_url: The S3 endpoint (MinIO, Ceph, R2); None: boto3's default.
        connect_timeout, read_timeout: Seconds, per request.
        max_attempts: Attempts per request (botocore's standard retry mode: backoff
            with jitter).
        lookup_timeout: Seconds a ``fetch`` waits for the remote; a download still
            running then goes on in the background and serves later fetches.
        failures_to_open: Consecutive failed requests that open the circuit breaker
            (a fetch's parallel requests count once).
        open_seconds: How long an open breaker skips the remote.
        cache_seconds: How long "the remote has no such node" and a node's listing of
            children are remembered (a node uploaded by another machine meanwhile is
            seen after at most this long).
        max_nodes: Nodes one fetch may download.
        max_probe: A node with at most this many remote children has their manifests
            read when none is a prefix of the prompt, to restore a common prefix
            inside a node (layouts without state layers).
        max_object_bytes: The largest node file accepted from the remote.
        threads: Parallel requests.
        upload: Upload this store's new nodes after each local commit.
        max_pending_uploads: Nodes waiting for upload beyond this are dropped (counted).
        upload_attempts: Attempts per node upload, with exponential backoff.
        close_timeout: Seconds ``close`` waits for pending uploads while the remote
            answers.
        list_max_keys, list_timeout: Bounds of one listing of the remote (``kvstore
            pull`` and ``push`` list a namespace's nodes): keys, and seconds for all
            its pages; a listing past them is a ``RemoteError``.
    """

    def __init__(
        self,
        url: str,
        *,
        endpoint_url: Optional[str] = None,
        connect_timeout: float = 2.0,
        read_timeout: float = 10.0,
        max_attempts: int = 3,
        lookup_timeout: float = 10.0,
        failures_to_open: int = 3,
        open_seconds: float = 30.0,
        cache_seconds: float = 30.0,
        max_nodes: int = 512,
        max_probe: int = 8,
        max_object_bytes: int = 4 << 30,
        threads: int = 8,
        upload: bool = True,
        max_pending_uploads: int = 10_000,
        upload_attempts: int = 3,
        close_timeout: float = 60.0,
        list_max_keys: int = LIST_MAX_KEYS,
        list_timeout: float = LIST_TIMEOUT,
    ):
        self.bucket, self.prefix = parse_url(url)  # the URL's error first
        self.url = url
        for name, value in (
            ("connect_timeout", connect_timeout),
            ("read_timeout", read_timeout),
            ("lookup_timeout", lookup_timeout),
            ("open_seconds", open_seconds),
            ("cache_seconds", cache_seconds),
            ("close_timeout", close_timeout),
            ("list_timeout", list_timeout),
        ):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"{name} must be a number of seconds, got {value!r}")
            if not 0 <= value < 1e9:  # NaN and inf too: waits take finite timeouts
                raise ValueError(f"{name} must be >= 0 seconds, got {value!r}")
        for name, value, minimum in (
            ("max_attempts", max_attempts, 1),
            ("failures_to_open", failures_to_open, 1),
            ("max_nodes", max_nodes, 1),
            ("max_probe", max_probe, 0),
            ("max_object_bytes", max_object_bytes, 1),
            ("threads", threads, 1),
            ("max_pending_uploads", max_pending_uploads, 0),
            ("upload_attempts", upload_attempts, 1),
            ("list_max_keys", list_max_keys, 1),
        ):
            if not is_int(value):
                raise TypeError(f"{name} must be an int, got {value!r}")
            if value < minimum:
                raise ValueError(f"{name} must be >= {minimum}, got {value}")
        if endpoint_url is not None and not isinstance(endpoint_url, str):
            raise TypeError(f"endpoint_url must be a str, got {endpoint_url!r}")
        self.endpoint_url = endpoint_url
        self.connect_timeout, self.read_timeout = connect_timeout, read_timeout
        self.max_attempts = max_attempts
        self.lookup_timeout = lookup_timeout
        self.failures_to_open, self.open_seconds = failures_to_open, open_seconds
        self.cache_seconds = cache_seconds
        self.max_nodes, self.max_probe = max_nodes, max_probe
        self.max_object_bytes = max_object_bytes
        self.threads = threads
        self.upload = upload
        self.max_pending_uploads = max_pending_uploads
        self.upload_attempts = upload_attempts
        self.close_timeout = close_timeout

        self._counters = Counters()
        self._s3 = S3Client(  # imports boto3: a clear error now, not at a request
            url,
            endpoint_url=endpoint_url,
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
            max_attempts=max_attempts,
            failures_to_open=failures_to_open,
            open_seconds=open_seconds,
            max_connections=threads + 4,
            counters=self._counters,
            list_max_keys=list_max_keys,
            list_timeout=list_timeout,
        )
        self._reader = ManifestReader(
            self._s3, cache_seconds=cache_seconds, max_object_bytes=max_object_bytes
        )
        self._io = ContextPool(threads, thread_name_prefix="kvstore-remote")
        self._store = None
        self._local = threading.local()
        self._closing = threading.Event()
        self._lookups: Optional[ThreadPoolExecutor] = None
        self._lookup_slots = threading.BoundedSemaphore(2)
        self._slow = False  # the last lookup timed out (warned once per streak)
        self._uploads = Uploader(
            self._s3,
            max_pending=max_pending_uploads,
            attempts=upload_attempts,
            closing=self._closing,
        )

    def __repr__(self) -> str:
        return f"RemoteTier({self.url!r})"

    # -- binding to a store ----------------------------------------------------

    @property
    def bound(self) -> bool:
        """Whether a ``KVStore`` uses this tier already."""
        return self._store is not None

    def bind(self, store) -> None:
        """Attach to ``store`` (done by ``KVStore``): start the uploader. The tier
        walks the store's trie (``store.parts.reads``), checks records
        (``store.parts.shapes``) and commits what it downloads
        (``store.parts.writes``)."""
        if self._store is not None:
            raise ValueError(f"{self!r} already serves another KVStore")
        self._store = store
        self._lookups = ThreadPoolExecutor(2, thread_name_prefix="kvstore-lookup")
        if self.upload:
            self._uploads.start(store)

    def close(self) -> None:
        """Wait (up to ``close_timeout``, while the remote answers) for pending uploads,
        then stop. Downloads in flight end before this returns. Idempotent."""
        if self._closing.is_set():
            return
        self._uploads.drain(self.close_timeout)
        self._closing.set()
        self._uploads.stop()
        if self._lookups is not None:
            self._lookups.shutdown(wait=True)
        self._io.shutdown(wait=True)

    def stats(self) -> Dict[str, Any]:
        """Counters of this process (flat keys, merged into ``KVStore.stats()``)."""
        out = {
            "remote": self.url,
            "remote_open": self.circuit_open(),
            "pending_uploads": self._uploads.pending(),
            "remote_last_error": self._counters.last_error,
        }
        out.update(self._counters.get(_STATS))
        return out

    def circuit_open(self) -> bool:
        """Whether the breaker currently skips the remote."""
        return self._s3.circuit_open()

    # -- fetch: following a prompt on the remote ---------------------------------------

    def before_fetch(self, arr: np.ndarray) -> None:
        """``KVStore.fetch`` hook: download the nodes the remote has along ``arr``
        beyond the local ones, waiting at most ``lookup_timeout``. Never raises."""
        store = self._store
        if store is None or self._closing.is_set() or len(arr) < 2:
            return
        try:
            path = store.parts.reads.find(arr, limit=len(arr), full_only=True)
        except Exception:  # the fetch itself reports a broken index
            return
        pos = sum(step.take for step in path)
        if pos >= len(arr) - 1:
            return  # the local store has every restorable token: no remote needed
        parent = path[-1].h if path else store.root
        if self.circuit_open() or not self._lookup_slots.acquire(blocking=False):
            # A dead remote, or two lookups in flight: not waited for.
            self._counters.add(remote_skipped=1)
            return
        try:
            job = self._lookups.submit(self._fill_released, parent, pos, arr)
        except RuntimeError:  # shut down meanwhile
            self._lookup_slots.release()
            return
        try:
            job.result(timeout=self.lookup_timeout)
            self._slow = False
        except FutureTimeout:
            self._counters.add(remote_timeouts=1)
            if not self._slow:  # said once per streak: a stalled remote is not news
                self._slow = True
                log.warning(
                    "kvstore: remote %s: no answer within %g s; going on without it "
                    "(the download continues in the background; further timeouts "
                    "are counted in remote_timeouts until it answers in time)",
                    self.url,
                    self.lookup_timeout,
                )
        except Exception:  # a bug, not the remote: still never the caller's problem
            log.exception("kvstore: remote lookup failed")
            self._counters.add(remote_errors=1)

    def _fill_released(self, parent: bytes, pos: int, arr: np.ndarray) -> None:
        try:
            with operation():  # its parallel requests meet one outage: one failure
                self._fill(parent, pos, arr)
        except RemoteError:
            pass  # counted and logged where it happened
        except Exception:  # e.g. a local write error: logged, never the caller's
            log.exception("kvstore: remote download failed")
            self._counters.add(remote_errors=1)
        finally:
            self._lookup_slots.release()

    def _fill(self, parent: bytes, pos: int, arr: np.ndarray) -> int:
        """Download and commit the remote's nodes along ``arr`` after the local node
        ``parent`` (which ends at ``pos``); returns how many."""
        chain, failed = self._resolve(parent, pos, arr)
        done = self._download_commit(chain, chain_mode=True) if chain else 0
        if done or not failed:
            self._counters.add(**{"remote_hits" if done else "remote_misses": 1})
        return done

    def _resolve(
        self, parent: bytes, pos: int, arr: np.ndarray
    ) -> Tuple[List[Tuple[bytes, NodeRecord]], bool]:
        """The remote's nodes along ``arr`` from ``parent`` (which ends at ``pos``), and
        whether a request failed on the way (what was found before it is kept)."""
        store = self._store
        ns, C, L = store.namespace, store.chunk_tokens, len(arr)
        out: List[Tuple[bytes, NodeRecord]] = []
        try:
            while pos < L - 1 and len(out) < self.max_nodes:
                if self._closing.is_set():
                    break
                n_full = min((L - pos) // C, self.max_nodes - len(out), _WINDOW)
                spans = [(pos + i * C, pos + (i + 1) * C) for i in range(n_full)]
                hashes = chain_hashes(parent, arr, spans)
                parents = [parent] + hashes[:-1]
                # Full chunks are addressed by hash: ask for a window of them at once.
                jobs = [
                    self._io.submit(
                        self._reader.manifest,
                        ns,
                        p,
                        h,
                        start=s,
                        chunk_tokens=C,
                        tokens=arr[s:e],
                    )
                    for p, h, (s, e) in zip(parents, hashes, spans)
                ]
                found = 0
                for h, job in zip(hashes, jobs):
                    rec = job.result()
                    if rec is None:
                        break
                    out.append((h, rec))
                    parent, pos, found = h, rec.end, found + 1
                for job in jobs[found + 1 :]:
                    job.cancel()
                if found == n_full == _WINDOW:
                    continue
                if len(out) >= self.max_nodes or pos >= L - 1:
                    break
                child = self._best_child(parent, pos, arr)
                if child is None:
                    break
                out.append(child)
                h, rec = child
                if not np.array_equal(rec.tokens, arr[pos : rec.end]):
                    break  # a node diverging inside: sliced locally, the path ends
                parent, pos = h, rec.end
        except RemoteError:
            return out, True
        return out, False

    def _best_child(
        self, parent: bytes, pos: int, arr: np.ndarray
    ) -> Optional[Tuple[bytes, NodeRecord]]:
        """The child of ``parent`` sharing the most tokens with ``arr[pos:]``."""
        store = self._store
        ns, C = store.namespace, store.chunk_tokens
        children = self._reader.children(ns, parent)
        if not children:
            return None
        rest = arr[pos : pos + C]
        # A child whose tokens are a prefix of the prompt has a hash we can compute.
        for n in range(len(rest), 0, -1):
            h = chain_hash(parent, rest[:n])
            if h in children:
                rec = self._reader.manifest(
                    ns, parent, h, start=pos, chunk_tokens=C, tokens=rest[:n]
                )
                if rec is not None:
                    return h, rec
        if store.layout.has_state or len(children) > self.max_probe:
            return None  # checkpoints cannot be cut; too many children to read
        jobs = [
            (
                h,
                self._io.submit(
                    self._reader.manifest, ns, parent, h, start=pos, chunk_tokens=C
                ),
            )
            for h in sorted(children)
        ]
        best, best_n = None, 0
        for h, job in jobs:
            rec = job.result()
            if rec is not None:
                n = common_prefix(rec.tokens, rest)
                if n > best_n:
                    best, best_n = (h, rec), n
        return best

    # -- downloading and committing ----------------------------------------------------

    @contextmanager
    def _downloading(self):
        """Marks commits made by this thread as coming from the remote (no re-upload)."""
        self._local.downloading = True
        self._local.added = []
        try:
            yield self._local.added
        finally:
            self._local.downloading = False

    def _download(self, h: bytes, rec: NodeRecord) -> Dict[str, bytes]:
        """Node ``h``'s files, validated; RemoteCorrupt or RemoteError otherwise."""
        store = self._store
        ns = store.namespace
        try:
            # Before downloading: a manifest cannot cost RAM.
            store.parts.shapes.check_sizes(rec)
        except CorruptRecord as e:
            raise RemoteCorrupt(f"{self._s3.manifest_key(ns, rec.parent, h)}: {e}")
        if rec.has_state and not store.layout.has_state:
            raise RemoteCorrupt(
                f"{self._s3.manifest_key(ns, rec.parent, h)}: a checkpoint for a "
                f"layout without state layers"
            )
        raw = {}
        for part, nbytes, checksum in node_parts(rec):
            key = self._s3.blob_key(ns, h, checksum, part)
            try:
                data = self._s3.get(key, limit=nbytes, exact=nbytes)
            except NotFound:
                # Files go up before their manifest: this one was deleted since (a
                # lifecycle rule, a person). A broken pair, reported like corruption.
                raise RemoteCorrupt(f"{key}: missing") from None
            except RemoteCorrupt as e:
                raise RemoteCorrupt(f"{key}: {e}") from None
            try:
                check_node_file(data, rec, part, ns=ns, layout=store.layout)
            except CorruptBlob as e:
                raise RemoteCorrupt(f"{key}: {e}") from None
            raw[part] = data
        return raw

    def _download_commit(
        self,
        items: List[Tuple[bytes, NodeRecord]],
        *,
        chain_mode: bool,
        problems: Optional[List[str]] = None,
        progress: Optional[Callable[[int], None]] = None,
    ) -> int:
        """Download, validate and commit ``items`` (parents before children).

        With ``chain_mode`` the items are one path and the first node that cannot be
        had ends it; otherwise they stand alone and a remote failure raises
        RemoteError. Invalid objects are reported (and added to ``problems``).
        Returns the number of nodes committed (each batch's also to ``progress``).
        """
        store = self._store
        ns = store.namespace
        todo = [(h, rec) for h, rec in items if store.index.get_node(ns, h) is None]
        batches: List[List[Tuple[bytes, NodeRecord]]] = []
        nbytes = 0  # bounded bytes in memory between download and commit
        for item in todo:
            if not batches or nbytes + item[1].total_bytes > _BATCH_BYTES:
                batches.append([])
                nbytes = 0
            batches[-1].append(item)
            nbytes += item[1].total_bytes

        def submit(batch):
            return [
                (h, rec, self._io.submit(self._download, h, rec)) for h, rec in batch
            ]

        # The next batch downloads while this one is validated and committed.
        committed, ahead = 0, submit(batches[0]) if batches else []
        for k in range(len(batches)):
            jobs, ahead = ahead, submit(batches[k + 1]) if k + 1 < len(batches) else []
            stop = True  # until this batch is through: closing, an error, a stop
            try:
                if self._closing.is_set():
                    break
                nodes, stop = self._downloaded(jobs, chain_mode, problems)
                done = self._commit(nodes)
                committed += done
                if progress is not None and done:
                    progress(done)
            finally:
                if stop:  # what has not started is not needed
                    _cancel(jobs)
                    _cancel(ahead)
            if stop:
                break
        self._counters.add(remote_nodes_down=committed)
        return committed

    def _downloaded(
        self, jobs, chain_mode: bool, problems: Optional[List[str]]
    ) -> Tuple[List[tuple], bool]:
        """The ``(kind, node)`` of a batch's download ``jobs``, and whether the chain
        stops there (``chain_mode``: the first node that cannot be had ends it)."""
        nodes, stop = [], False
        for h, rec, job in jobs:
            if stop:
                job.cancel()
                continue
            try:
                nodes.append((rec.kind, _new_node(h, rec, job.result())))
            except RemoteCorrupt as e:
                self._reader.report_corrupt(str(e))
                self._reader.mark_missing(h)
                if problems is not None:
                    problems.append(str(e))
                stop = chain_mode
            except RemoteError:
                if not chain_mode:
                    raise
                stop = True
        return nodes, stop

    def _commit(self, nodes: List[tuple]) -> int:
        """Commit downloaded ``(kind, node)`` through the store's own save commit
        (parent checks, disk budget, RAM tier), one call per run of one kind."""
        store = self._store
        with self._downloading() as added:
            for kind, group in itertools.groupby(nodes, key=lambda item: item[0]):
                # Like a second writer process: LMDB serializes the commits.
                store.parts.writes.write_nodes(
                    [node for _, node in group], kind=kind, pin=False, existing=[]
                )
        return len(added)

    # -- uploading ---------------------------------------------------------------------

    def after_commit(self, added: Iterable[tuple]) -> None:
        """``KVStore`` hook, after a commit: queue the new nodes for upload."""
        if getattr(self._local, "downloading", False):
            self._local.added.extend(h for h, *_ in added)
            return
        if self.upload:
            self._uploads.add(added)

    def wait_uploads(self, timeout: float) -> bool:
        """Wait until queued uploads are done; False at the timeout or when the circuit
        breaker opens (a dead remote is not waited for)."""
        return self._uploads.wait(timeout)

    def put_namespace(self, ns: bytes, description: dict) -> None:
        """Upload the namespace's description once (for people and tools browsing)."""
        self._uploads.put_namespace(ns, description)

    def upload_node(
        self, blobs, ns: bytes, h: bytes, rec: NodeRecord, layout, *, head: bool = True
    ) -> bool:
        """Upload node ``h`` (files first, manifest last); False when the remote has it.
        See :meth:`Uploader.upload_node`."""
        return self._uploads.upload_node(blobs, ns, h, rec, layout, head=head)

    # -- sync: pull (push is in sync) -----------------------------------------------------

    def list_nodes(self, ns: bytes) -> Dict[bytes, Tuple[bytes, ...]]:
        """``hash -> parents`` of every manifest of namespace ``ns`` on the remote
        (:func:`kvstore.remote.sync.list_nodes`)."""
        return list_nodes(self._s3, ns)

    def pull(self, *, progress: Optional[Callable[[int], None]] = None) -> dict:
        """Download every node of the bound store's namespace that it lacks.

        The trie is walked from the root, parents before children; every manifest and
        file is validated as in a fetch, an invalid node is reported and its subtree
        skipped. Remote failures (network, credentials, bucket) raise RemoteError.
        """
        store = self._store
        ns, C = store.namespace, store.chunk_tokens
        nodes = self.list_nodes(ns)
        children = defaultdict(list)
        for h, parents in nodes.items():
            for parent in parents:
                children[parent].append(h)
        report = {"remote_nodes": len(nodes), "pulled": 0, "present": 0}
        report.update({"invalid": 0, "unreachable": 0, "problems": []})
        for h, parents in sorted(nodes.items()):
            if len(parents) > 1:  # one at most can hash to h: the pull finds which
                problem = (
                    f"node {h.hex()} is listed under {len(parents)} parents "
                    f"({', '.join(p.hex()[:12] for p in parents)}): the copy under a "
                    "reachable parent that its hash proves is pulled"
                )
                self._reader.report_corrupt(problem)
                report["problems"].append(problem)

        def manifest(h, parent):
            return self._reader.manifest(
                ns, parent, h, start=None, chunk_tokens=C, strict=True
            )

        # Every manifest's key is in the listing: they are read in parallel, in the
        # tree's breadth-first order, a wave at a time. A node is kept when its parent
        # was and it starts where its parent ends; the files of a wave are then
        # downloaded together and committed parents first (a child of a node that
        # could not be had is skipped by the commit's parent check).
        order, at = [(h, store.root) for h in sorted(children[store.root])], 0
        listed = set(order)  # each (node, parent) once: listings may loop
        while at < len(order):
            below = [(c, order[at][0]) for c in sorted(children[order[at][0]])]
            order += [pair for pair in below if pair not in listed]
            listed.update(below)
            at += 1
        ends = {store.root: 0}  # where each kept node ends
        reached = set()
        for lo in range(0, len(order), _PULL_WAVE_NODES):
            wave = order[lo : lo + _PULL_WAVE_NODES]
            jobs = [(h, p, self._io.submit(manifest, h, p)) for h, p in wave]
            good = []
            for h, parent, job in jobs:
                try:
                    rec, problem = job.result(), None
                except RemoteCorrupt as e:
                    rec, problem = None, str(e)
                except BaseException:  # the remote failed: the pull ends here
                    _cancel(jobs)
                    raise
                if parent not in ends or h in ends:
                    continue  # below a node that is missing or invalid, or had
                reached.add(h)
                wrong = None if rec is None else wrong_start(rec, ends[parent])
                if wrong is not None:
                    problem = f"{self._s3.manifest_key(ns, parent, h)}: {wrong}"
                if problem is not None:
                    self._reader.report_corrupt(problem)
                    report["problems"].append(problem)
                    report["invalid"] += 1
                elif rec is not None:
                    good.append((h, rec))
                    ends[h] = rec.end
            self._pull_wave(good, report, progress)
        report["unreachable"] += len(nodes) - len(reached)
        report["bytes_down"] = self.stats()["bytes_down"]
        return report

    def _pull_wave(self, wave, report: dict, progress) -> None:
        """Download and commit the nodes of ``wave`` (manifests, parents first) that
        the store lacks; count them in ``report``."""
        store = self._store
        local = {h for h, _ in wave if store.index.get_node(store.namespace, h)}
        report["present"] += len(local)
        if progress is not None and local:
            progress(len(local))
        todo = [(h, rec) for h, rec in wave if h not in local]
        before = len(report["problems"])
        pulled = self._download_commit(
            todo, chain_mode=False, problems=report["problems"], progress=progress
        )
        invalid = len(report["problems"]) - before
        report["pulled"] += pulled
        report["invalid"] += invalid
        # The rest lie below a node that could not be had (or came meanwhile).
        report["unreachable"] += len(todo) - pulled - invalid


def _cancel(jobs) -> None:
    """Cancel the ``(hash, _, future)`` jobs that have not started (the rest finish
    unused)."""
    for _, _, job in jobs:
        job.cancel()


def _new_node(h: bytes, rec: NodeRecord, raw: Dict[str, bytes]):
    """A node for ``WritePath.write_nodes`` whose files are the downloaded bytes."""
    return NewNode(h, rec.parent, rec.start, rec.tokens, None, raw=raw)
