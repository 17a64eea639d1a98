"""The shared remote tier against real S3 servers on 127.0.0.1: moto's, and Ceph's
RADOS Gateway over a one-machine cluster (``tools/ceph_cluster.py``; those tests skip,
saying why, where Ceph is not installed). Every test that talks to a server runs
against both.

Two store directories stand for two machines sharing one bucket. Faults: the server
stopped mid-run, slow responses (a delaying TCP proxy), corrupted or hostile objects,
a missing bucket and missing credentials. The local path must keep working, ``fetch``
never raises, and every problem is logged and counted.
"""

import json
import logging
import os
import pickle
import socket
import sys
import threading
import time
import uuid

import boto3  # the "test" extra installs boto3 and moto[server]: no skipping
import botocore.exceptions
import mlx.core as mx
import moto.server as moto_server
import numpy as np
import pytest
from conftest import (
    assert_same_as_cold,
    compute_cache,
    next_logits,
    random_tokens,
    run_cli,
)

from kvstore import KVStore, maintenance, server
from kvstore.disk.blobs import node_metadata, serialize_node
from kvstore.disk.chunking import chain_hash
from kvstore.remote import RemoteTier, decode_manifest, encode_manifest, parse_url

C = 64  # chunk tokens
SYSTEM = random_tokens(150, seed=21)  # nodes [0,64) [64,128) [128,150)
USER = random_tokens(40, seed=22)
OTHER = random_tokens(40, seed=23)
PROMPT = SYSTEM + USER


# -- the S3 server and a delaying proxy ---------------------------------------------------


def start_moto():
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    srv = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    srv.start()
    host, port = srv.get_host_and_port()
    return srv, f"http://{host}:{port}"


def stop_moto(srv):
    srv.stop()
    srv._server.server_close()  # refuse connections from now on


class Backend:
    """An S3 server the module's tests run against: ``name``, ``endpoint`` and the
    credentials of its test user."""

    def __init__(self, name, endpoint, key="testing", secret="testing", cluster=None):
        self.name, self.endpoint = name, endpoint
        self.key, self.secret = key, secret
        self.cluster = cluster  # the CephCluster, for the gateway's


@pytest.fixture(
    scope="module", params=["moto", pytest.param("ceph", marks=pytest.mark.stress)]
)
def backend(request):
    """Each test of the module runs against moto and against Ceph's S3 gateway (a
    real RADOS cluster on this machine; skipped, saying why, without Ceph), with the
    environment pointing at it."""
    if request.param == "moto":
        srv, endpoint = start_moto()
        server = Backend("moto", endpoint)
    else:
        cluster = request.getfixturevalue("ceph")
        srv, server = None, Backend(
            "ceph", cluster.endpoint, cluster.access_key, cluster.secret_key, cluster
        )
    env = pytest.MonkeyPatch()
    aws_env(env, server)
    yield server
    env.undo()
    if srv is not None:
        stop_moto(srv)


def aws_env(monkeypatch, server):
    """``server``'s endpoint and credentials; nothing from the user's AWS configuration."""
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", server.endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", server.key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", server.secret)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent/aws-config")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent/aws-credentials")
    # boto3's default session keeps the credentials it first read: a new one.
    monkeypatch.setattr(boto3, "DEFAULT_SESSION", None)


@pytest.fixture
def s3(backend):
    """A boto3 client of the module's server."""
    return boto3.client("s3")


@pytest.fixture
def url(s3):
    """A fresh bucket per test: ``s3://<bucket>/fleet``."""
    bucket = f"kv-{uuid.uuid4().hex[:12]}"
    s3.create_bucket(Bucket=bucket)
    return f"s3://{bucket}/fleet"


@pytest.fixture(scope="module")
def golden(backend, model, tmp_path_factory):
    """Machine A's store and upload of SYSTEM, made once: ``(url, A's store path)``."""
    boto3.client("s3").create_bucket(Bucket="kv-golden")
    url = "s3://kv-golden/fleet"
    path = tmp_path_factory.mktemp("machine-a") / "a"
    assert machine_a(path, model, url)["uploads"] == 3
    return url, path


@pytest.fixture
def shared(url, s3, golden):
    """``url``'s bucket holding a copy of machine A's upload of SYSTEM."""
    src = bucket_of(golden[0])
    for key in keys(s3, golden[0]):
        s3.copy_object(
            Bucket=bucket_of(url), Key=key, CopySource={"Bucket": src, "Key": key}
        )
    return url


def fast(url, **kw):
    """A RemoteTier with short timeouts, as a test wants them."""
    options = dict(
        connect_timeout=1.0,
        read_timeout=2.0,
        max_attempts=1,
        lookup_timeout=5.0,
        upload_attempts=1,
        close_timeout=10.0,
    )
    options.update(kw)
    return RemoteTier(url, **options)


class DelayProxy:
    """A TCP proxy to ``upstream`` that holds every chunk of each answer ``delay`` s."""

    def __init__(self, upstream: str, delay: float):
        host, port = upstream.rsplit("//", 1)[1].split(":")
        self.upstream = (host, int(port))
        self.delay = delay
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.endpoint = "http://127.0.0.1:%d" % self.sock.getsockname()[1]
        self.closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while not self.closed:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            up = socket.create_connection(self.upstream)
            threading.Thread(
                target=self._pump, args=(client, up, 0), daemon=True
            ).start()
            threading.Thread(
                target=self._pump, args=(up, client, self.delay), daemon=True
            ).start()

    @staticmethod
    def _pump(src, dst, delay):
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                time.sleep(delay)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self):
        self.closed = True
        self.sock.close()


# -- helpers -----------------------------------------------------------------------------


def bucket_of(url):
    return parse_url(url)[0]


def keys(s3, url):
    return sorted(
        o["Key"] for o in s3.list_objects_v2(Bucket=bucket_of(url)).get("Contents", [])
    )


def node_hashes(store, tokens, spans):
    out, parent = [], store.root
    for s, e in spans:
        parent = chain_hash(parent, np.array(tokens[s:e], dtype=np.int32))
        out.append(parent)
    return out


def machine_a(path, model, url, prompts=(SYSTEM,)):
    """Machine A: computes ``prompts`` (kind system) and uploads them."""
    with KVStore(path, model, chunk_tokens=C, remote=fast(url)) as a:
        for p in prompts:
            a.prefill(p, kind="system")
        a.flush()
        assert a.remote.wait_uploads(20)
        stats = a.stats()
        assert stats["upload_errors"] == 0 and stats["remote_errors"] == 0
        return stats


def assert_clean(path):
    report = maintenance.verify(path)
    assert report["clean"], report["problems"]


# -- the store: what kvstore needs of it, and where moto and Ceph differ ----------------------


def test_what_kvstore_needs_from_the_store(s3, url, backend):
    """The S3 calls and semantics the remote tier relies on (docs/remote.md), checked
    on each server, and the differences between them found so far."""
    bucket = bucket_of(url)
    other = boto3.client(
        "s3", aws_access_key_id=backend.key, aws_secret_access_key="wrong"
    )
    s3.put_object(Bucket=bucket, Key="p/a", Body=b"one", Metadata={"state": "1"})
    # Read after write, overwrite and delete, at once; user metadata on HEAD.
    assert s3.get_object(Bucket=bucket, Key="p/a")["Body"].read() == b"one"
    assert s3.head_object(Bucket=bucket, Key="p/a")["Metadata"] == {"state": "1"}
    s3.put_object(Bucket=bucket, Key="p/a", Body=b"two")
    assert s3.get_object(Bucket=bucket, Key="p/a")["Body"].read() == b"two"
    s3.put_object(Bucket=bucket, Key="p/empty", Body=b"")
    assert s3.get_object(Bucket=bucket, Key="p/empty")["ContentLength"] == 0
    s3.delete_object(Bucket=bucket, Key="p/empty")
    for call in (s3.get_object, s3.head_object):
        with pytest.raises(botocore.exceptions.ClientError) as e:
            call(Bucket=bucket, Key="p/empty")
        assert e.value.response["Error"]["Code"] in ("NoSuchKey", "404")
    # Listings: a prefix, pages with continuation tokens, new keys listed at once.
    for i in range(5):
        s3.put_object(Bucket=bucket, Key=f"p/n/{i}", Body=b"")
    page = s3.list_objects_v2(Bucket=bucket, Prefix="p/n/", MaxKeys=2)
    assert page["IsTruncated"] and page["KeyCount"] == 2
    page = s3.list_objects_v2(
        Bucket=bucket, Prefix="p/n/", ContinuationToken=page["NextContinuationToken"]
    )
    assert [o["Key"] for o in page["Contents"]] == ["p/n/2", "p/n/3", "p/n/4"]
    with pytest.raises(botocore.exceptions.ClientError, match="NoSuchBucket"):
        s3.list_objects_v2(Bucket="kv-no-such-bucket", Prefix="p/")

    # Differences. botocore sends a CRC32 with each PUT: moto keeps and returns it (and
    # botocore checks it on GET); Ceph 16 does neither. kvstore checks its own xxh3.
    head = s3.head_object(Bucket=bucket, Key="p/a", ChecksumMode="ENABLED")
    assert ("ChecksumCRC32" in head) == (backend.name == "moto")
    # Ceph caps a page at 1,000 keys whatever MaxKeys asks (kvstore asks 1,000).
    page = s3.list_objects_v2(Bucket=bucket, Prefix="p/n/", MaxKeys=5000)
    assert page["MaxKeys"] == (5000 if backend.name == "moto" else 1000)
    # moto accepts any credentials; the gateway checks them.
    if backend.name == "moto":
        assert other.get_object(Bucket=bucket, Key="p/a")["Body"].read() == b"two"
    else:
        with pytest.raises(botocore.exceptions.ClientError, match="SignatureDoesNot"):
            other.get_object(Bucket=bucket, Key="p/a")


# -- two machines --------------------------------------------------------------------------


def test_two_machines_share_a_system_prompt(tmp_path, model, shared, golden, s3):
    url = shared
    with KVStore(golden[1], model, chunk_tokens=C) as a:
        ns = a.namespace.hex()
    assert f"fleet/{ns}/namespace.json" in keys(s3, url)

    with KVStore(tmp_path / "b", model, chunk_tokens=C, remote=fast(url)) as b:
        assert b.stats()["nodes"] == 0
        assert_same_as_cold(model, b, PROMPT, len(SYSTEM))
        stats = b.stats()
        assert stats["remote_hits"] == 1 and stats["remote_nodes_down"] == 3
        assert stats["nodes"] == 3 and stats["remote_corrupt"] == 0
        # The KV B restores is A's, bit for bit.
        with KVStore(golden[1], model, chunk_tokens=C) as a:
            ref, n = a.fetch(PROMPT)
        got, m = b.fetch(PROMPT)
        assert n == m == len(SYSTEM)
        for x, y in zip(got, ref):
            assert mx.array_equal(x.keys[:, :, :n], y.keys[:, :, :n]).item()
            assert mx.array_equal(x.values[:, :, :n], y.values[:, :, :n]).item()
        # Now local: another fetch asks the remote nothing it already answered.
        down = b.stats()["bytes_down"]
        b.fetch(PROMPT)
        assert b.stats()["bytes_down"] == down
        # What B downloaded is not sent back.
        b.flush()
        assert b.remote.wait_uploads(10)
        assert b.stats()["uploads"] == 0
    assert_clean(tmp_path / "b")
    # The downloaded nodes are ordinary local nodes: no remote needed any more.
    with KVStore(tmp_path / "b", model, chunk_tokens=C) as b:
        assert b.fetch(PROMPT)[1] == len(SYSTEM)
    # A prefill on a third machine computes only the token a restore always leaves.
    with KVStore(tmp_path / "c", model, chunk_tokens=C, remote=fast(url)) as c:
        assert c.prefill(SYSTEM, kind="system")["computed"] == 1


def test_machine_b_uploads_what_it_computes(tmp_path, model, shared):
    url = shared
    with KVStore(tmp_path / "b", model, chunk_tokens=C, remote=fast(url)) as b:
        result = b.prefill(PROMPT, kind="user")
        assert result == {"tokens": 190, "computed": 40, "reused": 150}
        b.flush()
        assert b.remote.wait_uploads(10)
        assert b.stats()["uploads"] == 1  # the new tail only
    # A third machine gets the whole conversation.
    with KVStore(tmp_path / "c", model, chunk_tokens=C, remote=fast(url)) as c:
        assert_same_as_cold(model, c, PROMPT + OTHER, len(PROMPT))


def test_a_prefix_inside_a_remote_node_is_sliced(tmp_path, model, url):
    """A saved SYSTEM + USER as one prompt (no boundary); B diverges inside the tail."""
    with KVStore(tmp_path / "a", model, chunk_tokens=C, remote=fast(url)) as a:
        a.save(PROMPT, compute_cache(model, PROMPT))
        a.flush()
        assert a.remote.wait_uploads(10)
    with KVStore(tmp_path / "b", model, chunk_tokens=C, remote=fast(url)) as b:
        assert_same_as_cold(model, b, SYSTEM + OTHER, len(SYSTEM))
        assert b.stats()["remote_nodes_down"] == 3


@pytest.mark.parametrize("family", ["gemma3", "llama-q4"])
def test_checkpoints_and_quantized_kv_travel_too(tmp_path, url, family):
    """Gemma 3's sliding-window checkpoints (state files) and 4-bit quantized KV are
    uploaded, downloaded and validated like plain node files."""
    from conftest import tiny_llama
    from families import build

    if family == "gemma3":
        model, options = build("gemma3_text"), {}
    else:
        model, options = tiny_llama(0, hidden=128), {"kv_bits": 4, "kv_group_size": 32}
    with KVStore(
        tmp_path / "a", model, chunk_tokens=C, remote=fast(url), **options
    ) as a:
        a.prefill(PROMPT, boundaries=[len(SYSTEM)])
        a.flush()
        assert a.remote.wait_uploads(10)
    with KVStore(
        tmp_path / "b", model, chunk_tokens=C, remote=fast(url), **options
    ) as b:
        cache, n = b.fetch(PROMPT + OTHER)
        assert n == len(PROMPT) and b.stats()["remote_nodes_down"] == 4
        warm = next_logits(model, cache, OTHER)
        # The same restore from A's own disk: B's KV is A's.
        with KVStore(tmp_path / "a", model, chunk_tokens=C, **options) as a:
            ref = next_logits(model, a.fetch(PROMPT + OTHER)[0], OTHER)
        assert mx.array_equal(warm, ref).item()
        if family == "gemma3":  # quantized KV is not the cold run's, by design
            cold = next_logits(model, b.new_cache(), PROMPT + OTHER)
            assert mx.allclose(warm, cold, atol=1e-4, rtol=1e-3).item()
        assert b.stats()["remote_corrupt"] == 0
    assert_clean(tmp_path / "b")


def test_concurrent_fetches_download_once_and_stay_consistent(tmp_path, model, shared):
    with KVStore(tmp_path / "b", model, chunk_tokens=C, remote=fast(shared)) as b:
        results, errors = [], []

        def worker(seed):
            try:
                results.append(b.fetch(SYSTEM + random_tokens(40, seed))[1])
            except BaseException as e:  # a fetch must never raise
                errors.append(e)

        threads = [threading.Thread(target=worker, args=(50 + i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors
        # Each fetch got the remote's nodes, or skipped it while two lookups ran.
        assert set(results) <= {0, len(SYSTEM)} and len(SYSTEM) in results
        b.flush()
        assert b.stats()["nodes"] == 3 and b.stats()["uploads"] == 0
        assert b.fetch(PROMPT)[1] == len(SYSTEM)
    assert_clean(tmp_path / "b")


# -- broken and hostile objects -------------------------------------------------------------


def _second_node(store, url):
    """Keys of the node [64, 128) of SYSTEM: (manifest key, blob key, manifest)."""
    h0, h1, _ = node_hashes(store, SYSTEM, [(0, 64), (64, 128), (128, 150)])
    base = f"{parse_url(url)[1]}/{store.namespace.hex()}"
    mkey = f"{base}/nodes/{h0.hex()}/{h1.hex()}.json"
    return mkey, base, h1


def _rewrite(s3, url, key, fn):
    bucket = bucket_of(url)
    data = s3.get_object(Bucket=bucket, Key=key)["Body"].read()
    s3.put_object(Bucket=bucket, Key=key, Body=fn(data))


def _edit_manifest(**changes):
    def fn(data):
        obj = json.loads(data)
        for k, v in changes.items():
            if v is KeyError:
                del obj[k]
            else:
                obj[k] = v(obj[k]) if callable(v) else v
        return json.dumps(obj).encode()

    return fn


def _flip(data):
    mid = len(data) // 2
    return data[:mid] + bytes([data[mid] ^ 0x40]) + data[mid + 1 :]


def _forged_blob(s3, url, mkey, store, *, shape=None, ns=None):
    """Upload a well-formed safetensors file (wrong shape or namespace) and point the
    manifest at it with a matching size and checksum: the remote tries to pick."""
    import xxhash

    bucket = bucket_of(url)
    manifest = json.loads(s3.get_object(Bucket=bucket, Key=mkey)["Body"].read())
    expected = store.layout.delta_tensors(64)
    tensors = {}
    for name, (dtype, want) in expected.items():
        real = shape or want
        tensors[name] = (dtype, real, np.zeros(real, dtype=np.float32))
    data = serialize_node(tensors, node_metadata(ns or store.namespace))
    digest = xxhash.xxh3_64_intdigest(data)
    base = mkey.split("/nodes/")[0]
    s3.put_object(
        Bucket=bucket,
        Key=f"{base}/blobs/{manifest['hash']}.{digest:016x}.safetensors",
        Body=data,
    )
    manifest["file"] = {"nbytes": len(data), "xxh3": f"{digest:016x}"}
    s3.put_object(Bucket=bucket, Key=mkey, Body=json.dumps(manifest).encode())


def _blob_key(s3, url, mkey):
    manifest = json.loads(s3.get_object(Bucket=bucket_of(url), Key=mkey)["Body"].read())
    base = mkey.split("/nodes/")[0]
    return f"{base}/blobs/{manifest['hash']}.{manifest['file']['xxh3']}.safetensors"


DAMAGE = {
    "blob-truncated": ("blob", lambda d: d[: len(d) // 2]),
    "blob-flipped-byte": ("blob", _flip),
    "blob-empty": ("blob", lambda d: b""),
    "blob-deleted": ("blob", None),
    "blob-wrong-shape": ("forge", {"shape": (1, 2, 64, 8)}),
    "blob-other-namespace": ("forge", {"ns": b"\x01" * 16}),
    "manifest-not-json": ("manifest", lambda d: b"{not json"),
    "manifest-pickle": ("manifest", lambda d: pickle.dumps({"tokens": [1, 2]})),
    "manifest-huge": ("manifest", lambda d: d + b" " * (1 << 20)),
    "manifest-extra-field": ("manifest", _edit_manifest(cls="KVCache")),
    "manifest-missing-field": ("manifest", _edit_manifest(kind=KeyError)),
    "manifest-token-changed": (
        "manifest",
        _edit_manifest(tokens=lambda t: t[:-1] + [(t[-1] + 1) % 512]),
    ),
    "manifest-tokens-as-strings": (
        "manifest",
        _edit_manifest(tokens=lambda t: [str(x) for x in t]),
    ),
    "manifest-tokens-bool": ("manifest", _edit_manifest(tokens=lambda t: [True] * 64)),
    "manifest-tokens-float": (
        "manifest",
        _edit_manifest(tokens=lambda t: [float(x) for x in t]),
    ),
    "manifest-hash-claims-other": ("manifest", _edit_manifest(hash="ab" * 16)),
    "manifest-start-wrong": ("manifest", _edit_manifest(start=0)),
    "manifest-parent-wrong": ("manifest", _edit_manifest(parent="cd" * 16)),
    "manifest-size-huge": (
        "manifest",
        _edit_manifest(file=lambda f: {**f, "nbytes": 1 << 40}),
    ),
    "manifest-size-bool": (
        "manifest",
        _edit_manifest(file=lambda f: {**f, "nbytes": True}),
    ),
    "manifest-state-for-delta-layout": (
        "manifest",
        _edit_manifest(state=lambda s: {"nbytes": 100, "xxh3": "0" * 16}),
    ),
    "manifest-kind-unknown": ("manifest", _edit_manifest(kind="root")),
    "manifest-nan": ("manifest", lambda d: d.replace(b'"start":64', b'"start":NaN')),
    "manifest-duplicate-key": (
        "manifest",
        lambda d: d[:-1] + b',"start":64}',
    ),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_broken_remote_object_is_a_miss_and_a_report(
    tmp_path, model, shared, s3, caplog, damage
):
    url = shared
    what, how = DAMAGE[damage]
    with KVStore(tmp_path / "b", model, chunk_tokens=C, remote=fast(url)) as b:
        mkey, _, h1 = _second_node(b, url)
        if what == "blob" and how is None:
            s3.delete_object(Bucket=bucket_of(url), Key=_blob_key(s3, url, mkey))
        elif what == "blob":
            _rewrite(s3, url, _blob_key(s3, url, mkey), how)
        elif what == "manifest":
            _rewrite(s3, url, mkey, how)
        else:
            _forged_blob(s3, url, mkey, b, **how)
        before = keys(s3, url)
        with caplog.at_level(logging.WARNING, logger="kvstore"):
            assert_same_as_cold(model, b, PROMPT, 64)  # the node before it only
        stats = b.stats()
        assert stats["remote_corrupt"] == 1, stats["remote_last_error"]
        assert stats["nodes"] == 1 and stats["errors"] == 0
        assert "remote object" in caplog.text
        assert not os.path.exists(b.blobs.path(b.namespace, h1))
        # Remembered for a while: not downloaded again on every fetch.
        down = stats["bytes_down"]
        b.fetch(PROMPT)
        assert b.stats()["bytes_down"] == down
    assert keys(s3, url) == before  # a reader never deletes or rewrites objects
    assert_clean(tmp_path / "b")
    assert not [p for p in (tmp_path / "b").rglob("*.tmp")]


@pytest.mark.parametrize(
    "damage", ["manifest-start-wrong", "manifest-not-json", "manifest-parent-wrong"]
)
def test_pull_reports_a_broken_manifest_and_skips_what_is_below(
    tmp_path, model, shared, s3, damage
):
    """SYSTEM's three nodes on the remote, the second's manifest broken: a pull
    takes the first, reports the second, and does not reach the third."""
    url = shared
    with KVStore(tmp_path / "b", model, chunk_tokens=C, remote=fast(url)) as b:
        mkey, _, h1 = _second_node(b, url)
        _rewrite(s3, url, mkey, DAMAGE[damage][1])
        report = b.remote.pull()
        assert report["remote_nodes"] == 3 and report["pulled"] == 1
        assert report["invalid"] == 1 and report["unreachable"] == 1
        assert h1.hex() in report["problems"][0]
        assert b.stats()["nodes"] == 1 and b.index.get_node(b.namespace, h1) is None
    assert_clean(tmp_path / "b")


@pytest.mark.parametrize("stray", ["f" * 32, "0" * 32])
def test_a_stray_manifest_copy_hides_nothing_from_a_pull(
    tmp_path, model, shared, s3, stray
):
    """SYSTEM's second node's manifest copied under a made-up parent: if the
    listing's last key won, the pull would keep the made-up parent and never reach
    the real node and what hangs below it. The node is reported as listed twice and
    pulled from under its real parent, whichever parent the listing gives first."""
    url = shared
    with KVStore(tmp_path / "b", model, chunk_tokens=C, remote=fast(url)) as b:
        mkey, base, h1 = _second_node(b, url)
        bucket = bucket_of(url)
        s3.copy_object(
            Bucket=bucket,
            Key=f"{base}/nodes/{stray}/{h1.hex()}.json",
            CopySource={"Bucket": bucket, "Key": mkey},
        )
        report = b.remote.pull()
        assert report["remote_nodes"] == 3 and report["pulled"] == 3, report
        assert report["unreachable"] == 0 and report["invalid"] == 0, report
        assert len(report["problems"]) == 1, report["problems"]
        assert (
            h1.hex() in report["problems"][0] and "2 parents" in report["problems"][0]
        )
        assert b.stats()["nodes"] == 3
        assert b.fetch(PROMPT)[1] == len(SYSTEM)
    assert_clean(tmp_path / "b")


def test_manifest_decoder_is_strict(tmp_path, model):
    """Round trip, then a fuzz of single-byte changes: a record or RemoteCorrupt."""
    from kvstore.disk.index import NodeRecord
    from kvstore.remote import RemoteCorrupt

    ns, parent = b"\x05" * 16, b"\x06" * 16
    tokens = np.array(SYSTEM[:64], dtype=np.int32)
    h = chain_hash(parent, tokens)
    rec = NodeRecord(parent, 64, tokens, 1000, 12345, "system", True, 0.0, 500, 99)
    raw = encode_manifest(ns, h, rec)
    got = decode_manifest(raw, ns=ns, h=h, chunk_tokens=C, max_object_bytes=1 << 20)
    assert (got.parent, got.start, got.nbytes, got.checksum) == (
        parent,
        64,
        1000,
        12345,
    )
    assert (got.kind, got.pinned, got.state_nbytes, got.state_checksum) == (
        "system",
        False,  # pins are local policy
        500,
        99,
    )
    assert np.array_equal(got.tokens, tokens)
    rng = np.random.default_rng(0)
    outcomes = set()
    for _ in range(2000):
        bad = bytearray(raw)
        bad[rng.integers(len(bad))] = rng.integers(256)
        try:
            r = decode_manifest(
                bytes(bad), ns=ns, h=h, chunk_tokens=C, max_object_bytes=1 << 20
            )
            outcomes.add("ok")
            assert np.array_equal(r.tokens, tokens) and r.parent == parent
        except RemoteCorrupt:
            outcomes.add("corrupt")
    assert "corrupt" in outcomes
    with pytest.raises(RemoteCorrupt, match="another namespace"):
        decode_manifest(raw, ns=b"\x07" * 16, h=h, chunk_tokens=C, max_object_bytes=1)
    with pytest.raises(RemoteCorrupt, match="tokens"):
        decode_manifest(raw, ns=ns, h=h, chunk_tokens=32, max_object_bytes=1 << 20)


# -- a failing remote: the local path keeps working --------------------------------------------


def test_remote_stopped_mid_run(tmp_path, model, backend, monkeypatch):
    """moto: a server of this test's own, shut down; Ceph: radosgw killed (SIGKILL),
    restarted after the test."""
    if backend.name == "moto":
        srv, endpoint = start_moto()
        aws_env(monkeypatch, Backend("moto", endpoint))
        stop = lambda: stop_moto(srv)  # noqa: E731
    else:
        stop = lambda: backend.cluster.kill("rgw")  # noqa: E731
    bucket = f"kv-stopped-{uuid.uuid4().hex[:8]}"
    boto3.client("s3").create_bucket(Bucket=bucket)
    url = f"s3://{bucket}/fleet"
    try:
        machine_a(tmp_path / "a", model, url)
        tier = fast(url, open_seconds=60.0)
        with KVStore(tmp_path / "b", model, chunk_tokens=C, remote=tier) as b:
            assert b.fetch(PROMPT)[1] == len(SYSTEM)  # from the remote
            local = random_tokens(100, seed=31)
            b.save(local, compute_cache(model, local))
            b.flush()
            assert b.remote.wait_uploads(10)
            stop()
            stop = None

            # A prompt whose continuation B does not have: the remote is asked, fails.
            tic = time.perf_counter()
            assert_same_as_cold(model, b, local + OTHER, len(local))
            assert time.perf_counter() - tic < 15
            stats = b.stats()
            assert stats["remote_errors"] >= 1 and stats["errors"] == 0
            assert "Could not connect" in stats["remote_last_error"]
            # New prompts need new requests: they fail until the breaker opens, then
            # the dead remote is skipped without waiting.
            for seed in range(5):
                tic = time.perf_counter()
                prompt = local + random_tokens(100, 40 + seed)
                assert b.fetch(prompt)[1] == len(local)
            assert time.perf_counter() - tic < 0.5
            stats = b.stats()
            assert stats["remote_open"] and stats["remote_skipped"] >= 1
            assert stats["remote_errors"] == tier.failures_to_open
            # Saves do not wait for the remote either.
            more = random_tokens(130, seed=32)
            tic = time.perf_counter()
            b.save(more, compute_cache(model, more))
            b.flush()
            assert time.perf_counter() - tic < 5
            assert b.fetch(more + [1])[1] == len(more)
            tic = time.perf_counter()
        assert time.perf_counter() - tic < 5  # close does not wait for a dead remote
    finally:
        if backend.name == "ceph" and stop is None:
            backend.cluster.start_rgw()  # the module's next tests need it
        elif backend.name == "moto" and stop is not None:
            stop()
    assert_clean(tmp_path / "b")


def test_slow_remote_is_waited_for_at_most_lookup_timeout(
    tmp_path, model, shared, backend
):
    url = shared
    proxy = DelayProxy(backend.endpoint, delay=0.25)
    try:
        # Slower than the lookup budget but within the read timeout: the fetch goes on
        # without the remote, the download finishes in the background.
        tier = fast(
            url, endpoint_url=proxy.endpoint, read_timeout=10.0, lookup_timeout=0.1
        )
        with KVStore(tmp_path / "b", model, chunk_tokens=C, remote=tier) as b:
            tic = time.perf_counter()
            cache, n = b.fetch(PROMPT)
            assert time.perf_counter() - tic < 2.0
            assert n == 0 and b.stats()["remote_timeouts"] == 1
            deadline = time.time() + 30
            while b.stats()["nodes"] < 3 and time.time() < deadline:
                time.sleep(0.2)
            assert b.stats()["nodes"] == 3
            assert_same_as_cold(model, b, PROMPT, len(SYSTEM))
        # Slower than the read timeout: requests fail, the breaker opens.
        tier = fast(url, endpoint_url=proxy.endpoint, read_timeout=0.1)
        with KVStore(tmp_path / "c", model, chunk_tokens=C, remote=tier) as c:
            local = random_tokens(100, seed=33)
            tic = time.perf_counter()
            c.save(local, compute_cache(model, local))
            assert time.perf_counter() - tic < 0.5
            c.flush()
            tic = time.perf_counter()
            for seed in range(4):
                assert c.fetch(local + random_tokens(30, seed))[1] == len(local)
            assert time.perf_counter() - tic < 10
            stats = c.stats()
            assert stats["remote_errors"] >= 1 and stats["remote_skipped"] >= 1
            assert "timeout" in stats["remote_last_error"].lower()
    finally:
        proxy.close()


@pytest.mark.parametrize("fault", ["no-bucket", "no-credentials", "bad-endpoint"])
def test_misconfigured_remote_is_reported_not_raised(
    tmp_path, model, url, monkeypatch, caplog, fault
):
    if fault == "no-bucket":
        url = "s3://kv-no-such-bucket/fleet"
        expect = "NoSuchBucket"
    elif fault == "no-credentials":
        monkeypatch.delenv("AWS_ACCESS_KEY_ID")
        monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
        expect = "credentials"
    else:
        monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # discard port
        expect = "connect"
    with caplog.at_level(logging.WARNING, logger="kvstore"):
        with KVStore(tmp_path / "b", model, chunk_tokens=C, remote=fast(url)) as b:
            local = random_tokens(100, seed=34)
            b.save(local, compute_cache(model, local))
            b.flush()
            assert_same_as_cold(model, b, local + OTHER, len(local))
            b.remote.wait_uploads(5)
            stats = b.stats()
            assert stats["remote_errors"] >= 1 and stats["errors"] == 0
            assert stats["uploads"] == 0 and stats["writes_failed"] == 0
            assert expect.lower() in stats["remote_last_error"].lower()
    assert expect.lower() in caplog.text.lower()
    assert_clean(tmp_path / "b")


@pytest.mark.parametrize(
    "code, message, said",
    [
        (
            "NoSuchBucket",
            "The specified bucket does not exist",
            "NoSuchBucket: The spec",
        ),
        # Ceph's gateway answers without a message:
        ("InvalidAccessKeyId", None, "InvalidAccessKeyId: the store knows no such"),
        ("SignatureDoesNotMatch", "", "SignatureDoesNotMatch: the secret key does"),
        # A HEAD's error: no body, botocore gives the status and its reason phrase.
        ("403", "Forbidden", "HTTP 403 Forbidden: access denied (wrong or revoked"),
        ("418", "I'm a teapot", "HTTP 418 I'm a teapot"),
        ("SlowDown", None, "SlowDown"),
    ],
)
def test_error_answers_are_described(code, message, said):
    from kvstore.remote.client import _describe

    assert _describe(code, message).startswith(said)
    assert "None" not in _describe(code, message)


@pytest.mark.stress
def test_two_servers_share_a_system_prompt(tmp_path, tiny_model_dir, url):
    """``kvstore serve --remote`` as real processes on two stores: B answers with the
    system prompt A computed, restored through the remote."""
    from serving import Server, answer, chat_body

    def serve(name):
        store = str(tmp_path / name)
        kv = ["kvstore.server", "--model", tiny_model_dir, "--store", store]
        return Server(kv + ["--remote", url], tmp_path / f"{name}.log")

    a = serve("a")
    try:
        assert answer(a.chat(chat_body("w10 w11 w12 w13")))
        assert a.stats()["misses"] == 1
    finally:
        assert a.stop() == 0, a.output()  # uploads are drained at close
    b = serve("b")
    try:
        assert answer(b.chat(chat_body("w20 w21 w22")))
        stats = b.stats()
    finally:
        assert b.stop() == 0, b.output()
    # The restore came through the remote tier, and is counted as such.
    assert stats["remote_hits"] == 1 and stats["tokens_reused_remote"] >= 300
    assert stats["disk_hits"] == 0 and stats["tokens_reused_disk"] == 0
    store = stats["stores"][0]
    assert store["remote"] == url and store["remote_hits"] == 1
    assert store["remote_nodes_down"] >= 2 and store["remote_errors"] == 0


# -- push, pull and the command line --------------------------------------------------------


def test_push_pull_and_prefill_with_remote(tmp_path, tiny_model_dir, url, s3, capsys):
    from mlx_lm import load

    model, tokenizer = load(tiny_model_dir)
    prompts = [SYSTEM, PROMPT, random_tokens(70, seed=35)]
    with KVStore(tmp_path / "a", model, tokenizer, chunk_tokens=C) as a:
        for p in prompts:
            a.prefill(p)
        a.flush()
        nodes = a.stats()["nodes"]

    status, out, err = run_cli(
        capsys, *["push", "--remote", url, "--store", tmp_path / "a", "--json"]
    )
    assert status == 0, err
    report = json.loads(out)
    assert report["uploaded"] == report["nodes"] == nodes and not report["problems"]
    status, out, _ = run_cli(
        capsys, *["push", "--remote", url, "--store", tmp_path / "a", "--json"]
    )
    assert status == 0 and json.loads(out)["uploaded"] == 0
    assert json.loads(out)["present"] == nodes

    model_args = ["--model", tiny_model_dir, "--chunk-tokens", C]
    argv = ["pull", "--remote", url, "--store", tmp_path / "c", *model_args, "--json"]
    status, out, err = run_cli(capsys, *argv)
    assert status == 0, err
    report = json.loads(out)
    assert report["pulled"] == nodes and report["invalid"] == 0
    with KVStore(tmp_path / "c", model, tokenizer, chunk_tokens=C) as c:
        for p in prompts:
            assert c.fetch(p)[1] == len(p) - 1
        pulled_bytes = c.stats()["bytes_on_disk"]
    assert_clean(tmp_path / "c")
    status, out, _ = run_cli(capsys, *argv)  # again: nothing to do
    assert status == 0 and json.loads(out)["present"] == nodes

    # A pull keeps the store's recorded disk budget (evicting as saves do), and
    # --disk-bytes gives another.
    budget = pulled_bytes // 3
    KVStore(tmp_path / "g", model, tokenizer, chunk_tokens=C, disk_bytes=budget).close()
    for where, extra, limit in (
        ("g", [], budget),
        ("h", ["--disk-bytes", "40K"], 40960),
    ):
        pull = ["pull", "--remote", url, "--store", tmp_path / where, *model_args]
        status, out, err = run_cli(capsys, *pull, *extra, "--json")
        assert status == 0, err
        held = maintenance.store_stats(tmp_path / where)["bytes_on_disk"]
        assert 0 < held <= limit < pulled_bytes, (where, held, limit)
        assert_clean(tmp_path / where)

    # A broken object: pull reports it, skips its subtree, keeps the rest.
    mkey = next(k for k in keys(s3, url) if k.endswith(".json") and "/nodes/" in k)
    _rewrite(s3, url, _blob_key(s3, url, mkey), _flip)
    argv[4] = tmp_path / "d"
    status, out, err = run_cli(capsys, *argv)
    report = json.loads(out)
    assert status == 1 and report["invalid"] == 1
    assert "checksum mismatch" in report["problems"][0]
    assert 0 < report["pulled"] < nodes
    assert_clean(tmp_path / "d")

    # kvstore prefill --remote on a new machine downloads instead of computing.
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text(json.dumps({"tokens": SYSTEM}) + "\n")
    argv = ["prefill", jsonl, "--store", tmp_path / "e", "--remote", url, *model_args]
    status, out, err = run_cli(capsys, *argv + ["--json", "--quiet"])
    assert status == 0, err
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["tokens_computed"] == 1 and summary["remote_nodes_down"] == 3


@pytest.mark.parametrize(
    "argv, message",
    [
        (["push", "--store", "{tmp}"], "--remote"),
        (["push", "--remote", "http://x/y", "--store", "{tmp}"], "--remote: .*s3://"),
        (
            ["push", "--remote", "s3://bkt/p", "--store", "{tmp}/nowhere"],
            "no kvstore here",
        ),
        (
            ["push", "--remote", "s3://kv-no-such-bucket", "--store", "{a}"],
            "NoSuchBucket",
        ),
        (
            ["push", "--remote", "s3://bkt", "--store", "{a}", "--namespace", "zz"],
            "--namespace",
        ),
        (["pull", "--remote", "s3:///p", "--store", "{tmp}/s"], "--remote: .*bucket"),
        (
            ["prefill", "{tmp}/p.jsonl", "--remote", "s3:/x", "--store", "{tmp}/s"],
            "--remote",
        ),
        (
            ["pull", "--remote", "s3://bkt/p", "--remote-timeout", "0"],
            "--remote-timeout: not a number of seconds above 0: '0'",
        ),
        (
            ["push", "--remote", "s3://bkt/p", "--remote-read-timeout", "nan"],
            "--remote-read-timeout: not a number of seconds above 0",
        ),
    ],
)
def test_cli_remote_arguments(tmp_path, model, s3, capsys, argv, message):
    import re

    with KVStore(tmp_path / "a", model, chunk_tokens=C) as a:
        a.prefill(SYSTEM)
    (tmp_path / "p.jsonl").write_text('{"tokens": [5, 6]}\n')
    argv = [a.format(tmp=tmp_path, a=tmp_path / "a") for a in argv]
    try:
        status, _, err = run_cli(capsys, *argv)
    except SystemExit as e:  # argparse
        status, err = e.code, capsys.readouterr().err
    assert status == 2, err
    assert "Traceback" not in err
    assert re.search(message, err), err


@pytest.mark.parametrize(
    "remote, error, message",
    [
        (123, TypeError, "s3://bucket/prefix URL"),
        ("s3://", ValueError, "bucket name"),
        ("https://bucket/prefix", ValueError, "s3://bucket/prefix"),
        ("s3://ab", ValueError, "bucket name"),
        ("s3://bucket//x", ValueError, "prefix"),
    ],
)
def test_library_remote_arguments(tmp_path, model, remote, error, message):
    with pytest.raises(error, match=message):
        KVStore(tmp_path / "s", model, remote=remote)
    with pytest.raises(ValueError, match="read_timeout"):
        RemoteTier("s3://bucket/p", read_timeout=-1)
    with pytest.raises(TypeError, match="max_nodes"):
        RemoteTier("s3://bucket/p", max_nodes=1.5)


def test_serve_remote_argument(tmp_path, capsys):
    status = server.main(
        ["--store", str(tmp_path / "s"), "--remote", "gs://b"], hard_exit=False
    )
    err = capsys.readouterr().err
    assert status == 2 and "bad --remote" in err and "Traceback" not in err
    with pytest.raises(SystemExit) as e:
        server.main(["--remote", "s3://b/p", "--remote-timeout", "-1"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--remote-timeout: not a number of seconds" in err


def test_remote_waits_from_the_command_line():
    from kvstore import cli

    args = cli.build_parser().parse_args(
        ["pull", "--remote", "s3://bkt/p", "--remote-timeout", "0.5"]
        + ["--remote-connect-timeout", "1", "--remote-retry-after", "5"]
    )
    tier = cli.remote_tier(args, upload=False)
    assert tier.lookup_timeout == 0.5 and tier.open_seconds == 5.0
    assert tier._s3._config["connect_timeout"] == 1.0
    assert (
        tier._s3._config["read_timeout"]
        == RemoteTier("s3://bkt/p")._s3._config["read_timeout"]
    )  # not given: RemoteTier's default


def test_without_boto3_the_library_works_and_remote_says_what_to_install(
    tmp_path, model, monkeypatch, capsys
):
    monkeypatch.setitem(sys.modules, "boto3", None)  # import boto3 -> ImportError
    with KVStore(tmp_path / "s", model, chunk_tokens=C) as s:
        s.prefill(SYSTEM)
        assert s.stats()["remote"] is None
    with pytest.raises(ImportError, match=r"pip install 'kvstore\[remote\]'"):
        KVStore(tmp_path / "s", model, remote="s3://bucket/p")
    status, _, err = run_cli(
        capsys, *["push", "--remote", "s3://bucket/p", "--store", tmp_path / "s"]
    )
    assert status == 2 and "--remote: " in err and "pip install" in err


# -- benchmark: remote vs cold vs local disk (numbers printed, never asserted) -------------------


def test_bench_remote_vs_cold_vs_disk(tmp_path, model, url):
    import importlib.util

    where = os.path.join(os.path.dirname(__file__), "..", "tools", "bench_remote.py")
    spec = importlib.util.spec_from_file_location("bench_remote", where)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rows = bench.run(model, url, tmp_path, tokens=1024, chunk_tokens=C, repeats=2)
    names = [r["case"] for r in rows]
    assert names == ["cold prefill", "local disk", "remote (S3)"]
    assert all(r["restored"] == rows[1]["restored"] for r in rows[1:])
    for r in rows:
        print(f"{r['case']:<14} {r['ms']:9.1f} ms  restored {r['restored']}")
    # push, pull and a warm start, next to boto3 copying the same files.
    before = keys(boto3.client("s3"), url)
    rows = bench.run_sync(
        model, url, tmp_path, prompts=2, tokens=300, chunk_tokens=C, repeats=1
    )
    assert [r["case"] for r in rows] == [
        "push (kvstore)",
        "upload (boto3)",
        "pull (kvstore)",
        "download (boto3)",
        "+ fsync (boto3)",
        "warm start",
    ]
    assert all(r["s"] > 0 and r["mb"] > 0 for r in rows)
    assert keys(boto3.client("s3"), url) == before  # its own objects deleted


# -- a listing that never ends ---------------------------------------------------------


class EndlessListing:
    """An S3 stand-in whose ListObjectsV2 answers ``IsTruncated`` with a next token
    forever: ``keys`` keys a page, a new token each page (or ``same_token``), after
    ``delay`` seconds. Anything else is a 404."""

    def __init__(self, *, keys=0, same_token=False, delay=0.0):
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        stub = self
        self.pages = 0

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                if "list-type=2" not in self.path:
                    self.send_response(404)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                time.sleep(delay)
                stub.pages += 1
                n = stub.pages
                token = "same" if same_token else f"token-{n}"
                contents = "".join(
                    f"<Contents><Key>p/{n}/{i}.json</Key><Size>1</Size></Contents>"
                    for i in range(keys)
                )
                body = (
                    '<?xml version="1.0" encoding="UTF-8"?>'
                    '<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
                    f"<Name>bkt</Name><Prefix>p</Prefix><KeyCount>{keys}</KeyCount>"
                    "<MaxKeys>1000</MaxKeys><IsTruncated>true</IsTruncated>"
                    f"<NextContinuationToken>{token}</NextContinuationToken>"
                    f"{contents}</ListBucketResult>"
                ).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = "http://127.0.0.1:%d" % self._server.server_address[1]
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def close(self):
        self._server.shutdown()
        self._server.server_close()


@pytest.mark.parametrize(
    "stub, bounds, match",
    [
        ({"keys": 1000}, {"list_max_keys": 3000}, "goes on past 3000 keys"),
        ({}, {"list_max_keys": 3000}, "goes on past 8 pages"),
        ({"delay": 0.2}, {"list_timeout": 0.5}, "goes on past 0.5 seconds"),
        ({"same_token": True}, {}, "repeats a continuation token"),
    ],
)
def test_a_listing_that_never_ends_is_bounded(monkeypatch, stub, bounds, match):
    from kvstore.remote import RemoteError

    server = EndlessListing(**stub)
    aws_env(monkeypatch, Backend("stub", server.endpoint))
    tier = RemoteTier("s3://bkt/p", **bounds)
    try:
        with pytest.raises(RemoteError, match=match):
            tier.list_nodes(bytes(16))
        # The fetch path asks for the first page's worth (a node's children): what
        # was listed by the bound, no error.
        assert len(tier._s3.list_keys("p/", max_keys=1000)) <= 1000 + 1000
    finally:
        tier.close()
        server.close()
    assert server.pages <= 8 + 4  # both listings


@pytest.mark.stress
def test_pull_and_push_end_against_an_endless_listing(
    tmp_path, tiny_model_dir, monkeypatch, capsys
):
    from mlx_lm import load

    model, tokenizer = load(tiny_model_dir)
    with KVStore(tmp_path / "s", model, tokenizer, chunk_tokens=C) as store:
        store.prefill(SYSTEM)
    model_args = ["--model", tiny_model_dir, "--chunk-tokens", C]
    for stub, match in (
        ({"same_token": True}, "repeats a continuation token"),
        ({"keys": 3}, "goes on past 2002 pages"),  # the default bounds
    ):
        server = EndlessListing(**stub)
        aws_env(monkeypatch, Backend("stub", server.endpoint))
        try:
            for argv in (
                ["push", "--remote", "s3://bkt/p", "--store", tmp_path / "s"],
                ["pull", "--remote", "s3://bkt/p", "--store", tmp_path / "t"]
                + model_args,
            ):
                status, _, err = run_cli(capsys, *argv)
                assert status == 2 and match in err and "never ends" in err, err
        finally:
            server.close()
