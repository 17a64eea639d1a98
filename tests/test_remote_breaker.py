"""The remote tier's circuit breaker (``S3Client``), without a server: the failures of
one operation's parallel requests count once; consecutive failures open the breaker."""

import threading

import pytest

pytest.importorskip("boto3")

from kvstore.remote.client import (  # noqa: E402
    ContextPool,
    Counters,
    S3Client,
    operation,
)
from kvstore.remote.errors import RemoteError, RemoteUnavailable  # noqa: E402


def client():
    c = S3Client(
        "s3://bucket/prefix",
        endpoint_url="http://127.0.0.1:9",
        connect_timeout=1,
        read_timeout=1,
        max_attempts=1,
        failures_to_open=3,
        open_seconds=60.0,
        max_connections=8,
        counters=Counters(),
    )
    c._client = object()  # requests below never reach it
    return c


def refused(_s3):
    raise ConnectionRefusedError("connection refused")


def fail(c, times):
    for _ in range(times):
        with pytest.raises(RemoteError):
            c._request("GET", "k", refused)


def errors(c):
    return c.counters.get(["remote_errors"])["remote_errors"]


def parallel_failures(c, n):
    """One operation: ``n`` GETs in a pool, all in flight before any fails."""
    barrier = threading.Barrier(n)

    def call(s3):
        barrier.wait(5)
        refused(s3)

    def get(i):
        with pytest.raises(RemoteError):
            c._request("GET", f"k{i}", call)

    with ContextPool(n) as pool, operation():
        for job in [pool.submit(get, i) for i in range(n)]:
            job.result()


def test_parallel_failures_of_one_operation_count_once():
    c = client()
    parallel_failures(c, 8)
    assert errors(c) == 8  # every failure is counted as an error
    assert not c.circuit_open()  # but one in the streak
    parallel_failures(c, 8)  # a second operation: two
    assert not c.circuit_open()
    fail(c, 1)  # a request of no operation: three, the breaker opens
    assert c.circuit_open() and errors(c) == 17
    with pytest.raises(RemoteUnavailable):
        c._request("GET", "k", lambda s3: b"never called")


def test_requests_outside_an_operation_count_each():
    c = client()
    fail(c, 2)
    assert c._request("GET", "k", lambda s3: b"ok") == b"ok"  # ends the streak
    fail(c, 2)
    assert not c.circuit_open()
    fail(c, 1)
    assert c.circuit_open()


def test_an_operation_counts_again_after_a_success():
    c = client()
    with operation():
        fail(c, 3)
        assert not c.circuit_open()
        assert c._request("GET", "k", lambda s3: b"ok") == b"ok"
        fail(c, 1)
    fail(c, 2)
    assert c.circuit_open()
