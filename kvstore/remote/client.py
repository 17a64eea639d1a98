"""The S3 access layer: one bucket and prefix, requests behind a circuit breaker.

Knows nothing of KVStore: keys, bounded GETs, PUT, HEAD, LIST, and the breaker that
skips a remote after repeated failures. boto3 is an optional dependency, imported on
first use.
"""

import contextvars
import itertools
import logging
import re
import threading
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

from .errors import NotFound, RemoteCorrupt, RemoteError, RemoteUnavailable

log = logging.getLogger("kvstore")

_BUCKET = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{1,61}[A-Za-z0-9]")
_NOT_FOUND = {"NoSuchKey", "404", "NotFound"}  # "404": HEAD, which has no body
LIST_PAGE = 1000
LIST_MAX_KEYS = 1_000_000  # a namespace's nodes: ~170 MB of key strings at most
LIST_TIMEOUT = 600.0  # seconds one listing may take, all pages together


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


# The remote operation (one fetch's lookup) a request belongs to; None: its own.
_OPERATION: "contextvars.ContextVar[Optional[object]]" = contextvars.ContextVar(
    "kvstore_remote_operation", default=None
)


@contextmanager
def operation():
    """Requests made inside (and in :class:`ContextPool` tasks submitted from inside)
    are one operation: the breaker counts at most one failure of it per streak."""
    token = _OPERATION.set(object())
    try:
        yield
    finally:
        _OPERATION.reset(token)


class ContextPool(ThreadPoolExecutor):
    """A thread pool whose tasks run in the submitter's context (its operation)."""

    def submit(self, fn, /, *args, **kwargs):
        return super().submit(contextvars.copy_context().run, fn, *args, **kwargs)


class Counters:
    """A tier's counters and its last error, shared by its client and its parts."""

    def __init__(self):
        self._lock = threading.Lock()
        self._counts: Dict[str, int] = defaultdict(int)
        self.last_error: Optional[str] = None

    def add(self, **deltas: int) -> None:
        with self._lock:
            for k, v in deltas.items():
                self._counts[k] += v

    def error(self, name: str, reason: str) -> None:
        """Count one ``name`` and remember ``reason`` as the last error."""
        with self._lock:
            self._counts[name] += 1
            self.last_error = reason

    def get(self, names: Iterable[str]) -> Dict[str, int]:
        with self._lock:
            return {name: self._counts[name] for name in names}


class S3Client:
    """Requests to ``s3://bucket/prefix``; failures feed a circuit breaker.

    Args:
        url: ``s3://bucket/prefix``.
        endpoint_url: The S3 endpoint; None: boto3's default.
        connect_timeout, read_timeout, max_attempts: Per request (botocore's standard
            retry mode).
        failures_to_open: Consecutive failed requests that open the breaker; those of
            one :func:`operation` count once (a fetch's parallel GETs that meet one
            outage do not open it alone).
        open_seconds: How long an open breaker skips the remote.
        max_connections: The connection pool's size.
        counters: Where requests count errors, skips and bytes.
        list_max_keys, list_timeout: Bounds of one listing (:meth:`list_keys`).
    """

    def __init__(
        self,
        url: str,
        *,
        endpoint_url: Optional[str],
        connect_timeout: float,
        read_timeout: float,
        max_attempts: int,
        failures_to_open: int,
        open_seconds: float,
        max_connections: int,
        counters: Counters,
        list_max_keys: int = LIST_MAX_KEYS,
        list_timeout: float = LIST_TIMEOUT,
    ):
        self.bucket, self.prefix = parse_url(url)
        self.url = url
        _import_boto3()  # a clear error now rather than at the first request
        self._config = dict(
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
            retries={"mode": "standard", "max_attempts": max_attempts},
            max_pool_connections=max_connections,
        )
        self.endpoint_url = endpoint_url
        self.failures_to_open, self.open_seconds = failures_to_open, open_seconds
        self.counters = counters
        self.list_max_keys, self.list_timeout = list_max_keys, list_timeout
        self._client = None
        self._client_lock = threading.Lock()
        self._lock = threading.Lock()
        self._failures = 0
        self._counted_ops: set = set()  # operations in the current streak
        self._open_until = 0.0

    # -- keys ------------------------------------------------------------------------

    def key(self, ns: bytes, *parts: str) -> str:
        return "/".join(([self.prefix] if self.prefix else []) + [ns.hex(), *parts])

    def manifest_key(self, ns: bytes, parent: bytes, h: bytes) -> str:
        return self.key(ns, "nodes", parent.hex(), h.hex() + ".json")

    def blob_key(self, ns: bytes, h: bytes, checksum: int, part: str) -> str:
        return self.key(ns, "blobs", f"{h.hex()}.{checksum:016x}{part}.safetensors")

    # -- requests, with the circuit breaker --------------------------------------------

    def circuit_open(self) -> bool:
        """Whether the breaker currently skips the remote."""
        return time.monotonic() < self._open_until

    def _boto(self):
        with self._client_lock:
            if self._client is None:
                try:
                    self._client = _new_client(self.endpoint_url, **self._config)
                except Exception as e:  # e.g. a malformed AWS_ENDPOINT_URL
                    self._failed(f"cannot make an S3 client: {type(e).__name__}: {e}")
                    raise RemoteError(str(e)) from None
            return self._client

    def _request(self, op: str, key: str, call: Callable[[Any], Any]):
        """Run ``call(client)``; failures feed the breaker and become RemoteError."""
        if self.circuit_open():
            self.counters.add(remote_skipped=1)
            raise RemoteUnavailable(
                f"skipped after repeated failures (last: {self.counters.last_error})"
            )
        from botocore.exceptions import BotoCoreError, ClientError
        from urllib3.exceptions import HTTPError

        try:
            out = call(self._boto())
        except ClientError as e:
            err = e.response.get("Error", {})
            code = str(err.get("Code", ""))
            if code in _NOT_FOUND:
                # A HEAD's bare 404 may be a missing bucket: it does not end a streak.
                if code == "NoSuchKey":
                    self._succeeded()
                raise NotFound(key) from None
            reason = f"{op} {key}: {_describe(code, err.get('Message'))}"
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
            self._counted_ops.clear()

    def _failed(self, reason: str) -> None:
        self.counters.error("remote_errors", reason)
        op = _OPERATION.get()
        with self._lock:
            if op is not None:
                if op in self._counted_ops:
                    return  # this operation's failure is already in the streak
                if len(self._counted_ops) >= self.failures_to_open:
                    self._counted_ops.clear()  # bounded: the streak opened already
                self._counted_ops.add(op)
            self._failures += 1
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

    def get(self, key: str, *, limit: int, exact: Optional[int] = None) -> bytes:
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
        self.counters.add(bytes_down=len(data))
        return data

    def put(self, key: str, data: bytes, metadata: Optional[dict] = None) -> None:
        self._request(
            "PUT",
            key,
            lambda s3: s3.put_object(
                Bucket=self.bucket, Key=key, Body=data, Metadata=metadata or {}
            ),
        )
        self.counters.add(bytes_up=len(data))

    def head(self, key: str) -> Optional[dict]:
        """The object's user metadata, None when it does not exist."""
        try:
            out = self._request(
                "HEAD", key, lambda s3: s3.head_object(Bucket=self.bucket, Key=key)
            )
        except NotFound:
            return None
        return out.get("Metadata") or {}

    def list_keys(self, prefix: str, *, max_keys: Optional[int] = None) -> List[str]:
        """Keys under ``prefix``: every page, or the first ``max_keys``.

        Bounded whatever the server answers (a server may say ``IsTruncated`` with a
        new token forever): at most ``list_max_keys`` keys (or ``max_keys``), two
        pages per :data:`LIST_PAGE` of them, ``list_timeout`` seconds, and no
        continuation token twice.

        Raises:
            RemoteError: a listing of every page that goes past a bound (the
                remote cannot be used). With ``max_keys``, the keys listed by then
                are returned.
        """
        limit = self.list_max_keys if max_keys is None else max_keys
        max_pages = 2 * (limit // LIST_PAGE + 1)
        deadline = time.monotonic() + self.list_timeout
        keys: List[str] = []
        token, seen = None, set()
        for pages in itertools.count(1):
            kwargs = {"Bucket": self.bucket, "Prefix": prefix, "MaxKeys": LIST_PAGE}
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
            if token in seen:
                problem = "repeats a continuation token"
            elif len(keys) >= limit:
                problem = f"goes on past {limit} keys"
            elif pages >= max_pages:
                problem = f"goes on past {max_pages} pages ({len(keys)} keys)"
            elif time.monotonic() > deadline:
                problem = f"goes on past {self.list_timeout:g} seconds"
            else:
                seen.add(token)
                continue
            if max_keys is not None:
                log.warning("kvstore: the remote's listing of %s %s", prefix, problem)
                return keys
            raise RemoteError(
                f"the listing of {prefix} {problem}: the server's answer never ends"
            )
        raise AssertionError("unreachable")


# What an error means, where the answer does not say (Ceph's gateway often sends no
# message; a HEAD's error has no body, only its HTTP status).
_HINTS = {
    "400": "bad request",
    "403": "access denied (wrong or revoked credentials, or no permission)",
    "500": "the server failed",
    "503": "the server is unavailable or slowing requests down",
    "InvalidAccessKeyId": "the store knows no such access key (wrong or revoked)",
    "SignatureDoesNotMatch": "the secret key does not match the access key",
    "AccessDenied": "no permission for this request",
}


def _describe(code: str, message: Optional[str]) -> str:
    """``CODE: message`` of an S3 error answer."""
    if code.isdigit():  # botocore's message is the status's reason phrase
        code, message = f"HTTP {code} {message or ''}".rstrip(), _HINTS.get(code)
    message = message or _HINTS.get(code)
    return f"{code}: {message}" if message else code


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
