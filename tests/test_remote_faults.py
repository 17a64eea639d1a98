"""Faults of a real object store, against Ceph's S3 gateway over a one-machine RADOS
cluster (``tools/ceph_cluster.py``; skipped, saying why, where Ceph is not installed).

The gateway killed and restarted during ``push``, ``pull`` and a fetch; the OSD frozen
under the gateway; two stores pushing one namespace while a third pulls; objects
replaced or deleted between a listing and the reads; credentials revoked mid-run. In
each: no wait beyond the configured timeouts, nothing partial accepted, every node a
store holds afterwards verified, and the next attempt completes.
"""

import logging
import threading
import time
import uuid

import boto3
import mlx.core as mx
import pytest
from conftest import compute_cache, random_tokens
from test_remote import (
    OTHER,
    PROMPT,
    SYSTEM,
    Backend,
    C,
    DelayProxy,
    _blob_key,
    _flip,
    assert_clean,
    aws_env,
    bucket_of,
    fast,
    keys,
    node_hashes,
)

from kvstore import KVStore
from kvstore.remote import RemoteError, push
from kvstore.remote import tier as tier_module

pytestmark = pytest.mark.stress

# Several conversations sharing prefixes: ~20 nodes over several trie levels.
PROMPTS = [SYSTEM + random_tokens(64 * k + 30, seed=60 + k) for k in range(1, 5)]


@pytest.fixture(scope="module")
def gateway(ceph):
    """The session's cluster, the environment pointing at its gateway."""
    env = pytest.MonkeyPatch()
    aws_env(env, Backend("ceph", ceph.endpoint, ceph.access_key, ceph.secret_key, ceph))
    yield ceph
    env.undo()


@pytest.fixture
def url(gateway):
    """A fresh bucket per test; the gateway and the OSD running again after it."""
    bucket = f"kv-{uuid.uuid4().hex[:12]}"
    boto3.client("s3").create_bucket(Bucket=bucket)
    yield f"s3://{bucket}/fleet"
    revive(gateway)


def revive(cluster):
    """Whatever a test stopped, running again."""
    import signal

    if "osd" in cluster.procs:
        cluster.procs["osd"].send_signal(signal.SIGCONT)
    if "rgw" not in cluster.procs:
        cluster.start_rgw()


def source_store(path, model, prompts=PROMPTS):
    """A store holding ``prompts``; returns its node count."""
    with KVStore(path, model, chunk_tokens=C) as s:
        for p in prompts:
            s.prefill(p, boundaries=[len(SYSTEM)])
        s.flush()
        return s.stats()["nodes"]


def assert_complete(path, source, model, prompts):
    """Every node of ``path`` verifies, and each prompt restores from it bit for bit
    what it restores from ``source``."""
    assert_clean(path)
    with (
        KVStore(path, model, chunk_tokens=C) as s,
        KVStore(source, model, chunk_tokens=C) as ref,
    ):
        for p in prompts:
            (cache, n), (want, m) = s.fetch(p + OTHER), ref.fetch(p + OTHER)
            assert n == m == len(p)
            for x, y in zip(cache, want):
                assert all(
                    mx.array_equal(a, b).item() for a, b in zip(x.state, y.state)
                )


def pull(path, model, url, **kw):
    """``kvstore pull`` through the library: the report."""
    tier = fast(url, upload=False, **kw)
    with KVStore(path, model, chunk_tokens=C, remote=tier):
        return tier.pull()


def remote_nodes(url, model, tmp_path):
    """Manifest count of the model's namespace on the remote."""
    with KVStore(tmp_path / "probe", model, chunk_tokens=C) as s:
        ns = s.namespace.hex()
    return sum(1 for k in keys(boto3.client("s3"), url) if f"{ns}/nodes/" in k)


# -- the gateway killed and restarted ---------------------------------------------------


def test_gateway_killed_during_push(tmp_path, model, url, gateway):
    nodes = source_store(tmp_path / "a", model)
    sent = []

    def progress(n):
        sent.append(n)
        if len(sent) == 5:
            gateway.kill("rgw")  # SIGKILL, mid-push: other uploads are in flight

    tier = fast(url, upload=False, threads=4)
    tic = time.perf_counter()
    with pytest.raises(RemoteError, match="Could not connect|Connection|skipped"):
        push(str(tmp_path / "a"), tier, progress=progress)
    assert time.perf_counter() - tic < 10
    tier.close()
    gateway.start_rgw()
    # What reached the remote is whole: a pull takes every manifest it finds, each
    # with its files, and refuses nothing.
    report = pull(tmp_path / "b", model, url)
    assert report["invalid"] == 0 and report["pulled"] == report["remote_nodes"]
    assert 5 <= report["remote_nodes"] < nodes
    assert_clean(tmp_path / "b")
    # The next push completes.
    again = push(str(tmp_path / "a"), fast(url, upload=False))
    assert again["uploaded"] + again["present"] == nodes and not again["problems"]
    assert remote_nodes(url, model, tmp_path) == nodes
    assert pull(tmp_path / "b", model, url)["pulled"] == nodes - report["pulled"]
    assert_complete(tmp_path / "b", tmp_path / "a", model, PROMPTS)


def test_gateway_killed_during_pull(tmp_path, model, url, gateway, monkeypatch):
    nodes = source_store(tmp_path / "a", model)
    assert push(str(tmp_path / "a"), fast(url, upload=False))["uploaded"] == nodes
    monkeypatch.setattr(tier_module, "_BATCH_BYTES", 1)  # a commit per node
    commits = []

    def progress(n):
        commits.append(n)
        if len(commits) == 2:
            gateway.kill("rgw")

    tier = fast(url, upload=False)
    with KVStore(tmp_path / "b", model, chunk_tokens=C, remote=tier) as b:
        tic = time.perf_counter()
        with pytest.raises(RemoteError):
            tier.pull(progress=progress)
        assert time.perf_counter() - tic < 10
        got = b.stats()["nodes"]
    assert 0 < got < nodes
    assert_clean(tmp_path / "b")  # no partial node
    gateway.start_rgw()
    report = pull(tmp_path / "b", model, url)
    assert report["present"] == got and report["pulled"] == nodes - got
    assert report["invalid"] == 0
    assert_complete(tmp_path / "b", tmp_path / "a", model, PROMPTS)


def test_gateway_killed_during_a_fetch(tmp_path, model, url, gateway, caplog):
    """The gateway dies as the fetch starts downloading node files: the fetch returns
    what the local store has within ``lookup_timeout``, commits nothing partial, and
    the next fetch (gateway back, breaker closed) restores through the remote."""
    nodes = source_store(tmp_path / "a", model, [SYSTEM])
    push(str(tmp_path / "a"), fast(url, upload=False))
    tier = fast(url, lookup_timeout=5.0, open_seconds=1.0)
    download = tier._download
    killed = []

    def dying(h, rec):
        if not killed:
            killed.append(h)
            gateway.kill("rgw")
        return download(h, rec)

    tier._download = dying
    with caplog.at_level(logging.WARNING, logger="kvstore"):
        with KVStore(tmp_path / "b", model, chunk_tokens=C, remote=tier) as b:
            tic = time.perf_counter()
            assert b.fetch(PROMPT)[1] == 0
            assert time.perf_counter() - tic < 5.5
            stats = b.stats()
            assert stats["remote_errors"] >= 1 and stats["nodes"] == 0
            assert stats["errors"] == 0
            gateway.start_rgw()
            time.sleep(1.0)  # the parallel downloads' failures opened the breaker
            cache, n = b.fetch(PROMPT)
            assert n == len(SYSTEM) and b.stats()["nodes"] == nodes
    assert killed and "Could not connect" in caplog.text
    assert_complete(tmp_path / "b", tmp_path / "a", model, [SYSTEM])


# -- the storage under the gateway stopped ------------------------------------------------


def test_osd_frozen_local_tiers_serve_and_it_is_said_once(
    tmp_path, model, url, gateway, caplog
):
    """The OSD stops answering (SIGSTOP): the gateway accepts connections but every
    request stalls. Fetches return the local store's answer within ``lookup_timeout``,
    the remote is given up after a few timed-out requests, and the log says so a few
    times, not once per request."""
    import signal

    source_store(tmp_path / "a", model, [SYSTEM])
    push(str(tmp_path / "a"), fast(url, upload=False))
    tier = fast(url, read_timeout=1.0, lookup_timeout=0.5, open_seconds=60.0)
    with KVStore(tmp_path / "b", model, chunk_tokens=C, remote=tier) as b:
        local = random_tokens(100, seed=70)
        b.save(local, compute_cache(model, local))
        b.flush()
        gateway.kill("osd", signal.SIGSTOP)
        with caplog.at_level(logging.WARNING, logger="kvstore"):
            caplog.clear()
            waits = []
            for seed in range(30):
                tic = time.perf_counter()
                assert b.fetch(local + random_tokens(80, 100 + seed))[1] == len(local)
                waits.append(time.perf_counter() - tic)
                time.sleep(0.1)
            # New nodes saved meanwhile are kept locally; close does not hang.
            more = random_tokens(130, seed=71)
            b.save(more, compute_cache(model, more))
            b.flush()
            assert b.fetch(more + [1])[1] == len(more)
            said = [r.getMessage() for r in caplog.records if r.name == "kvstore"]
        stats = b.stats()
        tic = time.perf_counter()
    assert time.perf_counter() - tic < tier.close_timeout + 1
    assert max(waits) < tier.lookup_timeout + 0.5, waits
    assert stats["remote_open"] and stats["remote_skipped"] >= 20
    assert "timeout" in stats["remote_last_error"].lower()
    # Said once each: the lookup timed out, a request failed, the remote is skipped.
    assert len(said) == 3, said
    assert "no answer within" in said[0] and "skipping the remote" in said[-1]
    assert stats["remote_timeouts"] >= 2
    assert_clean(tmp_path / "b")


# -- writers racing, readers in between ---------------------------------------------------


def perturbed_store(path, model, prompts):
    """Like :func:`source_store`, with KV differing in the last bits (another machine's
    arithmetic): the same nodes, other files and checksums."""
    with KVStore(path, model, chunk_tokens=C) as s:
        for p in prompts:
            cache = compute_cache(model, p)
            for c in cache:
                c.keys = c.keys * (1 + 2**-20)
            s.save(p, cache, boundaries=[len(SYSTEM)])
        s.flush()
        return s.stats()["nodes"]


def test_two_stores_push_one_namespace_while_a_third_pulls(
    tmp_path, model, url, gateway
):
    """A and B hold overlapping conversations (shared nodes with different bytes) and
    push at once, slowed by a proxy; C pulls over and over meanwhile. Every node C
    takes is whole and verifies, and after the pushes C has every node."""
    source_store(tmp_path / "a", model, PROMPTS[:3])
    perturbed_store(tmp_path / "b", model, PROMPTS[1:])
    with KVStore(tmp_path / "a", model, chunk_tokens=C) as a:
        ns = a.namespace
        hashes = {
            h for _, h, _ in a.index.read(lambda t: list(a.index.iter_nodes(t, ns)))
        }
    with KVStore(tmp_path / "b", model, chunk_tokens=C) as b:
        hashes |= {
            h for _, h, _ in b.index.read(lambda t: list(b.index.iter_nodes(t, ns)))
        }
    reports, errors = {}, []
    proxy = DelayProxy(gateway.endpoint, delay=0.05)

    def pusher(name):
        tier = fast(url, upload=False, threads=2, endpoint_url=proxy.endpoint)
        try:
            reports[name] = push(str(tmp_path / name), tier)
        except BaseException as e:
            errors.append(e)

    writers = [threading.Thread(target=pusher, args=(n,)) for n in "ab"]
    for t in writers:
        t.start()
    pulls = []
    while any(t.is_alive() for t in writers) or not pulls:
        pulls.append(pull(tmp_path / "c", model, url, cache_seconds=0.0))
    for t in writers:
        t.join()
    proxy.close()
    assert not errors
    assert all(r["uploaded"] + r["present"] == r["nodes"] for r in reports.values())
    assert all(p["invalid"] == 0 and not p["problems"] for p in pulls), pulls
    assert_clean(tmp_path / "c")
    final = pull(tmp_path / "c", model, url)
    assert final["remote_nodes"] == len(hashes) and final["invalid"] == 0
    with KVStore(tmp_path / "c", model, chunk_tokens=C) as c:
        assert c.stats()["nodes"] == len(hashes)
        for p in PROMPTS:
            assert c.fetch(p + OTHER)[1] == len(p)
    assert_clean(tmp_path / "c")
    # Shared nodes were sent by both, each manifest naming its own files.
    blobs = [k for k in keys(boto3.client("s3"), url) if "/blobs/" in k]
    assert len(blobs) > len(hashes)
    assert sum(p["pulled"] for p in pulls) > 0  # C did take nodes during the pushes


def spans(prompt):
    """The nodes of ``prompt`` in a :func:`source_store`: chunks, cut at SYSTEM's end."""
    cuts = [0, 64, 128, len(SYSTEM)] + list(range(len(SYSTEM) + C, len(prompt), C))
    return list(zip(cuts, cuts[1:] + [len(prompt)]))


def test_objects_replaced_or_deleted_between_listing_and_reading(tmp_path, model, url):
    """Between pull's listing and its reads another client replaces the first node
    with its own version (manifest and files), deletes a manifest, and overwrites a
    file with other bytes: the replacement is taken whole, the deleted node and its
    subtree are not reached, the overwritten file is refused and reported."""
    nodes = source_store(tmp_path / "a", model)
    push(str(tmp_path / "a"), fast(url, upload=False))
    other = url.replace("/fleet", "/other")
    perturbed_store(tmp_path / "w", model, PROMPTS[:1])
    push(str(tmp_path / "w"), fast(other, upload=False))
    s3, bucket = boto3.client("s3"), bucket_of(url)
    with KVStore(tmp_path / "w", model, chunk_tokens=C) as w:
        first = node_hashes(w, PROMPTS[0], spans(PROMPTS[0]))[0]
        theirs = w.index.get_node(w.namespace, first)
        deleted = node_hashes(w, PROMPTS[3], spans(PROMPTS[3]))[3]
        flipped = node_hashes(w, PROMPTS[1], spans(PROMPTS[1]))[3]
        ns = w.namespace.hex()

    tier = fast(url, upload=False)
    listing = tier.list_nodes

    def racing(namespace):
        out = listing(namespace)
        mkey = lambda h: f"fleet/{ns}/nodes/{out[h][0].hex()}/{h.hex()}.json"  # noqa
        for key in keys(s3, other):
            name = key.rsplit("/", 1)[-1]
            if key.startswith("other/") and name.startswith(first.hex()):
                dst = key.replace("other/", "fleet/", 1)
                s3.copy_object(
                    Bucket=bucket, Key=dst, CopySource={"Bucket": bucket, "Key": key}
                )
        s3.delete_object(Bucket=bucket, Key=mkey(deleted))
        blob = _blob_key(s3, url, mkey(flipped))
        s3.put_object(
            Bucket=bucket,
            Key=blob,
            Body=_flip(s3.get_object(Bucket=bucket, Key=blob)["Body"].read()),
        )
        return out

    tier.list_nodes = racing
    with KVStore(tmp_path / "c", model, chunk_tokens=C, remote=tier) as c:
        report = tier.pull()
        got = c.index.get_node(c.namespace, first)
    assert report["remote_nodes"] == nodes and report["invalid"] == 1
    assert "checksum mismatch" in report["problems"][0]
    assert flipped.hex() in report["problems"][0]
    # Not reached: the deleted node's 4 descendants, the refused node's 2.
    assert report["unreachable"] == 6
    assert report["pulled"] == nodes - 1 - 4 - 1 - 2
    assert (got.nbytes, got.checksum) == (theirs.nbytes, theirs.checksum)
    assert_clean(tmp_path / "c")


def test_credentials_revoked_mid_run(
    tmp_path, model, url, gateway, monkeypatch, capsys
):
    """A user's key removed on the gateway while a store uses it: the local path goes
    on, the log says it once (plus the breaker opening), and ``kvstore push`` fails
    with one clear line naming the error."""
    from conftest import run_cli

    uid = f"revoked-{uuid.uuid4().hex[:8]}"
    key, secret = uid + "-key", uuid.uuid4().hex
    gateway.admin(
        "user",
        "create",
        f"--uid={uid}",
        "--display-name=revoked",
        f"--access-key={key}",
        f"--secret={secret}",
    )
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    monkeypatch.setattr(boto3, "DEFAULT_SESSION", None)
    bucket = f"kv-{uuid.uuid4().hex[:12]}"
    boto3.client("s3").create_bucket(Bucket=bucket)
    url = f"s3://{bucket}/fleet"
    source_store(tmp_path / "a", model, [SYSTEM])
    tier = fast(url, open_seconds=60.0)
    logs = []
    with KVStore(tmp_path / "b", model, chunk_tokens=C, remote=tier) as b:
        assert b.prefill(PROMPT)["computed"] == len(PROMPT)
        b.flush()
        assert b.remote.wait_uploads(10) and b.stats()["uploads"] == 3
        gateway.admin("key", "rm", f"--uid={uid}", f"--access-key={key}")
        handler = logging.Handler()
        handler.emit = lambda r: logs.append(r.getMessage())
        logging.getLogger("kvstore").addHandler(handler)
        try:
            for seed in range(10):
                p = PROMPT + random_tokens(70, seed=80 + seed)
                assert b.fetch(p)[1] == len(PROMPT)
                b.save(p, compute_cache(model, p))
            b.flush()
            done = b.remote.wait_uploads(5)
            stats = b.stats()
        finally:
            logging.getLogger("kvstore").removeHandler(handler)
    # No upload got through once the key was gone: each failed, was dropped, or still
    # waits for the breaker that the fetches' errors may have opened first.
    assert stats["upload_errors"] + stats["uploads_dropped"] >= 1 or not done
    assert stats["remote_open"] and stats["uploads"] == 3
    # The last error may be a HEAD's: its 403 carries no body, so no error code.
    assert (
        "InvalidAccessKeyId" in stats["remote_last_error"]
        or "HTTP 403 Forbidden: access denied" in stats["remote_last_error"]
    )
    # Said once (and once more as the breaker opens); then no line per request.
    said = [m for m in logs if "node uploads not done at close" not in m]
    assert len(said) == 2 and "skipping the remote" in said[1], logs
    assert "InvalidAccessKeyId: the store knows no such access key" in said[0]
    assert (
        "InvalidAccessKeyId" in said[1]
        or "HTTP 403 Forbidden: access denied" in said[1]
    )
    assert_clean(tmp_path / "b")
    status, out, err = run_cli(
        capsys, "push", "--remote", url, "--store", tmp_path / "a"
    )
    assert status == 2 and "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and f"--remote {url}" in lines[0]
    assert "InvalidAccessKeyId: the store knows no such access key" in lines[0]


@pytest.mark.slow
def test_gateway_frozen_then_killed_during_a_serve_request(
    tmp_path, tiny_model_dir, url, gateway
):
    """``kvstore serve --remote`` (default timeouts) answers while the gateway is
    frozen, waiting at most ``lookup_timeout`` (10 s) for it; the gateway is then
    killed: the lookup left waiting in the background fails and commits nothing;
    restarted, the first request after the breaker closes restores A's other system
    prompt through it."""
    import signal

    from serving import Server, answer, chat_body

    def serve(name):
        store = str(tmp_path / name)
        kv = ["kvstore.server", "--model", tiny_model_dir, "--store", store]
        return Server(kv + ["--remote", url], tmp_path / f"{name}.log")

    other = " ".join(f"w{5 + (i * 11) % 500}" for i in range(300))
    a = serve("a")
    try:  # A computes two system prompts and uploads them
        assert answer(a.chat(chat_body("w10 w11 w12 w13")))
        assert answer(a.chat(chat_body("w10 w11", system=other)))
    finally:
        assert a.stop() == 0, a.output()
    b = serve("b")
    try:
        gateway.kill("rgw", signal.SIGSTOP)
        tic = time.perf_counter()
        assert answer(b.chat(chat_body("w20 w21 w22")))
        waited = time.perf_counter() - tic
        stats = b.stats()
        assert stats["remote_hits"] == 0 and stats["stores"][0]["remote_timeouts"] == 1
        # SIGKILL: the lookup still waiting in the background fails (its retries
        # find no gateway), nothing of it is committed.
        gateway.kill("rgw")
        time.sleep(1.0)
        assert b.stats()["stores"][0]["remote_nodes_down"] == 0
        gateway.start_rgw()
        # The failed requests (the lookup's, B's own uploads') opened the breaker:
        # the remote is skipped for its 30 s, then asked again.
        deadline = time.monotonic() + 40
        while b.stats()["stores"][0]["remote_open"]:
            assert time.monotonic() < deadline
            time.sleep(0.5)
        assert answer(b.chat(chat_body("w30 w31", system=other)))
        stats = b.stats()
    finally:
        assert b.stop() == 0, b.output()
    assert waited < 10 + 5, waited  # lookup_timeout, plus the tiny model's answer
    assert stats["remote_hits"] == 1 and stats["tokens_reused_remote"] >= 300
    assert stats["stores"][0]["remote_corrupt"] == 0
    assert_clean(tmp_path / "b")
