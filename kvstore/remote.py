"""The shared remote tier: node files in an S3-compatible object store, behind the disk.

AWS S3, MinIO, Ceph RGW, R2: anything speaking the S3 API through boto3 (an optional
dependency, imported on first use). Objects under the URL's prefix, per namespace::

    <ns>/namespace.json                         the namespace's description
    <ns>/nodes/<parent>/<h>.json                one manifest per node (JSON, see below)
    <ns>/blobs/<h>.<xxh3>.safetensors           its node file
    <ns>/blobs/<h>.<xxh3>.state.safetensors     its checkpoint, when it has one

Manifests sit under their parent: chunk hashes are computed locally from the prompt, so
full chunks are found by direct GETs, and a node ended by a boundary (a system prompt's
end) by one LIST of its parent's children. Blob keys carry their checksum: two machines
that computed one node with KV differing in the last bits upload two objects, and each
manifest names its own, so a race between writers cannot pair a manifest with another
writer's bytes.

Nothing from the remote is trusted: manifests are parsed strictly (exact keys, types,
bounded sizes, tokens matching the node's span, the hash recomputed from the parent and
the tokens), node files are checked like local ones (size, xxh3, header, shapes and
dtypes against the local layout, namespace) before they are written and committed
through the store's own commit. A broken object is a miss and a report; a dead or slow
remote costs one bounded wait, then a circuit breaker skips it for a while.
"""

import itertools
import json
import logging
import re
import threading
import time
from collections import OrderedDict, defaultdict
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterable, List, Optional, Set, Tuple

import numpy as np
import xxhash

from .blobs import (
    DELTA_PART,
    STATE_PART,
    CorruptBlob,
    check_layout,
    metadata_matches,
    parse_header,
)
from .chunking import MAX_TOKEN, chain_hash, chain_hashes, common_prefix
from .index import KINDS, CorruptRecord, NodeRecord

log = logging.getLogger("kvstore")

MANIFEST_FORMAT = "kvstore-node"
MANIFEST_VERSION = 1
_MANIFEST_KEYS = {
    "format",
    "version",
    "namespace",
    "hash",
    "parent",
    "start",
    "tokens",
    "kind",
    "file",
    "state",
}
_FILE_KEYS = {"nbytes", "xxh3"}
_HEX32 = re.compile(r"[0-9a-f]{32}")
_HEX16 = re.compile(r"[0-9a-f]{16}")
_CHILD_KEY = re.compile(r"([0-9a-f]{32})\.json")
_BUCKET = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{1,61}[A-Za-z0-9]")
_NOT_FOUND = {"NoSuchKey", "404", "NotFound"}  # "404": HEAD, which has no body
_WINDOW = 8  # full-chunk manifests asked for at once along a prompt
_BATCH_BYTES = 64 << 20  # downloaded bytes held before they are committed
_LIST_PAGE = 1000


class RemoteError(Exception):
    """The remote cannot be used: network, timeout, credentials, bucket, permissions."""


class RemoteUnavailable(RemoteError):
    """The circuit breaker is open: the remote failed repeatedly and is skipped."""


class RemoteCorrupt(Exception):
    """An object of the remote failed validation."""


class _NotFound(Exception):
    pass


# -- URLs and manifests --------------------------------------------------------------


def parse_url(url) -> Tuple[str, str]:
    """``s3://bucket[/prefix]`` -> ``(bucket, prefix without slashes at its ends)``.

    Raises:
        TypeError: ``url`` is not a string.
        ValueError: not an ``s3://`` URL with a valid bucket name.
    """
    if not isinstance(url, str):
        raise TypeError(
            f"remote must be an s3://bucket/prefix URL or a RemoteTier, got "
            f"{type(url).__name__}"
        )
    m = re.fullmatch(r"s3://([^/]*)(?:/(.*))?", url)
    if m is None:
        raise ValueError(f"remote {url!r} is not an s3://bucket/prefix URL")
    bucket, prefix = m.group(1), m.group(2) or ""
    if not _BUCKET.fullmatch(bucket):
        raise ValueError(
            f"remote {url!r}: {bucket!r} is not a bucket name (3-63 letters, digits, "
            f"'.', '-' or '_')"
        )
    if "//" in "/" + prefix or any(ord(c) < 32 for c in prefix) or len(prefix) > 512:
        raise ValueError(f"remote {url!r}: the prefix {prefix!r} is not a usable key")
    return bucket, prefix.rstrip("/")


def encode_manifest(ns: bytes, h: bytes, rec: NodeRecord) -> bytes:
    """The JSON manifest of node ``h`` (what another machine needs to rebuild its record)."""

    def file(nbytes, checksum):
        return {"nbytes": int(nbytes), "xxh3": f"{checksum:016x}"}

    obj = {
        "format": MANIFEST_FORMAT,
        "version": MANIFEST_VERSION,
        "namespace": ns.hex(),
        "hash": h.hex(),
        "parent": rec.parent.hex(),
        "start": int(rec.start),
        "tokens": [int(t) for t in rec.tokens],
        "kind": rec.kind,
        "file": file(rec.nbytes, rec.checksum),
        "state": (
            file(rec.state_nbytes, rec.state_checksum) if rec.has_state else None
        ),
    }
    return json.dumps(obj, separators=(",", ":")).encode()


def manifest_limit(chunk_tokens: int) -> int:
    """The largest manifest a node of ``chunk_tokens`` tokens can have, in bytes."""
    return 2048 + 12 * chunk_tokens


def decode_manifest(
    raw: bytes,
    *,
    ns: bytes,
    h: bytes,
    chunk_tokens: int,
    max_object_bytes: int,
) -> NodeRecord:
    """Parse a manifest strictly into a :class:`NodeRecord` (not pinned, created now).

    Raises:
        RemoteCorrupt: anything malformed, out of bounds, of another namespace or
            node, or whose hash is not the chain hash of its parent and tokens.
    """
    if len(raw) > manifest_limit(chunk_tokens):
        raise RemoteCorrupt(f"manifest of {len(raw)} bytes is too large")

    def no_duplicates(pairs):
        keys = [k for k, _ in pairs]
        if len(set(keys)) != len(keys):
            raise RemoteCorrupt("manifest has duplicate keys")
        return dict(pairs)

    def no_constant(name):
        raise RemoteCorrupt(f"manifest holds {name}")

    try:
        obj = json.loads(
            raw, object_pairs_hook=no_duplicates, parse_constant=no_constant
        )
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise RemoteCorrupt(f"manifest is not JSON: {str(e)[:80]}") from None
    if not isinstance(obj, dict) or set(obj) != _MANIFEST_KEYS:
        got = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
        raise RemoteCorrupt(
            f"manifest fields are {got}, expected {sorted(_MANIFEST_KEYS)}"
        )
    if obj["format"] != MANIFEST_FORMAT or obj["version"] != MANIFEST_VERSION:
        raise RemoteCorrupt(
            f"manifest format {obj['format']!r} version {obj['version']!r}"
        )
    if obj["namespace"] != ns.hex():
        raise RemoteCorrupt("manifest names another namespace")
    if obj["hash"] != h.hex():
        raise RemoteCorrupt("manifest names another node")
    parent = obj["parent"]
    if not isinstance(parent, str) or not _HEX32.fullmatch(parent):
        raise RemoteCorrupt("manifest parent is not a 32-digit hex hash")
    start, tokens = obj["start"], obj["tokens"]
    if not _is_int(start) or not 0 <= start <= MAX_TOKEN:
        raise RemoteCorrupt(f"manifest start {start!r} is not a position")
    if not isinstance(tokens, list) or not 1 <= len(tokens) <= chunk_tokens:
        raise RemoteCorrupt(
            f"manifest tokens must be a list of 1 to {chunk_tokens} token ids"
        )
    if not all(_is_int(t) and 0 <= t <= MAX_TOKEN for t in tokens):
        raise RemoteCorrupt("manifest tokens are not all token ids")
    if obj["kind"] not in KINDS:
        raise RemoteCorrupt(f"manifest kind {obj['kind']!r} is not one of {KINDS}")
    nbytes, checksum = _file_entry(obj["file"], "file", max_object_bytes)
    state_nbytes = state_checksum = 0
    if obj["state"] is not None:
        state_nbytes, state_checksum = _file_entry(
            obj["state"], "state", max_object_bytes
        )
    arr = np.array(tokens, dtype="<i4")
    parent = bytes.fromhex(parent)
    # Never the remote's word for it: the node's address is recomputed from its content.
    if chain_hash(parent, arr) != h:
        raise RemoteCorrupt("hash is not the chain hash of the parent and tokens")
    return NodeRecord(
        parent,
        start,
        arr,
        nbytes,
        checksum,
        obj["kind"],
        False,
        time.time(),
        state_nbytes,
        state_checksum,
    )


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _file_entry(entry, what: str, max_bytes: int) -> Tuple[int, int]:
    if not isinstance(entry, dict) or set(entry) != _FILE_KEYS:
        raise RemoteCorrupt(f"manifest {what} entry must be {sorted(_FILE_KEYS)}")
    nbytes, digest = entry["nbytes"], entry["xxh3"]
    if not _is_int(nbytes) or not 8 < nbytes <= max_bytes:
        raise RemoteCorrupt(f"manifest {what} size {nbytes!r} is out of bounds")
    if not isinstance(digest, str) or not _HEX16.fullmatch(digest):
        raise RemoteCorrupt(f"manifest {what} checksum is not 16 hex digits")
    return nbytes, int(digest, 16)


def check_node_file(data, rec: NodeRecord, part: str, *, ns: bytes, layout) -> None:
    """Validate one downloaded (or about to be uploaded) node file exactly as a local
    read does: size, checksum, header, tensors against ``layout``, namespace.

    Raises:
        CorruptBlob: the file is not what ``rec`` describes.
    """
    nbytes, checksum = (
        (rec.state_nbytes, rec.state_checksum)
        if part == STATE_PART
        else (rec.nbytes, rec.checksum)
    )
    if len(data) != nbytes:
        raise CorruptBlob(f"{len(data)} bytes, the manifest says {nbytes}")
    if xxhash.xxh3_64_intdigest(data) != checksum:
        raise CorruptBlob("checksum mismatch")
    _, tensors, meta = parse_header(data, len(data))
    if part == STATE_PART:
        layout.decode_state(memoryview(data), tensors, rec.end)
    else:
        check_layout(tensors, layout.delta_tensors(rec.ntokens))
    if not metadata_matches(meta, ns):
        raise CorruptBlob("file belongs to another namespace")


def _parts(rec: NodeRecord) -> List[Tuple[str, int, int]]:
    """``(part, nbytes, checksum)`` of a node's files."""
    out = [(DELTA_PART, rec.nbytes, rec.checksum)]
    if rec.has_state:
        out.append((STATE_PART, rec.state_nbytes, rec.state_checksum))
    return out


# -- the tier --------------------------------------------------------------------------


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
        failures_to_open: Consecutive failed requests that open the circuit breaker.
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
    ):
        self.bucket, self.prefix = parse_url(url)
        self.url = url
        for name, value in (
            ("connect_timeout", connect_timeout),
            ("read_timeout", read_timeout),
            ("lookup_timeout", lookup_timeout),
            ("open_seconds", open_seconds),
            ("cache_seconds", cache_seconds),
            ("close_timeout", close_timeout),
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
        ):
            if not _is_int(value):
                raise TypeError(f"{name} must be an int, got {value!r}")
            if value < minimum:
                raise ValueError(f"{name} must be >= {minimum}, got {value}")
        if endpoint_url is not None and not isinstance(endpoint_url, str):
            raise TypeError(f"endpoint_url must be a str, got {endpoint_url!r}")
        _import_boto3()  # a clear error now rather than at the first request
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

        self._client = None
        self._client_lock = threading.Lock()
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._failures = 0
        self._open_until = 0.0
        self._manifests: "OrderedDict[bytes, Tuple[float, Any]]" = OrderedDict()
        self._listings: "OrderedDict[bytes, Tuple[float, Set[bytes]]]" = OrderedDict()
        self._counts: Dict[str, int] = defaultdict(int)
        self._last_error: Optional[str] = None
        self._io = ThreadPoolExecutor(threads, thread_name_prefix="kvstore-remote")
        self._store = None
        self._local = threading.local()
        self._closing = threading.Event()
        self._lookups: Optional[ThreadPoolExecutor] = None
        self._lookup_slots = threading.BoundedSemaphore(2)
        self._pending: "OrderedDict[bytes, NodeRecord]" = OrderedDict()
        self._uploading = 0
        self._uploader: Optional[threading.Thread] = None
        self._namespaces_done: Set[bytes] = set()

    def __repr__(self) -> str:
        return f"RemoteTier({self.url!r})"

    # -- binding to a store ----------------------------------------------------

    def bind(self, store) -> None:
        """Attach to ``store`` (done by ``KVStore``): start the uploader."""
        if self._store is not None:
            raise ValueError(f"{self!r} already serves another KVStore")
        self._store = store
        self._lookups = ThreadPoolExecutor(2, thread_name_prefix="kvstore-lookup")
        if self.upload:
            self._uploader = threading.Thread(
                target=self._upload_loop, name="kvstore-upload", daemon=True
            )
            self._uploader.start()

    def close(self) -> None:
        """Wait (up to ``close_timeout``, while the remote answers) for pending uploads,
        then stop. Downloads in flight end before this returns. Idempotent."""
        if self._closing.is_set():
            return
        if self._uploader is not None:
            if not self.wait_uploads(self.close_timeout):
                log.warning(
                    "kvstore: remote %s: %d node uploads not done at close",
                    self.url,
                    len(self._pending) + self._uploading,
                )
        self._closing.set()
        with self._cond:
            self._counts["uploads_dropped"] += len(self._pending)
            self._pending.clear()
            self._cond.notify_all()
        if self._uploader is not None:
            self._uploader.join()
        if self._lookups is not None:
            self._lookups.shutdown(wait=True)
        self._io.shutdown(wait=True)

    def stats(self) -> Dict[str, Any]:
        """Counters of this process (flat keys, merged into ``KVStore.stats()``)."""
        with self._lock:
            c = self._counts
            out = {
                "remote": self.url,
                "remote_open": time.monotonic() < self._open_until,
                "pending_uploads": len(self._pending) + self._uploading,
                "remote_last_error": self._last_error,
            }
            for name in (
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
            ):
                out[name] = c[name]
        return out

    def _count(self, **deltas) -> None:
        with self._lock:
            for k, v in deltas.items():
                self._counts[k] += v

    # -- requests, with the circuit breaker --------------------------------------------

    def _s3(self):
        with self._client_lock:
            if self._client is None:
                try:
                    self._client = _new_client(
                        self.endpoint_url,
                        connect_timeout=self.connect_timeout,
                        read_timeout=self.read_timeout,
                        retries={"mode": "standard", "max_attempts": self.max_attempts},
                        max_pool_connections=self.threads + 4,
                    )
                except Exception as e:  # e.g. a malformed AWS_ENDPOINT_URL
                    self._failed(f"cannot make an S3 client: {type(e).__name__}: {e}")
                    raise RemoteError(str(e)) from None
            return self._client

    def _key(self, ns: bytes, *parts: str) -> str:
        return "/".join(([self.prefix] if self.prefix else []) + [ns.hex(), *parts])

    def _manifest_key(self, ns: bytes, parent: bytes, h: bytes) -> str:
        return self._key(ns, "nodes", parent.hex(), h.hex() + ".json")

    def _blob_key(self, ns: bytes, h: bytes, checksum: int, part: str) -> str:
        return self._key(ns, "blobs", f"{h.hex()}.{checksum:016x}{part}.safetensors")

    def circuit_open(self) -> bool:
        """Whether the breaker currently skips the remote."""
        return time.monotonic() < self._open_until

    def _request(self, op: str, key: str, call: Callable[[Any], Any]):
        """Run ``call(client)``; failures feed the breaker and become RemoteError."""
        if self.circuit_open():
            self._count(remote_skipped=1)
            raise RemoteUnavailable(
                f"skipped after repeated failures (last: {self._last_error})"
            )
        from botocore.exceptions import BotoCoreError, ClientError
        from urllib3.exceptions import HTTPError

        try:
            out = call(self._s3())
        except ClientError as e:
            err = e.response.get("Error", {})
            code = str(err.get("Code", ""))
            if code in _NOT_FOUND:
                # A HEAD's bare 404 may be a missing bucket: it does not end a streak.
                if code == "NoSuchKey":
                    self._succeeded()
                raise _NotFound(key) from None
            reason = f"{op} {key}: {code}: {err.get('Message', '')}".rstrip(": ")
            self._failed(reason)
            raise RemoteError(reason) from None
        except (BotoCoreError, HTTPError, OSError, ValueError) as e:
            reason = f"{op} {key}: {type(e).__name__}: {e}"
            self._failed(reason)
            raise RemoteError(reason) from None
        self._succeeded()
        return out

    def _succeeded(self) -> None:
        with self._lock:
            self._failures = 0

    def _failed(self, reason: str) -> None:
        with self._lock:
            self._failures += 1
            self._counts["remote_errors"] += 1
            self._last_error = reason
            first = self._failures == 1
            was_open = time.monotonic() < self._open_until
            opened = self._failures >= self.failures_to_open and not was_open
            if self._failures >= self.failures_to_open:
                self._open_until = time.monotonic() + self.open_seconds
        if first or opened:
            log.warning(
                "kvstore: remote %s: %s%s",
                self.url,
                reason,
                f"; skipping the remote for {self.open_seconds:g} s" if opened else "",
            )

    def _get(self, key: str, *, limit: int, exact: Optional[int] = None) -> bytes:
        """An object's bytes: at most ``limit``, or exactly ``exact``."""

        def call(s3):
            obj = s3.get_object(Bucket=self.bucket, Key=key)
            body = obj["Body"]
            try:
                size = obj.get("ContentLength")
                if exact is not None and size != exact:
                    return RemoteCorrupt(f"object has {size} bytes, expected {exact}")
                if size is not None and size > limit:
                    return RemoteCorrupt(f"object of {size} bytes is too large")
                # Never more than the bound, whatever the server claims.
                return body.read(limit + 1)
            finally:
                body.close()

        data = self._request("GET", key, call)
        if isinstance(data, RemoteCorrupt):
            raise data
        if len(data) > limit or (exact is not None and len(data) != exact):
            raise RemoteCorrupt(f"object has {len(data)} bytes")
        self._count(bytes_down=len(data))
        return data

    def _put(self, key: str, data: bytes, metadata: Optional[dict] = None) -> None:
        self._request(
            "PUT",
            key,
            lambda s3: s3.put_object(
                Bucket=self.bucket, Key=key, Body=data, Metadata=metadata or {}
            ),
        )
        self._count(bytes_up=len(data))

    def _head(self, key: str) -> Optional[dict]:
        """The object's user metadata, None when it does not exist."""
        try:
            out = self._request(
                "HEAD", key, lambda s3: s3.head_object(Bucket=self.bucket, Key=key)
            )
        except _NotFound:
            return None
        return out.get("Metadata") or {}

    def _list(self, prefix: str, *, max_keys: Optional[int] = None) -> List[str]:
        """Keys under ``prefix`` (every page, or the first ``max_keys``)."""
        keys: List[str] = []
        token = None
        while True:
            kwargs = {"Bucket": self.bucket, "Prefix": prefix, "MaxKeys": _LIST_PAGE}
            if token:
                kwargs["ContinuationToken"] = token
            page = self._request(
                "LIST", prefix, lambda s3, kw=kwargs: s3.list_objects_v2(**kw)
            )
            keys += [o["Key"] for o in page.get("Contents", ())]
            token = page.get("NextContinuationToken")
            if not page.get("IsTruncated") or not token:
                return keys
            if max_keys is not None and len(keys) >= max_keys:
                return keys

    # -- reading manifests -------------------------------------------------------------

    def _cached(self, cache: OrderedDict, key: bytes):
        with self._lock:
            hit = cache.get(key)
            if hit is None:
                return None
            if hit[0] < time.monotonic():
                del cache[key]
                return None
            return hit

    def _remember(self, cache: OrderedDict, key: bytes, value) -> None:
        with self._lock:
            cache[key] = (time.monotonic() + self.cache_seconds, value)
            cache.move_to_end(key)
            while len(cache) > 8192:
                cache.popitem(last=False)

    def _manifest(
        self,
        ns: bytes,
        parent: bytes,
        h: bytes,
        *,
        start: int,
        chunk_tokens: int,
        tokens: Optional[np.ndarray] = None,
        strict: bool = False,
    ) -> Optional[NodeRecord]:
        """Node ``h``'s manifest, validated; None when the remote lacks it or it is
        invalid (reported). With ``strict``, an invalid one raises RemoteCorrupt."""
        hit = self._cached(self._manifests, h)
        if hit is not None and not strict:
            return hit[1]
        listing = self._cached(self._listings, parent)
        if listing is not None and h not in listing[1] and not strict:
            return None  # the parent's fresh listing says no such child
        key = self._manifest_key(ns, parent, h)
        try:
            raw = self._get(key, limit=manifest_limit(chunk_tokens))
            rec = decode_manifest(
                raw,
                ns=ns,
                h=h,
                chunk_tokens=chunk_tokens,
                max_object_bytes=self.max_object_bytes,
            )
            if rec.parent != parent:
                raise RemoteCorrupt("manifest names another parent")
            if rec.start != start:
                raise RemoteCorrupt(f"manifest start {rec.start}, expected {start}")
            if tokens is not None and not np.array_equal(rec.tokens, tokens):
                raise RemoteCorrupt("manifest tokens differ from the prompt's")
        except _NotFound:
            rec = None
        except RemoteCorrupt as e:
            if strict:
                raise RemoteCorrupt(f"{key}: {e}") from None
            self._report_corrupt(f"{key}: {e}")
            rec = None
        self._remember(self._manifests, h, rec)
        return rec

    def _report_corrupt(self, what: str) -> None:
        with self._lock:
            self._counts["remote_corrupt"] += 1
            self._last_error = what
        log.warning("kvstore: remote object %s; treating it as a miss", what)

    def _children(self, ns: bytes, parent: bytes) -> Set[bytes]:
        """Hashes of ``parent``'s children on the remote (the first page of them)."""
        hit = self._cached(self._listings, parent)
        if hit is not None:
            return hit[1]
        prefix = self._key(ns, "nodes", parent.hex()) + "/"
        out = set()
        for key in self._list(prefix, max_keys=_LIST_PAGE):
            m = _CHILD_KEY.fullmatch(key[len(prefix) :])
            if m:
                out.add(bytes.fromhex(m.group(1)))
        self._remember(self._listings, parent, out)
        return out

    # -- fetch: following a prompt on the remote ---------------------------------------

    def before_fetch(self, arr: np.ndarray) -> None:
        """``KVStore.fetch`` hook: download the nodes the remote has along ``arr``
        beyond the local ones, waiting at most ``lookup_timeout``. Never raises."""
        store = self._store
        if store is None or self._closing.is_set() or len(arr) < 2:
            return
        try:
            path = store.index.read(
                lambda txn: store._walk(txn, arr, limit=len(arr), full_only=True)
            )
        except Exception:  # the fetch itself reports a broken index
            return
        pos = sum(step.take for step in path)
        if pos >= len(arr) - 1:
            return  # the local store has every restorable token: no remote needed
        parent = path[-1].h if path else store.root
        if self.circuit_open() or not self._lookup_slots.acquire(blocking=False):
            self._count(remote_skipped=1)  # dead remote, or two lookups in flight
            return
        try:
            job = self._lookups.submit(self._fill_released, parent, pos, arr)
        except RuntimeError:  # shut down meanwhile
            self._lookup_slots.release()
            return
        try:
            job.result(timeout=self.lookup_timeout)
        except FutureTimeout:
            self._count(remote_timeouts=1)
            log.warning(
                "kvstore: remote %s: no answer within %g s; going on without it "
                "(the download continues in the background)",
                self.url,
                self.lookup_timeout,
            )
        except Exception:  # a bug, not the remote: still never the caller's problem
            log.exception("kvstore: remote lookup failed")
            self._count(remote_errors=1)

    def _fill_released(self, parent: bytes, pos: int, arr: np.ndarray) -> None:
        try:
            self._fill(parent, pos, arr)
        except RemoteError:
            pass  # counted and logged where it happened
        except Exception:  # e.g. a local write error: logged, never the caller's
            log.exception("kvstore: remote download failed")
            self._count(remote_errors=1)
        finally:
            self._lookup_slots.release()

    def _fill(self, parent: bytes, pos: int, arr: np.ndarray) -> int:
        """Download and commit the remote's nodes along ``arr`` after the local node
        ``parent`` (which ends at ``pos``); returns how many."""
        chain, failed = self._resolve(parent, pos, arr)
        done = self._download_commit(chain, chain_mode=True) if chain else 0
        if done or not failed:
            self._count(**{"remote_hits" if done else "remote_misses": 1})
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
                        self._manifest,
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
        children = self._children(ns, parent)
        if not children:
            return None
        rest = arr[pos : pos + C]
        # A child whose tokens are a prefix of the prompt has a hash we can compute.
        for n in range(len(rest), 0, -1):
            h = chain_hash(parent, rest[:n])
            if h in children:
                rec = self._manifest(
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
                    self._manifest, ns, parent, h, start=pos, chunk_tokens=C
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
            store._check_sizes(rec)  # before downloading: a manifest cannot cost RAM
        except CorruptRecord as e:
            raise RemoteCorrupt(f"{self._manifest_key(ns, rec.parent, h)}: {e}")
        if rec.has_state and not store.layout.has_state:
            raise RemoteCorrupt(
                f"{self._manifest_key(ns, rec.parent, h)}: a checkpoint for a layout "
                f"without state layers"
            )
        raw = {}
        for part, nbytes, checksum in _parts(rec):
            key = self._blob_key(ns, h, checksum, part)
            try:
                data = self._get(key, limit=nbytes, exact=nbytes)
            except _NotFound:
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
    ) -> int:
        """Download, validate and commit ``items`` (parents before children).

        With ``chain_mode`` the items are one path and the first node that cannot be
        had ends it; otherwise they stand alone and a remote failure raises
        RemoteError. Invalid objects are reported (and added to ``problems``).
        Returns the number of nodes committed.
        """
        store = self._store
        ns = store.namespace
        todo = [(h, rec) for h, rec in items if store.index.get_node(ns, h) is None]
        committed, i = 0, 0
        while i < len(todo) and not self._closing.is_set():
            batch, nbytes = [], 0  # bounded bytes in memory between download and commit
            while i < len(todo) and (
                not batch or nbytes + todo[i][1].total_bytes <= _BATCH_BYTES
            ):
                batch.append(todo[i])
                nbytes += todo[i][1].total_bytes
                i += 1
            jobs = [
                (h, rec, self._io.submit(self._download, h, rec)) for h, rec in batch
            ]
            nodes, stop = [], False
            for h, rec, job in jobs:
                if stop:
                    job.cancel()
                    continue
                try:
                    nodes.append((rec.kind, _new_node(h, rec, job.result())))
                except RemoteCorrupt as e:
                    self._report_corrupt(str(e))
                    self._remember(self._manifests, h, None)
                    if problems is not None:
                        problems.append(str(e))
                    stop = chain_mode
                except RemoteError:
                    if not chain_mode:
                        raise
                    stop = True
            committed += self._commit(nodes)
            if stop:
                break
        self._count(remote_nodes_down=committed)
        return committed

    def _commit(self, nodes: List[tuple]) -> int:
        """Commit downloaded ``(kind, node)`` through the store's own save commit
        (parent checks, disk budget, RAM tier), one call per run of one kind."""
        store = self._store
        with self._downloading() as added:
            for kind, group in itertools.groupby(nodes, key=lambda item: item[0]):
                # Like a second writer process: LMDB serializes the commits.
                store._write_nodes(
                    [node for _, node in group], kind=kind, pin=False, existing=[]
                )
        return len(added)

    # -- uploading -----------------------------------------------------------------------

    def after_commit(self, added: Iterable[tuple]) -> None:
        """``KVStore`` hook, after a commit: queue the new nodes for upload."""
        if getattr(self._local, "downloading", False):
            self._local.added.extend(h for h, *_ in added)
            return
        if not self.upload:
            return
        with self._cond:
            for h, rec, *_ in added:
                if self._closing.is_set() or (
                    h not in self._pending
                    and len(self._pending) >= self.max_pending_uploads
                ):
                    self._counts["uploads_dropped"] += 1
                    continue
                self._pending[h] = rec  # a later record (with a checkpoint) replaces
            self._cond.notify_all()

    def wait_uploads(self, timeout: float) -> bool:
        """Wait until queued uploads are done; False at the timeout or when the circuit
        breaker opens (a dead remote is not waited for)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._pending or self._uploading:
                left = deadline - time.monotonic()
                if left <= 0 or self.circuit_open() or self._uploader is None:
                    return False
                self._cond.wait(min(left, 0.1))
        return True

    def _upload_loop(self) -> None:
        store = self._store
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
                self._count(upload_errors=1)
            finally:
                with self._cond:
                    self._uploading -= 1
                    self._cond.notify_all()

    def _upload_with_retries(self, store, h: bytes, rec: NodeRecord) -> None:
        ns = store.namespace
        for attempt in range(self.upload_attempts):
            # Wait out an open breaker (or stop at close) rather than spin on it.
            while self.circuit_open() and not self._closing.wait(0.2):
                pass
            if self._closing.is_set():
                self._count(uploads_dropped=1)
                return
            try:
                if ns not in self._namespaces_done:
                    self.put_namespace(ns, store.description)
                self.upload_node(store.blobs, ns, h, rec, store.layout)
                return
            except (CorruptBlob, OSError) as e:
                # The local file went (evicted, quarantined) or is broken: not ours to
                # send. A broken one is the store's to report.
                self._count(uploads_skipped=1)
                if isinstance(e, CorruptBlob):
                    store._report_broken(h, f"before upload: {e}")
                return
            except RemoteError:
                if attempt == self.upload_attempts - 1:
                    self._count(upload_errors=1)
                    return
                self._closing.wait(0.5 * 2**attempt)

    def put_namespace(self, ns: bytes, description: dict) -> None:
        """Upload the namespace's description once (for people and tools browsing)."""
        key = self._key(ns, "namespace.json")
        if self._head(key) is None:
            self._put(key, json.dumps(description, sort_keys=True).encode())
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
        mkey = self._manifest_key(ns, rec.parent, h)
        if head:
            meta = self._head(mkey)
            if meta is not None and (meta.get("state") == "1" or not rec.has_state):
                self._count(uploads_present=1)
                return False
        for part, nbytes, checksum in _parts(rec):
            data = blobs.read_all(
                ns, h, nbytes=nbytes, checksum=checksum, expected=None, part=part
            )[0]
            check_node_file(data, rec, part, ns=ns, layout=layout)
            self._put(self._blob_key(ns, h, checksum, part), bytes(data))
        self._put(
            mkey,
            encode_manifest(ns, h, rec),
            {"state": "1" if rec.has_state else "0"},
        )
        self._count(uploads=1)
        return True

    # -- sync: pull and push -----------------------------------------------------------

    def list_nodes(self, ns: bytes) -> Dict[bytes, bytes]:
        """``hash -> parent`` of every manifest of namespace ``ns`` on the remote."""
        prefix = self._key(ns, "nodes") + "/"
        out = {}
        for key in self._list(prefix):
            parts = key[len(prefix) :].split("/")
            if len(parts) == 2 and _HEX32.fullmatch(parts[0]):
                m = _CHILD_KEY.fullmatch(parts[1])
                if m:
                    out[bytes.fromhex(m.group(1))] = bytes.fromhex(parts[0])
        return out

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
        for h, parent in nodes.items():
            children[parent].append(h)
        report = {"remote_nodes": len(nodes), "pulled": 0, "present": 0}
        report.update({"invalid": 0, "unreachable": 0, "problems": []})
        reached = 0
        level = [(h, store.root, 0) for h in sorted(children[store.root])]
        while level:
            jobs = [
                (h, p, s, self._io.submit(self._strict_manifest, ns, p, h, s, C))
                for h, p, s in level
            ]
            good = []
            for h, p, s, job in jobs:
                try:
                    rec = job.result()
                except RemoteCorrupt as e:
                    self._report_corrupt(str(e))
                    report["problems"].append(str(e))
                    report["invalid"] += 1
                    continue
                if rec is not None:
                    good.append((h, rec))
            reached += len(level)
            local = {h for h, _ in good if store.index.get_node(ns, h) is not None}
            report["present"] += len(local)
            before = len(report["problems"])
            pulled = self._download_commit(
                [(h, rec) for h, rec in good if h not in local],
                chain_mode=False,
                problems=report["problems"],
            )
            report["pulled"] += pulled
            report["invalid"] += len(report["problems"]) - before
            if progress is not None:
                progress(pulled + len(local))
            level = [
                (c, h, rec.end)
                for h, rec in good
                if store.index.get_node(ns, h) is not None
                for c in sorted(children[h])
            ]
        report["unreachable"] = len(nodes) - reached
        report["bytes_down"] = self.stats()["bytes_down"]
        return report

    def _strict_manifest(self, ns, parent, h, start, chunk_tokens):
        return self._manifest(
            ns, parent, h, start=start, chunk_tokens=chunk_tokens, strict=True
        )


def push(
    path: str,
    tier: RemoteTier,
    *,
    namespaces: Optional[Iterable[bytes]] = None,
    progress: Optional[Callable[[int], None]] = None,
) -> dict:
    """Upload the nodes of the store at ``path`` that the remote lacks (no model needed).

    Every file is checked against its record and its namespace's layout before it is
    sent. Remote failures raise RemoteError; local problems are reported.

    Args:
        path: The store directory.
        tier: An unbound :class:`RemoteTier`.
        namespaces: Which namespaces (ids); None: every namespace with nodes.
    """
    import os

    from .blobs import Blobs
    from .index import Index
    from .maintenance.common import _descriptions, _layout

    index = Index(os.path.join(path, "index"), create=False)
    report = {"namespaces": 0, "nodes": 0, "uploaded": 0, "present": 0}
    report.update({"skipped": 0, "problems": []})
    try:
        blobs = Blobs(os.path.join(path, "blobs"), os.path.join(path, "quarantine"))
        descs = index.read(lambda txn: _descriptions(index, txn))

        def records(txn, ns):
            out = []
            for _, h, raw in index.iter_nodes(txn, ns):
                try:
                    out.append((h, NodeRecord.decode(raw)))
                except CorruptRecord as e:
                    report["problems"].append(f"node {h.hex()}: index record: {e}")
            return out

        selected = list(namespaces) if namespaces is not None else sorted(descs)
        for ns in selected:
            recs = index.read(lambda txn: records(txn, ns))
            if not recs:
                continue
            try:
                layout = _layout(descs.get(ns, "no description"))
            except ValueError as e:
                report["problems"].append(f"namespace {ns.hex()}: {e}")
                continue
            report["namespaces"] += 1
            report["nodes"] += len(recs)
            known = tier.list_nodes(ns)
            tier.put_namespace(ns, descs[ns])
            recs.sort(key=lambda item: item[1].start)  # parents before children

            def one(item):
                h, rec = item
                if known.get(h) == rec.parent and not rec.has_state:
                    return "present"
                try:
                    sent = tier.upload_node(blobs, ns, h, rec, layout, head=h in known)
                except (CorruptBlob, OSError) as e:
                    report["problems"].append(f"node {h.hex()}: {e}")
                    return "skipped"
                return "uploaded" if sent else "present"

            for outcome in tier._io.map(one, recs):
                report[outcome] += 1
                if progress is not None:
                    progress(1)
    finally:
        index.close()
    report["bytes_up"] = tier.stats()["bytes_up"]
    return report


def _new_node(h: bytes, rec: NodeRecord, raw: Dict[str, bytes]):
    """A node for ``KVStore._write_nodes`` whose files are the downloaded bytes."""
    from .store import _NewNode

    return _NewNode(h, rec.parent, rec.start, rec.tokens, None, raw=raw)


_SESSIONS_LOCK = threading.Lock()
_LOADER = []  # botocore's data loader, shared: a new session re-reads ~130 ms of JSON


def _new_client(endpoint_url: Optional[str], **config):
    """A new S3 client (a new session: credentials and endpoint as the environment says
    now), sharing botocore's parsed service descriptions with earlier clients."""
    boto3, Config = _import_boto3()
    import botocore.session

    with _SESSIONS_LOCK:  # botocore sessions are not thread-safe
        session = botocore.session.get_session()
        if _LOADER:
            session.register_component("data_loader", _LOADER[0])
        else:
            _LOADER.append(session.get_component("data_loader"))
        return boto3.session.Session(botocore_session=session).client(
            "s3", endpoint_url=endpoint_url, config=Config(**config)
        )


def _import_boto3():
    try:
        import boto3
        from botocore.config import Config
    except ImportError:
        raise ImportError(
            "the remote tier (--remote / KVStore(remote=...)) needs boto3: "
            "pip install 'kvstore[remote]' (or pip install boto3)"
        ) from None
    return boto3, Config
